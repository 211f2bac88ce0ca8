package kvaware

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestLaterRequests: n is the new context over the mean computed tokens
// (floored at a block), less the request itself; nothing while ū is
// unmeasured or when nothing is new.
func TestLaterRequests(t *testing.T) {
	for _, c := range []struct {
		newTok int
		mean   float64
		bs     int
		want   float64
	}{
		{6000, 400, 16, 14}, // a session's first request: files nobody holds
		{20, 400, 16, 0},    // a follow-up adding a short edit
		{400, 400, 16, 0},   // a mean request places only itself
		{160, 1, 16, 9},     // ū under a block: floored at one block
		{6000, 0, 16, 0},    // ū not measured yet
		{0, 400, 16, 0},     // nothing new
		{6000, 400, 0, 0},   // no block size: nothing keyed
	} {
		if got := laterRequests(c.newTok, c.mean, c.bs); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("laterRequests(%d, %v, %d) = %v, want %v", c.newTok, c.mean, c.bs, got, c.want)
		}
	}
}

// TestQueueAverage: an instance's average queue starts at its first
// sample, each sample holds until the next (the average moves toward it
// as 1 − e^(−t/window) over the time it held), shadow reads do not move
// it, a sample that is not a finite non-negative number is dropped, and
// a sample older than the last does not move the clock back.
func TestQueueAverage(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var b queueAverage
	var m decayMemo
	win := DefaultUtilisationWindow
	if got := b.read(t0, 0.5, false, &m); got != 0 {
		t.Fatalf("a shadow read before any sample: %v", got)
	}
	if got := b.read(t0, 0.5, true, &m); got != 0.5 {
		t.Fatalf("the first sample: average %v, want the sample 0.5", got)
	}
	if got := b.read(t0.Add(win), 2, false, &m); got != 0.5 {
		t.Fatalf("a shadow read moved the average: %v", got)
	}
	// 0.5 held for one window, then 1 sampled: the average has only seen 0.5.
	if got := b.read(t0.Add(win), 1, true, &m); got != 0.5 {
		t.Fatalf("0.5 held for a window: %v, want 0.5", got)
	}
	// 1 held for a window, then 0: the average moves toward 1.
	got := b.read(t0.Add(2*win), 0, true, &m)
	if want := 0.5 + 0.5*(1-math.Exp(-1)); math.Abs(got-want) > 1e-9 {
		t.Fatalf("1 held for one window: %v, want %v", got, want)
	}
	for _, bad := range []float64{math.NaN(), math.Inf(1), math.Inf(-1), -1} {
		if g := b.read(t0.Add(3*win), bad, true, &m); g != got {
			t.Fatalf("sample %v moved the average: %v → %v", bad, got, g)
		}
	}
	// 0 held for a window (the bad samples were dropped, the clock kept).
	got2 := b.read(t0.Add(3*win), 0, true, &m)
	if want := got * math.Exp(-1); math.Abs(got2-want) > 1e-9 {
		t.Fatalf("0 held for one window: %v, want %v", got2, want)
	}
	if g := b.read(t0.Add(3*win), 5, true, &m); g != got2 {
		t.Fatalf("no time passed, the average moved: %v → %v", got2, g)
	}
	// A decision that committed late (older clock): it replaces the held
	// sample but the clock stays, so the next fold spans real time only.
	if g := b.read(t0.Add(2*win), 0, true, &m); g != got2 {
		t.Fatalf("an older sample moved the average: %v → %v", got2, g)
	}
	if !b.at.Equal(t0.Add(3 * win)) {
		t.Fatalf("an older sample moved the clock back to %v", b.at)
	}
	got3 := b.read(t0.Add(4*win), 0, true, &m)
	if want := got2 * math.Exp(-1); math.Abs(got3-want) > 1e-9 {
		t.Fatalf("after the late sample, 0 held for one window: %v, want %v", got3, want)
	}
}

// TestSessionPlacement: two idle instances hold a shared prefix; one has
// been busy for the last window, the other idle. A request bringing much
// new context (a session's first request) goes to the one that has been
// idle, though rendezvous order prefers the other; a request adding about
// the mean new tokens (a follow-up) places nothing and keeps the
// rendezvous tie-break. Without the placement term both would tie.
func TestSessionPlacement(t *testing.T) {
	sessionPlacement(t, config.RoutingConfig{}, false, 1)
}

// TestSessionPlacementFixedWeight: a fixed weight past the floor is the
// operator's price of a recomputed token, not a measure of load: on the
// same light load the placement term still counts.
func TestSessionPlacementFixedWeight(t *testing.T) {
	sessionPlacement(t, config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 2}}, false, 1)
}

// TestSessionPlacementQueued: with requests queueing behind each other's
// prefill (a third instance busy beside the first, so the measured weight
// passes 1) the later requests' wait is the prefill queue, not the step
// residual: no placement term, and the request with new context keeps
// the rendezvous tie-break — whether the weight the score uses is the
// measured one or fixed.
func TestSessionPlacementQueued(t *testing.T) {
	sessionPlacement(t, config.RoutingConfig{}, true, 0)
	sessionPlacement(t, config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 2}}, true, 0)
	sessionPlacement(t, config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 0.5}}, true, 0)
}

// sessionPlacement builds the scene; want is the instance (0 or 1) the
// request with new context should go to. queued keeps the third instance
// busy beside the first, for three windows (the fleet 2/3 busy).
func sessionPlacement(t *testing.T, rc config.RoutingConfig, queued bool, want int) {
	t.Helper()
	w := newKVWorld(t, 3)
	s := w.strategy(rc)
	a, b := w.insts[0], w.insts[1]
	shared := promptTokens(3, 32*kvTestBS) // the instructions, 512 tokens
	w.store(a.ID(), shared, 0, 32)
	w.store(b.ID(), shared, 0, 32)
	// ū: picks that each compute 4 blocks (64 tokens), on both holders.
	for i := range 2 * drainMinSamples {
		in := []*router.Instance{a, b}[i%2]
		kvPick(t, s, kvRequest("warm", append(slices.Clone(shared), promptTokens(uint32(100+i), 4*kvTestBS)...)), []*router.Instance{in})
	}
	// a busy for one window, b idle: committed decisions sample both.
	a.Acquire()
	windows := 1
	if queued {
		w.insts[2].Acquire()
		windows = 3
	}
	for range 10 * windows {
		w.clock.Advance(DefaultUtilisationWindow / 10)
		kvPick(t, s, kvRequest("tick", promptTokens(7, 4*kvTestBS)), []*router.Instance{w.insts[2], a, b})
	}
	a.Release()
	if queued {
		w.insts[2].Release()
	}
	w.clock.Advance(time.Second) // every pending prefill drained: both queues 0 now
	// A request whose rendezvous order puts a before b.
	var first, follow *router.Request
	for i := uint32(0); first == nil || follow == nil; i++ {
		ctx := append(slices.Clone(shared), promptTokens(1000+i, 64*kvTestBS)...) // 1,024 new tokens: 16 × ū
		edit := append(slices.Clone(shared), promptTokens(2000+i, 4*kvTestBS)...) // 64 new tokens: ū
		if r := kvRequest(fmt.Sprintf("s%d", i), ctx); first == nil && rendezvousBefore(r, a, b) {
			first = r
		}
		if r := kvRequest(fmt.Sprintf("f%d", i), edit); follow == nil && rendezvousBefore(r, a, b) {
			follow = r
		}
	}
	if d := kvPick(t, s, first, []*router.Instance{a, b}); d.Instance != w.insts[want] {
		t.Errorf("new context: picked %s (%s), want %s (a busy over the last window, b idle)", d.Instance.ID(), d.Reason, w.insts[want].ID())
	}
	w.clock.Advance(time.Second)
	// The follow-up adds about ū new tokens, so it places nothing: n is
	// under one later request with ū as it stands now (the first pick,
	// 16 ū of new context, moved ū up, which only lowers n further).
	if n := laterRequests(4*kvTestBS, s.st.computed.mean(), kvTestBS); n >= 1 {
		t.Fatalf("the follow-up places %v later requests (ū %v), want under 1", n, s.st.computed.mean())
	}
	if d := kvPick(t, s, follow, []*router.Instance{a, b}); d.Instance != a {
		t.Errorf("a follow-up (about ū new tokens): picked %s (%s), want the rendezvous tie-break %s", d.Instance.ID(), d.Reason, a.ID())
	}
}

func rendezvousBefore(r *router.Request, a, b *router.Instance) bool {
	return a.Rendezvous(r.RoutingHash()) > b.Rendezvous(r.RoutingHash())
}
