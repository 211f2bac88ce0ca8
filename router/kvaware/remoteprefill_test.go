package kvaware

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestRemotePrefillPickChargesNoPrefill: a disaggregated request's decode
// pick (Request.RemotePrefill) books no pending prefill on the decode
// instance — it receives the prompt's KV, it does not compute it — while
// the prefill pick books the whole prompt on the prefill instance.
func TestRemotePrefillPickChargesNoPrefill(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
	tokens := promptTokens(47, 32*kvTestBS)
	req := kvRequest("r", tokens)
	req.ShareKeys = true
	pre, err := s.Pick(context.Background(), req, w.insts[:1])
	if err != nil {
		t.Fatal(err)
	}
	req.RemotePrefill = true
	dec, err := s.Pick(context.Background(), req, w.insts[1:])
	if err != nil {
		t.Fatal(err)
	}
	p0, _ := w.st.PendingPrefill(w.insts[0].ID())
	p1, n1 := w.st.PendingPrefill(w.insts[1].ID())
	if p0 != int64(len(tokens)) || p1 != 0 {
		t.Fatalf("pending prefill: prefill instance %d (want %d), decode instance %d tokens in %d requests (want 0)", p0, len(tokens), p1, n1)
	}
	pre.Observer.Done(200, -1)
	dec.Observer.Done(200, -1)
}
