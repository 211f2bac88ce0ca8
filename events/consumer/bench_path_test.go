//go:build unix

package consumer

import (
	"context"
	"fmt"
	"log/slog"
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

// pathMsg is a stream message as the consume goroutine receives it: its
// metadata as JetStream sends it (the reply subject, which this tree's
// deliver parses) and parsed (what an older tree's dispatch read through
// Metadata): what the consumer's own path reads of it.
type pathMsg struct {
	jetstream.Msg
	subj  string
	reply string // ackReply(md)
	hdr   nats.Header
	data  []byte
	md    *jetstream.MsgMetadata
}

func (m *pathMsg) Subject() string                           { return m.subj }
func (m *pathMsg) Reply() string                             { return m.reply }
func (m *pathMsg) Headers() nats.Header                      { return m.hdr }
func (m *pathMsg) Data() []byte                              { return m.data }
func (m *pathMsg) Metadata() (*jetstream.MsgMetadata, error) { return m.md, nil }

// ackReply is the reply subject JetStream gives a message with metadata
// md (the form with domain and account hash).
func ackReply(md *jetstream.MsgMetadata) string {
	return fmt.Sprintf("$JS.ACK._.ACCOUNTHASH.S.C.1.%d.%d.%d.%d.TOKEN", md.Sequence.Stream, md.Sequence.Stream, md.Timestamp.UnixNano(), md.NumPending)
}

// benchPayload is the benchmarks' message: one BlockStored of evBlocks
// blocks, hashes base+from on, chained to the block before from.
func benchPayload(b *testing.B, base uint64, from, evBlocks int, tokens []uint32) []byte {
	ev := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: tokens}
	for j := 0; j < evBlocks; j++ {
		ev.BlockHashes = append(ev.BlockHashes, base+uint64(from+j))
	}
	if from > 0 {
		ev.ParentHash, ev.HasParent = base+uint64(from-1), true
	}
	p, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{ev}}, events.EncodingMap)
	if err != nil {
		b.Fatal(err)
	}
	return p
}

// BenchmarkConsumerPath is the consumer's own per-message path without
// NATS: the messages of BenchmarkConsumerThroughput (64 instances × 2,048
// blocks in events of evBlocks blocks), round-robin over the instances as
// a live fleet sends them, handed to dispatch as received messages (their
// metadata read from the reply subject, pathDispatch), each taken from its
// shard's queue and applied (header, decode, instance state, the memory
// index, metrics) on one goroutine. One op is
// the whole stream into a fresh index; it reports CPU per message and
// blocks per CPU-second of the path alone, the part of
// BenchmarkConsumerThroughput's per-message cost that is the consumer's.
func BenchmarkConsumerPath(b *testing.B) {
	for _, evBlocks := range []int{16, 64} {
		b.Run(fmt.Sprintf("event=%dblocks", evBlocks), func(b *testing.B) {
			const instances, perInst = 64, 2048
			tokens := make([]uint32, evBlocks*16)
			var pps []pathPayload
			for seq, from := uint64(1), 0; from < perInst; seq, from = seq+1, from+evBlocks {
				for inst := 0; inst < instances; inst++ {
					pps = append(pps, pathPayload{inst, seq, benchPayload(b, uint64(inst+1)<<32, from, evBlocks, tokens)})
				}
			}
			benchPath(b, instances, pps, evBlocks, nil, instances*perInst)
		})
	}
	// The fleet's shapes (BenchmarkConsumerFleet), the path alone.
	for _, s := range []fleetShape{{16, 1, false}, {50, 1, false}, {50, 50, false}, {50, 1, true}, {50, 50, true}} {
		b.Run("fleet/"+s.String(), func(b *testing.B) {
			const instances, perInst = 256, 4096
			steps := (perInst + s.blocks - 1) / s.blocks
			var pps []pathPayload
			for step := 0; step < steps; step++ {
				for inst := 0; inst < instances; inst++ {
					p, err := events.Encode(nil, fleetBatch(inst, step, s), events.EncodingMap)
					if err != nil {
						b.Fatal(err)
					}
					pps = append(pps, pathPayload{inst, uint64(step + 1), p})
				}
			}
			var prefill func(*kvindex.Memory)
			if s.evict {
				prefill = func(idx *kvindex.Memory) { fleetPrefill(b, idx, instances, steps*s.blocks) }
			}
			benchPath(b, instances, pps, s.blocks, prefill, instances*steps*s.blocks)
		})
	}
}

// pathPayload is one engine payload of instance inst with engine seq seq.
type pathPayload struct {
	inst int
	seq  uint64
	data []byte
}

// benchPath runs BenchmarkConsumerPath over payloads pps of blocks stored
// blocks each; prefill fills each op's index first (untimed); the index
// then holds want entries.
func benchPath(b *testing.B, instances int, pps []pathPayload, blocks int, prefill func(*kvindex.Memory), want int) {
	srv := testenv.StartNATS(b)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	const pool = "pp"
	var msgs []*pathMsg
	stored := time.Now()
	for _, pp := range pps {
		name := fmt.Sprintf("e%d", pp.inst)
		subj, _ := kvstream.EventsSubject(pool, name)
		h := kvstream.EventHeaders{Seq: pp.seq, HasSeq: true, Pool: pool, Instance: name}
		md := &jetstream.MsgMetadata{Timestamp: stored, NumPending: 1}
		md.Sequence.Stream = uint64(len(msgs) + 1)
		msgs = append(msgs, &pathMsg{subj: subj, reply: ackReply(md), hdr: h.Header(), data: pp.data, md: md})
	}
	ctx := context.Background()
	var cpu time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m", Capacity: 2 * want})
		if err != nil {
			b.Fatal(err)
		}
		if prefill != nil {
			prefill(idx)
		}
		c, err := New(Config{Conn: nc, Pool: pool, Applier: idx, Shards: 1, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			b.Fatal(err)
		}
		for inst := 0; inst < instances; inst++ {
			in := c.newInst(fmt.Sprintf("e%d", inst), stored)
			in.needLoad = false // loaded: no snapshot in this benchmark
			c.insts[in.status.Instance] = in
		}
		b.StartTimer()
		cpu0 := cputime.Process()
		for _, m := range msgs {
			pathDispatch(ctx, c, m)
			pathDo(ctx, c, <-c.shards[0])
		}
		cpu += cputime.Process() - cpu0
		b.StopTimer()
		if n, _ := idx.Len(ctx); n != want {
			b.Fatalf("index holds %d entries, want %d", n, want)
		}
		b.StartTimer()
	}
	n := float64(b.N) * float64(len(msgs))
	b.ReportMetric(cpu.Seconds()*1e6/n, "cpu-us/msg")
	b.ReportMetric(n*float64(blocks)/cpu.Seconds(), "blocks/cpu-s")
}
