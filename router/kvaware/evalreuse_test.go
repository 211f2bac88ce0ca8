package kvaware

import (
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestEvalReuseAcrossCandidateLists: a pooled evaluation whose last
// decision built a candidate index (8 or more matches) must not lend it to
// a decision over another, longer list that ends before the lookup (no
// token ids): that decision read pending counters by position in the old
// list, past its end.
func TestEvalReuseAcrossCandidateLists(t *testing.T) {
	w := newKVWorld(t, 12)
	s := w.strategy(config.RoutingConfig{})
	toks := promptTokens(3, 4*kvTestBS)
	for _, in := range w.insts[:10] {
		w.store(in.ID(), toks, 0, 4)
	}
	for range 20 { // the pool may drop an evaluation (it does at random under -race)
		if d := kvPick(t, s, kvRequest("x", toks), w.insts[:10]); d.Reason != router.ReasonKVMatch {
			t.Fatalf("with tokens: %s, want kv_match", d.Reason)
		}
		if d := kvPick(t, s, kvRequest("x", nil), w.insts); d.Reason != router.ReasonHeuristic {
			t.Fatalf("without tokens: %s, want heuristic", d.Reason)
		}
	}
}
