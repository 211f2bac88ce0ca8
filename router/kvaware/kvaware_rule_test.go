package kvaware

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestColdBoundedLoad: a prompt nobody holds goes to its hash-home while
// the home's queue is within (1+ε) of the mean, and to the least loaded
// instance once the home is past it (consistent hashing with bounded
// loads); a burst of that prompt then follows it there.
func TestColdBoundedLoad(t *testing.T) {
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{})
	cold := promptTokens(31, 64*kvTestBS)
	order := router.RendezvousOrder(kvRequest("cold", cold), w.insts)
	home := order[0]

	if d := kvPick(t, s, kvRequest("cold", cold), w.insts); d.Instance != home || d.Reason != router.ReasonHeuristic {
		t.Fatalf("idle fleet: picked %s (%s), want the home %s (heuristic)", d.Instance.ID(), d.Reason, home.ID())
	}
	// Pile unrelated long prompts on the home: pending prefill well past
	// the bound (the mean is a quarter of the home's queue).
	busy := promptTokens(32, 400*kvTestBS)
	for i := range 3 {
		busy[0] = uint32(1000 + i) // distinct prompts
		d, err := s.Pick(context.Background(), kvRequest("x", busy), []*router.Instance{home})
		if err != nil || d.Instance != home {
			t.Fatal(d, err)
		}
	}
	cold2 := promptTokens(33, 64*kvTestBS)
	req := kvRequest("cold", cold2) // same routing text: same home
	d := kvPick(t, s, req, w.insts)
	if d.Instance == home || d.Reason != router.ReasonLoadBound {
		t.Fatalf("home over the bound: picked %s (%s), want another (load_bound)", d.Instance.ID(), d.Reason)
	}
	// The next request of that new prefix follows it (speculative entry).
	if d2 := kvPick(t, s, kvRequest("cold", cold2), w.insts); d2.Instance != d.Instance || d2.Reason != router.ReasonKVMatch {
		t.Errorf("burst: picked %s (%s), want %s (kv_match)", d2.Instance.ID(), d2.Reason, d.Instance.ID())
	}
	// With the rule off, the home takes it regardless (prefix_aware).
	off := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{LoadBound: -1}})
	if d := kvPick(t, off, kvRequest("cold", promptTokens(34, 64*kvTestBS)), w.insts); d.Instance != home {
		t.Errorf("load_bound off: picked %s, want the home %s", d.Instance.ID(), home.ID())
	}
}

// TestAdaptiveWeight: the prefill cost weight follows the measured busy
// fraction ρ as max(1, ρ/(1−ρ)², requests measured behind others), capped;
// a fixed weight stays fixed.
func TestAdaptiveWeight(t *testing.T) {
	ad := resolveScoring(&config.KVScoringConfig{})
	for _, c := range []struct{ rho, want float64 }{{0, 1}, {0.25, 1}, {0.5, 2}, {0.7, 0.7 / 0.09}, {0.75, 12}, {0.8, MaxAdaptiveCostWeight}, {0.99, MaxAdaptiveCostWeight}, {1, MaxAdaptiveCostWeight}} {
		if got := ad.weight(c.rho, 0); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("adaptive weight at ρ=%v: %v, want %v", c.rho, got, c.want)
		}
	}
	// Requests measured behind others in a busy period count when they say
	// more than the busy fraction does.
	for _, c := range []struct{ rho, behind, want float64 }{{0.1, 3, 3}, {0.5, 0.5, 2}, {0.5, 40, MaxAdaptiveCostWeight}} {
		if got := ad.weight(c.rho, c.behind); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("adaptive weight at ρ=%v, %v behind: %v, want %v", c.rho, c.behind, got, c.want)
		}
	}
	fixed, neg := resolveScoring(&config.KVScoringConfig{PrefillCostWeight: 3}), resolveScoring(&config.KVScoringConfig{PrefillCostWeight: -1})
	if got := fixed.weight(0.99, 30); got != 3 {
		t.Errorf("fixed weight 3: %v", got)
	}
	if got := neg.weight(0.99, 30); got != 0 {
		t.Errorf("negative weight: %v", got)
	}

	// The busy fraction averages the share of candidates with requests in
	// flight over the window of the decision clock.
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{})
	p := promptTokens(41, 8*kvTestBS)
	kvPick(t, s, kvRequest("a", p), w.insts) // idle: ρ = 0
	if u := w.st.Utilisation(); u != 0 {
		t.Fatalf("idle utilisation %v", u)
	}
	for _, in := range w.insts {
		in.Acquire()
	}
	w.clock.Advance(DefaultUtilisationWindow)
	kvPick(t, s, kvRequest("b", p), w.insts)
	if u, want := w.st.Utilisation(), 1-math.Exp(-1); math.Abs(u-want) > 1e-6 {
		t.Errorf("after one window fully busy: %v, want %v", u, want)
	}
	w.clock.Advance(10 * DefaultUtilisationWindow)
	kvPick(t, s, kvRequest("c", p), w.insts)
	if u := w.st.Utilisation(); u < 0.99 {
		t.Errorf("after ten windows fully busy: %v", u)
	}
	// Shadow (dry) scoring reads the average without moving it.
	for _, in := range w.insts {
		in.Release()
	}
	w.clock.Advance(time.Hour)
	before := w.st.Utilisation()
	ev := w.st.getEval()
	s.evaluate(context.Background(), kvRequest("d", p), w.insts, ev, false)
	w.st.putEval(ev)
	if w.st.Utilisation() != before {
		t.Errorf("dry scoring moved the utilisation from %v to %v", before, w.st.Utilisation())
	}
}
