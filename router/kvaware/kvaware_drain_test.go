package kvaware

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestPendingDrains: the wait kv_aware predicts on an instance working
// through routed prefill shrinks as the engine's prefill rate would work it
// off, instead of staying at the whole pending work until the first byte;
// it never exceeds the pending tokens, and work routed after the queue
// emptied starts then, not after an old prediction.
func TestPendingDrains(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillTokensPerSecond: 10_000}})
	queueOn := func(inst *router.Instance) float64 { return probeQueue(t, s, w, inst) }
	near := func(what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-6 {
			t.Fatalf("%s: queue %.6f s, want %.6f s", what, got, want)
		}
	}
	long := promptTokens(1, 2000*kvTestBS) // 32,000 tokens: 3.2 s at 10,000 tokens/s
	d, err := s.Pick(context.Background(), kvRequest("long", long), w.insts)
	if err != nil {
		t.Fatal(err)
	}
	x := d.Instance
	near("at the pick", queueOn(x), 3.2)
	w.clock.Advance(time.Second)
	near("1 s later", queueOn(x), 2.2)
	if tok, _ := w.st.PendingPrefill(x.ID()); tok != int64(len(long)) {
		t.Fatalf("pending tokens %d: the counter itself keeps the whole prompt until the first byte", tok)
	}

	// A second request behind it adds its own work after what is left.
	d2 := kvPickOn(t, s, x, 1000)
	near("behind the first", queueOn(x), 2.2+float64(len(d2.prompt))/10_000)

	// Past the predicted end the counter still holds both (no first byte
	// yet), but the engine has done the work at its rate: no prefill
	// wait, only the residual of the step it runs for them (S/2).
	w.clock.Advance(10 * time.Second)
	near("past the end", queueOn(x), DefaultDecodeStepSeconds/2)

	// Released work is not counted however late the prediction runs.
	d.Observer.Done(200, -1)
	d2.dec.Observer.Done(200, -1)
	near("released", queueOn(x), 0)

	// New work on an emptied queue starts now.
	d3 := kvPickOn(t, s, x, 1001)
	near("fresh queue", queueOn(x), float64(len(d3.prompt))/10_000)
	d3.dec.Observer.Done(200, -1)
}

type pickedOn struct {
	dec    router.Decision
	prompt []uint32
}

// kvPickOn routes a cold 1,600-token prompt with inst the only candidate
// and returns the decision, unreleased.
func kvPickOn(t *testing.T, s *KVAware, inst *router.Instance, seed uint32) pickedOn {
	t.Helper()
	p := promptTokens(seed, 100*kvTestBS)
	d, err := s.Pick(context.Background(), kvRequest("x", p), []*router.Instance{inst})
	if err != nil {
		t.Fatal(err)
	}
	return pickedOn{dec: d, prompt: p}
}

// TestDrainMeasures: the rate the wait drains at is the one the router
// measures from first bytes (work ahead plus own, over routing to first
// byte) once enough have arrived, and the requests found ahead in a busy
// period feed the prefill cost weight.
func TestDrainMeasures(t *testing.T) {
	w := newKVWorld(t, 1)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillTokensPerSecond: 10_000}})
	x := w.insts[0]
	queue := func() float64 { return probeQueue(t, s, w, x) }
	firstByte := func(d router.Decision) {
		t.Helper()
		d.Observer.FirstByte()
		d.Observer.Done(200, -1)
	}
	// Eight 625-block (10,000-token) prompts, each routed behind a
	// 1,600-token one and answered 2 s later: 11,600 tokens in 2 s, 5,800
	// tokens/s, about half the configured P.
	for i := range drainMinSamples {
		d := kvPickOn(t, s, x, uint32(2000+i))
		p := promptTokens(uint32(3000+i), 625*kvTestBS)
		dec, err := s.Pick(context.Background(), kvRequest("m", p), w.insts)
		if err != nil {
			t.Fatal(err)
		}
		firstByte(d.dec)
		w.clock.Advance(2 * time.Second)
		firstByte(dec)
	}
	if r := w.st.drainRate.rate(10_000); r < 4_000 || r > 6_000 {
		t.Fatalf("measured rate %.0f tokens/s, want about 5,800", r)
	}
	// Every sample found one request ahead (the small one routed first).
	if b := w.st.behind.mean(); b < 0.4 || b > 0.6 {
		t.Fatalf("mean ahead in the busy period %.2f, want 0.5 (alternately 0 and 1)", b)
	}
	rate := w.st.drainRate.rate(10_000)
	d := kvPickOn(t, s, x, 5000) // 1,600 tokens
	near := func(got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-3 {
			t.Fatalf("queue %.4f s, want %.4f s", got, want)
		}
	}
	near(queue(), 1600.0/10_000)
	w.clock.Advance(100 * time.Millisecond)
	near(queue(), (1600-0.1*rate)/10_000) // drained at the measured rate, not P (which would leave 0.06 s)
	d.dec.Observer.Done(200, -1)
}

// probeQueue is the wait kv_aware predicts on inst now, from dry scoring
// of a small probe prompt (nothing committed).
func probeQueue(t *testing.T, s *KVAware, w *kvWorld, inst *router.Instance) float64 {
	t.Helper()
	_, ev, err := s.pick(context.Background(), kvRequest("probe", promptTokens(99, 4*kvTestBS)), w.insts, false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.st.putEval(ev)
	return ev.find(inst).queue
}
