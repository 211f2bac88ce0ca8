package flowcontrol

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func TestErlangC(t *testing.T) {
	for _, c := range []struct {
		k    int
		a    float64
		want float64
	}{
		{1, 0.5, 0.5},   // M/M/1: an arrival waits with probability ρ
		{1, 0.9, 0.9},   //
		{2, 1, 1.0 / 3}, // two servers at half load each
		{3, 0, 0},       // no load, no wait
		{4, 3, 0.5094},  // tabulated: C(4, 3) ≈ 0.509
		{10, 8, 0.409},  // tabulated: C(10, 8) ≈ 0.409
	} {
		if got := erlangC(c.k, c.a); math.Abs(got-c.want) > 0.001 {
			t.Errorf("C(%d, %v) = %.4f, want %.4f", c.k, c.a, got, c.want)
		}
	}
}

// staff is the fewest servers for which at most one request in ten waits
// longer than the target, the fewest stable without a target, and never
// more than most.
func TestStaffMeetsTheTargetWithFewestServers(t *testing.T) {
	for _, c := range []struct {
		name            string
		a, work, target float64
		most, want      int
	}{
		// Half a server of 20 ms requests, 110 ms to spare: one server
		// (P(wait > 110 ms) = 0.5·e^(−2.75) ≈ 0.03).
		{"light load", 0.5, 0.02, 0.11, 3, 1},
		// 1.7 servers: two are stable, but P(wait > 100 ms) ≈ 0.17 there;
		// three keep it below one in ten.
		{"near two servers", 1.7, 0.019, 0.1, 3, 3},
		{"near two servers, eight instances", 1.7, 0.019, 0.1, 7, 3},
		// The same load with five times the slack: two suffice.
		{"loose objective", 1.7, 0.019, 0.5, 7, 2},
		// A whole server's load cannot be carried by one.
		{"one server's load", 1.0, 0.02, 10, 3, 2},
		{"no target: fewest stable", 1.0, 0.02, -1, 3, 2},
		{"no target, light", 0.4, 0.02, -1, 3, 1},
		{"no load", 0, 0.02, 0.1, 3, 1},
		{"no target reachable", 0.9, 0.02, 0, 3, 3},
		{"load beyond the fleet", 5, 0.02, 0.1, 3, 3},
		{"single instance", 0.5, 0.02, 0.1, 0, 0},
	} {
		if got := staff(c.a, c.work, c.target, c.most); got != c.want {
			t.Errorf("%s: staff(%v, %v, %v, %d) = %d, want %d", c.name, c.a, c.work, c.target, c.most, got, c.want)
		}
	}
}

// demandSched is a queue over instances a–d that has seen arrivals every
// 10 ms for 3 s: a 1,000-token step-sized prompt (cachedShare of it held
// by a, the given objective) every 30 ms — 1.33 instances of their whole
// prompts' prefill — and between them 5,000-token prompts, one every
// longEvery arrivals; and whose service fit is 20 ms plus 40 µs per token
// of own work (a 1,000-token prompt: 60 ms, 40 ms of an instance).
func demandSched(t *testing.T, cachedShare float64, objective time.Duration, longEvery int) *Sched {
	s := mustNew(t, Config{InstancePrefill: 2000, ReserveInstance: true})
	s.SetInstances([]string{"a", "b", "c", "d"})
	for i := range 300 {
		now := at(10 * i)
		var it *Item
		switch {
		case i%3 == 0:
			cached := int64(cachedShare * 1000)
			it = &Item{Prefill: 1000, Cost: 1100, Deadline: now.Add(objective), Cached: []Hold{{"a", cached}}}
		case i%longEvery == 1:
			it = &Item{Prefill: 5000, Cost: 5000}
		default:
			continue
		}
		s.noteArrival(it, now)
		s.last = now
	}
	s.svcN = 1
	for range 10 {
		s.svcFit.add(1000, 0, 0.02+1000*40e-6)
		s.svcFit.add(5000, 0, 0.02+5000*40e-6)
	}
	return s
}

// holdLong marks the first n of the instances held by long prompts whose
// first tokens are predicted after d.
func holdLong(s *Sched, n int, d time.Duration) {
	for _, name := range []string{"a", "b", "c", "d"}[:n] {
		s.insts[name].big, s.insts[name].bigEnd = 1, s.last.Add(d)
	}
}

// While nothing waits, a long prompt is held back when the instances it
// would leave the step-sized requests let more than one in ten of them
// wait past what their objective leaves (uncached work, Erlang C);
// counting only their uncached tokens, a cached class needs fewer. While
// step-sized requests wait, the reservation is their offered load on whole
// prompts, ⌈1.33⌉ = 2, cached or not.
func TestReservationFromUncachedDemandAndObjectives(t *testing.T) {
	long := &Item{Prefill: 5000, Cost: 5000}
	for _, c := range []struct {
		name      string
		cached    float64
		objective time.Duration
		waiting   bool
		held      int
		want      bool
	}{
		// 1.33 instances of 40 ms requests, 90 ms to spare: the two left
		// by two held long prompts let 9 % wait longer (averaged over the
		// new prompt's 220 ms hold, at whose end a third frees), one 80 %.
		{"uncached, two left", 0, 150 * time.Millisecond, false, 1, false},
		{"uncached, one left", 0, 150 * time.Millisecond, false, 2, true},
		// Nine tenths cached: 0.13 instances of 4 ms requests; one does.
		{"cached, one left", 0.9, 150 * time.Millisecond, false, 2, false},
		{"cached, none left", 0.9, 150 * time.Millisecond, false, 3, true},
		// An objective the service alone spends (60 ms of 20): no number
		// of instances meets it, but one always stays for long prompts.
		{"objective spent, none held", 0, 20 * time.Millisecond, false, 0, false},
		{"objective spent, one held", 0, 20 * time.Millisecond, false, 1, true},
		// Short requests waiting: two instances stay theirs.
		{"waiting, two left", 0.9, 150 * time.Millisecond, true, 1, false},
		{"waiting, one left", 0.9, 150 * time.Millisecond, true, 2, true},
	} {
		s := demandSched(t, c.cached, c.objective, 1000)
		holdLong(s, c.held, time.Hour)
		s.queuedSmall = btoi(c.waiting)
		if got := s.reserveBlocks(long); got != c.want {
			t.Errorf("%s: held back %v, want %v", c.name, got, c.want)
		}
	}
}

// TestStaffCountsTheInstancesLongPromptsLeave: the short requests' tail
// counts the instances long prompts leave them now and one more as each
// of those prompts reaches its first token. With every long prompt held
// for good it is staff's criterion on the instances left; a long prompt
// ending within the wait the objective leaves shortens the tail; averaged
// over a new prompt's hold, the arrivals after the others end wait less.
func TestStaffCountsTheInstancesLongPromptsLeave(t *testing.T) {
	const a, work, target = 0.53, 0.02, 0.069 // kvbench flow --seed 2 at half load
	never := []float64{math.Inf(1)}
	confined := shortTail(a, work, target, 1, 0, never)
	if want := erlangC(1, a) * math.Exp(-(1-a)*target/work); math.Abs(confined-want) > 1e-12 {
		t.Fatalf("confined to one instance: %v, want C·e^(−(k−a)t/w) = %v", confined, want)
	}
	if confined <= missShare {
		t.Fatalf("confined to one instance: %v, want past the one-in-ten boundary (the seed-2 cell)", confined)
	}
	soon := shortTail(a, work, target, 1, 0, []float64{0.01, math.Inf(1)})
	if soon >= confined/10 {
		t.Fatalf("a second instance freed after 10 ms: %v, want far below %v", soon, confined)
	}
	// A 400 ms hold, the other long prompts ending at 100 and 200 ms.
	if got := shortTail(a, work, target, 1, 0.4, []float64{0.1, 0.2, 0.4}); got > missShare {
		t.Fatalf("others ending within the hold: %v, want within one in ten", got)
	}
	// The others held for good: over a 400 ms hold only the arrivals in
	// its last 69 ms see the new prompt's instance free in time (a sixth
	// of them); none left: every one waits.
	if got := shortTail(a, work, target, 1, 0.4, []float64{0.4, math.Inf(1)}); got < confined*0.8 || got > confined {
		t.Fatalf("others held for good over a hold: %v, want a little below %v", got, confined)
	}
	if got := shortTail(a, work, target, 0, 0, never); got != 1 {
		t.Fatalf("no instance left: %v, want 1", got)
	}
	if got := shortTail(0, work, target, 1, 0, never); got != 0 {
		t.Fatalf("no load: %v, want 0", got)
	}
	for left := 1; left < 4; left++ {
		if shortTail(a, work, target, left+1, 0.4, []float64{0.4}) > shortTail(a, work, target, left, 0.4, []float64{0.4}) {
			t.Fatalf("more instances left, a longer tail at %d", left)
		}
	}
}

// TestReservationCountsLongPromptsLoad: with nothing waiting, whether the
// reservation stages the short requests (Erlang C) or keeps them their
// bare offered load depends on every prompt's offered work: at 2 of 4
// instances (a long prompt every 300 ms) a long prompt leaving two
// instances goes; at 8 (one every 30 ms) the pool is overloaded whatever
// waits at the moment, and the short requests keep the fewest instances on
// which at most one in ten waits at all: C(3, 1.33) = 18 %, so all three
// a long prompt may leave them (⌈1.33⌉ = 2 before session 15).
func TestReservationCountsLongPromptsLoad(t *testing.T) {
	long := &Item{Prefill: 5000, Cost: 5000}
	light := demandSched(t, 0, 150*time.Millisecond, 30)
	heavy := demandSched(t, 0, 150*time.Millisecond, 3)
	b := light.svcFit.slope()
	if light.overloaded(b) || !heavy.overloaded(b) {
		t.Fatalf("overloaded: light %v (%.2f instances), heavy %v (%.2f)", light.overloaded(b),
			light.arrTok/light.arrSec*b, heavy.overloaded(b), heavy.arrTok/heavy.arrSec*b)
	}
	for _, c := range []struct {
		s    *Sched
		held int
		want bool
	}{{light, 1, false}, {light, 2, true}, {heavy, 1, true}, {heavy, 2, true}} {
		holdLong(c.s, c.held, time.Hour)
		if got := c.s.reserveBlocks(long); got != c.want {
			t.Errorf("overloaded %v, %d held: held back %v, want %v", c.s.overloaded(b), c.held, got, c.want)
		}
	}
	// The difference: cached short requests (0.13 instances) leave the
	// long prompts three instances under staffing, two under overload.
	light, heavy = demandSched(t, 0.9, 150*time.Millisecond, 30), demandSched(t, 0.9, 150*time.Millisecond, 3)
	holdLong(light, 2, time.Hour)
	holdLong(heavy, 2, time.Hour)
	if light.reserveBlocks(long) || !heavy.reserveBlocks(long) {
		t.Fatalf("cached short requests, two held: held back %v (light), %v (overloaded); want false, true",
			light.reserveBlocks(long), heavy.reserveBlocks(long))
	}
}

// twoWithHeldLong is a queue over instances a and b, with room for one
// step-sized prompt each, that has served two short requests (the last at
// 1 s), holds the long prompt long on a and keeps b for short requests:
// the long prompt held, of priority prio, waits, held back by the
// reservation.
func twoWithHeldLong(t *testing.T, prio int64) (s *Sched, long, held *Item) {
	s = mustNew(t, Config{InstancePrefill: 100, ReserveInstance: true, MaxWait: time.Hour, AgingStep: time.Hour})
	s.SetInstances([]string{"a", "b"})
	for i, ms := range []int{0, 1000} {
		short := &Item{Prefill: 50, Cost: 50}
		offer(t, s, short, at(ms), Admitted)
		s.Bind(short, "b")
		ft := at(ms + []int{50, 1}[i]) // teaches a service time of ~25 ms
		s.FirstToken(short, ft)
		s.Done(short, ft)
	}
	long = &Item{Prefill: 500, Cost: 500}
	offer(t, s, long, at(1002), Admitted)
	s.Bind(long, "a")
	held = &Item{Priority: prio, Prefill: 500, Cost: 500}
	offer(t, s, held, at(1003), Queued)
	return s, long, held
}

// TestStepSizedArrivalPassesHeldLongPrompts: a step-sized request that
// arrives while only a long prompt held back by the reservation waits goes
// at once onto the reserved instance, not queued and predicted behind that
// prompt's tokens (here 0.5 s at the queue's drain rate, past its 200 ms
// objective: it was shed on arrival); a long arrival still waits.
func TestStepSizedArrivalPassesHeldLongPrompts(t *testing.T) {
	s, _, _ := twoWithHeldLong(t, 0)
	s.busySec, s.busyTokens = 1, 1000 // the queue drains 1,000 tokens a second
	short := &Item{Prefill: 50, Cost: 50, Deadline: at(1204)}
	offer(t, s, short, at(1004), Admitted)
	if n := s.Counts().Shed[ShedDeadline]; n != 0 {
		t.Fatalf("%d shed for their deadline", n)
	}
	offer(t, s, &Item{Prefill: 500, Cost: 500}, at(1005), Queued)
}

// TestOverloadKeepsInstancesFreeOfLongRequests: under overload the short
// requests keep 2 of a–d (nine tenths cached: ⌈1.33⌉ on whole prompts,
// and on 0.13 instances of uncached work one in ten waits on two) free
// of long requests in prefill or in decode (a long prompt past its first
// token still runs its decode steps there, and a short prompt waits for
// the step in progress). With long requests decoding on c and d, a long
// prompt has room on c or d only, and is held back (letting step-sized
// requests pass) when neither has. With only a free, b, running the
// fewest long requests, takes no more until they end. With none anywhere
// a long prompt may take the two instances the short requests use least.
// Short requests have room everywhere and are told which instances are
// kept. Not overloaded, the staffing rule alone decides.
func TestOverloadKeepsInstancesFreeOfLongRequests(t *testing.T) {
	long := &Item{Prefill: 5000, Cost: 5000}
	short := &Item{Prefill: 1000, Cost: 1100}
	room := func(s *Sched, what string, want map[string]bool) {
		t.Helper()
		for name, w := range want {
			if got := s.Room(name, long); got != w {
				t.Errorf("%s: room for a long prompt on %s %v, want %v", what, name, got, w)
			}
			if !s.Room(name, short) {
				t.Errorf("%s: no room for a short request on %s", what, name)
			}
		}
	}
	heavy := demandSched(t, 0.9, 150*time.Millisecond, 3)
	if k, ok := heavy.keepK(long); !ok || k != 2 {
		t.Fatalf("kept %d (%v), want 2", k, ok)
	}
	heavy.insts["c"].long, heavy.insts["d"].long = 1, 1
	room(heavy, "long decodes on c, d", map[string]bool{"a": false, "b": false, "c": true, "d": true})
	if heavy.reserveBlocks(long) {
		t.Errorf("long decodes on c, d, both with room: held back")
	}
	kept := heavy.KeptFree(short, nil)
	slices.Sort(kept)
	if !slices.Equal(kept, []string{"a", "b"}) || heavy.KeptFree(long, nil) != nil {
		t.Errorf("kept free for a short request %v, for a long one %v; want [a b], none", kept, heavy.KeptFree(long, nil))
	}
	heavy.insts["c"].pending, heavy.insts["d"].pending = 1000, 1000
	if !heavy.reserveBlocks(long) || heavy.fits(long) {
		t.Errorf("c and d busy: held back %v, fits %v; want held back by the reservation", heavy.reserveBlocks(long), heavy.fits(long))
	}

	drain := demandSched(t, 0.9, 150*time.Millisecond, 3)
	drain.insts["b"].long, drain.insts["c"].long, drain.insts["d"].long = 1, 2, 3
	room(drain, "only a free", map[string]bool{"a": false, "b": false, "c": true, "d": true})

	none := demandSched(t, 0.9, 150*time.Millisecond, 3)
	none.insts["d"].inflight = 2 // d serves short requests; then a, b, c by name
	room(none, "no long requests", map[string]bool{"a": false, "b": true, "c": true, "d": false})
	if kept := none.KeptFree(short, nil); !slices.Equal(kept, []string{"d", "a"}) {
		t.Errorf("no long requests: kept %v, want [d a]", kept)
	}

	light := demandSched(t, 0, 150*time.Millisecond, 30)
	if _, ok := light.keepK(long); ok {
		t.Errorf("not overloaded: instances kept free of long decodes")
	}
	light.insts["c"].long, light.insts["d"].long = 1, 1
	if !light.Room("a", long) {
		t.Errorf("not overloaded: no room on a")
	}
}

// mayTakeRef is mayTake as first written: a pass over the pool for each
// instance asked. keepView must answer the same.
func mayTakeRef(s *Sched, l *instLoad, it *Item) bool {
	if !s.oversized(it) || s.liveN < 2 {
		return true
	}
	k, ok := s.keepK(it)
	if !ok {
		return true
	}
	free, above, fewer := 0, 0, 0
	for _, o := range s.insts {
		switch {
		case !o.live || o == l:
		case o.long == 0:
			free++
			if servesMore(o, l) {
				above++
			}
		case o.long < l.long || (o.long == l.long && o.name < l.name):
			fewer++
		}
	}
	others := max(s.unboundBig-btoi(it.big && it.inst == nil), 0)
	if l.long == 0 {
		return free-others >= k && above >= k
	}
	return fewer >= k-(free-others)
}

// The view gathered once per request answers every instance as the pass
// per instance did, over random pools: long requests, requests in flight,
// instances gone, admitted long prompts not yet bound.
func TestKeepViewMatchesPassPerInstance(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	long := &Item{Prefill: 5000, Cost: 5000}
	checked := 0
	for range 300 {
		s := demandSched(t, 0, 150*time.Millisecond, 3)
		for _, l := range s.insts {
			l.long = rng.IntN(3) * rng.IntN(2)
			l.inflight = rng.IntN(4)
			l.live = rng.IntN(8) != 0
		}
		s.unboundBig = rng.IntN(3)
		long.big = rng.IntN(2) == 0
		if _, ok := s.keepK(long); !ok {
			continue
		}
		v := s.keep(long)
		for name, l := range s.insts {
			checked++
			if got, want := v.mayTake(l), mayTakeRef(s, l, long); got != want {
				t.Fatalf("%s (long %d, in flight %d, live %v; unbound %d, big %v): view %v, pass %v",
					name, l.long, l.inflight, l.live, s.unboundBig, long.big, got, want)
			}
		}
	}
	if checked < 400 {
		t.Fatalf("only %d answers compared", checked)
	}
}
