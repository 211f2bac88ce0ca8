package bridge

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// BenchmarkBridgePublish is the bridge's own path from its input buffer to
// JetStream's ack, without the engine's ZMQ socket: the captured vLLM
// batches (cycled) are put straight into an instance's buffer, as its
// subscriber does, and the bridge decodes, publishes (window 128) and
// folds each into its table. The NATS server (file store) runs in this
// process, so cpu-µs/batch is the bridge's and the server's together.
// Coalescing off and on (DefaultCoalesce) side by side: the whole burst
// is queued at once, so with it on the bridge joins what is queued.
func BenchmarkBridgePublish(b *testing.B) {
	ps := eventstest.CapturedPayloads(b, "array.jsonl")
	blocks := 0
	for _, p := range ps {
		bt, err := events.Decode(p)
		if err != nil {
			b.Fatal(err)
		}
		for _, e := range bt.Events {
			blocks += len(e.BlockHashes)
		}
	}
	for _, coalesce := range []int{0, DefaultCoalesce} {
		b.Run(fmt.Sprintf("coalesce%d", coalesce), func(b *testing.B) {
			ctx := testenv.Context(b, 10*time.Minute)
			nc := testenv.Connect(b, testenv.StartNATS(b).URL())
			name := testenv.UniqueName(b)
			br, err := New(Config{Pool: "p", Conn: nc, Coalesce: coalesce, Buffer: b.N + 16,
				Stream:  kvstream.StreamConfig{Name: "EV_" + name},
				Bucket:  kvstream.BucketConfig{Name: "SN_" + name},
				Sources: []Source{{Instance: "i0", Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(b))}},
				// Nothing answers on the endpoint: no engine to probe.
				EngineProbeInterval: -1, SnapshotInterval: time.Hour, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				b.Fatal(err)
			}
			testenv.Go(b, ctx, br.Run)
			testenv.WaitFor(b, 20*time.Second, "bridge ready", br.Ready)
			in := br.insts[0]
			b.ReportAllocs()
			b.ResetTimer()
			start, cpu0 := time.Now(), cputime.Process()
			for i := 0; i < b.N; i++ {
				in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: ps[i%len(ps)]})
			}
			deadline := time.Now().Add(5 * time.Minute)
			for s := in.stats(); !s.HasSeq || s.EngineSeq < uint64(b.N); s = in.stats() {
				if time.Now().After(deadline) {
					b.Fatalf("bridge stuck at %+v", s)
				}
				time.Sleep(200 * time.Microsecond)
			}
			el, cpu := time.Since(start).Seconds(), (cputime.Process() - cpu0).Seconds()
			b.StopTimer()
			s := in.stats()
			if s.Dropped != 0 || s.Gaps != 0 || s.Malformed != 0 {
				b.Fatalf("bridge dropped messages: %+v", s)
			}
			msgs := float64(b.N) - float64(s.CoalescedBatches) + float64(s.Coalesced)
			b.ReportMetric(float64(b.N)/el, "batches/s")
			b.ReportMetric(float64(b.N)/float64(len(ps))*float64(blocks)/el, "blocks/s")
			b.ReportMetric(cpu*1e6/float64(b.N), "cpu-µs/batch")
			b.ReportMetric(float64(b.N)/msgs, "batches/nats-msg")
		})
	}
}
