//go:build unix

package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/kvstream"
)

// deliver reads a message's metadata (from its reply subject, without
// allocating) and the clock once and hands both
// on: the message is queued with its stream sequence and store time, the
// lag is the delivery time less the store time (0 once nothing is
// pending), the delivery time is the watchdog's, and a stream sequence
// already dispatched is dropped.
func TestDeliverReadsMetadataAndClockOnce(t *testing.T) {
	e := newEnv(t)
	cfg := e.cfg
	cfg.Applier, cfg.Shards = newRecorder(), 1
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	subj, _ := kvstream.EventsSubject(e.pool, "i0")
	msg := func(seq uint64, stored time.Time, pending uint64) *pathMsg {
		md := &jetstream.MsgMetadata{Timestamp: stored, NumPending: pending}
		md.Sequence.Stream = seq
		h := kvstream.EventHeaders{Seq: seq, HasSeq: true}
		return &pathMsg{subj: subj, reply: ackReply(md), hdr: h.Header(), data: []byte{1}, md: md}
	}
	stored := time.Now().Add(-2 * time.Second)
	before := time.Now()
	c.deliver(ctx, 0, msg(7, stored, 3))
	after := time.Now()
	var w work
	select {
	case w = <-c.shards[0]:
	default:
		t.Fatal("nothing queued")
	}
	if w.streamSeq != 7 || !w.stored.Equal(stored) || w.instance != "i0" {
		t.Fatalf("queued seq %d stored %v instance %q, want 7 %v i0", w.streamSeq, w.stored, w.instance, stored)
	}
	if lag := time.Duration(c.lag.Load()); lag < before.Sub(stored) || lag > after.Sub(stored) {
		t.Fatalf("lag %v, want the delivery time less the store time, %v..%v", lag, before.Sub(stored), after.Sub(stored))
	}
	if at := time.Unix(0, c.sc.at.Load()); at.Before(before) || at.After(after) || c.sc.seq != 7 {
		t.Fatalf("delivery at %v (want %v..%v), seq %d (want 7)", at, before, after, c.sc.seq)
	}
	if c.caughtUp.Load() {
		t.Fatal("caught up with 3 messages pending")
	}

	c.deliver(ctx, 0, msg(7, stored, 3)) // already dispatched
	c.deliver(ctx, 1, msg(8, stored, 3)) // a replaced consumer's generation
	if n := len(c.shards[0]); n != 0 {
		t.Fatalf("%d queued from a repeated sequence or a replaced consumer, want 0", n)
	}

	c.deliver(ctx, 0, msg(8, stored, 0))
	if lag := c.lag.Load(); lag != 0 || !c.caughtUp.Load() {
		t.Fatalf("nothing pending: lag %v caught up %v, want 0 and true", time.Duration(lag), c.caughtUp.Load())
	}
	if w := <-c.shards[0]; w.streamSeq != 8 {
		t.Fatalf("queued seq %d, want 8", w.streamSeq)
	}
}
