package bridge

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// heldNATS is a bridge whose NATS replies a gate can hold, fed by hand as
// its subscriber would be: what the tests of the buffer's bounds share.
// Its engine is real (a vLLM-format publisher), so a replay finds what
// send published; the bridge is given no replay endpoint unless cfg sets
// it (replay is the engine's).
type heldNATS struct {
	in    *instance
	gate  *testenv.ReplyGate
	pub   *enginezmq.Publisher
	topic string
	all   [][]byte // every payload the engine published, in order
}

func startHeldNATS(t *testing.T, cfg func(c *Config, replay string)) *heldNATS {
	t.Helper()
	ctx := testenv.Context(t, 2*time.Minute)
	ns := testenv.StartNATS(t)
	h := &heldNATS{gate: testenv.StartReplyGate(t, fmt.Sprintf("127.0.0.1:%d", ns.Port))}
	pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{})
	h.pub, h.topic = pub, pcfg.Topic
	h.in = startBridgeCfg(t, func(c *Config) {
		c.Conn = testenv.Connect(t, "nats://"+h.gate.Addr(), nats.MaxReconnects(-1))
		c.Buffer = 1000
		c.PublishWindow, c.PublishTimeout = 1, time.Minute
		cfg(c, pcfg.ReplayEndpoint)
	})
	return h
}

// publish sends p from the engine and returns the message the bridge's
// subscriber would have read.
func (h *heldNATS) publish(t *testing.T, p []byte) enginezmq.Message {
	t.Helper()
	seq, err := h.pub.Publish(p)
	if err != nil {
		t.Fatal(err)
	}
	h.all = append(h.all, p)
	return enginezmq.Message{Topic: h.topic, Seq: seq, Payload: p}
}

// send publishes p and puts it in the bridge's buffer.
func (h *heldNATS) send(t *testing.T, p []byte) {
	t.Helper()
	h.in.enqueue(h.publish(t, p))
}

// holdAfter has m0 published, then holds NATS and has m1 published with
// its ack held (the publish window is one): the buffer is empty, and
// whatever comes next meets it.
func (h *heldNATS) holdAfter(t *testing.T, m0, m1 enginezmq.Message) {
	t.Helper()
	h.in.enqueue(m0)
	waitEngineSeq(t, h.in, m0.Seq)
	h.gate.Hold()
	base := h.in.sent.Load()
	h.in.enqueue(m1)
	testenv.WaitFor(t, 30*time.Second, "the second message published, its ack held", func() bool { return h.in.sent.Load() == base+1 && len(h.in.in) == 0 })
}

// The outage buffer is bounded in bytes as well as in messages: each
// engine message may be up to enginezmq.MaxFrame (64 MiB), so 10,000 of
// them (the count bound) bounded nothing in practice. Here NATS holds its
// acks while the engine sends ten messages; the buffer takes what fits in
// its bytes (three), far below its count (1,000), and the rest are
// dropped as past the count bound: counted, and replayed once NATS
// answers, so the stream ends with everything the engine stored. Before
// the fix the buffer kept all ten.
func TestBufferBoundedByBytes(t *testing.T) {
	// Hashes of one width: every payload is the same size.
	payload := func(i int) []byte { return storeBatch(t, uint64(1000+100*i), 8) }
	size := len(payload(0))
	// The bridge's subscriber reaches no engine: messages are put in its
	// buffer as the subscriber would (the engine's replay still answers).
	reg := prometheus.NewRegistry()
	h := startHeldNATS(t, func(c *Config, replay string) {
		c.Registerer = reg
		c.BufferBytes = 3*size + size/2
		c.Sources[0].ReplayEndpoint = replay
	})
	in, gate := h.in, h.gate
	// NATS stops answering: seq 1 waits for its ack ...
	h.holdAfter(t, h.publish(t, payload(0)), h.publish(t, payload(1)))
	for i := 2; i < 12; i++ { // ... and 2-11 meet the buffer
		h.send(t, payload(i))
	}
	drops := testenv.Metric(t, reg, "kvbridge_drops_total", map[string]string{"reason": "buffer_full"})
	if s := in.stats(); len(in.in) != 3 || s.Dropped != 7 || drops != 7 || in.buffered.Load() != int64(3*size) {
		t.Fatalf("the buffer holds %d messages (%d bytes), %d dropped (%v counted); want 3 (%d bytes, its byte bound %d) and 7",
			len(in.in), in.buffered.Load(), s.Dropped, drops, 3*size, in.b.cfg.BufferBytes)
	}
	gate.Release()
	waitEngineSeq(t, in, 11)
	routed, msgs := readStream(t, in)
	if got, want := routed.Dump(), engineTable(t, h.all...); !reflect.DeepEqual(got, want) {
		t.Fatalf("the stream builds %d blocks; want the engine's %d (stream %+v)", len(got), len(want), msgs)
	}
	if s := in.stats(); s.Replays == 0 || s.Clears != 1 { // the start-up resync's clear only
		t.Fatalf("after the drops: %+v; want them replayed, no clear", s)
	}
	testenv.WaitFor(t, 10*time.Second, "the buffer's bytes all taken off", func() bool { return in.buffered.Load() == 0 })
}

// An empty buffer takes one message whatever its size, as the count bound
// always takes one: a message larger than the byte bound would otherwise
// be dropped every time, and then again from every replay.
func TestBufferTakesOneLargeMessage(t *testing.T) {
	in := startBridgeCfg(t, func(c *Config) { c.BufferBytes = 16 })
	p := storeBatch(t, 1, 64)
	in.enqueue(enginezmq.Message{Topic: "kv", Seq: 1, Payload: p})
	waitEngineSeq(t, in, 1)
	if s := in.stats(); s.Dropped != 0 || s.Blocks != 64 {
		t.Fatalf("a %d-byte message in a 16-byte buffer: %+v; want it published", len(p), s)
	}
}

// A replay is bounded in bytes as in messages (Config.ReplayBytes): the
// bridge holds every reply until the replay ends. A start-up replay past
// the bound fails as one past the message count does: the bridge starts
// empty and counts the failure, where before it took all of it.
func TestReplayBoundedByBytes(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{})
	var all [][]byte
	for i := range 5 {
		p := storeBatch(t, uint64(1000+100*i), 8)
		if _, err := pub.Publish(p); err != nil {
			t.Fatal(err)
		}
		all = append(all, p)
	}
	for _, tc := range []struct {
		max    int
		blocks int
		failed uint64
	}{
		{max: 5 * len(all[0]), blocks: 40},
		{max: 2 * len(all[0]), failed: 1},
	} {
		br, _, _ := runBridgeCfg(t, 0, 16, pcfg.Endpoint, nil, func(c *Config) {
			c.Sources[0].ReplayEndpoint = pcfg.ReplayEndpoint
			c.ReplayBytes = tc.max
		})
		testenv.WaitFor(t, 30*time.Second, "bridge ready", br.Ready)
		if s := br.insts[0].stats(); s.Blocks != tc.blocks || s.ReplayFailures != tc.failed {
			t.Fatalf("a start-up replay of 5 messages, %d bytes, bounded at %d: %+v; want %d blocks, %d replay failures",
				5*len(all[0]), tc.max, s, tc.blocks, tc.failed)
		}
	}
}

// A dropped message that fits both the buffer's and a replay's byte bound
// is replayed whole. catchUp's replay starts at the last message handled,
// to compare it byte for byte, so the dropped message is the replay's
// second reply: enginezmq let only a first reply past ReplayBytes, and
// the previous message with the dropped one passed it. Before the fix
// the replay failed and the instance was cleared (1 replay failure, 2
// clears, the stream building 0 blocks of the engine's 48).
func TestDroppedMessageWithinBoundsReplayed(t *testing.T) {
	small := func(i int) []byte { return storeBatch(t, uint64(1000+100*i), 8) }
	big := storeBatch(t, 50000, 24)
	// The big message fits both bounds alone, not with a small one.
	bound := len(big) + len(small(0))/2
	h := startHeldNATS(t, func(c *Config, replay string) {
		c.BufferBytes, c.ReplayBytes = bound, bound
		c.Sources[0].ReplayEndpoint = replay
	})
	in, gate := h.in, h.gate
	h.holdAfter(t, h.publish(t, small(0)), h.publish(t, small(1))) // seq 1 waits for its ack ...
	h.send(t, small(2))                                            // ... seq 2 is buffered ...
	h.send(t, big)                                                 // ... and seq 3, within both bounds, dropped: the buffer is not empty
	if s := in.stats(); s.Dropped != 1 {
		t.Fatalf("%d dropped; want the big message dropped", s.Dropped)
	}
	gate.Release()
	// catchUp counts its replay, filled or failed (the start-up resync
	// counted one filled).
	testenv.WaitFor(t, 30*time.Second, "the drop caught up", func() bool {
		s := in.stats()
		return s.Replays > 1 || s.ReplayFailures > 0
	})
	if s := in.stats(); s.ReplayFailures != 0 {
		t.Fatalf("the replay of the dropped message failed: %+v; want it filled", s)
	}
	waitEngineSeq(t, in, 3)
	s := in.stats()
	routed, msgs := readStream(t, in)
	if got, want := routed.Dump(), engineTable(t, h.all...); s.ReplayFailures != 0 || s.Clears != 1 || !reflect.DeepEqual(got, want) {
		t.Fatalf("%d replay failures, %d clears; the stream builds %d blocks, the engine holds %d (stream %+v); want no failure, the resync's clear only, equal tables",
			s.ReplayFailures, s.Clears, len(got), len(want), msgs)
	}
}

// A message kept while others are dropped has a payload of its own. The
// dialing subscriber carves payloads from shared 1 MiB chunks, so a kept
// payload carved beside dropped ones kept their chunk alive: --buffer-bytes
// bounded the bytes counted, not the heap (40 kept 50 KB messages held
// 41.9 MB). Here messages read by a real subscriber meet a buffer behind
// a held NATS: seq 2 is kept (no drop yet: not copied), seq 3 dropped,
// seq 4, carved right after it, kept. Before the fix seq 4's payload in
// the buffer was the subscriber's, in the chunk it shares with seq 3.
func TestKeptAmongDropsOwnsPayload(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	small := func(i int) []byte { return storeBatch(t, uint64(1000+100*i), 8) }
	ps := [][]byte{small(0), small(1), small(2), storeBatch(t, 50000, 24), small(4)}
	pub := eventstest.NewStreamPUB(t, "kv", ps)
	sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: pub.Endpoint(), Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	read := make(chan enginezmq.Message, len(ps))
	testenv.Go(t, ctx, func(ctx context.Context) error { return sub.Run(ctx, func(m enginezmq.Message) { read <- m }) })
	if err := pub.Accept(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	if err := pub.Send(0, uint64(len(ps))); err != nil {
		t.Fatal(err)
	}
	var ms []enginezmq.Message
	for range ps {
		select {
		case m := <-read:
			ms = append(ms, m)
		case <-ctx.Done():
			t.Fatalf("%d of %d messages read", len(ms), len(ps))
		}
	}
	if _, ok := enginezmq.JoinPayloads(ms[3:]); !ok {
		t.Fatal("seqs 3 and 4 were not carved one after the other from a chunk: the test shows nothing")
	}
	// The messages are put in the buffer as the bridge's subscriber would;
	// it holds two small ones in bytes, not a small and the big one.
	h := startHeldNATS(t, func(c *Config, _ string) { c.BufferBytes = 2*len(ps[0]) + len(ps[0])/2 })
	in := h.in
	h.holdAfter(t, ms[0], ms[1])
	for _, m := range ms[2:] {
		in.enqueue(m)
	}
	// The processor waits for seq 1's ack: the buffer is the test's to
	// look into, and is put back as it was.
	var kept []enginezmq.Message
	for len(in.in) > 0 {
		kept = append(kept, <-in.in)
	}
	for _, m := range kept {
		in.in <- m
	}
	if s := in.stats(); s.Dropped != 1 || len(kept) != 2 || kept[0].Seq != 2 || kept[1].Seq != 4 {
		t.Fatalf("%d dropped, buffer %+v; want seq 3 dropped, 2 and 4 kept", s.Dropped, kept)
	}
	if &kept[0].Payload[0] != &ms[2].Payload[0] {
		t.Error("seq 2, kept before any drop, was copied")
	}
	if &kept[1].Payload[0] == &ms[4].Payload[0] || !bytes.Equal(kept[1].Payload, ps[4]) {
		t.Error("seq 4, kept after seq 3 was dropped, still holds the subscriber's chunk")
	}
	if _, ok := enginezmq.JoinPayloads([]enginezmq.Message{ms[3], kept[1]}); ok {
		t.Error("seq 4's kept message still reads as carved from seq 3's chunk")
	}
}

// The drop warning says what becomes of the dropped messages: replayed
// once the buffer drains, or, with no replay endpoint (catchUp has
// nothing to replay from), the instance cleared at the engine's next
// message. Before, it said "replayed once the buffer drains" either way.
func TestDropWarningSaysWhatFollows(t *testing.T) {
	for _, tc := range []struct {
		name   string
		replay bool
		want   string
	}{
		{"replay", true, "replayed once the buffer drains"},
		{"no-replay", false, "no replay endpoint, so the instance is cleared at the engine's next message"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			payload := func(i int) []byte { return storeBatch(t, uint64(1000+100*i), 8) }
			size := len(payload(0))
			var logs lockedBuffer
			h := startHeldNATS(t, func(c *Config, replay string) {
				c.BufferBytes = size + size/2
				c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
				if tc.replay {
					c.Sources[0].ReplayEndpoint = replay
				}
			})
			in := h.in
			t.Cleanup(h.gate.Release)
			h.holdAfter(t, h.publish(t, payload(0)), h.publish(t, payload(1)))
			h.send(t, payload(2)) // kept
			h.send(t, payload(3)) // dropped
			out := logs.String()
			if s := in.stats(); s.Dropped != 1 || !strings.Contains(out, "buffer full") || !strings.Contains(out, tc.want) {
				t.Fatalf("%d dropped; want 1, and a warning saying %q:\n%s", s.Dropped, tc.want, out)
			}
		})
	}
}
