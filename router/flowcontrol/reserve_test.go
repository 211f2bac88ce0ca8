package flowcontrol

import (
	"math"
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

// The reservation counts the step-sized requests' uncached tokens as their
// work and their objectives as the wait they can spare: the same arrivals
// reserve three of four instances when every prompt token is prefilled and
// one when nine tenths are cached; a looser objective reserves fewer.
// While other requests wait it is their offered load on whole prompts.
func TestReservationFromUncachedDemandAndObjectives(t *testing.T) {
	reserved := func(cachedShare float64, objective time.Duration, waiting int) int {
		s := mustNew(t, Config{InstancePrefill: 2000, ReserveInstance: true})
		s.SetInstances([]string{"a", "b", "c", "d"})
		// Arrivals every 10 ms, a third of them 1,000-token step-sized
		// prompts: 33 per second, 33,333 prompt tokens per second.
		for i := range 300 {
			now := at(10 * i)
			it := &Item{Prefill: 5000, Cost: 5000}
			if i%3 == 0 {
				cached := int64(cachedShare * 1000)
				it = &Item{Prefill: 1000, Cost: 1100, Deadline: now.Add(objective), Cached: []Hold{{"a", cached}}}
			}
			s.noteArrival(it, now)
			s.last = now
		}
		// 20 ms in the engine plus 40 µs per prompt token: a 1,000-token
		// prompt is predicted at 60 ms and is 40 ms of an instance's prefill.
		s.svcN = 1
		for range 10 {
			s.svcFit.add(1000, 0, 0.02+1000*40e-6)
			s.svcFit.add(5000, 0, 0.02+5000*40e-6)
		}
		s.queued = waiting
		return s.reserved(&Item{Prefill: 5000, Cost: 5000})
	}
	// Uncached: 1.33 instances of 40 ms requests with 90 ms to spare; two
	// instances let 12 % wait longer, three 1.5 %.
	if k := reserved(0, 150*time.Millisecond, 0); k != 3 {
		t.Errorf("uncached prompts, 150 ms objective: reserved = %d, want 3", k)
	}
	// Nine tenths cached: 0.13 instances of 4 ms requests.
	if k := reserved(0.9, 150*time.Millisecond, 0); k != 1 {
		t.Errorf("90%% cached prompts: reserved = %d, want 1", k)
	}
	// 440 ms to spare: two instances let 0.2 % wait longer.
	if k := reserved(0, 500*time.Millisecond, 0); k != 2 {
		t.Errorf("uncached prompts, 500 ms objective: reserved = %d, want 2", k)
	}
	// While other requests wait, the short ones' offered load on whole
	// prompts, ⌈1.33⌉, cached or not.
	if k := reserved(0.9, 150*time.Millisecond, 1); k != 2 {
		t.Errorf("90%% cached prompts, requests waiting: reserved = %d, want 2", k)
	}
	// An objective the service alone spends (a 90 % cached prompt is
	// predicted at 24 ms on the instance holding it) leaves no wait: the
	// fewest instances on which at most one request in ten waits at all.
	if k := reserved(0.9, 20*time.Millisecond, 0); k != 2 {
		t.Errorf("objective shorter than the service: reserved = %d, want 2", k)
	}
}
