package kvaware

import (
	"math"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestDupCostCountsCopies: a recompute of blocks two or more instances
// hold is charged w·(n−1) beyond prefillCost's w for each block on n
// instances; blocks on one instance, or held by the candidate, cost
// nothing more.
func TestDupCostCountsCopies(t *testing.T) {
	sc := resolveScoring(&config.KVScoringConfig{PrefillTokensPerSecond: 1000})
	ev := &kvEval{blockSize: 16, weight: 2, depths: []int{6, 4, 4}}
	for _, c := range []struct {
		held int
		want float64 // blocks × (n − 1), summed over blocks on ≥ 2 instances
	}{
		// blocks 1–4 on 3 instances (2 more each), 5–6 on one
		{0, 4 * 2},
		{2, 2 * 2},
		{4, 0},
		{6, 0},
	} {
		got := sc.dupCost(ev, c.held)
		want := 2 * c.want * 16 / 1000
		if math.Abs(got-want) > 1e-12 {
			t.Errorf("held %d: dupCost %v, want %v", c.held, got, want)
		}
	}
	if got := sc.dupCost(&kvEval{blockSize: 16, weight: 2, depths: []int{6}}, 0); got != 0 {
		t.Errorf("one holder: dupCost %v, want 0 (the first copy is priced by prefillCost alone)", got)
	}
}

// TestDupCostKeepsRootOnHolders: a 64-block prompt whose first 32 blocks
// vllm-0 and vllm-1 both hold, each with a unique prompt of x blocks
// waiting; vllm-2 holds nothing and is idle. At weight 1 a move to vllm-2
// costs the 32 root blocks twice (its own prefill and the fleet's, as
// before: the move pays from x = 64) and, the root being on two instances
// already, once more (from x = 96). With 72 blocks waiting the request
// stays on a holder (without the copy price it moved to vllm-2); with 128
// it moves.
func TestDupCostKeepsRootOnHolders(t *testing.T) {
	for _, c := range []struct {
		x    int
		want string
	}{{72, "vllm-0"}, {128, "vllm-2"}} {
		w := newKVWorld(t, 3)
		s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1, MaxNumBatchedTokens: -1, LoadBound: -1}})
		prompt := promptTokens(51, 64*kvTestBS)
		w.store("vllm-0", prompt, 0, 32)
		w.store("vllm-1", prompt, 0, 32)
		routeTo(t, s, w.insts[0], promptTokens(52, c.x*kvTestBS))
		routeTo(t, s, w.insts[1], promptTokens(53, c.x*kvTestBS))
		if d := kvPick(t, s, kvRequest("b", prompt), w.insts); d.Instance.ID() != c.want {
			t.Errorf("%d blocks waiting on each holder: picked %s, want %s", c.x, d.Instance.ID(), c.want)
		}
	}
}
