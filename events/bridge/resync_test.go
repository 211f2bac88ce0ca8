package bridge

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
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
