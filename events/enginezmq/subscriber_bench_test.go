package enginezmq_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkSubscriberRead: the bridge's ZMQ side alone, a Subscriber
// dialing an engine's PUB socket and reading the captured vLLM batches
// (eventstest.StreamPUB: pre-encoded ZMTP frames in large writes, so the
// engine side costs little), in one process. cpu-µs/msg is the process's
// CPU per message, the stand-in's included.
func BenchmarkSubscriberRead(b *testing.B) {
	ps := eventstest.CapturedPayloads(b, "array.jsonl")
	pub := eventstest.NewStreamPUB(b, "kv", ps)
	sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: pub.Endpoint(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan struct{})
	n := uint64(0)
	go func() {
		_ = sub.Run(ctx, func(m enginezmq.Message) {
			if n++; n == uint64(b.N) {
				close(got)
			}
		})
	}()
	if err := pub.Accept(10 * time.Second); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0 := time.Now(), cputime.Process()
	if err := pub.Send(0, uint64(b.N)); err != nil {
		b.Fatal(err)
	}
	<-got
	el, cpu := time.Since(start), cputime.Process()-cpu0
	b.StopTimer()
	b.ReportMetric(float64(b.N)/el.Seconds(), "msgs/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/msg")
}
