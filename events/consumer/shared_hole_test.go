package consumer

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/tiers"
)

// holeWorld is a pool of e0 and quiet, heartbeating, and one router that
// consumed 20 rounds of both.
func holeWorld(t *testing.T, seed uint64) (*sharedWorld, *router) {
	w := newSharedWorld(t, seed, "e0", "quiet")
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	t.Cleanup(func() { close(stop); hb.Wait() })
	r := w.startRouter()
	w.publish(20)
	w.converge("first messages", r)
	return w, r
}

// engine is the world's engine called name.
func (w *sharedWorld) engine(name string) *fakeEngine {
	w.t.Helper()
	i := slices.IndexFunc(w.engines, func(f *fakeEngine) bool { return f.name == name })
	if i < 0 {
		w.t.Fatalf("no engine %s", name)
	}
	return w.engines[i]
}

// instBlocks is instance's block counters in idx.
func instBlocks(ctx context.Context, idx kvindex.Index, instance string) [tiers.Count]int {
	st, _ := idx.Instances(ctx)
	for _, s := range st {
		if s.Instance == instance {
			return s.Blocks
		}
	}
	return [tiers.Count]int{}
}

// lose has engine name change its cache without the change reaching the
// stream, as when the stream lost the messages before the router read
// them (retention passed it): batches are drawn, applied to the truth and
// the bridge's table, and never published, until the engine holds other
// blocks than before.
func (w *sharedWorld) lose(name string) {
	w.t.Helper()
	f := w.engine(name)
	was := instBlocks(w.ctx, w.truth, name)
	for n := 0; instBlocks(w.ctx, w.truth, name) == was; n++ {
		if n == 100 {
			w.t.Fatalf("%s: 100 draws changed nothing", name)
		}
		if evs := f.next(w.rng); evs != nil {
			w.table(f, evs)
		}
	}
}

// appliedLast waits until the router's index is at engine name's last
// message in the stream and the router's status says so (it is updated
// after the index's write returns: read at the index's position alone,
// LastSeq could still be one message behind).
func (w *sharedWorld) appliedLast(r *router, name string) {
	w.t.Helper()
	subj, _ := kvstream.EventsSubject(w.pool, name)
	last, err := w.stream().GetLastMsgForSubject(w.ctx, subj)
	if err != nil {
		w.t.Fatal(err)
	}
	testenv.WaitFor(w.t, 20*time.Second, name+"'s last message applied", func() bool {
		p, err := r.idx.Position(w.ctx, name)
		return err == nil && p.Seq >= last.Sequence && r.c.status(name).StreamSeq >= last.Sequence
	})
}

// messages is engine name's messages in the stream after stream seq after.
func (w *sharedWorld) messages(name string, after uint64) []*jetstream.RawStreamMsg {
	w.t.Helper()
	subj, _ := kvstream.EventsSubject(w.pool, name)
	stream := w.stream()
	var out []*jetstream.RawStreamMsg
	for seq := after + 1; ; {
		m, err := stream.GetMsg(w.ctx, seq, jetstream.WithGetMsgSubject(subj))
		if err != nil {
			return out
		}
		out, seq = append(out, m), m.Sequence+1
	}
}

// A live message whose engine seq jumps (the stream lost the messages
// before it) in the shared index: the consumer loads the snapshot, and
// when the one it gets is older than the hole (the bridge did not answer;
// the bucket's was put before the lost messages) it applied the message
// and read the instance live, while the index lacked what the lost
// messages did. Now quiet is not live until a snapshot past the hole is
// loaded: at a later message, when the bridge's is past the index's
// position, after which the index equals the engines.
func TestSharedLiveHoleNotLive(t *testing.T) {
	w, r := holeWorld(t, 61)
	w.keepBucket = true // the bucket keeps quiet's snapshot from before the hole
	lostBefore := counterValue(r.c.m.replayLost)
	w.lose("quiet")
	w.publishOne("quiet")
	w.appliedLast(r, "quiet")
	idx, truth := instBlocks(w.ctx, r.idx, "quiet"), instBlocks(w.ctx, w.truth, "quiet")
	if idx == truth {
		t.Fatalf("the lost messages changed nothing the index shows (%v)", truth)
	}
	samples := 0
	for range 25 {
		_, _ = r.c.dueShared(w.ctx, sharedLease, false) // the check, as watchShared runs it
		for end := time.Now().Add(60 * time.Millisecond); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
			if r.c.Live("quiet") || r.c.IndexConsistent() {
				t.Fatalf("quiet read live (index consistent %v) after a hole in its engine seqs: the index holds %v blocks, the engine %v",
					r.c.IndexConsistent(), idx, truth)
			}
			samples++
		}
	}
	if samples == 0 {
		t.Fatal("no sample taken")
	}
	if got := counterValue(r.c.m.replayLost) - lostBefore; got != 1 {
		t.Fatalf("replay_lost counted %v times for one hole", got)
	}
	// The bridge's snapshot at quiet's next message is past the hole (and
	// past the index's position): a message a little over loadRetryAt's
	// second after the failed repair brings it.
	w.keepBucket, w.snapshotFirst = false, true
	deadline := time.Now().Add(20 * time.Second)
	for !r.c.Live("quiet") {
		if time.Now().After(deadline) {
			t.Fatalf("quiet not live 20 s after the hole: %+v", r.c.status("quiet"))
		}
		w.publishOne("quiet")
		w.appliedLast(r, "quiet")
		time.Sleep(300 * time.Millisecond)
	}
	w.converge("a snapshot past the hole", r)
}

// A hole in an instance's engine seqs in the middle of its stream (a
// message removed), followed by a clear (the engine's AllBlocksCleared,
// or a bridge's resync: a clear and its table): the clear wipes whatever
// the lost message did, so the state after it is exact from the stream
// alone. The repair's replay refused the hole (errReplayGap) and, the
// snapshot being older than the hole, left quiet not live until its next
// message; now it replays over it up to the clear and on, and the index
// equals the engines.
func TestSharedReplayGapThenClearAccepted(t *testing.T) {
	for _, c := range []struct {
		name   string
		resync bool
		seed   uint64
	}{{"engine clear", false, 67}, {"bridge resync", true, 73}} {
		t.Run(c.name, func(t *testing.T) {
			sw := newSavedWorld(t, c.seed)
			w, r := sw.sharedWorld, sw.r
			// quiet's messages since the save; the second of them goes.
			since := w.messages("quiet", sw.saved.Seq)
			if len(since) < 3 {
				t.Fatalf("quiet published %d messages after the save", len(since))
			}
			quiet := w.engine("quiet")
			if c.resync {
				w.resync(quiet)
			} else {
				clear(quiet.held)
				w.send(quiet, []events.Event{{Kind: events.AllBlocksCleared}})
			}
			w.publish(5, "quiet")
			w.converge("quiet's clear and after", r)
			if err := w.stream().DeleteMsg(w.ctx, since[1].Sequence); err != nil {
				t.Fatal(err)
			}
			w.redis.Kill()
			testenv.WaitFor(t, 10*time.Second, "the outage noticed", func() bool { return !r.c.IndexConsistent() })
			sw.savedSnap()  // the bucket's snapshot from before the hole
			w.redis.Start() // loads the RDB: quiet at the save, before the hole
			w.converge("a hole followed by a clear", r)
			if g := quietGaps(r); g == 0 {
				t.Fatal("converged, but the repair met no hole")
			}
		})
	}
}

// resync publishes a bridge's resync of engine f: a synthetic message (no
// engine seq) holding a clear and the bridge's table.
func (w *sharedWorld) resync(f *fakeEngine) {
	w.t.Helper()
	evs := append([]events.Event{{Kind: events.AllBlocksCleared}}, w.snapshots[f.name].evs...)
	p, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: evs}, events.EncodingMap)
	if err != nil {
		w.t.Fatal(err)
	}
	subj, _ := kvstream.EventsSubject(w.pool, f.name)
	h := kvstream.EventHeaders{Pool: w.pool, Instance: f.name, Synthetic: kvstream.SyntheticResync}
	if _, err := w.js.PublishMsg(w.ctx, &nats.Msg{Subject: subj, Data: p, Header: h.Header()}); err != nil {
		w.t.Fatal(err)
	}
	if _, err := w.truth.Apply(w.ctx, f.name, evs); err != nil {
		w.t.Fatal(err)
	}
}

// A duplicate of an earlier engine message (a message stored twice, a
// second bridge publishing behind the first) in the shared index, where
// it is not skipped, consumed or (after Redis restored from an RDB before
// it) replayed: it lowered the instance's last engine seq, so the next
// message read as a hole — a gap counted and a snapshot reload, and, with
// the snapshot older than the index (here the bucket's), the instance
// not live. The last seq keeps its maximum.
func TestSharedDuplicateDoesNotLowerLastSeq(t *testing.T) {
	for _, c := range []struct {
		name     string
		replayed bool
		seed     uint64
	}{{"consumed", false, 71}, {"replayed", true, 79}} {
		t.Run(c.name, func(t *testing.T) {
			w, r := holeWorld(t, c.seed)
			w.publish(5, "quiet")
			w.converge("quiet's messages", r)
			w.keepBucket = true // a false hole's reload finds the bucket's snapshot, at the index's position
			if c.replayed {
				w.saveRDB()
			}
			msgs := w.messages("quiet", 0)
			dup := msgs[len(msgs)-2] // engine seq one below the last applied
			ack, err := w.js.PublishMsg(w.ctx, &nats.Msg{Subject: dup.Subject, Data: dup.Data, Header: dup.Header})
			if err != nil {
				t.Fatal(err)
			}
			w.appliedLast(r, "quiet")
			if c.replayed {
				w.redis.Kill()
				testenv.WaitFor(t, 10*time.Second, "the outage noticed", func() bool { return !r.c.IndexConsistent() })
				w.redis.Start() // loads the RDB: quiet before the duplicate
				testenv.WaitFor(t, 20*time.Second, "the duplicate replayed", func() bool {
					p, err := r.idx.Position(w.ctx, "quiet")
					return err == nil && p.Seq >= ack.Sequence && r.c.IndexConsistent() && r.c.Live("quiet")
				})
			}
			gapsBefore, loadsBefore := quietGaps(r), r.counter(t, "kvrouter_events_snapshot_loads_total")
			w.publishOne("quiet")
			w.appliedLast(r, "quiet")
			quiet := w.engine("quiet")
			st := r.c.status("quiet")
			gaps, loads := quietGaps(r), r.counter(t, "kvrouter_events_snapshot_loads_total")
			if gaps != gapsBefore || loads != loadsBefore || st.LastSeq != quiet.seq || !r.c.Live("quiet") {
				t.Fatalf("after a duplicate of engine seq %d and the next message (engine seq %d): gaps %d (was %d), snapshot loads %v (was %v), last seq %d, live %v",
					quiet.seq-2, quiet.seq, gaps, gapsBefore, loads, loadsBefore, st.LastSeq, r.c.Live("quiet"))
			}
		})
	}
}

// slowLoad is a router's index whose snapshot loads are late by delay.
type slowLoad struct {
	*kvindex.Redis
	delay time.Duration
}

func (s *slowLoad) LoadAt(ctx context.Context, instance string, seq uint64, evs []events.Event) (kvindex.SeqResult, error) {
	time.Sleep(s.delay)
	return s.Redis.LoadAt(ctx, instance, seq, evs)
}

// notLive fails the test when one of routers reads instance live, or its
// index consistent, in samples taken for about d, the routers' checks
// run meanwhile (as watchShared runs them).
func (w *sharedWorld) notLive(d time.Duration, instance, what string, routers ...*router) {
	w.t.Helper()
	samples := 0
	for end := time.Now().Add(d); time.Now().Before(end); {
		for _, r := range routers {
			_, _ = r.c.dueShared(w.ctx, sharedLease, false)
		}
		for stop := time.Now().Add(50 * time.Millisecond); time.Now().Before(stop); time.Sleep(2 * time.Millisecond) {
			for i, r := range routers {
				if r.c.Live(instance) || r.c.IndexConsistent() {
					w.t.Fatalf("%s: router %d of %d reads %s live (index consistent %v): the index holds %v blocks, the engine %v",
						what, i+1, len(routers), instance, r.c.IndexConsistent(), instBlocks(w.ctx, r.idx, instance), instBlocks(w.ctx, w.truth, instance))
				}
			}
			samples++
		}
	}
	if samples == 0 {
		w.t.Fatal("no sample taken")
	}
}

// holeInQuiet has quiet's engine change its cache in messages the stream
// loses, then publish one, which the routers apply over the hole, the
// bucket keeping quiet's snapshot from before it; it checks that the
// routers hold quiet not live for 1.5 s.
func (w *sharedWorld) holeInQuiet(rs ...*router) {
	w.t.Helper()
	w.keepBucket = true
	w.lose("quiet")
	w.publishOne("quiet")
	for _, r := range rs {
		w.appliedLast(r, "quiet")
	}
	if idx, truth := instBlocks(w.ctx, rs[0].idx, "quiet"), instBlocks(w.ctx, w.truth, "quiet"); idx == truth {
		w.t.Fatalf("the lost messages changed nothing the index shows (%v)", truth)
	}
	w.notLive(1500*time.Millisecond, "quiet", "after the hole", rs...)
}

// Two routers meet the same live hole in quiet's engine seqs, the
// snapshot they can load (the bucket's) older than it. The first applies
// the message after the hole over the old snapshot; the second, whose
// load comes later, found the index past the message and trusted it
// (another router applied it), clearing its hole: it read quiet live on
// the incomplete state (18 GPU blocks against the engine's 19, 4 of 4
// runs in review). The first records the hole in the index with the
// message, and every router, one started after the hole too, reads quiet
// not live until a snapshot past the hole is loaded; then all are live
// and the index equals the engines.
func TestSharedHoleSeenByEveryRouter(t *testing.T) {
	w := newSharedWorld(t, 61, "e0", "quiet")
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	t.Cleanup(func() { close(stop); hb.Wait() })
	r1 := w.startRouter()
	w.wrapIndex = func(idx *kvindex.Redis) SharedApplier { return &slowLoad{Redis: idx, delay: 300 * time.Millisecond} }
	r2 := w.startRouter()
	w.wrapIndex = nil
	w.publish(20)
	w.converge("first messages", r1, r2)
	w.holeInQuiet(r1, r2)
	// A router started now (or one restarted) learns the hole from the
	// index.
	r3 := w.startRouter()
	testenv.WaitFor(t, 20*time.Second, "the new router synced quiet", func() bool {
		if !r3.c.Live("e0") {
			return false
		}
		r3.c.mu.Lock()
		defer r3.c.mu.Unlock()
		in := r3.c.insts["quiet"]
		return in != nil && !in.syncQueued
	})
	w.notLive(time.Second, "quiet", "a router started after the hole", r1, r2, r3)
	// The bridge's snapshot at quiet's next message is past the hole.
	w.keepBucket, w.snapshotFirst = false, true
	deadline := time.Now().Add(20 * time.Second)
	for !r1.c.Live("quiet") || !r2.c.Live("quiet") || !r3.c.Live("quiet") {
		if time.Now().After(deadline) {
			t.Fatalf("quiet not live on every router 20 s after the hole: %v %v %v", r1.c.Live("quiet"), r2.c.Live("quiet"), r3.c.Live("quiet"))
		}
		w.publishOne("quiet")
		w.appliedLast(r1, "quiet")
		time.Sleep(300 * time.Millisecond)
	}
	w.converge("a snapshot past the hole", r1, r2, r3)
}

// A hole recorded in the shared index for quiet, whose engine then goes
// quiet (heartbeats, no message): its bridge's table at the stream seq of
// quiet's last message — the index's own position — holds what the lost
// messages did, and is all the bridge can answer. LoadAt refused a
// snapshot at the position, and no message came to retry at, so quiet
// stayed not live on every router for good. Now the routers' periodic
// sync loads it (a loadRetryAt apart while the load falls short), and
// quiet turns live on both, the index equal to the engines, within a few
// seconds.
func TestSharedQuietHoleRepairedAtPosition(t *testing.T) {
	w := newSharedWorld(t, 83, "e0", "quiet")
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	t.Cleanup(func() { close(stop); hb.Wait() })
	r1, r2 := w.startRouter(), w.startRouter()
	w.publish(20)
	w.converge("first messages", r1, r2)
	w.holeInQuiet(r1, r2)
	pos, err := r1.idx.Position(w.ctx, "quiet")
	if err != nil || pos.Hole == 0 || pos.Hole > pos.Seq {
		t.Fatalf("quiet's position %v (%v): want a hole recorded", pos, err)
	}
	// The bridge answers with its table at the index's position.
	start := time.Now()
	w.answer("quiet", w.quietTableAt(pos))
	var took [2]time.Duration
	for took[0] == 0 || took[1] == 0 {
		for i, r := range []*router{r1, r2} {
			if took[i] == 0 && r.c.Live("quiet") {
				took[i] = time.Since(start)
			}
		}
		if time.Since(start) > 15*time.Second {
			t.Fatalf("quiet not live on every router 15 s after its bridge answered at the index's position %v: %v %v (index %v blocks, engine %v)",
				pos, r1.c.Live("quiet"), r2.c.Live("quiet"), instBlocks(w.ctx, r1.idx, "quiet"), instBlocks(w.ctx, w.truth, "quiet"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("quiet live %v (router 1) and %v (router 2) after the bridge answered", took[0].Round(time.Millisecond), took[1].Round(time.Millisecond))
	w.converge("the table at the index's position", r1, r2)
	if p, err := r2.idx.Position(w.ctx, "quiet"); err != nil || p != (kvindex.Position{Seq: pos.Seq, Seeded: true}) {
		t.Fatalf("quiet's position %v (%v), want %d with no hole", p, err, pos.Seq)
	}
}

// quietTableAt is quiet's bridge's table as a snapshot at the index's
// position pos.
func (w *sharedWorld) quietTableAt(pos kvindex.Position) []byte {
	w.t.Helper()
	batch, err := events.Encode(nil, events.Batch{Events: w.snapshots["quiet"].evs}, events.EncodingMap)
	if err != nil {
		w.t.Fatal(err)
	}
	snap, err := kvstream.Snapshot{Pool: w.pool, Instance: "quiet", Blocks: len(w.snapshots["quiet"].evs), StreamSeq: pos.Seq,
		EngineSeq: w.engine("quiet").seq, HasSeq: true, Taken: time.Now(), Batch: batch}.MarshalBinary()
	if err != nil {
		w.t.Fatal(err)
	}
	return snap
}

// The periodic sync's retry of a quiet instance's hole asks its bridge
// for its table only while the bridge is heard from: silent (no heartbeat
// for StaleAfter), it answers nothing, and a hung one would hold the
// shard for SnapshotTimeout at every try. Once it heartbeats again the
// retry loads its table at the index's position, and quiet turns live on
// both routers.
func TestSharedQuietHoleSilentBridgeNotAsked(t *testing.T) {
	w := newSharedWorld(t, 89, "e0", "quiet")
	w.cfg.StaleAfter = time.Second
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	r1, r2 := w.startRouter(), w.startRouter()
	w.publish(20)
	w.converge("first messages", r1, r2)
	w.holeInQuiet(r1, r2)
	pos, err := r1.idx.Position(w.ctx, "quiet")
	if err != nil || pos.Hole == 0 {
		t.Fatalf("quiet's position %v (%v): want a hole recorded", pos, err)
	}
	close(stop)
	hb.Wait()
	time.Sleep(1500 * time.Millisecond) // past StaleAfter: the bridges are silent
	asked := w.answer("quiet", w.quietTableAt(pos))
	time.Sleep(3 * time.Second) // the retry is due every second or so
	if n := asked.Load(); n != 0 {
		t.Fatalf("quiet's silent bridge asked for its table %d times in 3 s", n)
	}
	w.notLive(300*time.Millisecond, "quiet", "its bridge silent", r1, r2)
	stop = make(chan struct{})
	hb = w.heartbeats(stop)
	t.Cleanup(func() { close(stop); hb.Wait() })
	testenv.WaitFor(t, 15*time.Second, "quiet live on both routers once its bridge heartbeats", func() bool {
		return r1.c.Live("quiet") && r2.c.Live("quiet")
	})
	if asked.Load() == 0 {
		t.Fatal("quiet live without its bridge's table")
	}
	w.converge("the table at the index's position", r1, r2)
}

// The stream lost quiet's last messages (retention removed them before
// either router read them) and quiet's engine has been quiet since: no
// later message of it shows a seq gap, but its bridge's heartbeats say
// its last message is at a stream seq both routers have consumed past.
// (An e0 message holds that seq here: to a router, one of quiet's
// messages removed from the stream looks the same.) Before, both routers
// read quiet live on the index without what the lost messages did, for
// as long as the engine stayed quiet (seen on the real binaries: both
// routers SIGSTOPped past the stream's retention). Now both hold it not
// live until a snapshot at or past that seq is loaded: the bridge's
// table, then both live, the index equal to the engines.
func TestSharedLostTailNotLive(t *testing.T) {
	w := newSharedWorld(t, 83, "e0", "quiet")
	r1, r2 := w.startRouter(), w.startRouter()
	w.publish(20)
	w.convergeBeating("first messages", r1, r2)
	w.keepBucket = true // the bucket keeps quiet's snapshot from before the loss
	w.lose("quiet")
	w.publishOne("e0")
	w.appliedLast(r1, "e0")
	w.appliedLast(r2, "e0")
	subj, _ := kvstream.EventsSubject(w.pool, "e0")
	m, err := w.stream().GetLastMsgForSubject(w.ctx, subj)
	if err != nil {
		t.Fatal(err)
	}
	last, quiet := m.Sequence, w.engine("quiet")
	if idx, truth := instBlocks(w.ctx, r1.idx, "quiet"), instBlocks(w.ctx, w.truth, "quiet"); idx == truth {
		t.Fatalf("the lost messages changed nothing the index shows (%v)", truth)
	}
	stop := make(chan struct{})
	var beats sync.WaitGroup
	beats.Go(func() {
		for {
			w.heartbeat("e0")
			w.heartbeatAt("quiet", quiet.seq, last)
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	})
	t.Cleanup(func() { close(stop); beats.Wait() })
	testenv.WaitFor(t, 10*time.Second, "the lost messages found by both routers", func() bool {
		return r1.c.status("quiet").Gaps == 1 && r2.c.status("quiet").Gaps == 1 && !r1.c.Live("quiet") && !r2.c.Live("quiet")
	})
	w.notLive(1500*time.Millisecond, "quiet", "after its last messages were lost", r1, r2)
	start := time.Now()
	w.answer("quiet", w.quietTableAt(kvindex.Position{Seq: last}))
	testenv.WaitFor(t, 15*time.Second, "quiet live on both routers after its bridge answered", func() bool {
		return r1.c.Live("quiet") && r2.c.Live("quiet")
	})
	t.Logf("quiet live on both routers %v after its bridge answered", time.Since(start).Round(time.Millisecond))
	w.converge("the bridge's table past the lost messages", r1, r2)
}

// restart has engine name restart: its bridge publishes the restart
// clear, and the new process starts empty, counting its seqs from 1.
func (w *sharedWorld) restart(name string) {
	w.t.Helper()
	w.restartClear(name)
	f := w.engine(name)
	clear(f.held)
	f.seq, f.table = 0, nil
	if _, err := w.truth.Apply(w.ctx, name, []events.Event{{Kind: events.AllBlocksCleared}}); err != nil {
		w.t.Fatal(err)
	}
	if st := w.snapshots[name]; st != nil {
		st.evs = nil
	}
}

// The shared index, the message after a clear lost: the router read
// quiet's restart clear, then fell behind retention, and the new
// process's first message was gone from the stream, with the clear,
// before it read it. The messages after it follow a clear, with no engine
// seq to compare theirs with: the router applied them at the clear's
// position and read quiet live, the index short of what the lost message
// stored. Now the stream no longer holding the clear gives the loss
// away: quiet is not live until its bridge's table past it is loaded,
// then the index equals the engines.
func TestSharedFirstMessageAfterClearLost(t *testing.T) {
	w, r := holeWorld(t, 97)
	w.keepBucket = true // the bucket keeps quiet's snapshot from before the restart
	w.restart("quiet")
	testenv.WaitFor(t, 10*time.Second, "the clear applied", func() bool { return r.c.status("quiet").Clears == 1 })
	w.stall(r.c)
	subj, _ := kvstream.EventsSubject(w.pool, "quiet")
	w.publishOne("quiet") // the new process's first message: lost
	lost, err := w.stream().GetLastMsgForSubject(w.ctx, subj)
	if err != nil {
		t.Fatal(err)
	}
	w.publishOne("quiet")
	w.publishOne("quiet")
	last, err := w.stream().GetLastMsgForSubject(w.ctx, subj)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := events.Decode(lost.Data); err != nil || b.Events[0].Kind != events.BlockStored {
		t.Fatalf("the lost message is %+v (%v), want a store", b.Events, err)
	}
	w.purgeBelow(lost.Sequence + 1) // retention removes it, and the clear, before the router reads them
	quiet := w.engine("quiet")
	testenv.WaitFor(t, 30*time.Second, "the router resumed past the loss", func() bool { return r.c.status("quiet").LastSeq == quiet.seq })
	w.notLive(1500*time.Millisecond, "quiet", "after the message after its clear was lost", r)
	if st := r.c.status("quiet"); st.Gaps != 1 || st.ReplayLost != 1 {
		t.Fatalf("gaps %d, replay lost %d: want the loss counted once", st.Gaps, st.ReplayLost)
	}
	w.answer("quiet", w.quietTableAt(kvindex.Position{Seq: last.Sequence}))
	testenv.WaitFor(t, 15*time.Second, "quiet live after its bridge answered", func() bool { return r.c.Live("quiet") })
	w.converge("the bridge's table past the lost message", r)
}

// The shared index, a resync's clear lost with the engine quiet after it:
// the router falls behind retention while quiet's engine removes blocks
// (messages the stream loses) and its bridge then resyncs (its clear,
// then its table in two chunks); retention removes the clear and the
// first chunk before the router reads them, and the second survives. No
// engine message follows to show the seq gap, and the heartbeats name no
// later message. Before, the router read quiet live, the index holding
// the removed blocks (12 GPU blocks, the engine 4); now it is not live
// until its bridge's table is loaded, then the index equals the engines.
func TestSharedQuietResyncClearLost(t *testing.T) {
	w, r := holeWorld(t, 101)
	w.keepBucket = true // the bucket keeps quiet's snapshot from before the loss
	w.stall(r.c)
	// Until the engine holds fewer blocks than the index, in two chains
	// at least: it removed blocks in the lost messages, which the
	// resync's table no longer stores.
	for n := 0; ; n++ {
		truth, idx := instBlocks(w.ctx, w.truth, "quiet")[0], instBlocks(w.ctx, r.idx, "quiet")[0]
		if truth < idx && len(w.tableDump("quiet")) >= 2 {
			break
		}
		if n == 50 {
			t.Fatalf("after 50 losses the engine holds %d blocks, the index %d", truth, idx)
		}
		w.lose("quiet")
	}
	last := w.chunkedResync("quiet")
	w.purgeBelow(last)
	testenv.WaitFor(t, 30*time.Second, "the router resumed past the loss", func() bool { return r.c.status("quiet").StreamSeq == last })
	if w.diff(r.idx) == "" {
		t.Fatal("the lost messages changed nothing the index shows")
	}
	w.notLive(1500*time.Millisecond, "quiet", "after its resync's clear was lost", r)
	if st := r.c.status("quiet"); st.Gaps != 1 || st.ReplayLost != 1 {
		t.Fatalf("gaps %d, replay lost %d: want the loss counted once", st.Gaps, st.ReplayLost)
	}
	w.answer("quiet", w.quietTableAt(kvindex.Position{Seq: last}))
	testenv.WaitFor(t, 15*time.Second, "quiet live after its bridge answered", func() bool { return r.c.Live("quiet") })
	w.converge("the bridge's table after the resync", r)
}

// tableDump is engine name's bridge's table as the bridge dumps it: a
// stored event per chain of blocks.
func (w *sharedWorld) tableDump(name string) []events.Event {
	tab := bridge.NewTable(0)
	tab.Apply(w.snapshots[name].evs)
	return tab.Events()
}

// chunkedResync publishes a resync of engine name's bridge as the bridge
// does: its clear, then its table's chains in two chunks. It returns the
// stream seq of the last.
func (w *sharedWorld) chunkedResync(name string) uint64 {
	w.t.Helper()
	dump := w.tableDump(name)
	if len(dump) < 2 {
		w.t.Fatalf("%s's table dumps as %d events, want two chunks' worth", name, len(dump))
	}
	half := len(dump) / 2
	w.synthetic(name, kvstream.SyntheticResync, events.Event{Kind: events.AllBlocksCleared})
	w.synthetic(name, kvstream.SyntheticResync, dump[:half]...)
	w.synthetic(name, kvstream.SyntheticResync, dump[half:]...)
	subj, _ := kvstream.EventsSubject(w.pool, name)
	last, err := w.stream().GetLastMsgForSubject(w.ctx, subj)
	if err != nil {
		w.t.Fatal(err)
	}
	return last.Sequence
}

// The other side of TestSharedQuietResyncClearLost: two routers read
// quiet's resync whole (its clear, then its table in two chunks) between
// its engine messages, and find nothing lost: no gap, no loss, no
// snapshot loaded, and the index equals the engines.
func TestSharedResyncReadWholeNoLoss(t *testing.T) {
	w := newSharedWorld(t, 103, "e0", "quiet")
	r1, r2 := w.startRouter(), w.startRouter()
	w.publish(20)
	w.convergeBeating("first messages", r1, r2)
	loads := func(r *router) float64 {
		return testenv.Metric(t, r.reg, "kvrouter_events_snapshot_loads_total", nil)
	}
	before1, before2 := loads(r1), loads(r2)
	w.chunkedResync("quiet")
	w.publish(5)
	w.convergeBeating("after the resync", r1, r2)
	for i, r := range []*router{r1, r2} {
		if st := r.c.status("quiet"); st.Gaps != 0 || st.ReplayLost != 0 {
			t.Fatalf("router %d: gaps %d, replay lost %d: want none, nothing was lost", i+1, st.Gaps, st.ReplayLost)
		}
	}
	if l1, l2 := loads(r1), loads(r2); l1 != before1 || l2 != before2 {
		t.Fatalf("snapshot loads %v and %v after the resync: want none", l1-before1, l2-before2)
	}
}

// The shared index's repair replay meets a resync's chunk whose clear is
// gone: Redis saved its RDB, quiet's engine then removed blocks and its
// bridge resynced (its clear, then its table in two chunks), the router
// applying it all; then quiet's messages since the save up to the first
// chunk were removed from the stream (from its middle: e0's before them
// remain), and Redis restarted from the RDB. The repair replays from the
// index's restored position, quiet's message at the save, to the second
// chunk alone: applied over an older state without the clear, it left
// the index short of what the removed messages did, and quiet read live
// (5 GPU blocks, the engine 10; orphanChunk off). Now the chunk after an
// engine message ends the replay as a hole would (errReplayGap), the
// bucket's snapshot (from before the save) does not reach past it, and
// quiet is not live until its bridge's table is loaded.
func TestSharedReplayMeetsResyncChunkWithoutClear(t *testing.T) {
	w, r := holeWorld(t, 107)
	for n := 0; instBlocks(w.ctx, w.truth, "quiet")[0] < 4; n++ {
		if n == 100 {
			t.Fatal("after 100 messages quiet's engine holds fewer than 4 blocks")
		}
		w.publishOne("quiet")
	}
	w.convergeBeating("quiet holding blocks", r)
	w.saveRDB()
	w.keepBucket = true // the bucket keeps quiet's snapshot from before the save
	saved, err := r.idx.Position(w.ctx, "quiet")
	if err != nil || !saved.Seeded {
		t.Fatalf("quiet's position at the save: %v, %v", saved, err)
	}
	atSave := instBlocks(w.ctx, r.idx, "quiet")[0]
	for n := 0; instBlocks(w.ctx, w.truth, "quiet")[0] >= atSave || len(w.tableDump("quiet")) < 2; n++ {
		if n == 100 {
			t.Fatalf("after 100 messages the engine holds %d blocks, %d at the save", instBlocks(w.ctx, w.truth, "quiet")[0], atSave)
		}
		w.publishOne("quiet")
	}
	last := w.chunkedResync("quiet")
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	t.Cleanup(func() { close(stop); hb.Wait() })
	w.converge("the resync applied", r)
	msgs := w.messages("quiet", saved.Seq)
	for _, m := range msgs[:len(msgs)-1] { // all but the last chunk
		if err := w.stream().DeleteMsg(w.ctx, m.Sequence); err != nil {
			t.Fatal(err)
		}
	}
	w.redis.Kill()
	testenv.WaitFor(t, 10*time.Second, "the outage noticed", func() bool { return !r.c.IndexConsistent() })
	w.redis.Start() // loads the RDB: quiet as of the save
	testenv.WaitFor(t, 20*time.Second, "quiet's repair tried", func() bool { return r.c.status("quiet").Gaps > 0 || r.c.IndexConsistent() })
	w.notLive(1500*time.Millisecond, "quiet", "after its repair met a resync's chunk without its clear", r)
	w.answer("quiet", w.quietTableAt(kvindex.Position{Seq: last}))
	w.converge("the bridge's table after the resync", r)
}
