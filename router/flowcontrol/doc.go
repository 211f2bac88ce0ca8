// Package flowcontrol is kvrouter's flow control: a per-pool queue in front
// of the engines that admits a request when the pool has room under its
// budgets (requests in flight, prompt tokens not yet prefilled), and
// otherwise holds it — bounded in length and in time — in strict priority
// bands with aging, sharing each band between tenants by weighted fair
// queuing on tokens. A request that cannot meet its time-to-first-token
// objective is shed at once rather than queued to fail.
//
// Sched is the deterministic core: no goroutines, no locks, time passed in,
// so the discrete-event simulator in kvbench drives it on a virtual clock.
// Gate wraps a Sched for concurrent callers that block until they are
// admitted, shed or cancelled (the HTTP data plane). The package imports
// only the standard library.
//
// Priorities follow vLLM's convention for the OpenAI "priority" field: an
// integer, default 0, lower means earlier handling (vllm-project/vllm,
// vllm/entrypoints/openai/chat_completion/protocol.py; priority scheduling
// introduced in https://github.com/vllm-project/vllm/pull/5958).
package flowcontrol
