package flowcontrol

import (
	"testing"
	"time"
)

// admitOrder frees the one slot n times and returns the order in which
// the waiting requests were admitted.
func admitOrder(t *testing.T, s *Sched, running *Item, from, n int) ([]*Item, *Item) {
	t.Helper()
	var got []*Item
	for i := range n {
		now := at(from + i*10)
		s.FirstToken(running, now)
		s.Done(running, now)
		running = s.Next(now)
		if running == nil {
			t.Fatalf("admission %d: nothing admitted", i)
		}
		got = append(got, running)
	}
	return got, running
}

// Oldest first until one of a tenant's requests is shed for its deadline
// while others of it wait; then newest first, until none of it waits.
func TestNewestFirstOnceATenantOverruns(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour, AgingStep: time.Hour})
	running := &Item{Cost: 10}
	offer(t, s, running, at(0), Admitted)
	a := []*Item{{Cost: 10}, {Cost: 10}, {Cost: 10}}
	for i, it := range a {
		offer(t, s, it, at(1+i), Queued)
	}
	got, running := admitOrder(t, s, running, 10, 1)
	if got[0] != a[0] {
		t.Fatal("before any shed: not oldest first")
	}
	b := []*Item{{Cost: 10}, {Cost: 10}}
	for i, it := range b {
		offer(t, s, it, at(21+i), Queued)
	}
	// A request of the tenant is shed on arrival, predicted behind its
	// own backlog (the drain rate is known now); a request shed while
	// waiting does the same (TestNewestFirstKeepsTheShare).
	if out := offer(t, s, &Item{Cost: 10, Deadline: at(24)}, at(23), Shed); out.Reason != ShedDeadline {
		t.Fatalf("shed %s", out.Reason)
	}
	// Waiting: a[1], a[2], b[0], b[1]; newest first now, and shown so.
	if st := s.Stats(at(50)); st.NewestFirstTenants != 1 || len(st.Tenants) != 1 || !st.Tenants[0].NewestFirst {
		t.Fatalf("stats after the shed: %d newest-first tenants, %+v", st.NewestFirstTenants, st.Tenants)
	}
	got, running = admitOrder(t, s, running, 60, 4)
	want := []*Item{b[1], b[0], a[2], a[1]}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("admission %d after the shed: got seq %d, want %d", i, got[i].seq, want[i].seq)
		}
	}
	// Its backlog gone, the tenant is oldest first again.
	c := []*Item{{Cost: 10}, {Cost: 10}}
	for i, it := range c {
		offer(t, s, it, at(200+i), Queued)
	}
	if st := s.Stats(at(205)); st.NewestFirstTenants != 0 || len(st.Tenants) != 1 || st.Tenants[0].NewestFirst {
		t.Fatalf("stats after the backlog emptied: %d newest-first tenants, %+v", st.NewestFirstTenants, st.Tenants)
	}
	got, _ = admitOrder(t, s, running, 210, 2)
	if got[0] != c[0] || got[1] != c[1] {
		t.Fatal("after the backlog emptied: not oldest first")
	}
}

// Newest first changes a tenant's own order, not its share of the band:
// the overrun tenant and a tenant that never overran still alternate
// (equal costs, equal weights).
func TestNewestFirstKeepsTheShare(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour, AgingStep: time.Hour})
	running := &Item{Cost: 10}
	offer(t, s, running, at(0), Admitted)
	for i := range 6 {
		offer(t, s, &Item{Tenant: "heavy", Cost: 10}, at(1+i), Queued)
	}
	offer(t, s, &Item{Tenant: "heavy", Cost: 10, Deadline: at(20)}, at(7), Queued)
	for i := range 3 {
		offer(t, s, &Item{Tenant: "light", Cost: 10}, at(8+i), Queued)
	}
	if exp := s.Expire(at(20), nil); len(exp) != 1 || exp[0].ExpiredReason() != ShedDeadline {
		t.Fatalf("expired %v", exp)
	}
	got, _ := admitOrder(t, s, running, 30, 6)
	var heavy, light int
	var lastHeavy uint64 = 1 << 62
	for _, it := range got {
		switch it.Tenant {
		case "heavy":
			heavy++
			if it.seq > lastHeavy {
				t.Fatalf("heavy admitted seq %d after %d: not newest first", it.seq, lastHeavy)
			}
			lastHeavy = it.seq
		case "light":
			light++
		}
	}
	if heavy != 3 || light != 3 {
		t.Fatalf("heavy %d, light %d of 6 admissions, want 3 each", heavy, light)
	}
}

// A request promoted by aging goes oldest first even in a tenant that
// goes newest first: aging bounds the oldest request's wait.
func TestAgedGoesOldestFirstNewestFirstOrNot(t *testing.T) {
	s := mustNew(t, Config{MaxConcurrency: 1, MaxWait: time.Hour, AgingStep: 100 * time.Millisecond})
	running := &Item{Priority: 0, Cost: 10}
	offer(t, s, running, at(0), Admitted)
	old := &Item{Priority: 1, Cost: 10}
	offer(t, s, old, at(1), Queued)
	offer(t, s, &Item{Priority: 1, Cost: 10, Deadline: at(5)}, at(2), Queued)
	offer(t, s, &Item{Priority: 1, Cost: 10}, at(3), Queued)
	if exp := s.Expire(at(5), nil); len(exp) != 1 {
		t.Fatalf("expired %d", len(exp))
	}
	offer(t, s, &Item{Priority: 0, Cost: 10}, at(150), Queued)
	// At 150 ms old has aged one step into band 0, where it ties with the
	// band-0 request; ties go to the band that is there by its own
	// priority. At 250 ms it has aged two steps: it goes, oldest first.
	got, _ := admitOrder(t, s, running, 150, 1)
	if got[0].Priority != 0 {
		t.Fatal("the band-0 request did not go first")
	}
	s.FirstToken(got[0], at(250))
	s.Done(got[0], at(250))
	if it := s.Next(at(250)); it != old {
		t.Fatalf("aged admission: seq %d, want the oldest (%d)", it.seq, old.seq)
	}
}
