package flowcontrol

import "testing"

// PreferCached does not count cached tokens on an instance the queue no
// longer knows (it left the pool, or went unhealthy, after the request
// arrived, and SetInstances dropped it) as tokens on an instance with
// room: otherwise the request whose prefix only the gone instance holds
// would overtake the one whose prefix the freed instance holds.
func TestPreferCachedIgnoresGoneInstance(t *testing.T) {
	s := mustNew(t, Config{InstanceConcurrency: 1, PreferCached: true})
	s.SetInstances([]string{"a", "b", "c"})
	var busy [3]*Item
	for i, name := range []string{"a", "b", "c"} {
		busy[i] = &Item{Tenant: "busy-" + name, Cost: 100, Prefill: 100}
		offer(t, s, busy[i], at(0), Admitted)
		s.Bind(busy[i], name)
	}
	// Both arrive while every instance is busy; cachedHolds saw c hold
	// 700 tokens of p's prompt and a 600 of q's.
	onGone := &Item{Tenant: "p", Cost: 800, Prefill: 800, Cached: []Hold{{"c", 700}}}
	onA := &Item{Tenant: "q", Cost: 800, Prefill: 800, Cached: []Hold{{"a", 600}}}
	offer(t, s, onGone, at(1), Queued)
	offer(t, s, onA, at(2), Queued)
	// c goes unhealthy, its request ends; the gate's refresh drops it.
	s.SetInstances([]string{"a", "b"})
	s.Done(busy[2], at(3))
	if got := s.Next(at(3)); got != nil {
		t.Fatalf("Next = %+v with a and b busy", got)
	}
	s.SetInstances([]string{"a", "b"})
	// a frees.
	s.Done(busy[0], at(4))
	got := s.Next(at(4))
	if got != onA {
		t.Fatalf("Next = tenant %q, want q (a holds 600 of its tokens; p's 700 are on c, which left)", got.Tenant)
	}
}
