// Package httpapi is kvrouter's HTTP data plane: the OpenAI API and
// SageMaker-style raw invoke, built on httputil.ReverseProxy over the
// router core (router.Table.Resolve, the pools' strategies), with the
// listeners' input limits, the request-body budget, retries, disaggregated
// prefill, flow-control admission, health checks and adapter discovery,
// its Prometheus metrics and OpenTelemetry spans. The admin API is
// mounted through Options.Admin (router/admin).
//
// One file drives a request: serve (proxy.go) calls each step in order —
// read the body, Resolve, admit, prefill, route and proxy — and each step
// returns to it (docs/architecture.md, "The request walk").
package httpapi
