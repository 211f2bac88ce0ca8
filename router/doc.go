// Package router is kvrouter's core: a request as the strategies see it
// (Request, Decision, Explanation, Observer), per-pool instances with
// health and in-flight state, the pool table (Table) a reload replaces
// whole, one Resolve that turns every edge's Inbound into a Request, and
// the routing strategies (random, round_robin, least_outstanding,
// prefix_aware; kv_aware through Exact) behind one small Strategy
// interface. It serves nothing and has no metrics or tracing library: the
// HTTP data plane is router/httpapi, the gRPC and Envoy edges grpcapi;
// configuration lives in package config, OpenAI parsing in router/openai
// (docs/architecture.md has the map).
//
// Strategies and instances need no network: NewStrategy and NewInstance are
// used directly by simulations (kvbench) to run the real routing logic.
package router
