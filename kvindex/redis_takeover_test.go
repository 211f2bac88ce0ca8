package kvindex

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
)

// A router (A) whose write reaches Redis late — its pipeline stalled past
// its lease, then sat in a hung server's socket — while another router
// (B) took the expired lease over and applied the same message and the
// next one. A's late block writes must not change what B's position
// says: B writes under a field id of its own (a takeover starts a new
// incarnation), so A's late removals and stores, under the old one, no
// longer count. A's mark never reaches Redis here (its only connection
// is the one the pipeline went out on, and a new one cannot be set up
// with the server stopped), as when A dies: nothing else would tell the
// state is not whole.
//
// took_over: A wrote the instance before. Old code: B wrote under A's
// field id; after A's late pipeline a lookup found 3 of a's 4 blocks
// (the block message 12 stored back, removed by A's late message 11),
// with the position at 12 (seeded, "whole").
//
// taken_back: B wrote it before, A took the lease from B and stalled, B
// takes it back. B's last commit is its own, but the lease has been A's
// since. With #w alone saying whose the state is (this branch's first
// version), B wrote on under its old id, A's late pipeline (a takeover:
// it rewrote the map under a new id, removing B's fields first) removed
// B's fields, and its registry write (the registry still named A's
// previous id, B's) pointed lookups at A's uncommitted incarnation:
// position 12, 3 of a's 4 blocks found.
func TestRedisLateWriterAfterTakeover(t *testing.T) {
	for _, takenBack := range []bool{false, true} {
		name := map[bool]string{false: "took_over", true: "taken_back"}[takenBack]
		t.Run(name, func(t *testing.T) { testRedisLateWriterAfterTakeover(t, takenBack) })
	}
}

func testRedisLateWriterAfterTakeover(t *testing.T, takenBack bool) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	prefix := testenv.UniqueName(t)
	const lease = time.Second // well over one write on a loaded machine (a write starts only within half of it)
	cA, cB := productionClient(t, srv.Addr), productionClient(t, srv.Addr)
	// Stalls A's pipeline that carries a commit (a begin goes through).
	hook := &processStall{match: func(c redis.Cmder) bool {
		args := c.Args()
		return len(args) > 5 && args[0] == "evalsha" && args[1] == mapScript.Hash() && args[5] == "c"
	}}
	cA.AddHook(hook)
	rA, rB := twoWriters(t, prefix, lease, cA, cB)
	root := Root(testModel, "", "")
	a := newChain(root, 4, 4, 1, 10)
	b := newChain(root, 2, 4, 2, 100)
	// Message 11 removes a's last block and stores b; message 12 stores
	// a's last block back and removes b.
	msg11 := []events.Event{a.removed("GPU", 3, 4), b.stored(0, 2)}
	msg12 := []events.Event{a.stored(3, 4), b.removed("GPU", 0, 2)}
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }

	hook.fn = func() {
		// A checked its lease and built its pipeline; it stalls past the
		// lease, and B takes the instance (back).
		time.Sleep(lease + 300*time.Millisecond)
		for _, m := range []struct {
			from, seq uint64
			evs       []events.Event
		}{{10, 11, msg11}, {11, 12, msg12}} {
			if res, err := rB.ApplyAt(ctx, "i", at(m.from), m.seq, m.evs); err != nil || res.Status != SeqApplied {
				t.Errorf("B's message %d: %+v %v", m.seq, res, err)
			}
		}
		checkLookup(t, rB, query{a.keys, map[string][tiers.Count]int{"i": all(4)}}, "a after B's message 12")
		checkLookup(t, rB, query{b.keys, nil}, "b after B's message 12")
		// A's pipeline goes out to a hung server.
		srv.Pause()
	}
	loader := rA
	if takenBack {
		loader = rB
	} else {
		hook.after.Store(1) // not the load's commit
	}
	if res, err := loader.LoadAt(ctx, "i", 10, []events.Event{a.stored(0, 4)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("load: %+v %v", res, err)
	}
	if takenBack {
		time.Sleep(lease + 100*time.Millisecond) // B's lease runs out: A takes it
	}
	started := time.Now()
	res, err := rA.ApplyAt(ctx, "i", at(10), 11, msg11)
	t.Logf("A's late message 11: %+v, err %v, after %v", res, err, time.Since(started).Round(time.Millisecond))
	if err == nil {
		t.Fatalf("A's late write succeeded: %+v", res)
	}
	srv.Resume()
	waitDrained(t, cB)

	pos, err := rB.Position(ctx, "i")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after A's late pipeline ran: position %v", pos)
	if !pos.Seeded {
		return // not whole: the consumers reload it
	}
	if pos.Seq != 12 {
		t.Fatalf("position %v, want 12 (B's) or unseeded", pos)
	}
	checkLookup(t, rB, query{a.keys, map[string][tiers.Count]int{"i": all(4)}}, "position 12, after A's late pipeline: a")
	checkLookup(t, rB, query{b.keys, nil}, "position 12, after A's late pipeline: b")
}

// processStall runs fn before its client's after+1st command that match
// accepts (counting commands in pipelines too), once.
type processStall struct {
	after atomic.Int32
	match func(redis.Cmder) bool
	fn    func()
}

func (h *processStall) fire(cmds ...redis.Cmder) {
	for _, c := range cmds {
		if h.match(c) && h.after.Add(-1) == -1 {
			h.fn()
		}
	}
}

func (h *processStall) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *processStall) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.fire(cmd)
		return next(ctx, cmd)
	}
}
func (h *processStall) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.fire(cmds...)
		return next(ctx, cmds)
	}
}

// The registry's fix-up (a write whose commit applied finds the registry
// naming a third field id: it lost a write) reaching Redis late — a
// stalled process, or a copy go-redis sent again after a read timeout —
// once another router has taken the instance over: it must not point the
// registry back at the retired field id, or lookups stop counting the
// instance's blocks while its position says it is whole. B moves the
// instance on by a load, or (a takeover starts a new incarnation too) by
// applying the next message. Old code (an unconditional HSET, with
// go-redis's retries): position 12, lookups found none of a's 4 blocks.
func TestRedisLateRegistryFixUp(t *testing.T) {
	for _, load := range []bool{true, false} {
		name := map[bool]string{true: "load", false: "apply"}[load]
		t.Run(name, func(t *testing.T) { testRedisLateRegistryFixUp(t, load) })
	}
}

func testRedisLateRegistryFixUp(t *testing.T, load bool) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	prefix := testenv.UniqueName(t)
	const lease = time.Second
	cA, cB := productionClient(t, srv.Addr), productionClient(t, srv.Addr)
	rA, rB := twoWriters(t, prefix, lease, cA, cB)
	a := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	if res, err := rA.LoadAt(ctx, "i", 10, []events.Event{a.stored(0, 3)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("A's load: %+v %v", res, err)
	}
	// The registry loses A's last write (as a Cluster failover does):
	// it names a third field id.
	if err := cB.HSet(ctx, rB.regKey(), instID("i"), "1 0123456789 i").Err(); err != nil {
		t.Fatal(err)
	}
	// A's next write commits, finds the registry naming the third id, and
	// its fix-up (the second registry write of the call: the first is in
	// its pipeline) stalls past A's lease while B takes the instance over.
	hook := &processStall{match: func(c redis.Cmder) bool {
		args := c.Args()
		return len(args) > 1 && (args[0] == "hset" && args[1] == rA.regKey() || args[0] == "evalsha" && args[1] == regScript.Hash())
	}}
	hook.after.Store(1)
	hook.fn = func() {
		time.Sleep(lease + 300*time.Millisecond)
		var res SeqResult
		var err error
		if load {
			res, err = rB.LoadAt(ctx, "i", 12, []events.Event{a.stored(0, 4)})
		} else {
			res, err = rB.ApplyAt(ctx, "i", at(11), 12, []events.Event{a.stored(3, 4)})
		}
		if err != nil || res.Status != SeqApplied {
			t.Errorf("B's message 12: %+v %v", res, err)
		}
		checkLookup(t, rB, query{a.keys, map[string][tiers.Count]int{"i": all(4)}}, "a after B's message 12")
	}
	cA.AddHook(hook)
	res, err := rA.ApplyAt(ctx, "i", at(10), 11, []events.Event{a.stored(0, 3)})
	t.Logf("A's message 11: %+v, err %v", res, err)
	if hook.after.Load() >= 0 {
		t.Fatal("A's write did not send a registry fix-up")
	}
	pos, err := rB.Position(ctx, "i")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after A's late fix-up: position %v", pos)
	if pos.Seeded {
		checkLookup(t, rB, query{a.keys, map[string][tiers.Count]int{"i": all(4)}}, "after A's late registry fix-up: a")
	}
}

// An instance silent for longer than the lease, then written by every
// router (each applies every message): ApplyAtYielding leaves it to the
// router that wrote it last (SeqYielded, nothing written) even though its
// lease ran out, so the change of writer — which costs a rewrite of the
// instance under a new field id — happens only when the last writer did
// not apply the message (it died or stalled) and another takes it over
// with ApplyAt.
func TestRedisYieldToLastWriter(t *testing.T) {
	ctx := context.Background()
	addr := testenv.Redis(t)
	prefix := testenv.UniqueName(t)
	const lease = 200 * time.Millisecond
	rA, rB := twoWriters(t, prefix, lease, productionClient(t, addr), productionClient(t, addr))
	root := Root(testModel, "", "")
	a := newChain(root, 6, 4, 1, 10)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	if res, err := rA.LoadAt(ctx, "i", 10, []events.Event{a.stored(0, 2)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("load: %+v %v", res, err)
	}
	fid := metaFID(t, rA, "i")
	for seq := uint64(11); seq <= 13; seq++ {
		time.Sleep(lease + 50*time.Millisecond) // silent past A's lease
		ev := []events.Event{a.stored(int(seq-9), int(seq-8))}
		res, err := rB.ApplyAtYielding(ctx, "i", at(seq-1), seq, ev)
		if err != nil || res.Status != SeqYielded || res.Position != at(seq-1) {
			t.Fatalf("B's message %d: %+v %v, want yielded at %d", seq, res, err, seq-1)
		}
		if res, err := rA.ApplyAtYielding(ctx, "i", at(seq-1), seq, ev); err != nil || res.Status != SeqApplied || res.Takeover {
			t.Fatalf("A's message %d: %+v %v, want applied without a takeover", seq, res, err)
		}
		if got := metaFID(t, rA, "i"); got != fid {
			t.Fatalf("message %d: field id %s → %s: the instance was rewritten", seq, fid, got)
		}
		checkLookup(t, rB, query{a.keys, map[string][tiers.Count]int{"i": all(int(seq - 8))}}, "a")
	}
	// A applies nothing more (dead): B yields, then takes over.
	time.Sleep(lease + 50*time.Millisecond)
	ev := []events.Event{a.stored(5, 6)}
	if res, err := rB.ApplyAtYielding(ctx, "i", at(13), 14, ev); err != nil || res.Status != SeqYielded {
		t.Fatalf("B's message 14: %+v %v, want yielded", res, err)
	}
	if res, err := rB.ApplyAt(ctx, "i", at(13), 14, ev); err != nil || res.Status != SeqApplied || !res.Takeover {
		t.Fatalf("B's takeover with message 14: %+v %v, want applied as a takeover", res, err)
	}
	if got := metaFID(t, rB, "i"); got == fid {
		t.Fatalf("B took the instance over under the old field id %s", fid)
	}
	checkLookup(t, rB, query{a.keys, map[string][tiers.Count]int{"i": all(6)}}, "a after B's takeover")
	// B's own writes, its lease run out or not, are not yielded.
	time.Sleep(lease + 50*time.Millisecond)
	b := newChain(root, 1, 4, 2, 100)
	if res, err := rB.ApplyAtYielding(ctx, "i", at(14), 15, []events.Event{b.stored(0, 1)}); err != nil || res.Status != SeqApplied || res.Takeover {
		t.Fatalf("B's message 15: %+v %v", res, err)
	}
	// A live lease of another writer is still not_owner.
	if res, err := rA.ApplyAtYielding(ctx, "i", at(15), 16, []events.Event{b.removed("GPU", 0, 1)}); err != nil || res.Status != SeqNotOwner {
		t.Fatalf("A's message 16 under B's live lease: %+v %v, want not_owner", res, err)
	}
}

// twoWriters is two routers' shared indexes (exact lookups) on clients cA
// and cB, under one prefix and lease.
func twoWriters(t *testing.T, prefix string, lease time.Duration, cA, cB redis.UniversalClient) (rA, rB *Redis) {
	t.Helper()
	var rs [2]*Redis
	for i, c := range []redis.UniversalClient{cA, cB} {
		r, err := NewRedis(c, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4, WriterLease: lease, ExactLookup: true})
		if err != nil {
			t.Fatal(err)
		}
		rs[i] = r
	}
	return rs[0], rs[1]
}
