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
	ctx := testenv.Context(t, 10*time.Minute)
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
	testenv.Go(t, ctx, br.Run)
	if accept != nil {
		accept()
	}
	return br, nc, "EV_" + name
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
