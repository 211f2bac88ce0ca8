// Package router is kvrouter's request path: typed configuration, per-pool
// instances with health and in-flight state, the routing strategies
// (random, round_robin, least_outstanding, prefix_aware) behind one small
// Strategy interface, and the HTTP data plane (OpenAI API and SageMaker-style
// raw invoke, built on httputil.ReverseProxy) with its admin API and metrics.
//
// Strategies and instances need no network: NewStrategy and NewInstance are
// used directly by simulations (kvbench) to run the real routing logic.
package router
