// Package grpcapi serves the router over gRPC: the kvrouter.v1 API
// (Router.Pick, Index.Lookup, Events.Watch), the standard health and
// reflection services, and an Envoy external-processing server that acts as
// a Gateway API Inference Extension endpoint picker.
//
// It is an edge beside router/httpapi, over the same core (router.Table's
// Resolve, the pools' strategies) and the KV index: the core and the HTTP
// data plane stay free of gRPC and Envoy's API types, and a binary that
// does not serve gRPC does not link them.
package grpcapi
