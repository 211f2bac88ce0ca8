package test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/kvindex"
)

// BenchmarkBridgeThroughput: engine messages (the 25 captured batches,
// cycled) through ZMQ → kvbridge → JetStream publish with ack, on loopback,
// with the publish window off (1: each publish waits for its ack, as
// before issue 15), at its default, and at its default with coalescing
// (the burst queues behind the window, so the bridge joins up to
// DefaultCoalesce engine messages per NATS message), side by side in one
// run. Beside
// wall-time rates it reports the CPU time of the whole process (engine
// publisher, bridge and NATS server) per batch.
func BenchmarkBridgeThroughput(b *testing.B) {
	ps := eventstest.CapturedPayloads(b, "array.jsonl")
	for _, c := range []struct{ window, coalesce int }{{1, 0}, {bridge.DefaultPublishWindow, 0}, {bridge.DefaultPublishWindow, bridge.DefaultCoalesce}} {
		name := fmt.Sprintf("window%d", c.window)
		if c.coalesce > 0 {
			name += fmt.Sprintf("/coalesce%d", c.coalesce)
		}
		window := c.window
		b.Run(name, func(b *testing.B) {
			r := newRig(b, rigOpts{buffer: 1 << 20, window: window, coalesce: c.coalesce})
			eventstest.Burst(b, ps, func(_ uint64, p []byte) {
				if _, err := r.pub.Publish(p); err != nil {
					b.Fatal(err)
				}
			}, func(n uint64) bool { s := r.stats(); return s.HasSeq && s.EngineSeq >= n }, func() any { return r.stats() })
			s := r.stats()
			if s.Dropped != 0 || s.Gaps != 0 {
				b.Fatalf("bridge dropped messages: %+v", s)
			}
			if s.MaxInFlight > uint64(window) {
				b.Fatalf("%d messages in flight at once, window %d", s.MaxInFlight, window)
			}
			b.ReportMetric(float64(s.MaxInFlight), "max-in-flight")
			b.ReportMetric(float64(b.N)/float64(uint64(b.N)-s.CoalescedBatches+s.Coalesced), "batches/nats-msg")
		})
	}
}

// notifier is an index that reports when a marked block became visible.
type notifier struct {
	kvindex.Index
	seen chan uint64
}

func (n *notifier) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	r, err := n.Index.Apply(ctx, instance, evs)
	for _, e := range evs {
		if e.Kind == events.BlockStored && len(e.BlockHashes) > 0 {
			select {
			case n.seen <- e.BlockHashes[0]:
			default:
			}
		}
	}
	return r, err
}

// BenchmarkEventToIndexLatency: one BlockStored batch at a time, from the
// engine's PUB socket to Apply returning in the router's memory index
// (ZMQ → kvbridge → JetStream → ordered consumer → shard → kvindex).
func BenchmarkEventToIndexLatency(b *testing.B) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "fake-model"})
	if err != nil {
		b.Fatal(err)
	}
	n := &notifier{Index: ix, seen: make(chan uint64, 16)}
	r := newRig(b, rigOpts{})
	r.runConsumer(consumer.Config{Applier: n})

	tokens := make([]uint32, 16)
	lat := make([]time.Duration, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		marker := uint64(i + 1)
		tokens[0] = uint32(i)
		p, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{{Kind: events.BlockStored,
			BlockHashes: []uint64{marker}, TokenIDs: tokens, BlockSize: 16, Medium: "GPU"}}}, events.EncodingArray)
		if err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		if _, err := r.pub.Publish(p); err != nil {
			b.Fatal(err)
		}
		timeout := time.After(10 * time.Second)
	wait:
		for {
			select {
			case h := <-n.seen:
				if h == marker {
					break wait
				}
			case <-timeout:
				b.Fatalf("batch %d never reached the index", i)
			}
		}
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	slices.Sort(lat)
	q := func(f float64) float64 { return float64(lat[int(f*float64(len(lat)-1))].Microseconds()) }
	b.ReportMetric(q(0.5), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
}
