package eventstest

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
)

// Burst is a throughput benchmark's timed part: it hands b.N engine
// batches (the payloads ps, cycled; the i-th with engine seq i+1) to send,
// waits (at most 5 minutes) until handled(b.N) says the last one is
// through, and reports batches/s, blocks/s and this process's CPU µs per
// batch. state describes what is stuck for a failure. The timer is
// stopped when it returns.
func Burst(b *testing.B, ps [][]byte, send func(seq uint64, p []byte), handled func(n uint64) bool, state func() any) {
	b.Helper()
	blocks := CountBlocks(b, ps)
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0 := time.Now(), cputime.Process()
	for i := 0; i < b.N; i++ {
		send(uint64(i+1), ps[i%len(ps)])
	}
	deadline := time.Now().Add(5 * time.Minute)
	for !handled(uint64(b.N)) {
		if time.Now().After(deadline) {
			b.Fatalf("stuck at %+v", state())
		}
		time.Sleep(200 * time.Microsecond)
	}
	el, cpu := time.Since(start).Seconds(), (cputime.Process() - cpu0).Seconds()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/el, "batches/s")
	b.ReportMetric(float64(b.N)/float64(len(ps))*float64(blocks)/el, "blocks/s")
	b.ReportMetric(cpu*1e6/float64(b.N), "cpu-µs/batch")
}

// CountBlocks is the number of blocks the events of payloads ps name.
func CountBlocks(t testing.TB, ps [][]byte) int {
	t.Helper()
	blocks := 0
	for _, p := range ps {
		bt, err := events.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range bt.Events {
			blocks += len(e.BlockHashes)
		}
	}
	return blocks
}
