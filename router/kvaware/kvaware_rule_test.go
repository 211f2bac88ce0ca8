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

// TestColdHomeDecoding: the bounded-load rule compares work queued, not
// the residual of the step in progress. A cold prompt's home that decodes
// one request while the rest of the fleet is idle predicts a longer wait
// (half a decode step) but holds no more work than a share of one step:
// it keeps the prompt. A home decoding many requests is loaded (each
// running sequence adds to every step) and the prompt leaves it.
func TestColdHomeDecoding(t *testing.T) {
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{})
	cold := promptTokens(51, 64*kvTestBS)
	home := router.RendezvousOrder(kvRequest("cold", cold), w.insts)[0]
	home.Acquire() // one request decoding there: in flight, no prefill pending
	d := kvPick(t, s, kvRequest("cold", cold), w.insts)
	if d.Instance != home || d.Reason != router.ReasonHeuristic {
		t.Fatalf("home decoding one request, fleet idle: picked %s (%s), want the home %s (heuristic)", d.Instance.ID(), d.Reason, home.ID())
	}
	if d.Explain == nil || d.Explain.PredictedTTFT < time.Duration(DefaultDecodeStepSeconds/2*1e9) {
		t.Errorf("the predicted TTFT at the home leaves out the step in progress: %+v", d.Explain)
	}
	// On a fresh fleet, a home decoding 16 requests: 8 ms of every step is
	// theirs, past (1+ε) × the mean load, with no prefill queued anywhere.
	w2 := newKVWorld(t, 4)
	s2 := w2.strategy(config.RoutingConfig{})
	home2 := router.RendezvousOrder(kvRequest("cold", cold), w2.insts)[0]
	for range 16 {
		home2.Acquire()
	}
	if d := kvPick(t, s2, kvRequest("cold", cold), w2.insts); d.Instance == home2 || d.Reason != router.ReasonLoadBound {
		t.Errorf("home decoding 16 requests: picked %s (%s), want another (load_bound)", d.Instance.ID(), d.Reason)
	}
}

// TestLoadBoundLeavesHome: a cold prompt's home over the load bound gives
// the prompt to another instance even when its queue only ties theirs (the
// others decode, so their queues hold a step residual the bound leaves
// out, and a tie goes to the highest rendezvous score: the home). Found
// in review: the home kept the prompt with reason load_bound.
func TestLoadBoundLeavesHome(t *testing.T) {
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{})
	cold := promptTokens(51, 64*kvTestBS)
	home := router.RendezvousOrder(kvRequest("cold", cold), w.insts)[0]
	if _, err := s.Pick(context.Background(), kvRequest("x", promptTokens(7, 8*kvTestBS)), []*router.Instance{home}); err != nil {
		t.Fatal(err) // 128 tokens of prefill pending on the home (~5.1 ms), not released
	}
	for _, in := range w.insts {
		if in != home {
			in.Acquire() // the others decode one request each: queue ~4.75 ms, load 0.5 ms
		}
	}
	d := kvPick(t, s, kvRequest("cold", cold), w.insts)
	if d.Instance == home || d.Reason != router.ReasonLoadBound {
		t.Fatalf("home over the bound, queues tied: picked %s (%s), want another instance (load_bound)", d.Instance.ID(), d.Reason)
	}
}

// TestAdaptiveWeight: the prefill cost weight follows the measured busy
// fraction ρ as max(1, ρ/(1−ρ)², requests measured behind others), capped;
// a fixed weight stays fixed.
func TestAdaptiveWeight(t *testing.T) {
	ad := resolveScoring(&config.KVScoringConfig{})
	for _, c := range []struct{ rho, want float64 }{{0, 1}, {0.25, 1}, {0.5, 2}, {0.7, 0.7 / 0.09}, {0.75, 12}, {0.8, MaxAdaptiveCostWeight}, {0.99, MaxAdaptiveCostWeight}, {1, MaxAdaptiveCostWeight}} {
		if got := ad.weight(measuredWeight(c.rho, 0)); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("adaptive weight at ρ=%v: %v, want %v", c.rho, got, c.want)
		}
	}
	// Requests measured behind others in a busy period count when they say
	// more than the busy fraction does.
	for _, c := range []struct{ rho, behind, want float64 }{{0.1, 3, 3}, {0.5, 0.5, 2}, {0.5, 40, MaxAdaptiveCostWeight}} {
		if got := ad.weight(measuredWeight(c.rho, c.behind)); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("adaptive weight at ρ=%v, %v behind: %v, want %v", c.rho, c.behind, got, c.want)
		}
	}
	fixed, neg := resolveScoring(&config.KVScoringConfig{PrefillCostWeight: 3}), resolveScoring(&config.KVScoringConfig{PrefillCostWeight: -1})
	if got := fixed.weight(measuredWeight(0.99, 30)); got != 3 {
		t.Errorf("fixed weight 3: %v", got)
	}
	if got := neg.weight(measuredWeight(0.99, 30)); got != 0 {
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

// TestUtilisationCountsDrainedBusy: an instance busy since the previous
// decision and idle at this one counts as busy until its request ended,
// not idle for the whole interval. A burst's instances drain before the
// next burst's first decision, which saw them idle and put the busy
// average far under the engines' (docs/BENCHMARKS.md §7, "Session 25").
func TestUtilisationCountsDrainedBusy(t *testing.T) {
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{})
	d, err := s.Pick(context.Background(), kvRequest("a", promptTokens(51, 8*kvTestBS)), w.insts)
	if err != nil {
		t.Fatal(err)
	}
	if u := w.st.Utilisation(); u != 0 {
		t.Fatalf("idle fleet at the first decision: %v", u)
	}
	d.Instance.Acquire() // the proxy's in-flight count while the request runs
	w.clock.Advance(DefaultUtilisationWindow * 9 / 10)
	d.Instance.Release()
	d.Observer.Done(200, -1)
	w.clock.Advance(DefaultUtilisationWindow / 10)
	kvPick(t, s, kvRequest("b", promptTokens(52, 8*kvTestBS)), w.insts)
	// One of four busy for 0.9 of the window since the last decision.
	if u, want := w.st.Utilisation(), 0.9/4*(1-math.Exp(-1)); math.Abs(u-want) > 1e-6 {
		t.Errorf("after one of four instances busy for 0.9 of a window: %v, want %v", u, want)
	}
	// Not counted again: idle since, the next interval is idle.
	before := w.st.Utilisation()
	w.clock.Advance(DefaultUtilisationWindow)
	kvPick(t, s, kvRequest("c", promptTokens(53, 8*kvTestBS)), w.insts)
	if u, want := w.st.Utilisation(), before*math.Exp(-1); math.Abs(u-want) > 1e-6 {
		t.Errorf("a window idle after: %v, want %v", u, want)
	}
}

// A request this router followed without routing it (shadow scoring of
// another strategy's pick) does not count as busy: it may have started
// after the last committed decision, and its end does not say when.
func TestUtilisationIgnoresUnroutedEnds(t *testing.T) {
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{})
	kvPick(t, s, kvRequest("a", promptTokens(61, 8*kvTestBS)), w.insts)
	if u := w.st.Utilisation(); u != 0 {
		t.Fatalf("idle fleet at the first decision: %v", u)
	}
	w.clock.Advance(DefaultUtilisationWindow / 2)
	o, _ := w.st.newObserver(w.insts[1].ID(), 100, 0) // as shadow.go does for a heuristic's pick
	w.clock.Advance(DefaultUtilisationWindow / 4)
	o.Done(200, -1)
	w.clock.Advance(DefaultUtilisationWindow / 4)
	kvPick(t, s, kvRequest("b", promptTokens(62, 8*kvTestBS)), w.insts)
	if u := w.st.Utilisation(); u != 0 {
		t.Errorf("a shadow-followed request counted from the last decision: %v", u)
	}
}
