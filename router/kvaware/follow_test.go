package kvaware

import (
	"context"
	"math"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestFollowLevel: levels double from a quarter of a pending request per
// instance to 16; below a quarter (and nonsense) is the idle level.
func TestFollowLevel(t *testing.T) {
	for _, c := range []struct {
		per  float64
		want int
	}{
		{0, 0}, {0.2, 0}, {0.25, 1}, {0.49, 1}, {0.5, 2}, {0.99, 2}, {1, 3}, {1.9, 3},
		{2, 4}, {4, 5}, {8, 6}, {15.9, 6}, {16, 7}, {1e9, 7}, {math.NaN(), 0}, {-1, 0},
	} {
		if got := followLevel(c.per); got != c.want {
			t.Errorf("followLevel(%v) = %d, want %d", c.per, got, c.want)
		}
	}
}

// TestFollowTableConditional: requests routed inside a burst (a high
// level) are measured with the followers their burst brings, requests
// routed alone with none — where the overall mean would give both the
// same number.
func TestFollowTableConditional(t *testing.T) {
	var tab followTable
	var alone, burst periodLevels
	var overall sampleMean
	for round := range 40 {
		// An isolated request: it starts and ends its busy period alone.
		tab.add(0, alone.join(0, true))
		overall.add(0)
		// A burst of ten at level 5: the k-th has 9−k followers.
		for k := range 10 {
			tab.add(5, burst.join(5, k == 0))
			overall.add(float64(k))
		}
		if round == 0 {
			if _, ok := tab.mean(0); ok {
				t.Fatal("a level with one sample is read")
			}
		}
	}
	// The last burst's requests are still crediting (its period is
	// open): they have their followers in full, since the burst is done.
	m0, ok0 := tab.mean(0)
	m5, ok5 := tab.mean(5)
	if !ok0 || !ok5 {
		t.Fatal("levels with 40 and 400 samples not read")
	}
	if m0 != 0 {
		t.Errorf("isolated requests: %v followers, want 0", m0)
	}
	// Within 0.2: a follower credited after its request's level decayed
	// weighs a little more than the request's count (half-life 64
	// samples against bursts of 10: ~2 %).
	if math.Abs(m5-4.5) > 0.2 {
		t.Errorf("burst requests: %v followers, want 4.5 (9, 8, …, 0)", m5)
	}
	if o := overall.mean(); o < 3.5 || o > 4.5 {
		t.Errorf("overall mean %v, want about 45/11", o)
	}
	if _, ok := tab.mean(3); ok {
		t.Error("a level never sampled is read")
	}
}

// TestWeightAtFleetLevel: a decision's prefill cost weight reads the
// followers measured at the fleet's current pending level, and the
// overall mean where that level has too few samples.
func TestWeightAtFleetLevel(t *testing.T) {
	w := newKVWorld(t, 1)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillTokensPerSecond: 10_000}})
	x := w.insts[0]
	// Level 3 (1–2 pending requests per instance): eight requests, then
	// 96 followers credited to them.
	for range drainMinSamples {
		w.st.follow.add(3, [followLevels]int32{})
	}
	var ahead [followLevels]int32
	ahead[3] = 96
	w.st.follow.add(0, ahead)
	want3, ok := w.st.follow.mean(3)
	if !ok || want3 < 11 || want3 > MaxAdaptiveCostWeight {
		t.Fatalf("level 3 mean %v (%v), want about 12", want3, ok)
	}
	weightNow := func() float64 {
		t.Helper()
		_, ev, err := s.pick(context.Background(), kvRequest("probe", promptTokens(99, 4*kvTestBS)), w.insts, false)
		if err != nil {
			t.Fatal(err)
		}
		defer w.st.putEval(ev)
		return ev.weight
	}
	idle := weightNow() // level 0: one sample, the overall mean stands in
	if idle >= want3 {
		t.Fatalf("idle fleet weight %v, want under level 3's %v", idle, want3)
	}
	d := kvPickOn(t, s, x, 7) // one pending request on the one instance: level 3
	if got := weightNow(); math.Abs(got-want3) > 1e-9 {
		t.Fatalf("weight with one pending request per instance %v, want level 3's %v", got, want3)
	}
	d.dec.Observer.Done(200, -1)
	if got := weightNow(); got != idle {
		t.Fatalf("weight after the request ended %v, want the idle %v", got, idle)
	}
}
