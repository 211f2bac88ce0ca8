package kvaware

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestRVWholeBlockPromptLastBlockNeverHits: vLLM caps a prompt's cache hit
// at its length less one token (v1 KVCacheManager.get_computed_blocks,
// max_cache_hit_length = num_tokens − 1) and hits whole blocks only, so a
// prompt of exactly k blocks reuses at most k − 1 of them and prefills the
// last. The prediction (Explain), the pending prefill charged at commit
// and a prompt one token longer (which reuses all k) agree.
func TestRVWholeBlockPromptLastBlockNeverHits(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware, ConcurrencyThreshold: 64})
	tokens := promptTokens(7, 2*kvTestBS) // exactly two full blocks
	w.store("vllm-0", tokens, 0, 2)
	d := kvPick(t, s, kvRequest("x", tokens), w.insts)
	if got, max := matchedSum(d), (len(tokens)-1)/kvTestBS*kvTestBS; got > max {
		t.Fatalf("predicted %d cached tokens for a %d-token prompt; vLLM can reuse at most %d", got, len(tokens), max)
	}
	for _, tc := range []struct{ n, want int }{
		{2 * kvTestBS, kvTestBS},       // the last block is recomputed
		{2*kvTestBS + 1, 2 * kvTestBS}, // both blocks hit, one token prefilled
		{kvTestBS, 0},                  // a one-block prompt hits nothing
		{2*kvTestBS + kvTestBS/2, 2 * kvTestBS},
	} {
		long := append(promptTokens(7, 2*kvTestBS), promptTokens(8, tc.n)...)[:tc.n]
		d, err := s.Pick(context.Background(), kvRequest("x", long), w.insts)
		if err != nil {
			t.Fatal(err)
		}
		if d.Instance.ID() != "vllm-0" && tc.want > 0 {
			t.Errorf("%d tokens: picked %s, want the holder", tc.n, d.Instance.ID())
		}
		if got := matchedSum(d); got != tc.want {
			t.Errorf("%d tokens: predicted %d cached, want %d", tc.n, got, tc.want)
		}
		if tok, _ := w.st.PendingPrefill(d.Instance.ID()); tok != int64(tc.n-tc.want) {
			t.Errorf("%d tokens: %d pending prefill tokens, want %d", tc.n, tok, tc.n-tc.want)
		}
		if d.Observer != nil {
			d.Observer.Done(200, -1)
		}
	}
}
