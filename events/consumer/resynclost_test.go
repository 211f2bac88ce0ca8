package consumer

import (
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// resync publishes one message of the bridge's resync of instance, as
// publishResync does: its clear first, then its table in chunks, every
// one marked resync and carrying no engine seq (the resync keeps the
// bridge's).
func (e *env) resync(instance string, evs ...events.Event) {
	e.t.Helper()
	e.synthetic(instance, kvstream.SyntheticResync, evs...)
}

// startFive starts a consumer of e recording into a new recorder, i0's
// bridge not answering snapshot requests (given up after 100 ms), and
// has it apply i0's engine seqs 1-5 (blocks 11-15, stream seqs 1-5).
func (e *env) startFive() (*Consumer, *recorder) {
	e.t.Helper()
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	c := e.start(cfg)
	e.fiveThenApplied(a)
	return c, a
}

// TestResyncChunkOutlivesLostClear: the consumer falls behind retention
// while the engine removes a block and the bridge then resyncs (its clear,
// then its table in two chunks); retention removes the removal, the clear
// and the first chunk before the consumer reads them, and the second
// chunk survives. Every resync message was taken as a clear: the chunk
// started the engine seqs over, hiding the gap before the engine's next
// message, and stood in for the clear's stream seq, which the stream still
// held: the instance read live holding the removed block, for good (a
// review: live on [11 12 13 14 15 14 15 17], no gap counted). Now only the
// resync's clear starts them over: the next engine message is a seq gap,
// the instance not live (the bridge not answering) until the bridge's
// table is loaded, then live and exact. With an older snapshot in the
// bucket, the replay after it reads the chunk too, and must not take it
// for a clear either.
func TestResyncChunkOutlivesLostClear(t *testing.T) {
	t.Run("no snapshot", func(t *testing.T) { resyncChunkOutlivesLostClear(t, false, false) })
	t.Run("older snapshot", func(t *testing.T) { resyncChunkOutlivesLostClear(t, true, false) })
}

// TestQuietResyncClearLost: TestResyncChunkOutlivesLostClear with the
// engine quiet after the resync. No engine message comes after the chunk
// to show the seq gap, and the bridge's heartbeats name the chunk's
// stream seq, the consumer's own last: no lost tail either. The instance
// read live holding the removed block for as long as the engine stayed
// quiet ([11 12 13 14 15 14 15] against [12 13 14 15], no gap counted).
// Now the chunk itself, after an engine message and no clear, gives the
// loss away: not live until the bridge's table is loaded.
func TestQuietResyncClearLost(t *testing.T) { resyncChunkOutlivesLostClear(t, false, true) }

func resyncChunkOutlivesLostClear(t *testing.T, older, quiet bool) {
	e := newEnv(t)
	if older {
		e.putSnapshot("i0", 3, 3, 11, 12, 13) // the bucket's, replayed from at the gap
	}
	c, a := e.startFive()
	e.stall(c)
	e.send("i0", 6, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{11}}) // stream seq 6: lost
	e.resync("i0", events.Event{Kind: events.AllBlocksCleared})                         // 7: the resync's clear, lost
	e.resync("i0", storedBlock(12), storedBlock(13))                                    // 8: lost
	e.resync("i0", storedBlock(14), storedBlock(15))                                    // 9: survives
	engine, engineSeq, last := []uint64{12, 13, 14, 15}, uint64(6), uint64(9)
	if !quiet {
		e.store("i0", 7, 17) // 10
		engine, engineSeq, last = append(engine, 17), 7, 10
	}
	e.purgeBelow(9)
	testenv.WaitFor(t, 30*time.Second, "consumer resumed past the loss", func() bool { return c.status("i0").StreamSeq == last })
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		e.heartbeatAt("i0", engineSeq, last)
		if c.Live("i0") {
			got, _ := a.get("i0")
			st := c.status("i0")
			t.Fatalf("i0 live holding %v, the engine %v: its resync's clear lost, a chunk after it survived; gaps %d, replay lost %d",
				got, engine, st.Gaps, st.ReplayLost)
		}
	}
	if st := c.status("i0"); st.Gaps != 1 || st.ReplayLost != 1 || st.NotLive != "hole" {
		t.Fatalf("gaps %d, replay lost %d, not live %q: want the loss counted once, not live for the hole", st.Gaps, st.ReplayLost, st.NotLive)
	}
	e.answer("i0", e.snapshot("i0", last, engineSeq, engine...))
	testenv.WaitFor(t, 10*time.Second, "live after the bridge's table", func() bool {
		e.heartbeatAt("i0", engineSeq, last)
		return c.Live("i0")
	})
	if got, _ := a.get("i0"); !slices.Equal(got, engine) {
		t.Fatalf("live, the index holding %v, the engine %v", got, engine)
	}
}

// TestQuietResyncAgedOut: the consumer reads the bridge's resync, then
// the instance is quiet while retention removes all of it, nothing lost.
// Its next engine message, after another instance's, finds the resync's
// clear gone from the stream and reloads; the bridge does not answer, and
// the bucket holds its table after the resync, current to the resync's
// last message, with the engine seq the resync kept, which the message
// follows on from: live and exact, no loss counted. Before, a snapshot
// counted only strictly past the clear's stream seq, which a resync's
// table chunk stood in for, as the clear itself is the last message of an
// empty table's resync: held not live as a hole (replay_lost) until the
// bridge answered (a review).
func TestQuietResyncAgedOut(t *testing.T) {
	t.Run("table", func(t *testing.T) { quietResyncAgedOut(t, false) })
	t.Run("empty table", func(t *testing.T) { quietResyncAgedOut(t, true) })
}

func quietResyncAgedOut(t *testing.T, empty bool) {
	e := newEnv(t)
	c, a := e.startFive()
	table, seq := []uint64{11, 12, 13, 14, 15}, uint64(5)
	if empty {
		// The engine drops its blocks; a bridge restarted since resyncs
		// its empty table: the clear alone.
		e.send("i0", 6, events.Event{Kind: events.BlockRemoved, BlockHashes: table}) // stream seq 6
		table, seq = nil, 6
		e.resync("i0", events.Event{Kind: events.AllBlocksCleared}) // 7
	} else {
		e.resync("i0", events.Event{Kind: events.AllBlocksCleared}) // 6
		var chunk []events.Event
		for _, h := range table {
			chunk = append(chunk, storedBlock(h))
		}
		e.resync("i0", chunk...) // 7
	}
	testenv.WaitFor(t, 20*time.Second, "the resync applied", func() bool { return c.status("i0").StreamSeq == 7 })
	e.putSnapshot("i0", 7, seq, table...) // the bridge's table after its resync
	e.purgeBelow(8)                       // retention removes it all, the instance quiet
	e.store("i1", 1, 30)                  // stream seq 8
	e.store("i0", seq+1, 20)              // 9
	testenv.WaitFor(t, 20*time.Second, "the engine's next message applied", func() bool { return c.status("i0").LastSeq == seq+1 })
	if st := c.status("i0"); st.ReplayLost != 0 {
		t.Fatalf("replay lost %d, gaps %d, not live %q after a resync that aged out, nothing lost", st.ReplayLost, st.Gaps, st.NotLive)
	}
	testenv.WaitFor(t, 10*time.Second, "i0 live", func() bool {
		e.heartbeatAt("i0", seq+1, 9)
		return c.Live("i0")
	})
	got, _ := a.get("i0")
	if want := append(table, 20); !slices.Equal(got, want) {
		t.Fatalf("live, the index holding %v, the engine %v", got, want)
	}
}

// TestResyncReadWholeNoLoss: the other side of TestQuietResyncClearLost.
// A consumer that reads a resync whole (its clear, then its table in two
// chunks) between engine messages, heartbeats naming each message as it
// is published, finds nothing lost: no gap, no snapshot reload, live
// throughout, and exact.
func TestResyncReadWholeNoLoss(t *testing.T) {
	e := newEnv(t)
	c, a := e.startFive()
	testenv.WaitFor(t, 10*time.Second, "i0 live", func() bool {
		e.heartbeatAt("i0", 5, 5)
		return c.Live("i0")
	})
	_, purges := a.get("i0")
	step := func(engineSeq, streamSeq uint64, publish func()) {
		t.Helper()
		publish()
		e.heartbeatAt("i0", engineSeq, streamSeq)
		if !c.Live("i0") {
			t.Fatalf("i0 not live at stream seq %d: %+v", streamSeq, c.status("i0"))
		}
	}
	step(6, 6, func() { e.send("i0", 6, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{11}}) })
	step(6, 7, func() { e.resync("i0", events.Event{Kind: events.AllBlocksCleared}) })
	step(6, 8, func() { e.resync("i0", storedBlock(12), storedBlock(13)) })
	step(6, 9, func() { e.resync("i0", storedBlock(14), storedBlock(15)) })
	step(7, 10, func() { e.store("i0", 7, 17) })
	testenv.WaitFor(t, 10*time.Second, "engine seq 7 applied", func() bool { return c.status("i0").LastSeq == 7 })
	e.heartbeatAt("i0", 7, 10)
	if got, n := a.get("i0"); !slices.Equal(got, []uint64{12, 13, 14, 15, 17}) || n != purges {
		t.Fatalf("the index holds %v after %d reloads, the engine [12 13 14 15 17]: want it exact with none", got, n-purges)
	}
	if st := c.status("i0"); st.Gaps != 0 || st.ReplayLost != 0 || !c.Live("i0") {
		t.Fatalf("gaps %d, replay lost %d, not live %q: want none, nothing was lost", st.Gaps, st.ReplayLost, st.NotLive)
	}
}

// TestReplayMeetsResyncChunkWithoutClear: the consumer read a resync whole
// (live and exact), then retention removed its clear and first chunk, and
// a reload (the engine reported down, then up again) finds the bridge not
// answering and the bucket's snapshot older than the resync: its replay
// after the snapshot reads the surviving chunk with nothing before it
// but the snapshot. Applied as it was, the chunk left the snapshot's
// block 11, which the engine removed in a message now gone, and the
// instance read live; now it is a hole: not live until the bridge's table
// is loaded.
func TestReplayMeetsResyncChunkWithoutClear(t *testing.T) {
	e := newEnv(t)
	e.putSnapshot("i0", 3, 3, 11, 12, 13) // the bucket's, older than the resync
	c, a := e.startFive()
	e.send("i0", 6, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{11}}) // stream seq 6
	e.resync("i0", events.Event{Kind: events.AllBlocksCleared})                         // 7
	e.resync("i0", storedBlock(12), storedBlock(13))                                    // 8
	e.resync("i0", storedBlock(14), storedBlock(15))                                    // 9
	testenv.WaitFor(t, 10*time.Second, "the resync applied", func() bool {
		got, _ := a.get("i0")
		return c.status("i0").StreamSeq == 9 && slices.Equal(got, []uint64{12, 13, 14, 15})
	})
	e.purgeBelow(9)
	_, purges := a.get("i0")
	down := func(down bool) {
		subj, _ := kvstream.InstancesSubject(e.pool, "i0")
		b, _ := json.Marshal(kvstream.Heartbeat{Pool: e.pool, Instance: "i0", EngineSeq: 6, StreamSeq: 9, EngineDown: down, Time: time.Now()})
		if err := e.nc.Publish(subj, b); err != nil {
			t.Fatal(err)
		}
	}
	down(true)
	testenv.WaitFor(t, 10*time.Second, "engine down", func() bool { return c.status("i0").EngineDown })
	down(false)
	testenv.WaitFor(t, 10*time.Second, "reloaded", func() bool { _, n := a.get("i0"); return n > purges })
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		e.heartbeatAt("i0", 6, 9)
		if c.Live("i0") {
			got, _ := a.get("i0")
			t.Fatalf("i0 live holding %v, the engine [12 13 14 15]: the replay applied a resync's chunk without its clear", got)
		}
	}
	if st := c.status("i0"); st.ReplayLost != 1 || st.NotLive != "hole" {
		t.Fatalf("replay lost %d, not live %q: want the loss counted once, not live for the hole", st.ReplayLost, st.NotLive)
	}
	e.answer("i0", e.snapshot("i0", 9, 6, 12, 13, 14, 15))
	testenv.WaitFor(t, 10*time.Second, "live after the bridge's table", func() bool {
		e.heartbeatAt("i0", 6, 9)
		return c.Live("i0")
	})
	if got, _ := a.get("i0"); !slices.Equal(got, []uint64{12, 13, 14, 15}) {
		t.Fatalf("live, the index holding %v, the engine [12 13 14 15]", got)
	}
}
