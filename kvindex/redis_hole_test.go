package kvindex

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A hole recorded with the message applied over it (ApplyAtHole) is read
// by every router, in Position, Positions and every guarded write's
// reply, until a load at or past it or a clear after it removes it; a
// plain message keeps it.
func TestRedisHoleRecorded(t *testing.T) {
	ctx := context.Background()
	addr := testenv.Redis(t)
	rA, rB := twoWriters(t, testenv.UniqueName(t), time.Second, productionClient(t, addr), productionClient(t, addr))
	a := newChain(Root(testModel, "", ""), 6, 4, 1, 10)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	want := func(what string, got Position, seq, hole uint64) {
		t.Helper()
		if got != (Position{Seq: seq, Seeded: true, Hole: hole}) {
			t.Fatalf("%s: position %v, want %d with hole %d", what, got, seq, hole)
		}
	}
	read := func(what string, seq, hole uint64) {
		t.Helper()
		p, err := rB.Position(ctx, "i")
		if err != nil {
			t.Fatal(err)
		}
		want(what+": B's Position", p, seq, hole)
		ps, err := rB.Positions(ctx, []string{"i"})
		if err != nil {
			t.Fatal(err)
		}
		want(what+": B's Positions", ps[0], seq, hole)
	}
	if res, err := rA.LoadAt(ctx, "i", 10, []events.Event{a.stored(0, 2)}); err != nil || res.Status != SeqApplied || res.Position.Hole != 0 {
		t.Fatalf("load: %+v %v", res, err)
	}
	res, err := rA.ApplyAtHole(ctx, "i", at(10), 12, true, []events.Event{a.stored(2, 3)})
	if err != nil || res.Status != SeqApplied {
		t.Fatalf("A's message 12 over the hole: %+v %v", res, err)
	}
	want("A's reply", res.Position, 12, 12)
	read("after the hole", 12, 12)
	// B, finding the same message applied, reads the hole in the reply.
	if res, err := rB.ApplyAt(ctx, "i", at(10), 12, []events.Event{a.stored(2, 3)}); err != nil || res.Status != SeqDuplicate {
		t.Fatalf("B's message 12: %+v %v", res, err)
	} else {
		want("B's duplicate", res.Position, 12, 12)
	}
	if res, err := rA.ApplyAt(ctx, "i", at(12), 13, []events.Event{a.stored(3, 4)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("A's message 13: %+v %v", res, err)
	} else {
		want("a message after the hole", res.Position, 13, 12)
	}
	// A snapshot loaded past the hole removes it (a load is refused at or
	// below the position, which is at or past the hole).
	if res, err := rA.LoadAt(ctx, "i", 14, nil); err != nil || res.Status != SeqApplied {
		t.Fatalf("load at 14: %+v %v", res, err)
	}
	read("a load past the hole", 14, 0)

	// Again, removed by a clear after the hole.
	if res, err := rA.ApplyAtHole(ctx, "i", at(14), 20, false, []events.Event{a.stored(0, 1)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("A's message 20 over a hole: %+v %v", res, err)
	}
	read("the second hole", 20, 20)
	if res, err := rA.LoadAt(ctx, "i", 15, nil); err != nil || res.Status != SeqDuplicate {
		t.Fatalf("load at 15: %+v %v", res, err)
	}
	read("an older load refused", 20, 20)
	if res, err := rA.ApplyAt(ctx, "i", at(20), 21, []events.Event{{Kind: events.AllBlocksCleared}}); err != nil || res.Status != SeqApplied {
		t.Fatalf("A's clear: %+v %v", res, err)
	} else {
		want("the clear's reply", res.Position, 21, 0)
	}
	read("after the clear", 21, 0)
}
