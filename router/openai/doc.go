// Package openai reads and writes the OpenAI-API side of a request, with
// no knowledge of routing: Parse decodes a chat or completions body in one
// validating scan (jsonscan.go), RoutingText takes its routing prefix,
// InjectCacheSalt and CacheSalt edit and read vLLM's cache_salt field, and
// WriteError / SSEErrorEvent write the OpenAI error shapes every edge
// answers with. It imports nothing else from kvrouter.
package openai
