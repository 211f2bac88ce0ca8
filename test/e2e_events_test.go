package test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// ZMQ publisher → kvbridge → JetStream → consumer → index: stores appear,
// then the engine's removals take them away again.
func TestE2EStoresThenRemovals(t *testing.T) {
	for _, file := range []string{"array.jsonl", "map.jsonl"} {
		t.Run(file, func(t *testing.T) {
			ps := eventstest.CapturedPayloads(t, file)
			r := newRig(t, rigOpts{})
			c, a, _ := r.startConsumer(consumer.Config{})

			r.publish(ps[0]) // seq 1: four chains stored
			first := reference(t, ps[0])
			if len(first) != 35 {
				t.Fatalf("capture seq 1 stores %d blocks, want 12+7+10+6 = 35", len(first))
			}
			waitTable(t, a, r.instance, first)

			r.publish(ps[1:23]...) // fills that evict, seq 2..23
			want := reference(t, ps[:23]...)
			waitTable(t, a, r.instance, want)
			gone := 0
			for h := range first {
				if _, ok := want[h]; !ok {
					gone++
				}
			}
			if gone == 0 {
				t.Fatal("the capture's removals removed none of the first blocks")
			}

			r.publish(ps[23:]...) // AllBlocksCleared, then 3 blocks
			waitTable(t, a, r.instance, reference(t, ps...))

			s := r.stats()
			if s.Gaps != 0 || s.ReplayFailures != 0 || s.Malformed != 0 || s.Dropped != 0 {
				t.Fatalf("bridge stats %+v", s)
			}
			st := c.Instances()
			if len(st) != 1 || st[0].Instance != r.instance || st[0].State != consumer.StateLive || st[0].LastSeq != uint64(len(ps)) {
				t.Fatalf("consumer instances %+v", st)
			}
			testenv.WaitFor(t, 5*time.Second, "a heartbeat", func() bool {
				hb := c.Instances()[0].Heartbeat
				return hb != nil && hb.URL == "http://127.0.0.1:18000" && hb.BlockSize == 16 && hb.Model == "fake-model"
			})
		})
	}
}

// NATS restarts in the middle of the stream: the bridge buffers and
// retries, the consumer recovers, nothing is lost.
func TestE2ENATSRestart(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	r := newRig(t, rigOpts{})
	_, a, _ := r.startConsumer(consumer.Config{})
	r.publish(ps[:10]...)
	waitTable(t, a, r.instance, reference(t, ps[:10]...))

	r.ns.Shutdown()
	r.ns.WaitForShutdown()
	r.publish(ps[10:18]...) // while NATS is down
	time.Sleep(300 * time.Millisecond)
	r.ns = r.ns.Restart(t)
	r.publish(ps[18:]...)

	waitTable(t, a, r.instance, reference(t, ps...))
	if s := r.stats(); s.Clears != 1 || s.Gaps != 0 || s.Dropped != 0 {
		t.Fatalf("bridge stats %+v: want only the start-up resync clear", s)
	}
}

// A NATS outage longer than the bridge's buffer: the overflow is dropped
// and counted, and the hole is filled from the engine's replay once NATS
// is back, so the index still ends equal to the engine.
func TestE2EOutageBufferOverflow(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	r := newRig(t, rigOpts{buffer: 2})
	_, a, _ := r.startConsumer(consumer.Config{})
	r.publish(ps[:5]...) // with a buffer of 2, some are dropped already
	waitTable(t, a, r.instance, reference(t, ps[:5]...))

	r.ns.Shutdown()
	r.ns.WaitForShutdown()
	r.publish(ps[5:20]...)
	testenv.WaitFor(t, 10*time.Second, "drops", func() bool { return r.stats().Dropped > 0 })
	r.ns = r.ns.Restart(t)
	r.publish(ps[20:]...)

	waitTable(t, a, r.instance, reference(t, ps...))
	if s := r.stats(); s.Gaps == 0 || s.ReplayFailures != 0 || s.Clears != 1 {
		t.Fatalf("bridge stats %+v: want gaps from the drops, all replayed, no clear but the start-up one", s)
	}
}

// The PUB socket drops batches: the bridge sees the gap and fills it from
// the engine's replay socket.
func TestE2EGapFilledFromReplay(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "map.jsonl")
	r := newRig(t, rigOpts{})
	c, a, _ := r.startConsumer(consumer.Config{})
	r.publish(ps[:5]...)
	r.pub.Skip(ps[5]) // dropped on the way, still in the replay buffer
	r.pub.Skip(ps[6])
	r.publish(ps[7:15]...)
	r.pub.Skip(ps[15])
	r.publish(ps[16:]...)

	waitTable(t, a, r.instance, reference(t, ps...))
	s := r.stats()
	if s.Gaps != 2 || s.ReplayFailures != 0 || s.Clears != 1 {
		t.Fatalf("bridge stats %+v: want 2 gaps, both replayed, only the start-up clear", s)
	}
	if st := c.Instances(); st[0].Gaps != 0 {
		t.Fatalf("consumer saw gaps %d: the bridge should have filled them", st[0].Gaps)
	}
}

// Replay unavailable: the bridge cannot vouch for the instance, so it
// publishes a clear; the index holds only what came after.
func TestE2EReplayUnavailable(t *testing.T) {
	for _, mode := range []string{"no replay socket", "replay buffer too short"} {
		t.Run(mode, func(t *testing.T) {
			ps := eventstest.CapturedPayloads(t, "array.jsonl")
			r := newRig(t, rigOpts{noReplay: mode == "no replay socket"})
			c, a, _ := r.startConsumer(consumer.Config{})
			r.publish(ps[:10]...)
			waitTable(t, a, r.instance, reference(t, ps[:10]...))
			r.pub.Skip(ps[10])
			r.pub.ForgetReplay()
			r.publish(ps[11:]...)

			want := reference(t, ps[11:]...) // a clear, then what followed the gap
			waitTable(t, a, r.instance, want)
			s := r.stats()
			if s.Gaps != 1 || s.ReplayFailures < 1 || s.Clears != 2 {
				t.Fatalf("bridge stats %+v: want 1 gap, failed replay, resync + gap clear", s)
			}
			// The consumer loaded the snapshot after the start-up clear, so
			// it sees only the gap's clear.
			testenv.WaitFor(t, 5*time.Second, "consumer counts the clear", func() bool { return c.Instances()[0].Clears == 1 })
		})
	}
}

// The engine restarts (seq back to 1), or a new publisher takes its place
// (another topic: the engine came back on another pod IP) whose seq happens
// to continue the old one's: either way the bridge clears the instance
// first, then the new engine's blocks are rebuilt.
func TestE2EEngineRestart(t *testing.T) {
	for _, tc := range []struct {
		name     string
		topic    string
		firstSeq uint64
	}{
		{"restart", rigTopic, 1},
		{"new publisher", "kv@127.0.0.2:18000@fake-model", 13},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps := eventstest.CapturedPayloads(t, "array.jsonl")
			r := newRig(t, rigOpts{})
			_, a, _ := r.startConsumer(consumer.Config{})
			r.publish(ps[:12]...)
			waitTable(t, a, r.instance, reference(t, ps[:12]...))

			_ = r.pub.Close()
			r.startEngine(tc.topic, tc.firstSeq)
			testenv.WaitFor(t, 20*time.Second, "bridge reconnected", r.pub.Subscribed)
			r.publish(ps[:4]...)
			waitTable(t, a, r.instance, reference(t, ps[:4]...))
			if s := r.stats(); s.Clears != 2 || s.Gaps != 0 {
				t.Fatalf("bridge stats %+v: want the start-up clear and the %s's", s, tc.name)
			}
		})
	}
}

// A router that starts late (the stream keeps only 4 messages) rebuilds
// from the bridge's snapshot and the stream after it, equal to a router
// that never stopped, including blocks far older than the stream holds;
// with the bridge down, from the bucket's snapshot.
func TestE2ERouterRestart(t *testing.T) {
	for _, mode := range []string{"inline", "object_store"} {
		t.Run(mode, func(t *testing.T) {
			inline := 0
			if mode == "object_store" {
				inline = 256 // every snapshot goes through the object store
			}
			testRouterRestart(t, inline)
		})
	}
}

func testRouterRestart(t *testing.T, inline int) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	r := newRig(t, rigOpts{maxMsgs: 4, snapInterval: 50 * time.Millisecond, inlineMax: inline})
	c, steady, _ := r.startConsumer(consumer.Config{})
	r.publishFollowed(c, ps[:23]...) // leave out the capture's final clear
	want := reference(t, ps[:23]...)
	waitTable(t, steady, r.instance, want)
	r.waitPublished(23)

	// The stream alone cannot rebuild it: it holds the last 4 messages.
	js, err := jetstream.New(r.conn())
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(r.ctx, r.stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(r.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 4 || info.State.FirstSeq < 20 {
		t.Fatalf("stream holds %d messages from seq %d; want the last 4", info.State.Msgs, info.State.FirstSeq)
	}
	if len(reference(t, ps[19:23]...)) >= len(want) {
		t.Fatal("the retained messages alone would rebuild the table; the test proves nothing")
	}

	// From the bridge (request-reply).
	c1, fromBridge, _ := r.startConsumer(consumer.Config{})
	waitTable(t, fromBridge, r.instance, want)
	// The load applies the snapshot's blocks before it records its
	// position: wait for the record too.
	testenv.WaitFor(t, 10*time.Second, "the consumer's status shows the snapshot it loaded", func() bool {
		st := c1.Instances()
		return len(st) == 1 && st[0].SnapshotSeq != 0
	})

	// From the bucket, with the bridge gone.
	time.Sleep(200 * time.Millisecond) // a periodic snapshot store
	r.stopBridge()
	_, fromBucket, _ := r.startConsumer(consumer.Config{})
	waitTable(t, fromBucket, r.instance, want)

	// And both keep up with new events like the steady one.
	r.startBridge(rigOpts{snapInterval: 50 * time.Millisecond, inlineMax: inline})
	r.publish(ps[23:]...)
	all := reference(t, ps...)
	for _, a := range []*tableApplier{steady, fromBridge, fromBucket} {
		waitTable(t, a, r.instance, all)
	}
}

// Malformed payloads and unknown event types in the stream are counted and
// skipped; the rest of the batch, and later batches, apply.
func TestE2EMalformedAndUnknown(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	r := newRig(t, rigOpts{})
	c, a, _ := r.startConsumer(consumer.Config{})
	r.publish(ps[0])
	waitTable(t, a, r.instance, reference(t, ps[0]))

	// Through the bridge: the engine sends bytes that are not a batch.
	r.publish([]byte{0xc1, 0x00, 0xff})
	// Straight into the stream: garbage, and a batch whose first event is
	// of a type no engine sends yet.
	nc := r.conn()
	subj, _ := kvstream.EventsSubject(r.pool, r.instance)
	unknown := unknownThenStored(t)
	for _, p := range [][]byte{[]byte("not msgpack"), unknown} {
		if err := nc.Publish(subj, p); err != nil {
			t.Fatal(err)
		}
	}
	r.publish(ps[1])

	want := reference(t, ps[0], unknown, ps[1])
	waitTable(t, a, r.instance, want)
	testenv.WaitFor(t, 5*time.Second, "counters", func() bool {
		st := c.Instances()[0]
		return st.Malformed == 2 && st.Unknown == 1
	})
	if s := r.stats(); s.Malformed != 1 {
		t.Fatalf("bridge malformed = %d, want 1", s.Malformed)
	}
}

// TestE2EUnreadableRemovalClears: a batch whose BlockRemoved the codec
// cannot read (its medium an integer) names blocks the engine dropped that
// no index can be told of; the bridge publishes it and then clears the
// instance, as after a gap it cannot fill, so neither its table nor the
// router's index keeps them as fresh. The engine's next stores count again.
func TestE2EUnreadableRemovalClears(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	r := newRig(t, rigOpts{})
	_, a, _ := r.startConsumer(consumer.Config{})
	r.publish(ps[0])
	want := reference(t, ps[0])
	waitTable(t, a, r.instance, want)
	clears := r.stats().Clears // the bridge's own start-up clear, if any
	var h uint64
	for k := range want {
		h = k
		break
	}
	bad := eventstest.UnreadableRemoval(t, h)
	r.publish(bad)
	waitTable(t, a, r.instance, map[uint64]bridge.Placement{})
	if s := r.stats(); s.Clears != clears+1 {
		t.Fatalf("bridge clears = %d, want %d", s.Clears, clears+1)
	}
	r.publish(ps[1])
	waitTable(t, a, r.instance, reference(t, ps[1]))
}

// unknownThenStored is a batch [ts, [["FutureEvent", 1], BlockStored], 0].
func unknownThenStored(t testing.TB) []byte {
	t.Helper()
	stored, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{{
		Kind: events.BlockStored, BlockHashes: []uint64{0xabc}, TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}},
		events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	b, err := events.Decode(stored)
	if err != nil || len(b.Events) != 1 {
		t.Fatalf("decode: %v", err)
	}
	// Splice the unknown event in front: the envelope is fixarray(3),
	// float64 ts (9 bytes), fixarray(1) events, ...
	if stored[0] != 0x93 || stored[1] != 0xcb || stored[10] != 0x91 {
		t.Fatalf("unexpected envelope %x", stored[:12])
	}
	out := append([]byte{}, stored[:10]...)
	out = append(out, 0x92)       // two events
	out = append(out, 0x92, 0xab) // ["FutureEvent", 1]
	out = append(out, "FutureEvent"...)
	out = append(out, 0x01)
	out = append(out, stored[11:]...)
	return out
}

// kvbridge restarts while the engine keeps publishing: the new bridge
// recovers its table from the bucket's snapshot plus the engine's replay
// from the snapshot's seq; if the replay no longer reaches back, it starts
// empty and clears the instance.
func TestE2EBridgeRestart(t *testing.T) {
	for _, replayKept := range []bool{true, false} {
		t.Run(map[bool]string{true: "replay_kept", false: "replay_lost"}[replayKept], func(t *testing.T) {
			ps := eventstest.CapturedPayloads(t, "array.jsonl")
			o := rigOpts{snapInterval: 20 * time.Millisecond}
			r := newRig(t, o)
			c, a, _ := r.startConsumer(consumer.Config{})
			r.publish(ps[:10]...)
			waitTable(t, a, r.instance, reference(t, ps[:10]...))
			time.Sleep(100 * time.Millisecond) // a periodic snapshot store
			r.stopBridge()

			r.publish(ps[10:16]...) // nobody listening
			if !replayKept {
				r.pub.ForgetReplay()
			}
			r.startBridge(o)
			r.publish(ps[16:20]...)

			want := reference(t, ps[:20]...)
			if !replayKept {
				want = reference(t, ps[16:20]...) // cleared, then what came after
			}
			waitTable(t, a, r.instance, want)
			s := r.stats()
			if replayKept {
				// The bridge's table takes a batch when its publish is
				// acked, which can come after the router applied it.
				testenv.WaitFor(t, 10*time.Second, "the bridge's table equal to the engine's", func() bool {
					s = r.stats()
					return s.Blocks == len(want)
				})
				if s.ReplayFailures != 0 {
					t.Fatalf("bridge stats %+v", s)
				}
			}
			// Two failures: the start-up replay, and the engine's
			// history before the first message heard.
			if !replayKept && s.ReplayFailures != 2 {
				t.Fatalf("bridge stats %+v: want the failed start-up replay and history replay", s)
			}
			if st := c.Instances()[0]; st.Gaps != 0 {
				t.Fatalf("consumer saw gaps: %+v", st)
			}
		})
	}
}

// TestE2ESnapshotStoresBesideHeartbeats: periodic stores through the object
// store (chunked) succeed under their deadline, are measured, and run beside
// the heartbeats rather than in their way: heartbeats keep their interval
// while a store due every 30 ms runs back to back.
func TestE2ESnapshotStoresBesideHeartbeats(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	reg := prometheus.NewRegistry()
	r := newRig(t, rigOpts{snapInterval: 30 * time.Millisecond, inlineMax: 256, reg: reg})
	nc := r.conn()
	beats := make(chan time.Time, 1024)
	sub, err := nc.Subscribe(kvstream.SubjectInstances+"."+r.pool+"."+r.instance, func(*nats.Msg) {
		select {
		case beats <- time.Now():
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	r.publish(ps[:23]...)
	r.waitPublished(23)
	stores := func(result string) float64 {
		return testenv.Metric(t, reg, "kvbridge_snapshots_total", map[string]string{"kind": "store", "result": result})
	}
	// A store is skipped while the stream has not moved since the last
	// one, and the bridge publishes the 23 messages faster than one
	// snapshot interval: keep it moving, a message per interval.
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; stores("ok") < 3; i++ {
		if time.Now().After(deadline) {
			t.Fatalf("%v periodic stores in 20 s, want 3", stores("ok"))
		}
		r.publish(ps[i%23])
		time.Sleep(30 * time.Millisecond)
	}
	if n := stores("error"); n != 0 {
		t.Fatalf("%v snapshot stores failed", n)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var timed uint64
	var size float64
	for _, f := range fams {
		switch f.GetName() {
		case "kvbridge_snapshot_store_seconds":
			timed = f.GetMetric()[0].GetHistogram().GetSampleCount()
		case "kvbridge_snapshot_bytes":
			size = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if timed == 0 || size <= 256 {
		t.Fatalf("stores timed %d, last snapshot %v bytes: want both measured (over the 256-byte inline limit)", timed, size)
	}
	// Heartbeats every 100 ms; a gap of 2 s would mean a store held them up.
	first := <-beats
	prev, n := first, 0
	for n < 10 {
		select {
		case b := <-beats:
			if gap := b.Sub(prev); gap > 2*time.Second {
				t.Fatalf("heartbeat gap %v while stores ran", gap)
			}
			prev, n = b, n+1
		case <-time.After(5 * time.Second):
			t.Fatalf("no heartbeat for 5 s after %d", n)
		}
	}
}

// oversizeMessages is an engine message over the NATS server's max
// payload (a step storing 25,000 blocks, 1.7 MB against the default
// 1 MiB), then one storing two blocks chained onto its last.
func oversizeMessages(t *testing.T) [][]byte {
	t.Helper()
	big := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU"}
	for i := range 25000 {
		big.BlockHashes = append(big.BlockHashes, 0x7000_0000+uint64(i))
		for k := range 16 {
			big.TokenIDs = append(big.TokenIDs, uint32(i*16+k)%150000+1)
		}
	}
	after := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", BlockHashes: []uint64{0x7100_0000, 0x7100_0001},
		ParentHash: big.BlockHashes[len(big.BlockHashes)-1], HasParent: true, TokenIDs: make([]uint32, 32)}
	var sent [][]byte
	for _, evs := range [][]events.Event{{big}, {after}} {
		p, err := events.Encode(nil, events.Batch{TS: 1, Events: evs}, events.EncodingArray)
		if err != nil {
			t.Fatal(err)
		}
		sent = append(sent, p)
	}
	return sent
}

// An engine message over the NATS server's max payload (a step storing
// 25,000 blocks, 1.7 MB against the default 1 MiB) between captured vLLM
// batches, and a store chained onto its blocks after it, as the engine on
// the real binaries sent (docs/BENCHMARKS.md §3, sessions 18 and 19): the
// bridge folds it into its table and publishes a resync, so the router's
// index ends with exactly the engine's blocks, the messages after it
// applied in order (the consumer at the last engine seq, no gap). Sent
// live; lost on the PUB socket and filled from the replay; and live with
// the message after it lost, so that the gap's fill checks the oversize
// message's hash against the engine's replay (a mismatch would clear the
// instance as restarted and resync it again). A router started
// afterwards, from the snapshot and the stream, holds the same.
func TestE2EOversizeEngineMessage(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	sent := oversizeMessages(t)
	all := append([][]byte{ps[0]}, sent...)
	all = append(all, ps[1:10]...)
	for _, tc := range []struct {
		name string
		lost int // index in all of a message lost on the PUB socket (0: none)
		gaps uint64
	}{{"live", 0, 0}, {"replayed", 1, 1}, {"next replayed", 2, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{})
			c, a, _ := r.startConsumer(consumer.Config{})
			if int64(len(sent[0])) <= r.conn().MaxPayload() {
				t.Fatalf("message of %d bytes is within the max payload", len(sent[0]))
			}
			for i, p := range all {
				if tc.lost != 0 && i == tc.lost {
					r.pub.Skip(p) // dropped on the way, still in the replay buffer
					continue
				}
				r.publish(p)
			}
			want := reference(t, all...)
			waitTable(t, a, r.instance, want)
			st := c.Instances()[0]
			if st.LastSeq != uint64(len(all)) || st.Gaps != 0 {
				t.Fatalf("consumer at engine seq %d with %d gaps, want %d and none", st.LastSeq, st.Gaps, len(all))
			}
			s := r.stats()
			if s.Dropped != 0 || s.OversizeResyncs != 1 || s.Clears != 2 || s.Gaps != tc.gaps || s.ReplayFailures != 0 || s.Blocks != len(want) {
				t.Fatalf("bridge stats %+v: want no drop, one oversize resync, two resync clears (start-up and it), %d gaps replayed, the engine's %d blocks",
					s, tc.gaps, len(want))
			}
			_, a2, _ := r.startConsumer(consumer.Config{})
			waitTable(t, a2, r.instance, want)
			t.Logf("message of %d bytes; engine %d blocks, index %d", len(sent[0]), len(want), len(a.dump(r.instance)))
		})
	}
}
