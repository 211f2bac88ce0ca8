package kvaware

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/replicasync"
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

// TestRemotePrefillCountedOnce: a disaggregated request's prompt counts
// once in kvrouter_kv_prompt_tokens_total, the matched tokens and the
// placement's mean computed tokens: at its prefill pick, where it is
// computed; its decode pick is still a decision (kvrouter_kv_decisions_total).
func TestRemotePrefillCountedOnce(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
	tokens := promptTokens(48, 32*kvTestBS)
	w.store(w.insts[1].ID(), tokens, 0, 8) // the decode instance holds a prefix
	req := kvRequest("r", tokens)
	req.ShareKeys = true
	kvPick(t, s, req, w.insts[:1])
	req.RemotePrefill = true
	kvPick(t, s, req, w.insts[1:])
	prompt := counterValue(t, w.st.m.prompt.WithLabelValues("p"))
	var matched float64
	for _, tier := range []string{"gpu", "cpu", "disk", "shared"} {
		matched += counterValue(t, w.st.m.matched.WithLabelValues("p", tier))
	}
	w.st.computed.mu.Lock()
	samples := w.st.computed.n
	w.st.computed.mu.Unlock()
	var decisions float64
	for _, r := range []string{"kv_match", "heuristic", "load_bound", "overflow", "saturated"} {
		decisions += counterValue(t, w.st.m.decisions.WithLabelValues("p", r))
	}
	if prompt != float64(len(tokens)) || matched != 0 || samples != 1 || decisions != 2 {
		t.Fatalf("prompt tokens %v (want %d), matched %v (want 0), computed samples %d (want 1), decisions %v (want 2)", prompt, len(tokens), matched, samples, decisions)
	}
}

// TestRemotePrefillIntentDecidedAsDecode: a peer's intent for a
// disaggregated request's decode pick, through the wire, is decided dry as
// its owner decides it for real: one request in flight on the decode
// instance and no pending prefill there (the owner's pick books none,
// TestRemotePrefillPickChargesNoPrefill); a prefill pick's intent books
// its prompt as before.
func TestRemotePrefillIntentDecidedAsDecode(t *testing.T) {
	w, p := newTableWorld(t, 2)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
	tokens := promptTokens(49, 32*kvTestBS)
	for _, remote := range []bool{true, false} {
		req := kvRequest("r", tokens)
		req.RemotePrefill = remote
		in := s.Intent(context.Background(), req)
		m := throughWire(t, &replicasync.Message{Kind: replicasync.KindIntent, Replica: "b", Incarnation: 1, Intents: []replicasync.Intent{in}})
		got := m.Intents[0]
		dec, err := s.DecideIntent(context.Background(), &got, false, w.insts[1:])
		if err != nil {
			t.Fatal(err)
		}
		f, tok, reqs := p.PeerLoad(dec.Instance.ID())
		want := int64(len(tokens))
		if remote {
			want = 0
		}
		if f != 1 || tok != want || reqs != min(want, 1) {
			t.Errorf("remote prefill %v: the peer's dry pick overlays %d in flight, %d pending tokens in %d requests on %s; want 1, %d, %d",
				remote, f, tok, reqs, dec.Instance.ID(), want, min(want, 1))
		}
		w.st.EndEpoch()
	}
}
