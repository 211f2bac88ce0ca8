package bridge

import (
	"runtime"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

// BenchmarkTableGC is one full garbage collection beside a table at
// kvbridge's default bound (1 Mi blocks of 16 tokens, chains of 16): what
// the table costs every collection the bridge makes, and the heap it
// holds.
func BenchmarkTableGC(b *testing.B) {
	const blocks, bs, run = 1 << 20, 16, 16
	tab := NewTable(blocks)
	e := events.Event{Kind: events.BlockStored, BlockSize: bs, Medium: "GPU",
		BlockHashes: make([]uint64, run), TokenIDs: make([]uint32, run*bs)}
	for c := 0; c < blocks/run; c++ {
		for i := range e.BlockHashes {
			e.BlockHashes[i] = uint64(c*run+i) + 1
		}
		tab.Apply([]events.Event{e})
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		runtime.GC()
	}
	b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/gc")
	b.ReportMetric(float64(ms.HeapAlloc)/(1<<20), "heap-MiB")
	runtime.KeepAlive(tab)
}
