// Package grpcapi serves the router over gRPC: the kvrouter.v1 API
// (Router.Pick, Index.Lookup, Events.Watch), the standard health and
// reflection services, and an Envoy external-processing server that acts as
// a Gateway API Inference Extension endpoint picker.
//
// It is separate from package router because it depends on router (pools,
// strategies, the KV index) while router must not depend on gRPC or Envoy's
// API types: the HTTP data plane stays free of those modules, and a binary
// that does not serve gRPC does not link them.
package grpcapi
