package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// TestRestartClearLostToRetention: the consumer falls behind retention
// while the engine restarts, so the bridge's restart clear and the new
// process's first message are gone before it reads them. The new
// process's next messages carry engine seqs at or below the old
// process's last, which the consumer skips as duplicates, and no later
// message shows a gap. The bridge's heartbeat (its engine seq behind the
// one applied, at a stream seq this consumer has read) gives it away: the
// instance is reloaded from the bridge's table, and the old process's
// blocks do not stay live. Before, they did, for good, and the new
// process's first blocks were never applied (a review).
func TestRestartClearLostToRetention(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.fiveThenApplied(a) // old process: engine seqs 1-5, blocks 11-15, stream seqs 1-5
	e.stall(c)
	// The engine restarts: the bridge publishes its restart clear, then
	// the new process's messages.
	e.restartClear("i0") // stream seq 6
	e.store("i0", 1, 21) // stream seq 7
	e.store("i0", 2, 22) // stream seq 8
	e.store("i0", 3, 23) // stream seq 9
	e.purgeBelow(8)      // retention removes 6 and 7 before the router reads them
	// The bridge's table: the new process's three blocks.
	e.putSnapshot("i0", 9, 3, 21, 22, 23)
	testenv.WaitFor(t, 20*time.Second, "consumer resumed past the loss", func() bool { return c.dispatched() >= 9 })
	if got, _ := a.get("i0"); !slices.Contains(got, 15) || slices.Contains(got, 22) {
		t.Fatalf("before the heartbeat: applied %v, want the old process's blocks and the new one's skipped (the case under test)", got)
	}
	gaps := counterValue(c.m.gaps)
	e.heartbeatAt("i0", 3, 9)
	testenv.WaitFor(t, 20*time.Second, "the bridge's table reloaded", func() bool {
		got, _ := a.get("i0")
		return slices.Equal(got, []uint64{21, 22, 23})
	})
	if g := counterValue(c.m.gaps); g != gaps+1 {
		t.Errorf("seq gaps counted %v, want %v (the backwards seq counted once)", g, gaps+1)
	}
	// The new process carries on: applied in order after the reload.
	for seq := uint64(4); seq <= 7; seq++ {
		e.store("i0", seq, 20+seq)
	}
	testenv.WaitFor(t, 20*time.Second, "seq 7 applied", func() bool { g, _ := a.get("i0"); return slices.Contains(g, 27) })
	e.heartbeatAt("i0", 7, 13)
	testenv.WaitFor(t, 20*time.Second, "i0 live", func() bool { return c.Live("i0") })
	if got, _ := a.get("i0"); !slices.Equal(got, []uint64{21, 22, 23, 24, 25, 26, 27}) {
		t.Fatalf("after the new process's messages: %v, want 21-27 and none of the old process's", got)
	}
}

// stall has the router stop reading, as in a stall or a partition: its
// consumer stopped, and a message the pull already pending still
// delivers dropped as a replaced consumer's (the consumer's Stop
// unsubscribes asynchronously: a flaky run of
// TestRestartClearLostToRetention read the restart clear published after
// it). The watchdog re-creates the consumer after the last message
// dispatched once messages have waited several seconds.
func (e *env) stall(c *Consumer) {
	c.sc.mu.Lock()
	c.sc.cc.Stop()
	c.sc.gen.Add(1)
	c.sc.mu.Unlock()
}

// restartClear publishes the bridge's restart clear of instance.
func (e *env) restartClear(instance string) {
	e.t.Helper()
	e.synthetic(instance, kvstream.SyntheticRestart, events.Event{Kind: events.AllBlocksCleared})
}

// synthetic publishes a bridge's synthetic message of instance, of kind
// reason (kvstream.Synthetic*, no engine seq), holding evs.
func (e *env) synthetic(instance, reason string, evs ...events.Event) {
	e.t.Helper()
	subj, _ := kvstream.EventsSubject(e.pool, instance)
	p, _ := events.Encode(nil, events.Batch{Events: evs}, events.EncodingMap)
	h := kvstream.EventHeaders{Pool: e.pool, Instance: instance, Synthetic: reason}
	if _, err := e.js.PublishMsg(e.ctx, &nats.Msg{Subject: subj, Data: p, Header: h.Header()}); err != nil {
		e.t.Fatal(err)
	}
}

// TestFirstMessageAfterClearLost: the consumer reads the bridge's
// restart clear, then falls behind retention, and the new process's
// first message (engine seq 0) is gone from the stream, with the clear,
// before it reads it. The messages after it follow a clear, with no
// engine seq to compare theirs with: they were applied, and the instance
// read live without the lost message's block, for good (a flaky run of
// TestRestartClearLostToRetention). Now the stream no longer holding the
// clear gives the loss away: a seq gap, the snapshot reloaded; the bridge
// not answering and the bucket holding none, the instance is not live
// until the bridge's table arrives, then live and exact. A clear whose
// next message comes after another instance's, nothing lost, reloads
// nothing.
func TestFirstMessageAfterClearLost(t *testing.T) {
	e := newEnv(t)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	c := e.start(cfg)
	e.fiveThenApplied(a) // old process: engine seqs 1-5, blocks 11-15, stream seqs 1-5
	e.restartClear("i0") // stream seq 6
	testenv.WaitFor(t, 20*time.Second, "the clear applied", func() bool {
		got, _ := a.get("i0")
		return len(got) == 0 && c.status("i0").Clears == 1
	})
	e.stall(c)
	e.store("i0", 0, 20) // stream seq 7: the new process's first message
	e.store("i0", 1, 21) // stream seq 8
	e.store("i0", 2, 22) // stream seq 9
	e.purgeBelow(8)      // retention removes 7, and the clear, before the router reads them
	testenv.WaitFor(t, 30*time.Second, "consumer resumed past the loss", func() bool { return c.status("i0").LastSeq == 2 })
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		e.heartbeatAt("i0", 2, 9)
		if c.Live("i0") {
			s, _ := a.get("i0")
			t.Fatalf("i0 live on %v, the engine [20 21 22]: its first message after the clear lost from the stream", s)
		}
	}
	if st := c.status("i0"); st.Gaps != 1 || st.ReplayLost != 1 || st.NotLive != "hole" {
		t.Fatalf("gaps %d, replay lost %d, not live %q: want the loss counted once, not live for the hole", st.Gaps, st.ReplayLost, st.NotLive)
	}
	e.answer("i0", e.snapshot("i0", 9, 2, 20, 21, 22))
	testenv.WaitFor(t, 10*time.Second, "live after the bridge's table", func() bool {
		e.heartbeatAt("i0", 2, 9)
		return c.Live("i0")
	})
	if s, _ := a.get("i0"); !slices.Equal(s, []uint64{20, 21, 22}) {
		t.Fatalf("live, the index holding %v, the engine [20 21 22]", s)
	}
	// Nothing lost: the clear is still in the stream when the next
	// message comes, another instance's between them.
	loads := counterValue(c.m.snapshotLoads.WithLabelValues("request"))
	e.restartClear("i0") // stream seq 10
	e.store("i1", 1, 30) // stream seq 11
	e.store("i0", 5, 25) // stream seq 12
	testenv.WaitFor(t, 20*time.Second, "engine seq 5 applied", func() bool { return c.status("i0").LastSeq == 5 })
	if st := c.status("i0"); st.Gaps != 1 || !c.Live("i0") {
		t.Fatalf("gaps %d, live %v after a clear with nothing lost: want 1 (the first loss), live", st.Gaps, c.Live("i0"))
	}
	if n := counterValue(c.m.snapshotLoads.WithLabelValues("request")) - loads; n != 0 {
		t.Fatalf("%v snapshot loads after a clear with nothing lost", n)
	}
	if s, _ := a.get("i0"); !slices.Equal(s, []uint64{25}) {
		t.Fatalf("the index holds %v, the engine [25]", s)
	}
}

// TestStartAfterStreamRecreated: a router started after the stream was
// re-created (a wiped store whose idle bridge put its snapshot again, or
// an operator's delete and re-create) while an instance's bridge has not
// published since: its snapshot numbers the old stream, past the new
// one's last message. The new stream's messages of the instance are
// applied, not skipped as covered by that number (a review: before, they
// were, for as long as the new stream stayed below the old number).
func TestStartAfterStreamRecreated(t *testing.T) {
	e := newEnv(t)
	for seq := uint64(1); seq <= 5; seq++ {
		e.store("i0", seq, 10+seq)
	}
	e.putSnapshotBytes("i0", e.oldStreamSnapshot()) // stream seq 5, engine seq 5
	e.recreateStream()
	// The bridge carries on in the new stream: stream seqs 1 and 2.
	e.store("i0", 6, 16)
	e.store("i0", 7, 17)
	c, a := e.startRecording()
	testenv.WaitFor(t, 10*time.Second, "ready", c.Ready)
	e.heartbeatAt("i0", 7, 2)
	testenv.WaitFor(t, 20*time.Second, "the new stream's messages applied", func() bool {
		got, _ := a.get("i0")
		// The snapshot's store (the recorder notes a store by its first
		// block, 11), then the new stream's two.
		return slices.Equal(got, []uint64{11, 16, 17})
	})
	if n := counterValue(c.m.messages.WithLabelValues("covered_by_snapshot")); n != 0 {
		t.Errorf("%v messages skipped as covered by the old stream's snapshot", n)
	}
}

// failingApplier is a recorder whose Apply fails while fail is set.
type failingApplier struct {
	*recorder
	fail atomic.Bool
}

func (f *failingApplier) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	if f.fail.Load() && len(evs) == 1 && evs[0].Kind == events.BlockRemoved {
		return kvindex.ApplyResult{}, errors.New("refused")
	}
	return f.recorder.Apply(ctx, instance, evs)
}

// TestReloadReplayShortNotLive: a reload (the engine back up) loads the
// bucket's snapshot, older than what was applied, and replays the stream
// after it; that replay stops short (here the index refuses the replayed
// removal). The instance then holds the old snapshot without the
// removals after it: not live until a reload completes, which its
// heartbeats queue (a review: before, the heartbeats made it live on the
// removed block for as long as the engine stayed quiet).
func TestReloadReplayShortNotLive(t *testing.T) {
	e := newEnv(t)
	fa := &failingApplier{recorder: newRecorder()}
	cfg := e.cfg
	cfg.Applier = fa
	c := e.start(cfg)
	e.store("i0", 1, 11)
	e.store("i0", 2, 12)
	e.send("i0", 3, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{11}, Medium: "GPU"})
	e.heartbeatAt("i0", 3, 3)
	testenv.WaitFor(t, 20*time.Second, "applied, live", func() bool {
		got, _ := fa.get("i0")
		return slices.Equal(got, []uint64{12}) && c.Live("i0")
	})
	e.putSnapshot("i0", 1, 1, 11) // the bucket's, older than what was applied
	fa.fail.Store(true)
	down := func(down bool) {
		subj, _ := kvstream.InstancesSubject(e.pool, "i0")
		b, _ := json.Marshal(kvstream.Heartbeat{Pool: e.pool, Instance: "i0", URL: "http://i0", BlockSize: 16,
			EngineSeq: 3, StreamSeq: 3, EngineDown: down, Time: time.Now()})
		_ = e.nc.Publish(subj, b)
	}
	down(true)
	testenv.WaitFor(t, 20*time.Second, "engine down", func() bool { return !c.Live("i0") })
	down(false) // back up: the bridge's table reloaded (here the bucket's)
	testenv.WaitFor(t, 20*time.Second, "the reload's replay refused", func() bool {
		got, _ := fa.get("i0")
		return slices.Equal(got, []uint64{11, 12})
	})
	notLive := func(what string) {
		t.Helper()
		for range 8 {
			e.heartbeatAt("i0", 3, 3)
			time.Sleep(200 * time.Millisecond)
			if c.Live("i0") {
				got, _ := fa.get("i0")
				t.Fatalf("live on a replay stopped short (%s): the index holds %v, block 11 removed since", what, got)
			}
		}
	}
	notLive("heartbeats")
	// The retry finds the snapshot unreadable: the state is still the
	// one the replay left short (a review: the retry's start cleared the
	// hold, and the heartbeats after a failed fetch made it live).
	e.putSnapshotBytes("i0", []byte("not a snapshot"))
	notLive("the retry's snapshot unreadable")
	e.putSnapshot("i0", 1, 1, 11)
	fa.fail.Store(false)
	testenv.WaitFor(t, 20*time.Second, "reloaded whole, live", func() bool {
		e.heartbeatAt("i0", 3, 3)
		got, _ := fa.get("i0")
		return slices.Equal(got, []uint64{12}) && c.Live("i0")
	})
}
