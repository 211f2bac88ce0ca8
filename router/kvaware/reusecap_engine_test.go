package kvaware

import (
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestReuseCapPerEngine: what a prompt of T tokens reuses of the blocks an
// instance holds, per routing.kv.engine. vLLM caps a hit at T − 1 in whole
// blocks (v1 KVCacheManager.get_computed_blocks, max_cache_hit_length);
// SGLang matches fill_ids[:T − 1] (Req.adjust_max_prefix_ids,
// python/sglang/srt/managers/schedule_batch.py @ 000eaff) aligned down to
// whole pages (RadixCache.match_prefix, mem_cache/radix_cache.py @
// 95769b2): the same ⌊(T − 1)/B⌋·B. TensorRT-LLM chops T − 1 tokens into
// blocks, the last one partial (WindowBlockManager::addSequence,
// cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp @ b35ac1b), and with
// enable_partial_reuse (its default, tensorrt_llm/llmapi/llm_args.py @
// fcd3f31) that partial block hits the held block it begins
// (KVCacheBlock::findMatchingBlock): a whole-block prompt held whole
// reuses T − 1 tokens, not T − B.
func TestReuseCapPerEngine(t *testing.T) {
	const bs = kvTestBS
	for _, tc := range []struct {
		engine       string
		tokens, held int
		want         int
	}{
		{"", 2 * bs, 2, bs}, // vLLM by default: the last block recomputed
		{config.EngineVLLM, 2 * bs, 2, bs},
		{config.EngineSGLang, 2 * bs, 2, bs},
		{config.EngineTRTLLM, 2 * bs, 2, 2*bs - 1}, // the last block's first B − 1 tokens hit
		{config.EngineTRTLLM, 2 * bs, 1, bs},       // only what is held
		{config.EngineTRTLLM, 2*bs + 5, 2, 2 * bs}, // the tail's tokens are in no held block
		{config.EngineTRTLLM, bs, 1, bs - 1},       // one block: all but the last token
		{config.EngineVLLM, bs, 1, 0},
		{config.EngineSGLang, 2*bs + 1, 2, 2 * bs},
	} {
		w := newKVWorld(t, 1)
		s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{Engine: tc.engine}})
		tokens := promptTokens(9, tc.tokens)
		w.store("vllm-0", tokens, 0, tc.held)
		if got := matchedSum(kvPick(t, s, kvRequest("x", tokens), w.insts)); got != tc.want {
			t.Errorf("engine %q, %d tokens, %d blocks held: %d tokens reused, want %d", tc.engine, tc.tokens, tc.held, got, tc.want)
		}
	}
}

// TestReuseCapEngineValidated: an engine kind the router has no rule for
// is refused, not read as vLLM.
func TestReuseCapEngineValidated(t *testing.T) {
	w := newKVWorld(t, 1)
	if _, err := newKVAware(config.RoutingConfig{KV: &config.KVScoringConfig{Engine: "tgi"}}, w.st, nil); err == nil || !strings.Contains(err.Error(), "routing.kv.engine") {
		t.Fatalf("engine tgi: err %v, want one naming routing.kv.engine", err)
	}
}
