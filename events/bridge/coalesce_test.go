package bridge

import (
	"bytes"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// TestCoalescedAppliedWhole: what a snapshot or heartbeat reads (the
// engine seq, the stream seq and the table, under the instance's lock)
// never shows part of a coalesced message: for every stream sequence
// read, the engine seq beside it is that message's last. A snapshot that
// paired a coalesced message's stream sequence with one of its earlier
// batches would make a consumer that loads it skip the later batches.
// Read concurrently with a backlog of the captured vLLM batches joined
// 64 to a message.
func TestCoalescedAppliedWhole(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	const n = 20000
	in := startBridge(t, DefaultCoalesce, n+16)
	for i := 0; i < n; i++ {
		in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: ps[i%len(ps)]})
	}
	engineAt := map[uint64]uint64{} // stream seq → engine seq read beside it
	reads := 0
	deadline := time.Now().Add(time.Minute)
	for {
		s := in.stats()
		if s.HasSeq {
			reads++
			if e, ok := engineAt[s.StreamSeq]; ok && e != s.EngineSeq {
				t.Fatalf("stream seq %d read with engine seq %d and %d: part of a coalesced message was visible", s.StreamSeq, e, s.EngineSeq)
			}
			engineAt[s.StreamSeq] = s.EngineSeq
			if s.EngineSeq == n {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("stuck at %+v", s)
		}
	}
	if s := in.stats(); s.Coalesced == 0 || s.Dropped != 0 {
		t.Fatalf("nothing coalesced, or drops: %+v", s)
	}
	t.Logf("%d reads over %d stream sequences", reads, len(engineAt))
}

// startBridge runs a bridge with one instance on an embedded NATS server,
// coalescing up to coalesce engine messages, with an input buffer of
// buffer; its engine endpoint answers nothing (messages are put in the
// instance's buffer as its subscriber would), and it is not probed.
func startBridge(t testing.TB, coalesce, buffer int) *instance {
	br, _, _ := runBridge(t, coalesce, buffer, fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)), nil)
	testenv.WaitFor(t, 20*time.Second, "bridge ready", br.Ready)
	return br.insts[0]
}

// runBridge runs a bridge as startBridge describes, its engine at
// endpoint; it returns the bridge, its NATS connection and its stream's
// name. accept, if set, runs once the bridge is running (an engine
// taking the subscriber's connection).
func runBridge(t testing.TB, coalesce, buffer int, endpoint string, accept func()) (*Bridge, *nats.Conn, string) {
	return runBridgeCfg(t, coalesce, buffer, endpoint, accept, nil)
}

// runBridgeCfg is runBridge with the configuration changed by set (nil:
// as it is) before the bridge is made.
func runBridgeCfg(t testing.TB, coalesce, buffer int, endpoint string, accept func(), set func(*Config)) (*Bridge, *nats.Conn, string) {
	br := newBridgeCfg(t, coalesce, buffer, endpoint, set)
	testenv.Go(t, testenv.Context(t, 10*time.Minute), br.Run)
	if accept != nil {
		accept()
	}
	return br, br.cfg.Conn, br.cfg.Stream.Name
}

// newBridgeCfg makes the bridge runBridgeCfg runs, not yet running.
func newBridgeCfg(t testing.TB, coalesce, buffer int, endpoint string, set func(*Config)) *Bridge {
	nc := testenv.Connect(t, testenv.StartNATS(t).URL())
	name := testenv.UniqueName(t)
	cfg := Config{Pool: "p", Conn: nc, Coalesce: coalesce, Buffer: buffer,
		Stream:              kvstream.StreamConfig{Name: "EV_" + name},
		Bucket:              kvstream.BucketConfig{Name: "SN_" + name},
		Sources:             []Source{{Instance: "i0", Endpoint: endpoint}},
		EngineProbeInterval: -1, SnapshotInterval: time.Hour, Logger: slog.New(slog.DiscardHandler)}
	if set != nil {
		set(&cfg)
	}
	br, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return br
}

// TestCoalescedFromSubscriber: engine messages read by the dialing
// subscriber from a ZMTP stream (vLLM's captured bytes) and joined 64 to a
// NATS message (their payloads a slice over the subscriber's chunk, not a
// copy: enginezmq.JoinPayloads) reach the stream byte for byte: every
// message's payload is its batches' engine payloads in seq order, every
// engine seq once, in order.
func TestCoalescedFromSubscriber(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	const n = 5000
	pub := eventstest.NewStreamPUB(t, "kv@127.0.0.1:8000@m", ps)
	br, nc, stream := runBridge(t, DefaultCoalesce, n+16, pub.Endpoint(), func() {
		if err := pub.Accept(30 * time.Second); err != nil {
			t.Fatal(err)
		}
	})
	testenv.WaitFor(t, 20*time.Second, "bridge ready", br.Ready)
	base := br.insts[0].stats().Published
	if err := pub.Send(0, n); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, time.Minute, "every engine message published", func() bool {
		return br.insts[0].stats().Published-base >= n
	})
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Context(t, time.Minute)
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	next, coalesced := uint64(0), 0
	for next < n {
		m, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
		if err != nil {
			t.Fatalf("after engine seq %d: %v", next, err)
		}
		h, err := kvstream.ParseEventHeaders(m.Headers())
		if err != nil {
			t.Fatal(err)
		}
		if !h.HasSeq || h.Synthetic != "" {
			continue // the bridge's own (its start-up resync)
		}
		if h.Seq != next {
			t.Fatalf("message starts at engine seq %d, want %d", h.Seq, next)
		}
		k := max(h.Batches, 1)
		var want []byte
		for i := range k {
			want = append(want, ps[(h.Seq+uint64(i))%uint64(len(ps))]...)
		}
		if !bytes.Equal(m.Data(), want) {
			t.Fatalf("message of engine seqs %d..%d: payload differs from its batches'", h.Seq, h.Seq+uint64(k)-1)
		}
		if k > 1 {
			coalesced++
		}
		next += uint64(k)
	}
	if coalesced == 0 {
		t.Fatal("nothing coalesced")
	}
	t.Logf("%d engine messages in %d coalesced NATS messages and others", n, coalesced)
}

// Engine seqs that wrap (..., 2⁶⁴-1, 0, 1) follow on for the bridge
// (enginezmq.SeqTracker), but a coalesced message's seqs must increase:
// kvstream.ParseEventHeaders refuses a last seq below the first. Joined
// across the wrap (before the fix), the message was unreadable for every
// consumer, its batches lost to the index; a group now ends at the wrap.
func TestCoalesceEndsAtSeqWrap(t *testing.T) {
	br := newBridgeCfg(t, DefaultCoalesce, 16, fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)), nil)
	in := br.insts[0]
	seqs := []uint64{^uint64(0) - 2, ^uint64(0) - 1, ^uint64(0), 0, 1, 2}
	// Queued before the bridge runs: handled back to back, so joined.
	for i, s := range seqs {
		in.enqueue(enginezmq.Message{Topic: "kv", Seq: s, Payload: storeBatch(t, uint64(1+10*i), 2)})
	}
	testenv.Go(t, testenv.Context(t, 10*time.Minute), br.Run)
	waitEngineSeq(t, in, 2)
	tab, _ := readStream(t, in) // fails on a header no consumer can read
	if tab.Len() != 2*len(seqs) {
		t.Fatalf("the stream builds %d blocks, want %d", tab.Len(), 2*len(seqs))
	}
	if s := in.stats(); s.Coalesced == 0 {
		t.Fatalf("nothing coalesced (%+v): the test does not reach the wrap", s)
	}
}
