package kvaware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// Preview decides as Pick would and commits nothing: a burst of previews
// of one new prefix leaves no speculative entries (each is still a
// heuristic decision, where picks would follow the first), no pending
// prefill and no observer; after one real pick the preview follows it.
func TestPreviewCommitsNothing(t *testing.T) {
	w := newKVWorld(t, 8)
	s := w.strategy(config.RoutingConfig{})
	system := promptTokens(21, 32*kvTestBS)
	req := func(i int) *router.Request {
		return kvRequest(fmt.Sprintf("q%d", i), append(slices.Clone(system), promptTokens(uint32(300+i), 20)...))
	}
	for _, strat := range []router.Strategy{s, NewShadow(router.NewPrefixAware(0, nil), s)} {
		for i := range 8 {
			d, h, err := Preview(context.Background(), strat, req(i), w.insts)
			if err != nil {
				t.Fatal(err)
			}
			// Nothing held: kv_aware's heuristic is the hash-home.
			if h.Strategy != config.StrategyPrefixAware || h.Instance != d.Instance {
				t.Fatalf("preview %d: hash pick %s (%s), kv_aware's heuristic %s", i, h.Instance.ID(), h.Strategy, d.Instance.ID())
			}
			if d.Reason != router.ReasonHeuristic || d.Observer != nil || d.Explain == nil {
				t.Fatalf("%s preview %d: reason %s, observer %v, explain %v; want heuristic, none, set", strat.Name(), i, d.Reason, d.Observer, d.Explain)
			}
		}
	}
	for _, in := range w.insts {
		if tok, reqs := w.st.PendingPrefill(in.ID()); tok != 0 || reqs != 0 {
			t.Fatalf("previews left pending prefill on %s: %d tokens, %d requests", in.ID(), tok, reqs)
		}
	}
	first := kvPick(t, s, req(100), w.insts)
	d, _, err := Preview(context.Background(), s, req(101), w.insts)
	if err != nil {
		t.Fatal(err)
	}
	if d.Instance != first.Instance || d.Reason != router.ReasonKVMatch {
		t.Fatalf("after a pick on %s: preview %s %s, want it kv_match", first.Instance.ID(), d.Instance.ID(), d.Reason)
	}
	if _, _, err := Preview(context.Background(), router.NewPrefixAware(0, nil), req(0), w.insts); !errors.Is(err, ErrNoPreview) {
		t.Fatalf("preview of prefix_aware: %v, want ErrNoPreview", err)
	}
}
