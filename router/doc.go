// Package router is kvrouter's request path: a request as the strategies
// see it (Request, Decision, Explanation, Observer), per-pool instances
// with health and in-flight state, the pool table swapped whole on reload,
// one Resolve that turns every edge's Inbound into a Request, the routing
// strategies (random, round_robin, least_outstanding, prefix_aware,
// kv_aware) behind one small Strategy interface, and the HTTP data plane
// (OpenAI API and SageMaker-style raw invoke, built on
// httputil.ReverseProxy) with its admin API and metrics. Configuration
// lives in package config, OpenAI parsing in router/openai, the KV-state
// pipeline in router/kvstate (docs/architecture.md has the map).
//
// Strategies and instances need no network: NewStrategy and NewInstance are
// used directly by simulations (kvbench) to run the real routing logic.
package router
