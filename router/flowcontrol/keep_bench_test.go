package flowcontrol

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"
)

// The cost of one Next under the gate's lock when the head is a long
// prompt and the queue keeps instances free of long requests (overload:
// keepK), every instance but the kept ones running a long request: the
// room checks walk the instances.
func BenchmarkNextLongHeadKept(b *testing.B) {
	for _, n := range []int{8, 64, 256} {
		b.Run(fmt.Sprintf("instances=%d", n), func(b *testing.B) {
			s, end := overloadedSched(b, n)
			long := &Item{Prefill: 5000, Cost: 5000}
			k, ok := s.keepK(long)
			if !ok {
				b.Fatal("not overloaded")
			}
			for i, name := range slices.Sorted(maps.Keys(s.insts)) {
				l := s.insts[name]
				if i >= k {
					l.long, l.inflight, l.pending = 1, 1, 2000
				}
			}
			if o := s.Offer(&Item{Prefill: 5000, Cost: 5000}, end.Add(time.Millisecond)); o.Verdict != Queued {
				b.Fatalf("verdict %v", o.Verdict)
			}
			b.ReportMetric(float64(k), "kept")
			b.ResetTimer()
			for range b.N {
				if s.Next(end.Add(2*time.Millisecond)) != nil {
					b.Fatal("admitted")
				}
			}
		})
	}
}

// overloadedSched is a pool of n instances whose short requests arrive,
// with long ones, faster than it serves them (the reservation's overload
// regime), and the time of the last arrival.
func overloadedSched(b *testing.B, n int) (*Sched, time.Time) {
	b.Helper()
	s, _ := New(Config{InstancePrefill: 2000, ReserveInstance: true, MaxQueue: 4096})
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("i%03d", i)
	}
	s.SetInstances(names)
	// Short requests at ~3 per 10 ms-step and long ones: the short
	// class's offered load, measured as in the reservation tests.
	for i := range 3000 {
		now := at(0).Add(time.Duration(i) * time.Millisecond * 8 / time.Duration(n))
		var it *Item
		switch {
		case i%3 == 0:
			it = &Item{Prefill: 1000, Cost: 1100, Deadline: now.Add(150 * time.Millisecond)}
		case i%3 == 1:
			it = &Item{Prefill: 5000, Cost: 5000}
		default:
			continue
		}
		s.noteArrival(it, now)
		s.last = now
	}
	end := s.last
	s.svcN = 1
	for range 10 {
		s.svcFit.add(1000, 0, 0.02+1000*40e-6)
		s.svcFit.add(5000, 0, 0.02+5000*40e-6)
	}
	return s, end
}

// The cost of KeptFree for one short request under overload with no long
// request anywhere (every instance free: the keepK serving most are
// sorted out of all of them), under the gate's lock.
func BenchmarkKeptFree(b *testing.B) {
	for _, n := range []int{8, 64, 256} {
		b.Run(fmt.Sprintf("instances=%d", n), func(b *testing.B) {
			s, _ := overloadedSched(b, n)
			for i, name := range slices.Sorted(maps.Keys(s.insts)) {
				s.insts[name].inflight = i % 7
			}
			short := &Item{Prefill: 1000, Cost: 1100}
			var dst []string
			b.ResetTimer()
			for range b.N {
				dst = s.KeptFree(short, dst[:0])
			}
			b.ReportMetric(float64(len(dst)), "kept")
		})
	}
}
