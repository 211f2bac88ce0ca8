package flowcontrol

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func mustGate(t testing.TB, cfg Config, opts ...GateOption) *Gate {
	t.Helper()
	g, err := NewGate(cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// waitQueued waits until n requests wait in g.
func waitQueued(t *testing.T, g *Gate, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if g.Stats().Queued == n {
			return
		}
	}
	t.Fatalf("queue never reached %d (at %d)", n, g.Stats().Queued)
}

// TestGateConcurrent runs many goroutines through a gate of 4 slots: never
// more than 4 hold a ticket, every request is admitted, and the gate ends
// empty.
func TestGateConcurrent(t *testing.T) {
	const slots, workers, per = 4, 32, 50
	g := mustGate(t, Config{MaxConcurrency: slots, MaxQueue: workers, MaxWait: time.Minute})
	var held, peak atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				tk, err := g.Acquire(context.Background(), Item{Tenant: string(rune('a' + w%5)), Priority: int64(i % 3), Cost: int64(1 + i)})
				if err != nil {
					t.Error(err)
					return
				}
				n := held.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				tk.FirstToken()
				held.Add(-1)
				tk.Done()
				tk.Done()
			}
		}()
	}
	wg.Wait()
	st := g.Stats()
	if peak.Load() > slots || st.InFlight != 0 || st.Queued != 0 || st.PendingPrefill != 0 {
		t.Fatalf("peak %d, stats %+v", peak.Load(), st)
	}
	if c := st.Counts; c.AdmittedAtOnce+c.AdmittedQueued != workers*per {
		t.Fatalf("admitted %d+%d", c.AdmittedAtOnce, c.AdmittedQueued)
	}
}

// TestGateCancelWhileQueued: a client that goes away while waiting leaves
// the queue at once and is counted; the slot it never took is not lost.
func TestGateCancelWhileQueued(t *testing.T) {
	g := mustGate(t, Config{MaxConcurrency: 1})
	first, err := g.Acquire(context.Background(), Item{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := g.Acquire(ctx, Item{Tenant: "gone"}); errc <- err }()
	waitQueued(t, g, 1)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v", err)
	}
	st := g.Stats()
	if st.Queued != 0 || st.Counts.Shed[Canceled] != 1 {
		t.Fatalf("stats %+v", st)
	}
	first.Done()
	if _, err := g.Acquire(context.Background(), Item{}); err != nil {
		t.Fatal(err)
	}
}

func TestGateTimeout(t *testing.T) {
	g := mustGate(t, Config{MaxConcurrency: 1, MaxWait: 20 * time.Millisecond})
	if _, err := g.Acquire(context.Background(), Item{}); err != nil {
		t.Fatal(err)
	}
	_, err := g.Acquire(context.Background(), Item{})
	var se *ShedError
	if !errors.As(err, &se) || se.Reason != ShedTimeout || se.RetryAfter < time.Second || se.Waited < 20*time.Millisecond {
		t.Fatalf("err %v (%+v)", err, se)
	}
}

// TestGateDisplacedWakesWaiter: a waiter displaced from a full queue is
// woken, shed, and told to retry after at least a second, as every shed
// request is.
func TestGateDisplacedWakesWaiter(t *testing.T) {
	g := mustGate(t, Config{MaxConcurrency: 1, MaxQueue: 1})
	if _, err := g.Acquire(context.Background(), Item{}); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { _, err := g.Acquire(context.Background(), Item{Priority: 5}); errc <- err }()
	waitQueued(t, g, 1)
	go func() { _, _ = g.Acquire(context.Background(), Item{Priority: 0}) }()
	var se *ShedError
	if err := <-errc; !errors.As(err, &se) || se.Reason != ShedDisplaced {
		t.Fatalf("err %v", err)
	}
	if se.RetryAfter < time.Second {
		t.Fatalf("displaced: RetryAfter %v, want at least 1s", se.RetryAfter)
	}
}

// TestGateLimitsFollowPool: the budget read through WithLimits applies at
// the next decision.
func TestGateLimitsFollowPool(t *testing.T) {
	var limit atomic.Int64
	limit.Store(1)
	g := mustGate(t, Config{}, WithLimits(func() (int, int64) { return int(limit.Load()), 0 }))
	a, err := g.Acquire(context.Background(), Item{})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Ticket, 1)
	go func() { tk, _ := g.Acquire(context.Background(), Item{}); got <- tk }()
	waitQueued(t, g, 1)
	limit.Store(2)
	a.FirstToken() // any decision re-reads the limits
	if tk := <-got; tk == nil {
		t.Fatal("not admitted after the limit rose")
	}
}

// TestGatePerInstance: with a per-instance prefill budget a request waits
// until an instance has room, FilterRoom keeps the instances that have,
// and Bind charges the one it went to.
func TestGatePerInstance(t *testing.T) {
	live := []string{"a", "b"}
	g := mustGate(t, Config{InstancePrefill: 100, MaxWait: time.Minute}, WithInstances(func() []string { return live }))
	ctx := context.Background()
	t1, err := g.Acquire(ctx, Item{Prefill: 80, Cost: 80})
	if err != nil {
		t.Fatal(err)
	}
	if got := FilterRoom(t1, []string{"a", "b"}, func(s string) string { return s }); len(got) != 2 {
		t.Fatalf("FilterRoom = %v, want both", got)
	}
	t1.Bind("a")
	t1.Bind("b") // only the first counts
	t2, err := g.Acquire(ctx, Item{Prefill: 80, Cost: 80})
	if err != nil {
		t.Fatal(err)
	}
	if got := FilterRoom(t2, []string{"a", "b"}, func(s string) string { return s }); len(got) != 1 || got[0] != "b" {
		t.Fatalf("FilterRoom = %v, want [b]", got)
	}
	t2.Bind("b")
	done := make(chan *Ticket)
	go func() {
		t3, err := g.Acquire(ctx, Item{Prefill: 80, Cost: 80})
		if err != nil {
			t.Error(err)
		}
		done <- t3
	}()
	waitQueued(t, g, 1)
	t2.FirstToken()
	t3 := <-done
	if got := FilterRoom(t3, []string{"a", "b"}, func(s string) string { return s }); len(got) != 1 || got[0] != "b" {
		t.Fatalf("FilterRoom = %v, want [b]", got)
	}
	t3.Bind("b")
	for _, tk := range []*Ticket{t1, t2, t3} {
		tk.Done()
	}
	for _, l := range g.Stats().Instances {
		if l.InFlight != 0 || l.PendingPrefill != 0 {
			t.Fatalf("load left: %+v", g.Stats().Instances)
		}
	}
}

// TestGateExpiryAdmitsTheRequestsBehind: a head that blocks the queue (its
// prompt does not fit the prefill budget beside the request in flight)
// expires at its deadline; the request behind it, which fits, is admitted
// then, not at the next first token or end (none comes here).
func TestGateExpiryAdmitsTheRequestsBehind(t *testing.T) {
	g := mustGate(t, Config{MaxPendingPrefill: 100})
	first, err := g.Acquire(context.Background(), Item{Prefill: 50})
	if err != nil {
		t.Fatal(err)
	}
	defer first.Done()
	headErr := make(chan error, 1)
	go func() {
		_, err := g.Acquire(context.Background(), Item{Prefill: 100, Deadline: time.Now().Add(50 * time.Millisecond)})
		headErr <- err
	}()
	waitQueued(t, g, 1)
	behind := make(chan error, 1)
	go func() {
		tk, err := g.Acquire(context.Background(), Item{Prefill: 10})
		if err == nil {
			tk.Done()
		}
		behind <- err
	}()
	var se *ShedError
	if err := <-headErr; !errors.As(err, &se) || se.Reason != ShedDeadline {
		t.Fatalf("head: %v, want shed for its deadline", err)
	}
	select {
	case err := <-behind:
		if err != nil {
			t.Fatalf("behind: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request behind the expired head was not admitted")
	}
}

// TestUnstreamedReleasesAtPredictedFirstToken: an Unstreamed request's
// prefill is released at the service fit's predicted first token (at once
// before the fit has a sample), and its first byte, after its generation,
// teaches the fit nothing.
func TestUnstreamedReleasesAtPredictedFirstToken(t *testing.T) {
	var clock atomic.Int64
	now := func() time.Time { return t0.Add(time.Duration(clock.Load())) }
	g := mustGate(t, Config{InstancePrefill: 1000}, WithClock(now), WithInstances(func() []string { return []string{"a"} }))
	acquire := func() *Ticket {
		tk, err := g.Acquire(context.Background(), Item{Cost: 600, Prefill: 600})
		if err != nil {
			t.Fatal(err)
		}
		tk.Bind("a")
		return tk
	}
	cold := acquire()
	cold.Unstreamed(0)
	if p := g.Stats().PendingPrefill; p != 0 {
		t.Fatalf("nothing learnt: pending prefill %d after Unstreamed, want 0", p)
	}
	clock.Add(int64(5 * time.Second)) // its generation
	cold.FirstToken()
	cold.Done()
	if st := g.Stats(); st.ServiceTTFT != 0 {
		t.Fatalf("a non-streamed first byte was learnt: service %v", st.ServiceTTFT)
	}
	warm := acquire() // streamed: teaches the fit 100 ms
	clock.Add(int64(100 * time.Millisecond))
	warm.FirstToken()
	warm.Done()
	tk := acquire()
	tk.Unstreamed(time.Hour) // the fit's prediction, not the fallback
	if p := g.Stats().PendingPrefill; p != 600 {
		t.Fatalf("pending prefill %d before the predicted first token, want 600", p)
	}
	deadline := time.Now().Add(10 * time.Second)
	for g.Stats().PendingPrefill != 0 {
		if time.Now().After(deadline) {
			t.Fatal("prefill not released at the predicted first token (~100 ms)")
		}
		time.Sleep(5 * time.Millisecond)
	}
	tk.Done()
	if st := g.Stats(); st.ServiceTTFT != 100*time.Millisecond || st.InFlight != 0 {
		t.Fatalf("service %v, in flight %d; want 100ms, 0", st.ServiceTTFT, st.InFlight)
	}
}

// waiterBehindLimit is a gate whose concurrency limit (1, read through
// WithLimits) one request holds, with a second waiting: its outcome comes
// on the channel. raise lifts the limit to 2 behind the gate's back.
func waiterBehindLimit(t *testing.T, maxWait time.Duration) (g *Gate, raise func(), outcome <-chan error) {
	var limit atomic.Int64
	limit.Store(1)
	g = mustGate(t, Config{MaxWait: maxWait}, WithLimits(func() (int, int64) { return int(limit.Load()), 0 }))
	a, err := g.Acquire(context.Background(), Item{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Done)
	got := make(chan error, 1)
	go func() {
		tk, err := g.Acquire(context.Background(), Item{})
		if err == nil {
			tk.Done()
		}
		got <- err
	}()
	waitQueued(t, g, 1)
	return g, func() { limit.Store(2) }, got
}

// TestGateRaisedLimitAdmitsAtExpiry: a budget raised with nothing else
// happening (no arrival, first token or end) leaves a slot free; when the
// waiter's own timer fires it is admitted to it, not shed for its wait.
func TestGateRaisedLimitAdmitsAtExpiry(t *testing.T) {
	_, raise, got := waiterBehindLimit(t, 300*time.Millisecond)
	raise()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("the waiter was not admitted beside a free slot: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no outcome")
	}
}

// TestGatePokeAdmits: Poke, called when the budgets or instances change,
// admits the waiters the change has room for at once.
func TestGatePokeAdmits(t *testing.T) {
	g, raise, got := waiterBehindLimit(t, time.Hour)
	raise()
	g.Poke()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("the waiter was not admitted: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the waiter was not admitted within 20 s of Poke (max_wait 1 h)")
	}
}
