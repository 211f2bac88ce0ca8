package flowcontrol

import (
	"fmt"
	"testing"
)

// The cost of one Next under the gate's lock when nothing can be
// admitted (every instance busy), 1,024 queued requests of 1,024 tenants,
// 256 instances, with and without PreferCached (the router now always sets it).
func BenchmarkNextBlocked(b *testing.B) {
	for _, ntenants := range []int{16, 1024} {
		for _, prefer := range []bool{false, true} {
			b.Run(fmt.Sprintf("tenants=%d/prefer=%v", ntenants, prefer), func(b *testing.B) {
				s, _ := New(Config{InstancePrefill: 1000, PreferCached: prefer, MaxQueue: 4096})
				names := make([]string, 256)
				for i := range names {
					names[i] = fmt.Sprintf("i%d", i)
				}
				s.SetInstances(names)
				for _, n := range names {
					it := &Item{Tenant: "busy", Cost: 1000, Prefill: 1000}
					s.Offer(it, at(0))
					s.Bind(it, n)
				}
				for i := range 1024 {
					it := &Item{Tenant: fmt.Sprintf("t%d", i%ntenants), Cost: 500, Prefill: 500, Cached: []Hold{{names[i%256], 100}}}
					if o := s.Offer(it, at(1)); o.Verdict != Queued {
						b.Fatalf("verdict %v", o.Verdict)
					}
				}
				b.ResetTimer()
				for range b.N {
					if s.Next(at(2)) != nil {
						b.Fatal("admitted")
					}
				}
			})
		}
	}
}
