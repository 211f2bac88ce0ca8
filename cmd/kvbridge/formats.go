package main

import "fmt"

// Input formats (--format). vLLM and SGLang publish msgpack batches on
// ZMQ that the codec reads as they are; TensorRT-LLM's executor events come
// as JSON from trtllm-serve's POST /kv_cache_events, which kvbridge polls,
// converts and feeds to the same pipeline through a loopback ZMQ
// publisher per attention-DP rank (bridge.TRTLLMPoller), so gaps, replay,
// snapshots and heartbeats work as for any engine (docs/engines.md).
const (
	formatVLLM   = "vllm"
	formatSGLang = "sglang"
	formatTRTLLM = "trtllm-json"
)

func validFormat(f string) error {
	switch f {
	case formatVLLM, formatSGLang, formatTRTLLM:
		return nil
	}
	return fmt.Errorf("--format %q: want vllm, sglang or trtllm-json", f)
}
