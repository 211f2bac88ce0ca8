package bridge

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A bridge that starts behind an engine rebuilds its table from the
// engine's replay buffer. A replayed message with a removal it cannot
// read names blocks the engine dropped: live, such a message clears the
// instance after it (publishEngine), so that neither the table nor any
// index keeps them as fresh. The start-up replay folded it in without the
// clear: the table, and the resync every router loads, kept the dropped
// block (before the fix: 3 blocks where the engine holds 2, and the
// removed one among them).
func TestResyncReplayUnreadableRemovalClears(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{})
	stored := storeBatch(t, 1, 3)
	for _, p := range [][]byte{stored, eventstest.UnreadableRemoval(t, 3)} {
		if _, err := pub.Publish(p); err != nil {
			t.Fatal(err)
		}
	}
	br, _, _ := runBridgeCfg(t, 0, 16, pcfg.Endpoint, nil, func(c *Config) {
		c.Sources[0].ReplayEndpoint = pcfg.ReplayEndpoint
	})
	testenv.WaitFor(t, 30*time.Second, "bridge ready", br.Ready)
	in := br.insts[0]
	in.mu.Lock()
	got := in.table.Dump()
	in.mu.Unlock()
	if _, ok := got[3]; ok || len(got) != 0 {
		t.Fatalf("after the start-up replay the table holds %d blocks (block 3 the engine dropped: %v); want none, as live", len(got), ok)
	}
	routed, _ := readStream(t, in)
	if n := routed.Len(); n != 0 {
		t.Fatalf("the stream builds %d blocks; want none", n)
	}
	// The engine's next stores count again, after the replayed seqs.
	next := storeBatch(t, 100, 2)
	if _, err := pub.Publish(next); err != nil {
		t.Fatal(err)
	}
	waitEngineSeq(t, in, 2)
	routed, _ = readStream(t, in)
	if n := routed.Len(); n != 2 {
		t.Fatalf("after the next message the stream builds %d blocks; want 2", n)
	}
}

// A snapshot served to a request is taken, then put in the object store
// (when over InlineSnapshotMax); a periodic store may take and put a
// newer one meanwhile. The request's put landing after the store's
// replaced the object the bucket's pointer names with an older snapshot,
// which kvstream.ResolveSnapshot refuses (older than the pointer); with
// the engine quiet no store rewrote it (nothing new to store), so a
// restarted bridge found no usable snapshot and started empty, and
// routers could not load the instance from the bucket. Before the fix
// (one object name for both): loadSnapshot returned nil.
func TestServedSnapshotKeepsBucketObject(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	in := startBridgeCfg(t, func(c *Config) { c.InlineSnapshotMax = 1 }) // every snapshot an object
	in.enqueue(enginezmq.Message{Topic: "kv", Seq: 1, Payload: storeBatch(t, 1, 3)})
	waitEngineSeq(t, in, 1)
	served, err := in.snapshot() // a request's, taken now ...
	if err != nil {
		t.Fatal(err)
	}
	in.enqueue(enginezmq.Message{Topic: "kv", Seq: 2, Payload: storeBatch(t, 100, 2)})
	waitEngineSeq(t, in, 2)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	in.storeSnapshot(sctx) // ... a store of a newer one ...
	cancel()
	data, err := in.marshalServed(ctx, served) // ... and the request's put after it
	if err != nil {
		t.Fatal(err)
	}
	snap := in.loadSnapshot(ctx)
	if snap == nil {
		t.Fatal("the bucket's snapshot cannot be used after a request's older object was written")
	}
	in.mu.Lock()
	cur := in.streamSeq
	in.mu.Unlock()
	if snap.StreamSeq != cur || snap.Blocks != 5 {
		t.Fatalf("the bucket's snapshot is at stream seq %d with %d blocks; want %d and 5", snap.StreamSeq, snap.Blocks, cur)
	}
	// The reply itself still resolves, to the request's snapshot.
	ptr, err := kvstream.UnmarshalSnapshot(data)
	if err != nil {
		t.Fatal(err)
	}
	_, obs := in.b.stores()
	got, err := kvstream.ResolveSnapshot(ctx, obs, ptr)
	if err != nil || got.StreamSeq != served.StreamSeq || got.Blocks != 3 {
		t.Fatalf("the served pointer resolves to stream seq %d, %d blocks (%v); want %d, 3", got.StreamSeq, got.Blocks, err, served.StreamSeq)
	}
}

// A NATS server configured with a max payload below InlineSnapshotMax
// (512 KiB by default) refuses an inline snapshot between the two:
// before the fix every store of such a table failed (the bucket kept no
// snapshot: a restarted bridge started empty) and every reply to a
// request failed, where the object store takes it. Here: a 128 KiB
// server, a table of ~220 KB.
func TestSnapshotInlineWithinMaxPayload(t *testing.T) {
	checkSnapshotWithinMaxPayload(t, 128<<10)
}

// The object store's chunks are messages too: nats.go cuts an object in
// chunks of 128 KiB unless told otherwise, which a server with a max
// payload of 64 KiB refuses. Before the fix every snapshot over 64 KiB
// failed to store and to serve there (the bucket kept none; a request
// got an error). Here: a 64 KiB server, a table of ~220 KB.
func TestSnapshotObjectChunksWithinMaxPayload(t *testing.T) {
	checkSnapshotWithinMaxPayload(t, 64<<10)
}

// checkSnapshotWithinMaxPayload stores and serves a snapshot larger
// than a NATS server's max payload mp, and loads both back.
func checkSnapshotWithinMaxPayload(t *testing.T, mp int32) {
	ctx := testenv.Context(t, 2*time.Minute)
	srv := testenv.StartNATSWith(t, func(o *server.Options) { o.MaxPayload = mp })
	in := startBridgeCfg(t, func(c *Config) { c.Conn = testenv.Connect(t, srv.URL()) })
	const msgs, per = 5, 500
	for i := range msgs {
		in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: storeBatch(t, uint64(1+i*per), per)})
	}
	waitEngineSeq(t, in, msgs)
	s, err := in.snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if mp := in.b.cfg.Conn.MaxPayload(); int64(len(s.Batch)) <= mp || len(s.Batch) > in.b.cfg.InlineSnapshotMax {
		t.Fatalf("a snapshot of %d bytes: want it between the max payload %d and InlineSnapshotMax %d", len(s.Batch), mp, in.b.cfg.InlineSnapshotMax)
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	in.storeSnapshot(sctx)
	cancel()
	if snap := in.loadSnapshot(ctx); snap == nil || snap.Blocks != msgs*per {
		t.Fatalf("the bucket's snapshot: %+v; want one of %d blocks", snap, msgs*per)
	}
	reply, err := in.b.cfg.Conn.Request(in.snapSubj, nil, 10*time.Second)
	if err != nil {
		t.Fatalf("snapshot request: %v", err)
	}
	if e := reply.Header.Get(HeaderError); e != "" {
		t.Fatalf("snapshot reply error: %s", e)
	}
	ptr, err := kvstream.UnmarshalSnapshot(reply.Data)
	if err != nil {
		t.Fatal(err)
	}
	_, obs := in.b.stores()
	if got, err := kvstream.ResolveSnapshot(ctx, obs, ptr); err != nil || got.Blocks != msgs*per {
		t.Fatalf("the served snapshot resolves to %d blocks (%v); want %d", got.Blocks, err, msgs*per)
	}
}
