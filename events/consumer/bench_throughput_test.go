//go:build unix

package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// BenchmarkConsumerThroughput is one router's consumer draining a
// JetStream stream into the memory index: 64 instances, each sending
// chains of 16-token blocks in events of evBlocks blocks (a vLLM batch
// stores a scheduler step's new full blocks), published before the
// consumer starts; one op is the whole stream. It reports blocks applied
// per second (wall) and per CPU second of this process. With
// server=inproc the NATS server is embedded in this process, so its CPU
// is in that figure; with server=process it runs in a process of its own
// (as in production, where the JetStream cluster has its own pods), this
// process's CPU is the router's alone (consumer and NATS client), and the
// server's is reported beside it: server-cpu-us/msg, and blocks/cpu-s-both
// for the two processes together. The coalesce=N cases publish N
// consecutive events of an instance per NATS message, as a coalescing
// kvbridge does with a backlog (kvstream.HeaderBatches). The floor=
// cases (16-block events, server process) measure what lies under the
// consumer's figure: floor=noindex is the consumer with an Applier that
// only counts blocks (the transport, delivery, decode and the consumer's
// own work, no index), floor=nats an ordered consumer on the same stream
// whose handler only counts messages (the NATS client's cost per
// message, under any consumer).
func BenchmarkConsumerThroughput(b *testing.B) {
	for _, sink := range []string{"nats", "noindex"} {
		b.Run("event=16blocks/floor="+sink+"/server=process", func(b *testing.B) { benchConsumerThroughput(b, 16, 1, true, sink) })
	}
	for _, evBlocks := range []int{16, 64, 256} {
		for _, coalesce := range []int{1, 8, 64} {
			if coalesce > 1 && evBlocks != 16 {
				continue // the small events, where the per-message cost dominates
			}
			for _, proc := range []bool{false, true} {
				name := fmt.Sprintf("event=%dblocks", evBlocks)
				if coalesce > 1 {
					name += fmt.Sprintf("/coalesce=%d", coalesce)
				}
				name += map[bool]string{false: "/server=inproc", true: "/server=process"}[proc]
				b.Run(name, func(b *testing.B) { benchConsumerThroughput(b, evBlocks, coalesce, proc, "index") })
			}
		}
	}
}

// countApplier is floor=noindex's Applier: it counts the blocks stored.
type countApplier struct{ blocks atomic.Int64 }

func (a *countApplier) Apply(_ context.Context, _ string, evs []events.Event) (kvindex.ApplyResult, error) {
	for i := range evs {
		if evs[i].Kind == events.BlockStored {
			a.blocks.Add(int64(len(evs[i].BlockHashes)))
		}
	}
	return kvindex.ApplyResult{}, nil
}

func (a *countApplier) Purge(context.Context, string) error { return nil }

// benchConsumerThroughput is one case of BenchmarkConsumerThroughput;
// sink is "index" (the consumer into the memory index) or a floor case.
func benchConsumerThroughput(b *testing.B, evBlocks, coalesce int, proc bool, sink string) {
	const instances, perInst = 64, 2048 // blocks per instance
	tokens := make([]uint32, evBlocks*16)
	build := func(pool string) []*nats.Msg {
		var msgs []*nats.Msg
		for inst := 0; inst < instances; inst++ {
			subj, _ := kvstream.EventsSubject(pool, fmt.Sprintf("e%d", inst))
			base := uint64(inst+1) << 32
			for seq, from := uint64(1), 0; from < perInst; {
				var p []byte
				h := kvstream.EventHeaders{Seq: seq, HasSeq: true, Pool: pool, Instance: fmt.Sprintf("e%d", inst)}
				n := 0
				for ; n < coalesce && from < perInst; n, seq, from = n+1, seq+1, from+evBlocks {
					p = append(p, benchPayload(b, base, from, evBlocks, tokens)...)
				}
				if n > 1 {
					h.Batches = n
				}
				msgs = append(msgs, &nats.Msg{Subject: subj, Data: p, Header: h.Header()})
			}
		}
		return msgs
	}
	drainStream(b, drainCase{name: fmt.Sprintf("ct%d", evBlocks), build: build, blocks: instances * perInst,
		events: instances * perInst / evBlocks, capacity: 2 * instances * perInst, proc: proc, sink: sink})
}

// drainCase is one stream for the consumer benchmarks to drain: built by
// build for a pool name, published whole before the consumer starts.
type drainCase struct {
	name     string
	build    func(pool string) []*nats.Msg
	blocks   int // blocks stored by the stream's events
	events   int // engine events in the stream
	capacity int // the index's capacity
	proc     bool
	sink     string
	// applies, when set, ends an op when the Applier has been called
	// this many times (a stream that also removes blocks, whose index
	// does not end at blocks entries); otherwise the op ends when the
	// index holds blocks entries.
	applies int
	// prefill, when set, fills each op's index before its timed window.
	prefill func(idx *kvindex.Memory)
}

// countedIndex is the memory index with its Apply calls counted (how an
// op that removes blocks knows the stream has been applied).
type countedIndex struct {
	*kvindex.Memory
	applies atomic.Int64
}

func (c *countedIndex) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	c.applies.Add(1)
	return c.Memory.Apply(ctx, instance, evs)
}

// drainStream publishes dc's stream, then each op drains all of it with a
// new consumer into a new index (see BenchmarkConsumerThroughput for what
// it reports).
func drainStream(b *testing.B, dc drainCase) {
	url, serverPid := "", 0
	if dc.proc {
		srv := testenv.StartNATSProcess(b)
		url, serverPid = srv.URL(), srv.Pid
	} else {
		url = testenv.StartNATS(b).URL()
	}
	serverCPU := func() time.Duration {
		if serverPid == 0 {
			return 0
		}
		return cputime.OfProcess(serverPid)
	}
	nc, err := nats.Connect(url)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	b.StopTimer()
	// The stream is published once; each op drains all of it with a new
	// consumer into a new index.
	name := fmt.Sprintf("%s_%d", dc.name, time.Now().UnixNano())
	pool := "p_" + name
	streamCfg := kvstream.StreamConfig{Name: "S_" + name, Memory: true}
	if _, err := kvstream.EnsureStream(ctx, js, streamCfg); err != nil {
		b.Fatal(err)
	}
	msgs := dc.build(pool)
	for _, m := range msgs {
		// A loaded machine may take longer than nats.go's default
		// 200 ms stall wait to ack 4,000 messages: wait instead of
		// failing.
		if _, err := js.PublishMsgAsync(m, jetstream.WithStallWait(time.Minute)); err != nil {
			b.Fatal(err)
		}
	}
	<-js.PublishAsyncComplete()
	want := dc.blocks
	if dc.applies > 0 {
		want = dc.applies
	}
	var blocks, cpu, scpu time.Duration
	var total int
	for i := 0; i < b.N; i++ {
		cfg := Config{Conn: nc, Pool: pool, Stream: streamCfg, Bucket: kvstream.BucketConfig{Name: fmt.Sprintf("B_%s_%d", name, i), Memory: true},
			Logger: slog.New(slog.DiscardHandler)}
		var applied func() int
		if dc.sink == "noindex" {
			ca := &countApplier{}
			cfg.Applier, applied = ca, func() int { return int(ca.blocks.Load()) }
		} else if dc.sink == "index" {
			idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m", Capacity: dc.capacity})
			if err != nil {
				b.Fatal(err)
			}
			if dc.prefill != nil {
				dc.prefill(idx)
			}
			cfg.Applier, applied = idx, func() int { n, _ := idx.Len(ctx); return n }
			if dc.applies > 0 {
				ci := &countedIndex{Memory: idx}
				cfg.Applier, applied = ci, func() int { return int(ci.applies.Load()) }
			}
		}
		b.StartTimer()
		start, cpu0, scpu0 := time.Now(), cputime.Process(), serverCPU()
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		if dc.sink == "nats" {
			var n atomic.Int64
			per := int64(dc.blocks / len(msgs))
			subj, _ := kvstream.PoolSubjects(kvstream.SubjectEvents, pool)
			cons, err := js.OrderedConsumer(ctx, streamCfg.Name, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subj}})
			if err != nil {
				b.Fatal(err)
			}
			cc, err := cons.Consume(func(jetstream.Msg) { n.Add(per) })
			if err != nil {
				b.Fatal(err)
			}
			applied = func() int { return int(n.Load()) }
			go func() { defer close(done); <-runCtx.Done(); cc.Stop() }()
		} else {
			c, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			go func() { defer close(done); _ = c.Run(runCtx) }()
		}
		deadline := time.Now().Add(2 * time.Minute)
		for {
			if applied() == want {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d after 2 minutes", applied(), want)
			}
			time.Sleep(time.Millisecond)
		}
		blocks += time.Since(start)
		cpu += cputime.Process() - cpu0
		scpu += serverCPU() - scpu0
		b.StopTimer()
		cancel()
		<-done
		total += dc.blocks
	}
	b.ReportMetric(float64(total)/blocks.Seconds(), "blocks/s")
	b.ReportMetric(float64(total)/cpu.Seconds(), "blocks/cpu-s")
	ops := float64(total) / float64(dc.blocks)
	b.ReportMetric(cpu.Seconds()*1e6/(ops*float64(len(msgs))), "cpu-us/msg")
	b.ReportMetric(cpu.Seconds()*1e6/(ops*float64(dc.events)), "cpu-us/event")
	if dc.proc {
		b.ReportMetric(scpu.Seconds()*1e6/(ops*float64(len(msgs))), "server-cpu-us/msg")
		b.ReportMetric(float64(total)/(cpu+scpu).Seconds(), "blocks/cpu-s-both")
	}
}
