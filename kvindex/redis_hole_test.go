package kvindex

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
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
	// A snapshot loaded past the hole removes it (one at the position
	// too: TestRedisHoleLoadAtPosition).
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

// A hole pending at or below the index's position is repaired by a
// snapshot at that very position (the bridge's table at the stream seq of
// the instance's last message already holds what the lost messages did):
// a quiet engine's bridge answers with nothing newer. LoadAt refused it
// (at the position: a duplicate), and the instance stayed not live on
// every router until its next message. Now it is accepted, once: it
// removes the hole, and a second load at the position (a second router's,
// or the same again) is refused as before, as is one without a hole and
// one older than the position, at or past the hole or not.
func TestRedisHoleLoadAtPosition(t *testing.T) {
	ctx := context.Background()
	addr := testenv.Redis(t)
	rA, rB := twoWriters(t, testenv.UniqueName(t), 200*time.Millisecond, productionClient(t, addr), productionClient(t, addr))
	a := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	load := func(what string, r *Redis, seq uint64, st SeqStatus, pos Position, evs ...events.Event) {
		t.Helper()
		res, err := r.LoadAt(ctx, "i", seq, evs)
		if err != nil || res.Status != st || res.Position != pos {
			t.Fatalf("%s: %v at %v (%v), want %v at %v", what, res.Status, res.Position, err, st, pos)
		}
	}
	read := func(what string, pos Position, held [tiers.Count]int) {
		t.Helper()
		for _, r := range []*Redis{rA, rB} {
			if p, err := r.Position(ctx, "i"); err != nil || p != pos {
				t.Fatalf("%s: position %v (%v), want %v", what, p, err, pos)
			}
			checkLookup(t, r, query{a.keys, map[string][tiers.Count]int{"i": held}}, what)
		}
	}
	holed := func(seq, hole uint64) Position { return Position{Seq: seq, Seeded: true, Hole: hole} }

	// Without a hole, a load at the position changes nothing.
	load("first load", rA, 10, SeqApplied, at(10), a.stored(0, 2))
	load("a load at the position, no hole", rA, 10, SeqDuplicate, at(10), a.stored(0, 4))
	read("no hole", at(10), all(2))

	// The engine removed block 1 in message 11, which the stream lost;
	// message 12 (a CPU copy of block 0) is applied over the hole.
	if res, err := rA.ApplyAtHole(ctx, "i", at(10), 12, false, []events.Event{a.tierStored("CPU", 0, 1)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("message 12 over the hole: %+v %v", res, err)
	}
	read("the hole", holed(12, 12), all(2))
	load("an older load", rA, 11, SeqDuplicate, holed(12, 12), a.stored(0, 1))
	// B's load at the position while A holds the writer lease: A's to do.
	load("B's load under A's lease", rB, 12, SeqNotOwner, holed(12, 12), a.stored(0, 1), a.tierStored("CPU", 0, 1))
	// The bridge's table at 12: block 0 in GPU and CPU.
	load("the load at the position", rA, 12, SeqApplied, at(12), a.stored(0, 1), a.tierStored("CPU", 0, 1))
	read("repaired", at(12), all(1))
	// Again, from either router (the hole is gone): refused, nothing
	// rewritten.
	load("the same load again", rA, 12, SeqDuplicate, at(12), a.stored(0, 4))
	time.Sleep(250 * time.Millisecond) // A's lease runs out
	load("B's load at the position after A's", rB, 12, SeqDuplicate, at(12), a.stored(0, 4))
	read("after the loads refused", at(12), all(1))

	// A hole at 14 and a message past it: a load at the hole, below the
	// position, is refused; one at the position is accepted, by B, which
	// takes the instance over.
	if res, err := rA.ApplyAtHole(ctx, "i", at(12), 14, false, []events.Event{a.stored(1, 2)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("message 14 over a hole: %+v %v", res, err)
	}
	if res, err := rA.ApplyAt(ctx, "i", at(14), 15, []events.Event{a.stored(2, 3)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("message 15: %+v %v", res, err)
	}
	load("a load at the hole, below the position", rA, 14, SeqDuplicate, holed(15, 14), a.stored(0, 4))
	read("the second hole", holed(15, 14), all(3))
	time.Sleep(250 * time.Millisecond)
	load("B's load at the position", rB, 15, SeqApplied, at(15), a.stored(0, 4))
	read("the second hole repaired", at(15), all(4))
}
