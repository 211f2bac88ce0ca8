// Package workload generates the request streams kvbench replays against a
// fleet — long shared context, multi-turn chat, RAG, code completion,
// multi-tenant, cache pressure, scale events — reads Mooncake-format traces,
// and computes cache-hit bounds from a trace.
//
// Every prompt is a list of Segments: a segment is a seed and a length, and
// its tokens are a pure function of the two, so equal segments are equal
// token runs and prefixes are shared exactly, while nothing large is held in
// memory until a request is materialised. Tokens are chosen so that the
// Simple tokenizer (package tokenizer, the dummy tokenizer of
// llm-d-inference-sim) maps the request's text form back to exactly the same
// ids: each token is one lower-case word followed by a space, and its id is
// FNV-32a of those bytes. The discrete-event mode uses the ids directly; the
// live mode sends the text, and the engine sees the same tokens.
package workload
