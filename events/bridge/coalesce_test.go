package bridge

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

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
	ctx := testenv.Context(t, 10*time.Minute)
	nc := testenv.Connect(t, testenv.StartNATS(t).URL())
	name := testenv.UniqueName(t)
	br, err := New(Config{Pool: "p", Conn: nc, Coalesce: coalesce, Buffer: buffer,
		Stream:              kvstream.StreamConfig{Name: "EV_" + name},
		Bucket:              kvstream.BucketConfig{Name: "SN_" + name},
		Sources:             []Source{{Instance: "i0", Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))}},
		EngineProbeInterval: -1, SnapshotInterval: time.Hour, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, ctx, br.Run)
	testenv.WaitFor(t, 20*time.Second, "bridge ready", br.Ready)
	return br.insts[0]
}
