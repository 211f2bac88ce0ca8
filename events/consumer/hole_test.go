package consumer

import (
	"encoding/json"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// holeEnv is a memory-index consumer of i0 whose bridge does not answer
// snapshot requests, the bucket holding i0's snapshot at stream seq 1
// (engine seq 1, block 1). It consumed engine seqs 1 and 2 (blocks 1 and
// 2); then the engine removed block 2 (engine seq 3) and stored block 4
// (engine seq 4, stream seq 3), and the message of engine seq 3 never
// reached the router (the stream lost it: retention passed the router).
// The engine holds [1 4].
func holeEnv(t *testing.T) (*env, *Consumer, *recorder) {
	e := newEnv(t)
	e.putSnapshot("i0", 1, 1, 1)
	e.store("i0", 1, 1)
	e.store("i0", 2, 2)
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	c := e.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "blocks 1 and 2, live", func() bool {
		s, _ := a.get("i0")
		return slices.Equal(s, []uint64{1, 2}) && c.Live("i0")
	})
	e.store("i0", 4, 4)
	testenv.WaitFor(t, 10*time.Second, "engine seq 4 applied", func() bool { return c.status("i0").LastSeq == 4 })
	return e, c, a
}

// answer has the bridge answer instance's snapshot requests with snap;
// it returns the count of requests answered.
func (e *env) answer(instance string, snap []byte) *atomic.Int64 {
	e.t.Helper()
	var n atomic.Int64
	subj, _ := kvstream.SnapshotSubject(e.pool, instance)
	sub, err := e.nc.Subscribe(subj, func(m *nats.Msg) { n.Add(1); _ = m.Respond(snap) })
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := e.nc.Flush(); err != nil {
		e.t.Fatal(err)
	}
	return &n
}

// A hole in an instance's engine seqs (messages lost from the stream)
// with the memory index, the snapshot reloaded for it older than the hole
// (the bridge does not answer; the bucket's predates it): the consumer
// counted the loss and kept the instance live, its index holding block 2,
// which the engine removed in a lost message ([1 2 4] against [1 4]). Now
// it is not live, heartbeats retrying the load (a second apart at the
// soonest, the hole counted once), until the bridge answers with its
// table past the hole: then live, and the index equals the engine.
func TestMemoryHoleNotLive(t *testing.T) {
	e, c, a := holeEnv(t)
	bucketLoads := func() float64 { return counterValue(c.m.snapshotLoads.WithLabelValues("bucket")) }
	before := bucketLoads()
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		e.heartbeat("i0")
		if c.Live("i0") {
			s, _ := a.get("i0")
			t.Fatalf("i0 live after a hole in its engine seqs: the index holds %v, the engine [1 4]", s)
		}
	}
	n := bucketLoads() - before
	if n < 1 || n > 4 {
		t.Fatalf("%v snapshot loads in 2.5 s of heartbeats: want the hole's load retried, a second apart", n)
	}
	if st := c.status("i0"); st.ReplayLost != 1 || st.State != StateStale || st.NotLive != "hole" {
		t.Fatalf("replay lost %d, state %v, not live %q: want one hole counted, stale for the hole", st.ReplayLost, st.State, st.NotLive)
	}
	// The bridge answers again, with its table at engine seq 4.
	e.answer("i0", e.snapshot("i0", 3, 4, 1, 4))
	answered := time.Now()
	testenv.WaitFor(t, 10*time.Second, "live after the bridge's table", func() bool {
		e.heartbeat("i0")
		return c.Live("i0")
	})
	t.Logf("not live for 2.5 s of heartbeats, %v loads retried; live %v after the bridge answered", n, time.Since(answered).Round(time.Millisecond))
	if s, _ := a.get("i0"); !slices.Equal(s, []uint64{1, 4}) {
		t.Fatalf("live, the index holding %v, the engine [1 4]", s)
	}
	if st := c.status("i0"); st.ReplayLost != 1 || st.NotLive != "" {
		t.Fatalf("replay lost %d, not live %q after the repair, want 1 and live", st.ReplayLost, st.NotLive)
	}
}

// The instance held not live by a hole comes back, exact: at a later
// message once the bridge answers (the load retried there), or at a
// clear after the hole (here the engine's), which wipes what the lost
// messages did though the bridge still does not answer, and makes the
// hole's pending load moot.
func TestMemoryHoleRecovers(t *testing.T) {
	t.Run("message after the bridge answers", func(t *testing.T) {
		e, c, a := holeEnv(t)
		if c.Live("i0") {
			t.Fatal("live after the hole")
		}
		e.answer("i0", e.snapshot("i0", 3, 4, 1, 4))
		want := []uint64{1, 4}
		deadline := time.Now().Add(20 * time.Second)
		for seq := uint64(5); !c.Live("i0"); seq++ {
			if time.Now().After(deadline) {
				t.Fatalf("not live 20 s after the bridge answered: %+v", c.status("i0"))
			}
			e.store("i0", seq, seq)
			want = append(want, seq)
			testenv.WaitFor(t, 10*time.Second, "the message applied", func() bool { return c.status("i0").LastSeq == seq })
			time.Sleep(200 * time.Millisecond)
		}
		if s, _ := a.get("i0"); !slices.Equal(s, want) {
			t.Fatalf("live, the index holding %v, the engine %v", s, want)
		}
	})
	t.Run("clear after the hole", func(t *testing.T) {
		e, c, a := holeEnv(t)
		e.send("i0", 5, events.Event{Kind: events.AllBlocksCleared})
		e.store("i0", 6, 6)
		testenv.WaitFor(t, 10*time.Second, "live after the clear and engine seq 6", func() bool {
			return c.Live("i0") && c.status("i0").LastSeq == 6
		})
		if s, _ := a.get("i0"); !slices.Equal(s, []uint64{6}) {
			t.Fatalf("live, the index holding %v, the engine [6]", s)
		}
		if st := c.status("i0"); st.ReplayLost != 1 {
			t.Fatalf("replay lost %d, want 1", st.ReplayLost)
		}
		// The hole's load, due again a second after the last, is moot
		// after the clear: a later message loads nothing.
		loads := counterValue(c.m.snapshotLoads.WithLabelValues("bucket"))
		time.Sleep(1500 * time.Millisecond)
		e.store("i0", 7, 7)
		testenv.WaitFor(t, 10*time.Second, "engine seq 7 applied", func() bool { return c.status("i0").LastSeq == 7 })
		if n := counterValue(c.m.snapshotLoads.WithLabelValues("bucket")) - loads; n != 0 || !c.Live("i0") {
			t.Fatalf("%v snapshot loads after the clear, live %v", n, c.Live("i0"))
		}
		if s, _ := a.get("i0"); !slices.Equal(s, []uint64{6, 7}) {
			t.Fatalf("the index holds %v, the engine [6 7]", s)
		}
	})
}

// A hole pending when the stream is re-created numbers the old stream.
// It held the instance not live after the bridge answered with its table
// numbered in the new stream, below the old hole's number (stream seq 1
// against 3: never live in the review's run); the hole now counts as
// before every message of the new stream.
func TestMemoryHoleAcrossRecreatedStream(t *testing.T) {
	e, c, a := holeEnv(t)
	e.recreateStream()
	testenv.WaitFor(t, 20*time.Second, "re-created stream noticed", func() bool { return counterValue(c.m.streamRecreated) == 1 })
	e.store("i0", 5, 5) // stream seq 1 of the new stream
	testenv.WaitFor(t, 10*time.Second, "engine seq 5 applied", func() bool { return c.status("i0").LastSeq == 5 })
	if c.Live("i0") {
		s, _ := a.get("i0")
		t.Fatalf("live with the hole pending (the bridge has not answered): the index holds %v, the engine [1 4 5]", s)
	}
	e.answer("i0", e.snapshot("i0", 1, 5, 1, 4, 5))
	testenv.WaitFor(t, 10*time.Second, "live after the bridge's table", func() bool {
		e.heartbeat("i0")
		return c.Live("i0")
	})
	if s, _ := a.get("i0"); !slices.Equal(s, []uint64{1, 4, 5}) {
		t.Fatalf("live, the index holding %v, the engine [1 4 5]", s)
	}
}

// heartbeatAt publishes instance's heartbeat saying its bridge's last
// message is engine seq engineSeq at stream seq streamSeq.
func (e *env) heartbeatAt(instance string, engineSeq, streamSeq uint64) {
	subj, _ := kvstream.InstancesSubject(e.pool, instance)
	b, _ := json.Marshal(kvstream.Heartbeat{Pool: e.pool, Instance: instance, URL: "http://" + instance, BlockSize: 16,
		EngineSeq: engineSeq, StreamSeq: streamSeq, Time: time.Now()})
	_ = e.nc.Publish(subj, b)
}

// purgeBelow removes the stream's messages below seq, as retention does.
func (e *env) purgeBelow(seq uint64) {
	e.t.Helper()
	s, err := e.js.Stream(e.ctx, e.cfg.Stream.Name)
	if err == nil {
		err = s.Purge(e.ctx, jetstream.WithPurgeSequence(seq))
	}
	if err != nil {
		e.t.Fatal(err)
	}
}

// The stream lost an instance's last messages (retention removed them
// before this router read them) and the engine has been quiet since: no
// later message shows a seq gap, but its bridge's heartbeats say its
// last message is at stream seq 4. Here i0's bucket snapshot is at
// stream seq 1 (block 1); engine seqs 2 (store 2), 3 (remove 2) and 4
// (store 4) are gone from the stream; the engine holds [1 4]. Before,
// the heartbeats kept i0 live on [1] for as long as the engine stayed
// quiet (seen on the real binaries: a router SIGSTOPped past retention,
// 222 engine messages lost, live on a stale table). Now it is not live
// until the bridge answers with its table, then live and exact.
func TestMemoryLostTailNotLive(t *testing.T) {
	e := newEnv(t)
	e.putSnapshot("i0", 1, 1, 1)
	e.store("i0", 1, 1)
	e.store("i0", 2, 2)
	e.send("i0", 3, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{2}, Medium: "GPU"})
	e.store("i0", 4, 4)
	e.purgeBelow(5)
	e.store("i1", 1, 10) // stream seq 5: the consumer is past i0's last message
	a := newRecorder()
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	c := e.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "i1's message applied", func() bool { return c.status("i1").LastSeq == 1 })
	// Live from the bucket's fresh snapshot until a heartbeat tells more.
	testenv.WaitFor(t, 10*time.Second, "the lost messages found", func() bool {
		e.heartbeatAt("i0", 4, 4)
		return c.status("i0").Gaps == 1 && !c.Live("i0")
	})
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		e.heartbeatAt("i0", 4, 4)
		if c.Live("i0") {
			s, _ := a.get("i0")
			t.Fatalf("i0 live on %v, the engine [1 4]: its last messages lost from the stream", s)
		}
	}
	if st := c.status("i0"); st.ReplayLost != 1 || st.Gaps != 1 {
		t.Fatalf("replay lost %d, gaps %d: want the lost tail counted once", st.ReplayLost, st.Gaps)
	}
	e.answer("i0", e.snapshot("i0", 4, 4, 1, 4))
	answered := time.Now()
	testenv.WaitFor(t, 10*time.Second, "live after the bridge's table", func() bool {
		e.heartbeatAt("i0", 4, 4)
		return c.Live("i0")
	})
	t.Logf("live %v after the bridge answered", time.Since(answered).Round(time.Millisecond))
	if s, _ := a.get("i0"); !slices.Equal(s, []uint64{1, 4}) {
		t.Fatalf("live, the index holding %v, the engine [1 4]", s)
	}
}
