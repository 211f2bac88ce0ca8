package flowcontrol

import (
	"fmt"
	"math"
	"testing"
	"time"
)

var t0 = time.Unix(1_700_000_000, 0)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

func mustNew(t testing.TB, cfg Config) *Sched {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func offer(t testing.TB, s *Sched, it *Item, now time.Time, want Verdict) Outcome {
	t.Helper()
	out := s.Offer(it, now)
	if out.Verdict != want {
		t.Fatalf("offer %+v: verdict %d (%s), want %d", *it, out.Verdict, out.Reason, want)
	}
	return out
}

func TestConfigValidate(t *testing.T) {
	bad := []Config{
		{MaxConcurrency: -1}, {MaxPendingPrefill: -1}, {MaxQueue: -1}, {MaxWait: -1}, {AgingStep: -1},
		{Weights: map[string]float64{"a": 0}}, {Weights: map[string]float64{"a": math.NaN()}},
		{Weights: map[string]float64{"a": math.Inf(1)}},
	}
	for _, c := range bad {
		if _, err := New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
	c := Config{}.WithDefaults()
	if c.MaxQueue != DefaultMaxQueue || c.MaxWait != DefaultMaxWait || c.AgingStep != DefaultMaxWait/10 {
		t.Errorf("defaults %+v", c)
	}
}

func TestZeroConfigAdmitsEverything(t *testing.T) {
	s := mustNew(t, Config{})
	for i := range 1000 {
		offer(t, s, &Item{Cost: int64(i)}, at(0), Admitted)
	}
	if s.InFlight() != 1000 || s.Len() != 0 {
		t.Fatalf("in flight %d, queued %d", s.InFlight(), s.Len())
	}
}

func TestConcurrencyBudgetQueuesInOrder(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 2})
	a, b := &Item{Cost: 10}, &Item{Cost: 10}
	offer(t, s, a, at(0), Admitted)
	offer(t, s, b, at(0), Admitted)
	var q []*Item
	for i := range 3 {
		it := &Item{Cost: 10, Tenant: "t"}
		offer(t, s, it, at(i+1), Queued)
		q = append(q, it)
	}
	if s.Next(at(5)) != nil {
		t.Fatal("Next admitted over the budget")
	}
	s.Done(a, at(10))
	s.Done(a, at(10)) // twice: no double release
	if got := s.Next(at(10)); got != q[0] {
		t.Fatalf("Next = %+v, want the first queued", got)
	}
	if s.Next(at(10)) != nil {
		t.Fatal("second Next admitted over the budget")
	}
	if w := q[0].Waited(); w != 9*time.Millisecond {
		t.Fatalf("waited %v", w)
	}
	s.Done(b, at(11))
	if got := s.Next(at(11)); got != q[1] {
		t.Fatal("FIFO within one tenant broken")
	}
}

func TestStrictPriority(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, AgingStep: time.Hour, MaxWait: 2 * time.Hour})
	first := &Item{}
	offer(t, s, first, at(0), Admitted)
	var items []*Item
	for i, p := range []int64{5, 0, -3, 5, 0, 10} {
		it := &Item{Priority: p, Tenant: fmt.Sprint(i)}
		offer(t, s, it, at(i), Queued)
		items = append(items, it)
	}
	prev := first
	var got []int64
	for range items {
		s.Done(prev, at(100))
		prev = s.Next(at(100))
		got = append(got, prev.Priority)
	}
	want := []int64{-3, 0, 0, 5, 5, 10}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("admission order %v, want %v", got, want)
	}
}

// TestAgingPreventsStarvation keeps the most urgent band saturated (a new
// priority-0 request arrives for every one admitted); a priority-3
// request must still be admitted once it has waited past 2 aging steps
// (aging climbs bands, not values: one to reach band 0, one more to pass
// it), not never.
func TestAgingPreventsStarvation(t *testing.T) {
	const step = 100 * time.Millisecond
	s := mustNew(t, Config{MaxConcurrency: 1, AgingStep: step, MaxWait: time.Hour})
	running := &Item{}
	offer(t, s, running, at(0), Admitted)
	low := &Item{Priority: 3, Tenant: "low"}
	offer(t, s, low, at(0), Queued)
	for i := range 5 {
		offer(t, s, &Item{Tenant: "hi"}, at(0), Queued)
		_ = i
	}
	var lowAt time.Duration
	for ms := 10; ms < 10_000; ms += 10 {
		now := at(ms)
		s.Done(running, now)
		running = s.Next(now)
		if running == low {
			lowAt = now.Sub(t0)
			break
		}
		offer(t, s, &Item{Tenant: "hi"}, now, Queued) // keep band 0 busy
	}
	if lowAt == 0 {
		t.Fatal("the priority-3 request starved")
	}
	if lowAt < 2*step || lowAt > 3*step {
		t.Fatalf("admitted after %v, want after 2 to 3 aging steps of %v", lowAt, step)
	}
}

// TestFairQueuingOnTokens: a heavy tenant with 10x larger requests and a
// light tenant both keep the queue backlogged; the tokens admitted to each
// must follow their weights, not their request counts — also with the
// default aging step (max_wait/10) and waits well past it: aging that
// overtakes no band does not turn a lone band into arrival order.
func TestFairQueuingOnTokens(t *testing.T) {
	for _, tc := range []struct {
		name         string
		weights      map[string]float64
		wantLightPer float64 // light tokens per heavy token
		aging        bool    // default max_wait (30 s) and aging step (3 s)
	}{
		{"equal", nil, 1, false},
		{"light weighted 2", map[string]float64{"light": 2}, 2, false},
		{"heavy weighted 4", map[string]float64{"heavy": 4}, 0.25, false},
		{"equal, waits past the aging step", nil, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{MaxConcurrency: 1, MaxQueue: 100_000, Weights: tc.weights}
			if !tc.aging {
				cfg.MaxWait, cfg.AgingStep = time.Hour, time.Hour
			}
			s := mustNew(t, cfg)
			running := &Item{}
			offer(t, s, running, at(0), Admitted)
			for range 2000 {
				offer(t, s, &Item{Tenant: "heavy", Cost: 1000}, at(0), Queued)
				offer(t, s, &Item{Tenant: "light", Cost: 100}, at(0), Queued)
			}
			got := map[string]int64{}
			for i := range 1000 { // 10 s
				s.Done(running, at(10*i))
				running = s.Next(at(10 * i))
				got[running.Tenant] += running.Cost
			}
			ratio := float64(got["light"]) / float64(got["heavy"])
			if math.Abs(ratio/tc.wantLightPer-1) > 0.05 {
				t.Fatalf("light/heavy tokens = %d/%d = %.3f, want %.3f", got["light"], got["heavy"], ratio, tc.wantLightPer)
			}
		})
	}
}

// TestFairQueuingNewTenantNotPenalised: a tenant arriving after another
// built a long backlog is served within a request or two, not after the
// backlog.
func TestFairQueuingNewTenantNotPenalised(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour, AgingStep: time.Hour})
	running := &Item{}
	offer(t, s, running, at(0), Admitted)
	for range 500 {
		offer(t, s, &Item{Tenant: "heavy", Cost: 1000}, at(0), Queued)
	}
	for i := range 10 { // the heavy tenant is being served
		s.Done(running, at(i))
		running = s.Next(at(i))
	}
	light := &Item{Tenant: "light", Cost: 100}
	offer(t, s, light, at(20), Queued)
	for i := range 3 {
		s.Done(running, at(30+i))
		running = s.Next(at(30 + i))
		if running == light {
			return
		}
	}
	t.Fatal("a new light tenant waited behind the heavy tenant's backlog")
}

func TestBoundedLengthDisplacesByPriority(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxQueue: 3})
	offer(t, s, &Item{}, at(0), Admitted)
	low := []*Item{{Priority: 9}, {Priority: 9}, {Priority: 5}}
	for _, it := range low {
		offer(t, s, it, at(1), Queued)
	}
	out := offer(t, s, &Item{Priority: 9}, at(2), Shed)
	if out.Reason != ShedQueueFull || out.RetryAfter < time.Second {
		t.Fatalf("equal priority into a full queue: %+v", out)
	}
	out = offer(t, s, &Item{Priority: 1}, at(3), Queued)
	if out.Displaced != low[1] {
		t.Fatalf("displaced %+v, want the newest of the worst band", out.Displaced)
	}
	if s.Len() != 3 || s.Counts().Shed[ShedDisplaced] != 1 || s.Counts().Shed[ShedQueueFull] != 1 {
		t.Fatalf("len %d counts %+v", s.Len(), s.Counts())
	}
	if s.Remove(low[1], Canceled, at(4)) {
		t.Fatal("a displaced item was still removable")
	}
}

// TestFloodStaysBounded offers a flood of requests from distinct tenants
// to a saturated pool: the queue and the tenants' fair-queuing state stay
// bounded by MaxQueue.
func TestFloodStaysBounded(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 4, MaxQueue: 64, MaxWait: time.Second})
	var running []*Item
	for i := range 200_000 {
		now := at(i / 100)
		it := &Item{Tenant: fmt.Sprint("t", i), Priority: int64(i % 3), Cost: int64(1 + i%500)}
		switch s.Offer(it, now).Verdict {
		case Admitted:
			running = append(running, it)
		}
		if i%7 == 0 && len(running) > 0 {
			s.Done(running[0], now)
			running = running[1:]
			if n := s.Next(now); n != nil {
				running = append(running, n)
			}
		}
		_ = s.Expire(now, nil)
		if s.Len() > 64 {
			t.Fatalf("queue length %d > 64", s.Len())
		}
	}
	tenants := 0
	for _, l := range s.levels {
		tenants += len(l.tenants)
	}
	if tenants > 2*64+3*16 || len(s.levels) > 3 || s.exp.Len() != s.Len() {
		t.Fatalf("state grew: %d tenant entries, %d levels, %d expiries for %d queued", tenants, len(s.levels), s.exp.Len(), s.Len())
	}
}

func TestBoundedTime(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Second})
	offer(t, s, &Item{}, at(0), Admitted)
	a, b := &Item{}, &Item{}
	offer(t, s, a, at(0), Queued)
	offer(t, s, b, at(500), Queued)
	if e, _ := s.NextExpiry(); !e.Equal(at(1000)) {
		t.Fatalf("next expiry %v", e)
	}
	if got := s.Expire(at(999), nil); len(got) != 0 {
		t.Fatal("expired early")
	}
	got := s.Expire(at(1000), nil)
	if len(got) != 1 || got[0] != a || a.ExpiredReason() != ShedTimeout {
		t.Fatalf("expired %v", got)
	}
	if s.Len() != 1 || s.Counts().Shed[ShedTimeout] != 1 {
		t.Fatal("counts")
	}
}

// busy runs a saturated queue at a known drain rate, so that predictions
// have something to go on: one slot, every request 1,000 tokens and 100 ms
// of service (10,000 tokens/s), first token 20 ms after admission.
func busy(t *testing.T, s *Sched) (running *Item, now time.Time) {
	running = &Item{Cost: 1000}
	offer(t, s, running, at(0), Admitted)
	for i := range 200 {
		offer(t, s, &Item{Cost: 1000}, at(i*100), Queued)
		s.FirstToken(running, at(i*100+20))
		s.Done(running, at(i*100+100))
		running = s.Next(at(i*100 + 100))
	}
	return running, at(200*100 + 100)
}

func TestDeadlineShedAtOnce(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour, AgingStep: time.Hour})
	_, now := busy(t, s)
	st := s.Stats(now)
	if r := st.DrainTokensPerSec; r < 9000 || r > 11000 {
		t.Fatalf("drain rate %.0f tokens/s, want ~10000", r)
	}
	if st.ServiceTTFT != 20*time.Millisecond {
		t.Fatalf("service TTFT %v", st.ServiceTTFT)
	}
	for range 20 { // 20 x 1,000 tokens ahead: ~2 s of waiting
		offer(t, s, &Item{Cost: 1000}, now, Queued)
	}
	out := offer(t, s, &Item{Cost: 1000, Deadline: now.Add(3 * time.Second)}, now, Queued)
	if out.PredictedWait < 1900*time.Millisecond || out.PredictedWait > 2100*time.Millisecond {
		t.Fatalf("predicted wait %v, want ~2s", out.PredictedWait)
	}
	out = offer(t, s, &Item{Cost: 1000, Deadline: now.Add(time.Second)}, now, Shed)
	if out.Reason != ShedDeadline || out.RetryAfter != 2*time.Second {
		t.Fatalf("outcome %+v, want deadline with Retry-After 2s", out)
	}
	// Shed behind its own tenant's backlog, the tenant goes newest first
	// (lifo.go): the next arrival is predicted ahead of that backlog.
	out = offer(t, s, &Item{Cost: 1000, Deadline: now.Add(time.Second)}, now, Queued)
	if out.PredictedWait != 0 {
		t.Fatalf("predicted wait %v newest first, want 0", out.PredictedWait)
	}
	// A more urgent request does not wait behind them: it meets the same
	// deadline.
	offer(t, s, &Item{Cost: 1000, Priority: -1, Deadline: now.Add(time.Second)}, now, Queued)
	// A light tenant's request is predicted behind only its share.
	offer(t, s, &Item{Tenant: "light", Cost: 100, Deadline: now.Add(time.Second)}, now, Queued)
}

func TestDeadlineReachedWhileWaiting(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour})
	offer(t, s, &Item{}, at(0), Admitted)
	it := &Item{Deadline: at(300)}
	offer(t, s, it, at(0), Queued) // no rate known yet: nothing to predict
	got := s.Expire(at(300), nil)
	if len(got) != 1 || got[0].ExpiredReason() != ShedDeadline {
		t.Fatalf("expired %v", got)
	}
	offer(t, s, &Item{Deadline: at(299)}, at(300), Shed) // already past
}

func TestPendingPrefillBudget(t *testing.T) {
	s := mustNew(t, Config{MaxPendingPrefill: 1000})
	a := &Item{Prefill: 600}
	offer(t, s, a, at(0), Admitted)
	big := &Item{Prefill: 5000, Cost: 5000}
	offer(t, s, big, at(1), Queued)
	small := &Item{Prefill: 100, Tenant: "other"}
	offer(t, s, small, at(2), Queued)
	if s.Next(at(3)) != nil {
		t.Fatal("admitted past the prefill budget")
	}
	s.FirstToken(a, at(4)) // prefill over: the pool is free of pending prefill
	if got := s.Next(at(4)); got != big {
		t.Fatalf("the over-budget request was not admitted alone (got %+v)", got)
	}
	if s.Next(at(4)) != nil {
		t.Fatal("admitted beside an over-budget prefill")
	}
	s.Done(big, at(5)) // ended before its first token: its prefill is freed too
	if got := s.Next(at(5)); got != small {
		t.Fatal("small not admitted")
	}
	if st := s.Stats(at(5)); st.PendingPrefill != 100 || st.InFlight != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestRemoveWaiting(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1})
	run := &Item{}
	offer(t, s, run, at(0), Admitted)
	a, b := &Item{Tenant: "a"}, &Item{Tenant: "b"}
	offer(t, s, a, at(0), Queued)
	offer(t, s, b, at(0), Queued)
	if !s.Remove(a, Canceled, at(1)) || s.Remove(a, Canceled, at(1)) {
		t.Fatal("Remove")
	}
	s.Done(run, at(2))
	if s.Next(at(2)) != b || s.Len() != 0 || s.Counts().Shed[Canceled] != 1 {
		t.Fatal("after Remove")
	}
	if _, ok := s.NextExpiry(); ok {
		t.Fatal("an expiry outlived its item")
	}
}

func TestSetLimits(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1})
	offer(t, s, &Item{}, at(0), Admitted)
	q := &Item{}
	offer(t, s, q, at(0), Queued)
	s.SetLimits(2, 0)
	if s.Next(at(1)) != q {
		t.Fatal("raising the limit did not admit")
	}
}

func TestStats(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1})
	offer(t, s, &Item{}, at(0), Admitted)
	offer(t, s, &Item{Tenant: "a", Cost: 10, Priority: 1}, at(0), Queued)
	offer(t, s, &Item{Tenant: "b", Cost: 30, Priority: 1}, at(100), Queued)
	offer(t, s, &Item{Tenant: "a", Cost: 5}, at(200), Queued)
	st := s.Stats(at(1000))
	if st.Queued != 3 || st.QueuedTokens != 45 || st.OldestWait != time.Second || len(st.Bands) != 2 ||
		st.Bands[0].Priority != 0 || st.Bands[1].Tokens != 40 || st.Tenants[0].Tenant != "b" || st.Tenants[1].Tokens != 15 {
		t.Fatalf("%+v", st)
	}
}

func TestPerInstancePrefillBudget(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 100})
	s.SetInstances([]string{"a", "b"})
	x, y := &Item{Prefill: 80, Cost: 80}, &Item{Prefill: 80, Cost: 80}
	offer(t, s, x, at(0), Admitted)
	if !s.Room("a", x) || !s.Room("b", x) {
		t.Fatal("empty instances have no room")
	}
	s.Bind(x, "a")
	if s.Room("a", y) {
		t.Fatal("a has room for 80 more over its 100-token budget")
	}
	offer(t, s, y, at(1), Admitted) // b has room
	s.Bind(y, "b")
	z := &Item{Prefill: 10, Cost: 10}
	offer(t, s, z, at(2), Admitted) // 80 + 10 <= 100: fits a
	if !s.Room("a", z) || s.Room("b", &Item{Prefill: 30}) {
		t.Fatal("room misjudged")
	}
	s.Bind(z, "a")
	w := &Item{Prefill: 50, Cost: 50}
	offer(t, s, w, at(3), Queued)
	if s.Next(at(3)) != nil {
		t.Fatal("admitted with no instance having room")
	}
	s.FirstToken(y, at(4)) // b's prefill done
	if got := s.Next(at(4)); got != w {
		t.Fatalf("Next after b freed = %v, want w", got)
	}
	if s.Room("a", w) || !s.Room("b", w) {
		t.Fatal("room should be on b only")
	}
	// An admitted request not yet bound takes one instance with room.
	v := &Item{Prefill: 20, Cost: 20} // a holds 90: only b has room
	offer(t, s, v, at(5), Queued)
	if s.Next(at(5)) != nil {
		t.Fatal("admitted while the one instance with room is promised to an unbound request")
	}
	s.Bind(w, "b")
	for _, it := range []*Item{x, y, z, w} {
		s.Done(it, at(6))
	}
	if got := s.Next(at(6)); got != v {
		t.Fatalf("Next = %v, want v", got)
	}
	s.Bind(v, "a")
	s.Done(v, at(7))
	st := s.Stats(at(7))
	for _, l := range st.Instances {
		if l.InFlight != 0 || l.PendingPrefill != 0 {
			t.Fatalf("load left after every request ended: %+v", st.Instances)
		}
	}
	// An instance that leaves is forgotten once empty; a large request
	// fits an empty instance.
	s.SetInstances([]string{"b"})
	if len(s.Stats(at(8)).Instances) != 1 {
		t.Fatalf("instances %+v", s.Stats(at(8)).Instances)
	}
	offer(t, s, &Item{Prefill: 1000, Cost: 1000}, at(8), Admitted)
}

// TestCompanionHoldsInstanceBudget: a warm-up copy of an admitted request
// counts on its instance like a request — the next request waits for
// that instance's prefill budget until the copy's first token, and the
// pool's in-flight count until it ends — without being queued, charged
// to its tenant or counted among admissions; one of a request not
// admitted is refused.
func TestCompanionHoldsInstanceBudget(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 1000, MaxConcurrency: 3})
	s.SetInstances([]string{"a", "b"})
	x := &Item{Tenant: "t", Prefill: 600, Cost: 610}
	offer(t, s, x, at(0), Admitted)
	s.Bind(x, "a")
	var c Item
	if !s.Companion(x, &c, "b", at(1)) {
		t.Fatal("companion of an admitted request refused")
	}
	if c.Tenant != "t" || c.Prefill != 600 || c.inst == nil || c.inst.name != "b" {
		t.Fatalf("companion %+v", c)
	}
	y := &Item{Tenant: "u", Prefill: 600, Cost: 600}
	if s.Room("a", y) || s.Room("b", y) {
		t.Fatal("room for 600 more beside 600 on each instance under a 1,000-token budget")
	}
	offer(t, s, y, at(2), Queued)
	if s.Next(at(2)) != nil {
		t.Fatal("admitted while the copy held b's budget")
	}
	s.FirstToken(&c, at(3))
	if got := s.Next(at(3)); got != y {
		t.Fatalf("Next after the copy's first token = %v, want y", got)
	}
	s.Bind(y, "b")
	// Three in flight (x, the copy, y) under a pool-wide budget of 3.
	z := &Item{Prefill: 10, Cost: 10}
	offer(t, s, z, at(4), Queued)
	s.Done(&c, at(5))
	s.Done(&c, at(5)) // a second end is a no-op
	if got := s.Next(at(5)); got != z {
		t.Fatalf("Next after the copy ended = %v, want z", got)
	}
	if st := s.Counts(); st.AdmittedAtOnce != 1 || st.AdmittedQueued != 2 || st.Companions != 1 {
		t.Errorf("admissions %d at once, %d queued, %d companions: the copy counts as a companion only", st.AdmittedAtOnce, st.AdmittedQueued, st.Companions)
	}
	var c2 Item
	if s.Companion(&Item{Prefill: 5}, &c2, "a", at(6)) || c2.inst != nil {
		t.Error("companion of a request never admitted was counted")
	}
	s.Done(x, at(7))
	if s.Companion(x, &c2, "a", at(7)) {
		t.Error("companion of an ended request was counted")
	}
	s.Bind(z, "a")
	for _, it := range []*Item{y, z} {
		s.Done(it, at(8))
	}
	for _, l := range s.Stats(at(8)).Instances {
		if l.InFlight != 0 || l.PendingPrefill != 0 {
			t.Fatalf("load left after every request and copy ended: %+v", l)
		}
	}
}

func TestPreferCachedChoosesWithinFairWindow(t *testing.T) {
	// a holds the cache of tenant "hit"'s requests; the freed slot goes to
	// the due request with the most cached tokens, but never to one fair
	// queuing puts beyond the head's finish tag.
	s := mustNew(t, Config{MaxConcurrency: 1, PreferCached: true})
	hold := []Hold{{Instance: "a", Tokens: 500}}
	first := &Item{Tenant: "x", Cost: 100}
	offer(t, s, first, at(0), Admitted)
	cold := &Item{Tenant: "cold", Cost: 100, Prefill: 1000}
	hot := &Item{Tenant: "hit", Cost: 100, Prefill: 1000, Cached: hold}
	offer(t, s, cold, at(1), Queued)
	offer(t, s, hot, at(2), Queued)
	s.Done(first, at(3))
	if got := s.Next(at(3)); got != hot {
		t.Fatalf("Next = %+v, want the request with cached tokens", got)
	}
	s.Done(hot, at(4))
	// hit's second request starts after its first finished (tag 100), at
	// cold's finish tag: outside cold's window, so cold goes first.
	hot2 := &Item{Tenant: "hit", Cost: 100, Prefill: 1000, Cached: hold}
	offer(t, s, hot2, at(4), Queued)
	if got := s.Next(at(4)); got != cold {
		t.Fatalf("Next = %+v, want cold (hot2 is beyond its window)", got)
	}
}

func TestPreferCachedOnInstanceWithRoom(t *testing.T) {
	// Per-instance budgets: a request's cached tokens count only on an
	// instance with room for it. b is busy prefilling, so the request
	// whose prefix b holds gains nothing now; the one a holds goes first
	// although it arrived later.
	s := mustNew(t, Config{InstancePrefill: 1000, PreferCached: true})
	s.SetInstances([]string{"a", "b"})
	busyA := &Item{Tenant: "x", Cost: 900, Prefill: 900}
	busyB := &Item{Tenant: "y", Cost: 900, Prefill: 900}
	offer(t, s, busyA, at(0), Admitted)
	s.Bind(busyA, "a")
	offer(t, s, busyB, at(0), Admitted)
	s.Bind(busyB, "b")
	onB := &Item{Tenant: "p", Cost: 800, Prefill: 800, Cached: []Hold{{"b", 600}}}
	onA := &Item{Tenant: "q", Cost: 800, Prefill: 800, Cached: []Hold{{"a", 600}}}
	offer(t, s, onB, at(1), Queued)
	offer(t, s, onA, at(2), Queued)
	s.FirstToken(busyA, at(3)) // a's prefill is over: a has room
	if got := s.Next(at(3)); got != onA {
		t.Fatalf("Next = %+v, want the request a holds (b has no room)", got)
	}
}

func TestInstanceBudgetChargesUncached(t *testing.T) {
	// An instance is charged only the prompt tokens it does not hold: the
	// holder of a 900-token prefix takes a 1,000-token prompt beside
	// 850 tokens already prefilling (100 new tokens fit the 1,000-token
	// budget), another instance does not.
	s := mustNew(t, Config{InstancePrefill: 1000, ChargeUncached: true})
	s.SetInstances([]string{"a", "b"})
	busyA := &Item{Cost: 850, Prefill: 850}
	busyB := &Item{Cost: 850, Prefill: 850}
	offer(t, s, busyA, at(0), Admitted)
	s.Bind(busyA, "a")
	offer(t, s, busyB, at(0), Admitted)
	s.Bind(busyB, "b")
	it := &Item{Cost: 1000, Prefill: 1000, Cached: []Hold{{"a", 900}}}
	if !s.Room("a", it) || s.Room("b", it) {
		t.Fatalf("room on a %v, b %v; want a only", s.Room("a", it), s.Room("b", it))
	}
	offer(t, s, it, at(1), Admitted)
	s.Bind(it, "a")
	if got := instLoadOf(t, s, at(1), "a").PendingPrefill; got != 950 {
		t.Fatalf("a's pending prefill = %d, want 850 + 100 uncached", got)
	}
	// Its first token releases what it was charged, not its whole prompt.
	s.FirstToken(it, at(2))
	if got := instLoadOf(t, s, at(2), "a").PendingPrefill; got != 850 {
		t.Fatalf("a's pending prefill after the first token = %d, want 850", got)
	}
	s.Done(it, at(3))
	s.Done(busyA, at(3))
	if got := instLoadOf(t, s, at(3), "a"); got.PendingPrefill != 0 || got.InFlight != 0 {
		t.Fatalf("a's load after every request ended: %+v", got)
	}
	// Cached tokens beyond the prompt (a stale or generous index) charge
	// nothing below zero.
	over := &Item{Cost: 10, Prefill: 10, Cached: []Hold{{"b", 500}}}
	offer(t, s, over, at(4), Admitted)
	s.Bind(over, "b")
	if got := instLoadOf(t, s, at(4), "b").PendingPrefill; got != 850 {
		t.Fatalf("b's pending prefill = %d, want 850 (the request is all cached)", got)
	}
}

func TestReserveCountsUncachedDemand(t *testing.T) {
	// A prompt larger than the budget whose uncached part fits it is not
	// oversized: the reservation does not keep it off any instance.
	s := mustNew(t, Config{InstancePrefill: 1000, ReserveInstance: true, ChargeUncached: true})
	it := &Item{Prefill: 3000, Cached: []Hold{{"a", 2500}}}
	if s.oversized(it) {
		t.Fatal("3,000-token prompt with 2,500 cached is oversized for a 1,000-token budget")
	}
	if !s.oversized(&Item{Prefill: 3000, Cached: []Hold{{"a", 1000}}}) {
		t.Fatal("3,000-token prompt with 1,000 cached is not oversized")
	}
}

func instLoadOf(t *testing.T, s *Sched, now time.Time, name string) InstanceLoad {
	t.Helper()
	for _, l := range s.Stats(now).Instances {
		if l.Instance == name {
			return l
		}
	}
	t.Fatalf("no instance %q in %+v", name, s.Stats(now).Instances)
	return InstanceLoad{}
}

func TestServiceFitGrowsWithPrompt(t *testing.T) {
	var f svcFit
	if f.at(100, 0) != 0 {
		t.Fatal("prediction before any sample")
	}
	for i := range 200 {
		// 20 ms of queueing plus 40 µs per token, alternating sizes.
		x := float64(1000 + 9000*(i%2))
		f.add(x, 0, 0.020+x*40e-6)
	}
	for _, c := range []struct {
		x    float64
		want time.Duration
	}{{1000, 60 * time.Millisecond}, {10000, 420 * time.Millisecond}, {5000, 220 * time.Millisecond}} {
		if got := f.at(c.x, 0); got < c.want-time.Millisecond || got > c.want+time.Millisecond {
			t.Errorf("at(%v) = %v, want %v", c.x, got, c.want)
		}
	}
	var g svcFit
	for range 10 {
		g.add(500, 0, 0.1) // one length: the mean
	}
	if got := g.at(5000, 0); got < 99*time.Millisecond || got > 101*time.Millisecond {
		t.Errorf("one length: at = %v, want 100ms", got)
	}
}

// The deadline test at arrival predicts each request's own time from
// admission to first token: a short prompt that will meet its deadline is
// queued, a long one with the same deadline that will not is shed (one
// average for both would queue the long one, 110 ms < 150 ms, to fail).
func TestDeadlineUsesServiceByPromptLength(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour, AgingStep: time.Hour})
	now := at(0)
	for i := range 64 {
		p := int64(1000 + 9000*(i%2)) // 20 ms per 1,000 prompt tokens
		it := &Item{Prefill: p, Cost: p}
		offer(t, s, it, now, Admitted)
		s.FirstToken(it, now.Add(time.Duration(p)*20*time.Microsecond))
		now = now.Add(time.Second)
		s.Done(it, now)
	}
	offer(t, s, &Item{Prefill: 1000, Cost: 1000}, now, Admitted) // holds the one slot
	offer(t, s, &Item{Prefill: 1000, Cost: 1000, Deadline: now.Add(150 * time.Millisecond)}, now, Queued)
	if out := offer(t, s, &Item{Prefill: 10000, Cost: 10000, Deadline: now.Add(150 * time.Millisecond)}, now, Shed); out.Reason != ShedDeadline {
		t.Fatalf("long prompt: %+v, want shed for its deadline", out)
	}
}

// Prompts larger than the per-instance budget hold at most all but one
// instance while requests that fit a step are arriving: a step-sized
// request goes ahead of an oversized head held back by the reservation,
// and the oversized one goes as soon as a long prefill ends. Without
// step-sized arrivals within an oversized prompt's service time, nothing
// is reserved.
func TestReserveInstanceForStepSized(t *testing.T) {
	cfg := Config{InstancePrefill: 100, MaxWait: time.Hour, AgingStep: time.Hour}
	// warm teaches the queue service times: 0.2 ms per prompt token.
	warm := func(s *Sched) {
		s.SetInstances([]string{"a", "b", "c"})
		for i, p := range []int64{50, 500} {
			it := &Item{Prefill: p, Cost: p}
			offer(t, s, it, at(200*i), Admitted)
			s.Bind(it, "a")
			s.FirstToken(it, at(200*i).Add(time.Duration(p)*200*time.Microsecond))
			s.Done(it, at(200*i+150))
		}
	}
	free := mustNew(t, cfg)
	warm(free)
	for i, name := range []string{"a", "b", "c"} {
		it := &Item{Tenant: "heavy", Prefill: 500, Cost: 500}
		offer(t, free, it, at(1000+i), Admitted) // without the reservation: all three
		free.Bind(it, name)
	}

	cfg.ReserveInstance = true
	idle := mustNew(t, cfg)
	warm(idle) // the last step-sized arrival is long past
	for i, name := range []string{"a", "b", "c"} {
		it := &Item{Tenant: "heavy", Prefill: 500, Cost: 500}
		offer(t, idle, it, at(1000+i), Admitted)
		idle.Bind(it, name)
	}

	s := mustNew(t, cfg)
	warm(s)
	first := &Item{Tenant: "light", Prefill: 50, Cost: 50}
	offer(t, s, first, at(1000), Admitted)
	s.Bind(first, "c")
	s.FirstToken(first, at(1010))
	s.Done(first, at(1010))
	big := make([]*Item, 4)
	for i := range big {
		big[i] = &Item{Tenant: "heavy", Prefill: 500, Cost: 500}
	}
	offer(t, s, big[0], at(1011), Admitted)
	s.Bind(big[0], "a")
	offer(t, s, big[1], at(1012), Admitted) // unbound: still counts
	offer(t, s, big[2], at(1013), Queued)   // two of three held, a short request 13 ms ago
	s.Bind(big[1], "b")
	offer(t, s, big[3], at(1014), Queued)
	small := &Item{Tenant: "light", Prefill: 50, Cost: 50}
	// The step-sized arrival passes the held-back heads at once
	// (passesHeld), onto the reserved room.
	offer(t, s, small, at(1015), Admitted)
	if s.Room("a", small) || !s.Room("c", small) {
		t.Fatal("room misjudged")
	}
	s.Bind(small, "c")
	if got := s.Next(at(1016)); got != nil {
		t.Fatalf("Next = %+v with two instances held by oversized prompts", got)
	}
	s.FirstToken(small, at(1017)) // c is empty again, but reserved
	if got := s.Next(at(1017)); got != nil {
		t.Fatalf("Next = %+v onto the reserved instance", got)
	}
	s.FirstToken(big[0], at(1018)) // a's long prefill ends
	if got := s.Next(at(1018)); got != big[2] {
		t.Fatalf("Next = %+v, want the oversized head", got)
	}
	s.Bind(big[2], "a")
	s.Done(big[1], at(1019)) // ended before its first token: b is free
	if got := s.Next(at(1019)); got != big[3] {
		t.Fatalf("Next = %+v, want the last oversized prompt", got)
	}
	s.Bind(big[3], "b")
	for _, it := range []*Item{big[0], big[2], big[3], small} {
		s.Done(it, at(1020))
	}
	if s.unboundBig != 0 {
		t.Fatalf("unboundBig %d after every request ended", s.unboundBig)
	}
	for name, l := range s.insts {
		if l.big != 0 || l.pending != 0 || l.inflight != 0 {
			t.Fatalf("%s holds %+v after every request ended", name, *l)
		}
	}

	// One instance: nothing to reserve.
	one := mustNew(t, cfg)
	warm(one)
	one.SetInstances([]string{"a"})
	short := &Item{Prefill: 50, Cost: 50}
	offer(t, one, short, at(1000), Admitted)
	one.Done(short, at(1000))
	offer(t, one, &Item{Prefill: 500, Cost: 500}, at(1001), Admitted)
}

// Under overload the reservation is the fewest instances on which at most
// one step-sized request in ten waits for an instance at all (Erlang C on
// their uncached load a_u·b, a their prompt tokens per second, b the
// seconds each prompt token adds to admission-to-first-token), never fewer
// than their offered load on whole prompts, ⌈a·b⌉; at least 1 and at most
// N−1, and 1 before b is known; a long prompt reserves only for short
// requests at least as urgent as itself, and only while they are arriving.
func TestReservedInstancesFollowDemand(t *testing.T) {
	long := &Item{Priority: 1, Prefill: 500, Cost: 500}
	for _, c := range []struct {
		perToken float64 // seconds
		cached   int64   // of each 100-token prompt, on instance a
		want     int
	}{
		// 1.33 instances of 40 ms requests: ⌈a·b⌉ = 2, on which C(2,
		// 1.33) = 53 % of them wait; C(3) = 18 %, C(4) = 5.2 %.
		{0.0004, 0, 4},
		// 0.67 instances: C(2) = 17 %, C(3) = 3.3 %; but the long prompts,
		// as urgent, offer 6.67 instances, which fit beside ⌈0.8⌉ = 1 on
		// whole prompts: they keep their ⌈6.67⌉ = 7, the short ones 1.
		{0.0002, 0, 1},
		// 3.33 instances: C(6) = 15 %, C(7) = 6.1 %, the most (N−1).
		{0.001, 0, 7},
		// 95 % cached: 0.067 instances of uncached work wait with C(1) =
		// 6.7 %, but the whole prompts' ⌈1.33⌉ = 2 stays the floor.
		{0.0004, 95, 2},
	} {
		s := mustNew(t, Config{InstancePrefill: 100, ReserveInstance: true})
		s.SetInstances([]string{"a", "b", "c", "d", "e", "f", "g", "h"})
		// Arrivals every 10 ms, a third of them step-sized at priority 1
		// with 100-token prompts: 3,333 step-sized prompt tokens per second.
		for i := range 300 {
			it := &Item{Priority: 1, Prefill: 500, Cost: 500}
			if i%3 == 0 {
				it = &Item{Priority: 1, Prefill: 100, Cost: 120, Cached: []Hold{{"a", c.cached}}}
			}
			s.noteArrival(it, at(10*i))
			s.last = at(10 * i)
		}
		s.svcN = 1
		s.svcFit.add(500, 0, 0.2) // one length: a service time, no slope
		if k := s.reserved(long); k != 1 {
			t.Fatalf("reserved = %d before the slope is known, want 1", k)
		}
		for range 10 {
			s.svcFit.add(100, 0, 0.05+100*c.perToken)
			s.svcFit.add(1000, 0, 0.05+1000*c.perToken)
		}
		if k := s.reserved(long); k != c.want {
			t.Errorf("%v s per token, 3,333 step-sized tokens/s, %d%% cached: reserved = %d, want %d", c.perToken, c.cached, k, c.want)
		}
		if k := s.reserved(&Item{Priority: 2, Prefill: 500}); k != c.want {
			t.Errorf("a less urgent long prompt: reserved = %d, want %d", k, c.want)
		}
		if k := s.reserved(&Item{Priority: 0, Prefill: 500}); k != 0 {
			t.Errorf("an urgent long prompt reserves %d instances for less urgent short requests", k)
		}
	}
	s := mustNew(t, Config{InstancePrefill: 100, ReserveInstance: true})
	s.SetInstances([]string{"a", "b", "c", "d"})
	for i := range 300 {
		if i%3 == 0 {
			s.noteArrival(&Item{Priority: 1, Prefill: 100, Cost: 120}, at(10*i))
			s.last = at(10 * i)
		}
	}
	s.svcN = 1
	s.svcFit.add(100, 0, 0.09)
	s.svcFit.add(1000, 0, 0.45)
	s.last = at(10*300 + 2000) // no short request for longer than a long prompt's service
	if k := s.reserved(long); k != 0 {
		t.Errorf("reserved = %d with no short request arriving, want 0", k)
	}
}

// The instances kept beyond the short requests' ⌈a·b⌉ for their wait come
// only out of what the long prompts at least as urgent as the one asking
// leave beside their own offered load, ⌈a_L·b⌉; long prompts whose load
// does not fit beside ⌈a·b⌉ bound nothing (their queue grows whatever is
// kept). 8 instances, arrivals every 10 ms in sixes: two 100-token
// short requests at priority 0 (1.33 instances; C(4) = 5.2 % wait, ⌈a·b⌉
// = 2), one 700-token prompt at priority 0 (4.67 instances: ⌈⌉ 5 ≤ 8 − 2)
// and three 500-token ones at priority 1 (10 instances).
func TestReservationLeavesUrgentLongPromptsTheirLoad(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 100, ReserveInstance: true})
	s.SetInstances([]string{"a", "b", "c", "d", "e", "f", "g", "h"})
	for i := range 600 {
		it := &Item{Priority: 1, Prefill: 500, Cost: 500}
		switch i % 6 {
		case 0, 1:
			it = &Item{Priority: 0, Prefill: 100, Cost: 100}
		case 2:
			it = &Item{Priority: 0, Prefill: 700, Cost: 700}
		}
		s.noteArrival(it, at(10*i))
		s.last = at(10 * i)
	}
	s.svcN = 1
	for range 10 {
		s.svcFit.add(100, 0, 0.05+100*0.0004)
		s.svcFit.add(1000, 0, 0.05+1000*0.0004)
	}
	for _, c := range []struct {
		prio int64
		want int
	}{
		{0, 3}, // 8 − 5: the urgent long prompts keep their 5
		{1, 4}, // 14.67 instances of long prompts: the short ones' wait-free 4
	} {
		if k := s.reserved(&Item{Priority: c.prio, Prefill: 500, Cost: 500}); k != c.want {
			t.Errorf("a long prompt at priority %d: reserved = %d, want %d", c.prio, k, c.want)
		}
	}
}

// A long prompt held back by the reservation (for urgent short requests)
// at the head of the most urgent band does not stop a less urgent short
// request from taking the reserved room when no urgent one waits.
func TestReserveBypassAcrossBands(t *testing.T) {
	s, long, urgentLong := twoWithHeldLong(t, 0) // b is reserved for short requests
	short := &Item{Priority: 1, Prefill: 50, Cost: 50}
	offer(t, s, short, at(1004), Admitted) // onto the reserved instance, past the held-back head
	s.Bind(short, "b")
	s.FirstToken(long, at(1005))
	if got := s.Next(at(1005)); got != urgentLong {
		t.Fatalf("Next = %+v, want the urgent long prompt once a's long prefill ends", got)
	}
}

func TestPreferCachedWithoutCacheKeepsOrder(t *testing.T) {
	// Requests that carry no cached tokens (a strategy other than
	// kv_aware) are ordered as without the preference: a head that does
	// not fit blocks the queue, a smaller request behind it waits.
	s := mustNew(t, Config{MaxConcurrency: 2, MaxPendingPrefill: 1000, PreferCached: true})
	first := &Item{Tenant: "x", Cost: 900, Prefill: 900}
	offer(t, s, first, at(0), Admitted)
	big := &Item{Tenant: "a", Cost: 800, Prefill: 800}
	small := &Item{Tenant: "b", Cost: 800, Prefill: 50}
	offer(t, s, big, at(1), Queued)
	offer(t, s, small, at(2), Queued)
	if got := s.Next(at(3)); got != nil {
		t.Fatalf("Next = %+v, want nil (the head does not fit and blocks)", got)
	}
	s.FirstToken(first, at(4))
	if got := s.Next(at(4)); got != big {
		t.Fatalf("Next = %+v, want the head", got)
	}
}

func TestInstanceBudgetChargesWholePromptByDefault(t *testing.T) {
	// Without ChargeUncached the cached tokens order the queue
	// (PreferCached) but the budget charges the whole prompt.
	s := mustNew(t, Config{InstancePrefill: 1000})
	s.SetInstances([]string{"a"})
	busy := &Item{Cost: 850, Prefill: 850}
	offer(t, s, busy, at(0), Admitted)
	s.Bind(busy, "a")
	it := &Item{Cost: 1000, Prefill: 1000, Cached: []Hold{{"a", 900}}}
	if s.Room("a", it) {
		t.Fatal("room on a for 1,000 more tokens beside 850 under a 1,000-token budget")
	}
}

func TestInstanceRoomHoldsDeadline(t *testing.T) {
	// An instance with prefill ahead has room for a request with a
	// deadline only if the prefill ahead and its own, at the service
	// line's cost per token, end before the deadline; an idle instance
	// always has room, a request without a deadline only needs the budget.
	s := mustNew(t, Config{InstancePrefill: 10000})
	for i := range 64 {
		x := float64(1000 + 9000*(i%2))
		s.svcFit.add(x, 0, 0.010+x*1e-4) // 0.1 ms per token
	}
	now := busyOnA(t, s, 5000)
	tight := &Item{Cost: 100, Prefill: 100, Deadline: now.Add(200 * time.Millisecond)}
	loose := &Item{Cost: 100, Prefill: 100, Deadline: now.Add(time.Second)}
	none := &Item{Cost: 100, Prefill: 100}
	if s.Room("a", tight) || !s.Room("b", tight) {
		t.Fatalf("tight deadline: room on a %v, b %v; want b only (5,100 tokens ahead are 510 ms)", s.Room("a", tight), s.Room("b", tight))
	}
	if !s.Room("a", loose) || !s.Room("a", none) {
		t.Fatalf("room on a: 1 s deadline %v, none %v; want both", s.Room("a", loose), s.Room("a", none))
	}
}

// The service line is fitted on the work ahead of a request on its
// instance as well as its own, so a class whose admitted requests once
// waited behind others is not shed on arrival for that wait when an
// instance is free: the engine here takes 20 ms plus 40 µs per token of
// prefill before a first token. Short prompts that queued behind one and
// two others took 100 and 140 ms; a line through their own length alone
// predicts 100 ms for every short prompt, past an 80 ms objective, and
// sheds them all on arrival (and, shed, they never lower it: kv_aware at
// 8 instances, 4×, shed 97 % of requests for good). On an idle instance
// the short prompt takes 60 ms: it is queued and admitted there.
func TestServiceLineCountsWorkAhead(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 8192, ReserveInstance: true, MaxWait: time.Hour, AgingStep: time.Hour})
	s.SetInstances([]string{"a", "b"})
	engine := func(tokens int) int { return 20 + tokens*40/1000 } // ms
	short := func() *Item { return &Item{Cost: 1000, Prefill: 1000} }
	for r := range 8 {
		t0 := r * 1000
		run := []*Item{short(), short(), short()}
		for _, it := range run { // 0, 1,000, 2,000 tokens ahead on a
			offer(t, s, it, at(t0), Admitted)
			s.Bind(it, "a")
		}
		for i, it := range run {
			s.FirstToken(it, at(t0+engine(1000*(i+1))))
		}
		long := &Item{Cost: 10000, Prefill: 10000, Priority: 1}
		offer(t, s, long, at(t0), Admitted)
		s.Bind(long, "b")
		s.FirstToken(long, at(t0+engine(10000)))
		for _, it := range append(run, long) {
			s.Done(it, at(t0+500))
		}
	}
	if got := s.service(short()); got < 59*time.Millisecond || got > 61*time.Millisecond {
		t.Fatalf("predicted service of a short prompt with nothing ahead %v, want 60ms", got)
	}
	// A short request passes, then long prompts hold a and, held back by
	// the reservation, wait for b.
	t0 := 9000
	s0 := short()
	offer(t, s, s0, at(t0), Admitted)
	s.Bind(s0, "b")
	s.FirstToken(s0, at(t0+60))
	s.Done(s0, at(t0+60))
	l1 := &Item{Cost: 10000, Prefill: 10000, Priority: 1}
	offer(t, s, l1, at(t0+60), Admitted)
	s.Bind(l1, "a")
	offer(t, s, &Item{Cost: 10000, Prefill: 10000, Priority: 1}, at(t0+61), Queued)
	now := at(t0 + 62)
	it := short()
	it.Deadline = now.Add(80 * time.Millisecond)
	offer(t, s, it, now, Admitted) // past the held-back long prompt
	if !s.Room("b", it) {
		t.Fatal("no room on idle b for the short request")
	}
}

// The fit tells a prompt's own prefill from the work still ahead of it,
// which costs less when part of it is already done: here 40 µs per own
// token and 20 µs per token ahead, 20 ms besides.
func TestServiceFitSeparatesWorkAhead(t *testing.T) {
	var f svcFit
	for i := range 300 {
		own := float64(1000 + 9000*(i%2))
		ahead := float64(1000 * (i % 5))
		f.add(own, ahead, 0.020+own*40e-6+ahead*20e-6)
	}
	a, b, c := f.coef()
	if math.Abs(a-0.020) > 1e-6 || math.Abs(b-40e-6) > 1e-9 || math.Abs(c-20e-6) > 1e-9 {
		t.Fatalf("fit a=%v b=%v c=%v, want 0.020, 40e-6, 20e-6", a, b, c)
	}
	if got := f.at(1000, 3000); got < 119*time.Millisecond || got > 121*time.Millisecond {
		t.Fatalf("at(1000, 3000) = %v, want 120ms", got)
	}
}

// The room test keeps a margin of the fit's spread: with first tokens ±10
// ms about the line, an instance where the mean just meets a deadline is
// one where half of them would miss it, so it has no room; one where the
// mean leaves 1.28 spreads (the 90th percentile) has.
func TestRoomKeepsTheFitsSpread(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 10000})
	for i := range 256 {
		own, ahead := float64(1000+9000*(i%2)), float64(1000*(i%3))
		e := 0.010 * float64(1-2*(i/2%2)) // +10, +10, -10, -10 ms, ...
		s.svcFit.add(own, ahead, 0.020+(own+ahead)*40e-6+e)
	}
	if sd := s.svcFit.spread(); math.Abs(sd-0.010) > 0.0005 {
		t.Fatalf("spread %v, want 10ms", sd)
	}
	now := busyOnA(t, s, 2000)
	// 2,000 tokens ahead and 1,000 of its own: 140 ms on average.
	edge := &Item{Cost: 1000, Prefill: 1000, Deadline: now.Add(141 * time.Millisecond)}
	margin := &Item{Cost: 1000, Prefill: 1000, Deadline: now.Add(154 * time.Millisecond)}
	if s.Room("a", edge) || !s.Room("a", margin) {
		t.Fatalf("room on a: deadline at the mean %v, 1.4 spreads after it %v; want false, true", s.Room("a", edge), s.Room("a", margin))
	}
}

// busyOnA gives s instances a and b, a prompt of tokens admitted to a and
// prefilling, and returns a moment later.
func busyOnA(t *testing.T, s *Sched, tokens int64) time.Time {
	s.SetInstances([]string{"a", "b"})
	busy := &Item{Cost: tokens, Prefill: tokens}
	offer(t, s, busy, at(0), Admitted)
	s.Bind(busy, "a")
	now := at(1)
	s.tick(now)
	return now
}

// One slow first token behind work, among samples that had nothing
// ahead, does not make a token ahead cost more than one of the request's
// own (found in review: the fit read its whole excess as c = 5·b, and an
// instance with anything ahead had no room for a deadline for good).
func TestServiceFitAheadCostsAtMostOwn(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 10000})
	for i := range 64 {
		own := float64(500 + 1000*(i%4))
		s.svcFit.add(own, 0, 0.020+own*40e-6)
	}
	s.svcFit.add(1000, 2000, 0.300) // one stall behind 2,000 tokens
	if _, b, c := s.svcFit.coef(); c > b || b <= 0 {
		t.Fatalf("fit b=%v c=%v: want 0 < c ≤ b", b, c)
	}
	// A request that an engine would serve in ~80 ms behind 500 tokens
	// finds room for a 150 ms objective.
	now := busyOnA(t, s, 500)
	it := &Item{Cost: 1000, Prefill: 1000, Deadline: now.Add(150 * time.Millisecond)}
	if !s.Room("a", it) {
		t.Fatalf("no room on a behind 500 tokens for a 150 ms objective (predicted %v)", s.svcFit.late(1000, 500))
	}
}

// Without a per-instance prefill budget nothing keeps a request off an
// instance with work ahead, so arrival shedding and expiry predict with
// the work ahead the samples saw on average, not with none (found in
// review: a request that would certainly miss was queued).
func TestServiceCountsMeanAheadWithoutPrefillBudget(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want time.Duration
	}{
		{Config{MaxConcurrency: 4}, 120 * time.Millisecond},    // 20 + 40 + 60 ms: 1,500 tokens ahead on average
		{Config{InstancePrefill: 8192}, 60 * time.Millisecond}, // the room test checks what is ahead
	} {
		s := mustNew(t, c.cfg)
		for i := range 256 {
			own, ahead := float64(1000+1000*(i%2)), float64(1000*(i%4))
			s.svcFit.add(own, ahead, 0.020+(own+ahead)*40e-6)
		}
		s.svcN = 1
		got := s.service(&Item{Cost: 1000, Prefill: 1000})
		if d := got - c.want; d < -time.Millisecond || d > time.Millisecond {
			t.Errorf("%+v: service %v, want %v", c.cfg, got, c.want)
		}
	}
}

// Samples whose own and ahead work always add up to the same amount say
// nothing about the cost of their sum: the bound c ≤ b keeps the fit
// finite (no division by their zero variance).
func TestServiceFitConstantSum(t *testing.T) {
	var f svcFit
	for i := range 100 {
		own := float64(1000 + 100*(i%10))
		f.add(own, 3000-own, 0.020+own*10e-6+(3000-own)*50e-6)
	}
	a, b, c := f.coef()
	for _, v := range []float64{a, b, c} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			t.Fatalf("fit a=%v b=%v c=%v: not finite", a, b, c)
		}
	}
	if c > b {
		t.Fatalf("fit b=%v c=%v: want c ≤ b", b, c)
	}
	if got := f.at(1500, 1500); got < 0 || got > time.Second {
		t.Fatalf("at(1500, 1500) = %v", got)
	}
}

// reserved is the instances the overload form keeps for the step-sized
// requests at least as urgent as it: 0 when none arrived within its
// predicted service time, 1 while the slope is unknown, else offeredK.
func (s *Sched) reserved(it *Item) int {
	d, ok := s.smallDemandFor(it)
	if !ok {
		return 0
	}
	b := s.svcFit.slope()
	if b <= 0 || s.arrSec <= 0 || d.reqs <= 0 {
		return min(1, s.liveN-1)
	}
	return s.offeredK(it, d, b)
}

// TestUnservedRequestsLeaveNoCharge: a tenant whose burst left the queue
// unserved (canceled here) is charged nothing for it: while both tenants
// stay backlogged afterwards, each gets about half the admissions.
func TestUnservedRequestsLeaveNoCharge(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: 5 * time.Second, AgingStep: time.Hour})
	running := &Item{Tenant: "b", Cost: 1000}
	offer(t, s, running, at(0), Admitted)
	offer(t, s, &Item{Tenant: "b", Cost: 1000}, at(0), Queued)
	var burst []*Item
	for range 100 {
		it := &Item{Tenant: "a", Cost: 1000}
		offer(t, s, it, at(0), Queued)
		burst = append(burst, it)
	}
	for _, it := range burst {
		s.Remove(it, Canceled, at(10))
	}
	got := map[string]int{}
	for step := 1; step <= 300; step++ {
		now := at(step * 100)
		s.Offer(&Item{Tenant: "a", Cost: 1000}, now)
		s.Offer(&Item{Tenant: "b", Cost: 1000}, now)
		s.Expire(now, nil)
		s.Done(running, now)
		if running = s.Next(now); running != nil {
			got[running.Tenant]++
		}
	}
	if got["a"] < 100 {
		t.Errorf("both tenants backlogged for 300 admissions: a got %d, b %d (want about half each); shed %v", got["a"], got["b"], s.Counts().Shed)
	}
}

// TestAgingCrossesAnyPriorityGap: however far a saturated band's priority
// is below priority 0 (a client may send any int64), a priority-0 request
// beside it is admitted within max_wait: aging climbs bands, not values.
func TestAgingCrossesAnyPriorityGap(t *testing.T) {
	for _, q := range []int64{-1, -5, -20, math.MinInt64} {
		s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: 10 * time.Second}) // aging step 1 s
		running := &Item{Priority: q, Cost: 10}
		offer(t, s, running, at(0), Admitted)
		victim := &Item{Priority: 0, Cost: 10}
		offer(t, s, victim, at(0), Queued)
		admittedAt, shed := -1, Reason("")
		for ms := 100; ms <= 12_000 && admittedAt < 0 && shed == ""; ms += 100 {
			offer(t, s, &Item{Priority: q, Cost: 10, Tenant: "hog"}, at(ms), Queued)
			for _, it := range s.Expire(at(ms), nil) {
				if it == victim {
					shed = it.ExpiredReason()
				}
			}
			s.Done(running, at(ms))
			if running = s.Next(at(ms)); running == victim {
				admittedAt = ms
			}
		}
		// One band more urgent: admitted once it has waited two aging steps.
		if admittedAt < 0 || admittedAt > 2_100 {
			t.Errorf("priority 0 beside a saturated band %d: admitted at %d ms (shed: %q), want after two aging steps (2 s)", q, admittedAt, shed)
		}
	}
}

// TestRoomOnEligibleInstancesOnly: a request that may go only to some
// instances (Item.Eligible: an adapter one instance holds) is admitted
// only while one of those has room, not because another is idle.
func TestRoomOnEligibleInstancesOnly(t *testing.T) {
	s := mustNew(t, Config{InstancePrefill: 1000})
	s.SetInstances([]string{"a", "b"})
	onlyB := func(inst string) bool { return inst == "b" }
	first := &Item{Cost: 800, Prefill: 800, Eligible: onlyB}
	offer(t, s, first, at(0), Admitted)
	s.Bind(first, "b")
	second := &Item{Cost: 800, Prefill: 800, Eligible: onlyB}
	offer(t, s, second, at(1), Queued)
	if it := s.Next(at(2)); it != nil {
		t.Fatal("admitted while its only instance has no room")
	}
	s.FirstToken(first, at(3))
	if it := s.Next(at(3)); it != second {
		t.Fatalf("Next = %v once b has room, want the waiting request", it)
	}
	// Any instance will do for a request without Eligible; one with no
	// live instance to go to is not held (the router answers it).
	s.Bind(second, "b")
	offer(t, s, &Item{Cost: 800, Prefill: 800}, at(4), Admitted)
	offer(t, s, &Item{Cost: 800, Prefill: 800, Eligible: func(string) bool { return false }}, at(5), Admitted)
}

// TestOneSlowFirstTokenShedsLittle: one slow first token (20 s: the fit's
// first sample, or one after 20 of 50 ms) does not make the queue shed
// requests with a 2 s objective that are each answered in 50 ms: at most
// a twentieth more of them are shed over the next 10 s than without it.
func TestOneSlowFirstTokenShedsLittle(t *testing.T) {
	run := func(before int, first time.Duration) (shed, total int) {
		s := mustNew(t, Config{InstancePrefill: 8192, MaxWait: 30 * time.Second})
		s.SetInstances([]string{"a"})
		start := 0
		for i := range before + 1 {
			d := 50 * time.Millisecond
			if i == before {
				d = first
			}
			warm := &Item{Cost: 100, Prefill: 100}
			offer(t, s, warm, at(start), Admitted)
			s.Bind(warm, "a")
			start += int(d / time.Millisecond)
			s.FirstToken(warm, at(start))
			s.Done(warm, at(start))
		}
		type ev struct {
			it  *Item
			ftk int
		}
		var running []ev
		for ms := start + 25; ms <= start+10_000; ms += 25 {
			kept := running[:0]
			for _, e := range running {
				if e.ftk <= ms {
					s.FirstToken(e.it, at(e.ftk))
					s.Done(e.it, at(e.ftk))
				} else {
					kept = append(kept, e)
				}
			}
			running = kept
			shed += len(s.Expire(at(ms), nil))
			for it := s.Next(at(ms)); it != nil; it = s.Next(at(ms)) {
				s.Bind(it, "a")
				running = append(running, ev{it, ms + 50})
			}
			it := &Item{Cost: 100, Prefill: 100, Deadline: at(ms).Add(2 * time.Second)}
			total++
			switch out := s.Offer(it, at(ms)); out.Verdict {
			case Admitted:
				s.Bind(it, "a")
				running = append(running, ev{it, ms + 50})
			case Shed:
				shed++
			}
		}
		return shed, total
	}
	for _, before := range []int{0, 20} {
		base, n := run(before, 50*time.Millisecond)
		out, _ := run(before, 20*time.Second)
		if out > base+n/20 {
			t.Errorf("after one 20 s first token (following %d of 50 ms), %d of %d requests with a 2 s objective shed over the next 10 s (%d without it), although each is answered in 50 ms", before, out, n, base)
		}
	}
}
