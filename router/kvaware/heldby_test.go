package kvaware

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestHeldByPerCandidate: HeldBy reports, per candidate and in the
// candidates' order, the prompt tokens each holds, commits nothing (no
// speculative entry: a second call answers the same), and keeps the
// prompt's keys for the pick when the request shares them.
func TestHeldByPerCandidate(t *testing.T) {
	w := newKVWorld(t, 3)
	s := w.strategy(config.RoutingConfig{})
	prompt := promptTokens(7, 10*kvTestBS)
	w.store("vllm-1", prompt, 0, 6)
	w.store("vllm-2", prompt, 0, 2)
	req := kvRequest("x", prompt)
	req.ShareKeys = true
	for range 2 {
		per, n, ok := s.HeldBy(context.Background(), req, w.insts, nil)
		if !ok || n != len(prompt) {
			t.Fatalf("HeldBy ok %v prompt %d, want true %d", ok, n, len(prompt))
		}
		if want := []int{0, 6 * kvTestBS, 2 * kvTestBS}; len(per) != 3 || per[0] != want[0] || per[1] != want[1] || per[2] != want[2] {
			t.Fatalf("held %v, want %v", per, want)
		}
	}
	if req.KeyMemo == nil {
		t.Fatal("the prompt's keys were not kept for the pick")
	}
	if held, n, ok := s.Held(context.Background(), req, w.insts); !ok || held != 6*kvTestBS || n != len(prompt) {
		t.Fatalf("Held = %d, %d, %v; want the most any candidate holds", held, n, ok)
	}
	if d := kvPick(t, s, req, w.insts); d.Instance.ID() != "vllm-1" {
		t.Fatalf("pick %s after HeldBy, want the holder", d.Instance.ID())
	}
}
