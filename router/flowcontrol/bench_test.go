package flowcontrol

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkOfferNext is the cost of one request through a saturated
// queue (offer, admit, finish) at a steady depth, over tenants and bands.
func BenchmarkOfferNext(b *testing.B) {
	for _, depth := range []int{8, 64, 512} {
		for _, tenants := range []int{1, 16, 256} {
			b.Run(fmt.Sprintf("depth%d/tenants%d", depth, tenants), func(b *testing.B) {
				benchOfferNext(b, depth, tenants)
			})
		}
	}
}

func benchOfferNext(b *testing.B, depth, tenants int) {
	s := mustNew(b, Config{MaxConcurrency: 1, MaxQueue: depth + 1, MaxWait: time.Hour})
	names := make([]string, tenants)
	for i := range names {
		names[i] = fmt.Sprint("tenant-", i)
	}
	items := make([]Item, depth+b.N+1)
	now := t0
	running := &items[0]
	s.Offer(running, now)
	for i := 1; i <= depth; i++ {
		items[i] = Item{Tenant: names[i%tenants], Priority: int64(i % 3), Cost: int64(100 + i%1000), Deadline: now.Add(time.Hour)}
		s.Offer(&items[i], now)
	}
	b.ReportAllocs()
	b.ResetTimer()
	defer cputime.Report(b)(b.N) // b.N is fixed for this call (for range b.N)
	for i := range b.N {
		now = now.Add(time.Millisecond)
		it := &items[depth+1+i]
		*it = Item{Tenant: names[i%tenants], Priority: int64(i % 3), Cost: int64(100 + i%1000), Deadline: now.Add(time.Hour)}
		s.Offer(it, now)
		s.Done(running, now)
		running = s.Next(now)
	}
}

// BenchmarkGateUncontended is the cost the HTTP path pays per request when
// the pool has room: Acquire admits at once, then FirstToken and Done.
func BenchmarkGateUncontended(b *testing.B) {
	g := mustGate(b, Config{MaxConcurrency: 1 << 20})
	ctx := context.Background()
	b.ReportAllocs()
	defer cputime.Report(b)(b.N) // b.N is fixed for this call (for range b.N)
	for range b.N {
		tk, err := g.Acquire(ctx, Item{Tenant: "t", Cost: 1000, Prefill: 900})
		if err != nil {
			b.Fatal(err)
		}
		tk.FirstToken()
		tk.Done()
	}
}
