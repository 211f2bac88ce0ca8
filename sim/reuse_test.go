package sim

import (
	"testing"
	"time"
)

// TestReuseCapPerEngine is the router's rule of the same name
// (router/kvaware) on the engine itself: vLLM reuses whole blocks of a
// prompt's first T − 1 tokens, TensorRT-LLM with partial reuse (PartialReuse)
// up to T − 1 tokens of the blocks held. They differ only for a prompt of
// exactly k blocks held whole.
func TestReuseCapPerEngine(t *testing.T) {
	shared := prompt(1, 64) // 4 blocks of 16
	cases := []struct {
		name    string
		partial bool
		r       []uint32
		want    int
	}{
		{"vllm, whole-block prompt", false, shared, 48},
		{"vllm, longer prompt", false, concat(shared, prompt(2, 5)), 64},
		{"trtllm, whole-block prompt", true, shared, 63},
		{"trtllm, longer prompt", true, concat(shared, prompt(2, 5)), 64},
		{"trtllm, one token past the blocks", true, concat(shared, prompt(2, 1)), 64},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{GPUBlocks: 64, PartialReuse: tc.partial}
			h := newHarness(t, cfg)
			h.submit(Request{ID: 1, Prompt: shared, MaxTokens: 1}, 0)
			h.drain()
			h.submit(Request{ID: 2, Prompt: tc.r, MaxTokens: 3}, time.Second)
			h.drain()
			if got := h.find(2, Finished).CachedTokens; got != tc.want {
				t.Fatalf("cached %d of %d tokens, want %d", got, len(tc.r), tc.want)
			}
			if got := h.e.Stats().PrefixHits; got != uint64(tc.want) {
				t.Fatalf("prefix hits %d, want %d", got, tc.want)
			}
			// The idle engine's floor agrees with the run.
			got := ttft(t, cfg, shared, Request{ID: 1, Prompt: tc.r, MaxTokens: 1})
			want, err := cfg.AloneTTFT(len(tc.r), len(shared))
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Fatalf("TTFT %v, AloneTTFT %v", got, want)
			}
			h.checkModel()
		})
	}
}
