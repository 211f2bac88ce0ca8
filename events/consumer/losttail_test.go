package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// An idle instance's bridge that has not published since the stream was
// re-created heartbeats its last message's seq in the old stream (5).
// Once the new stream passes 5 (another instance publishes), that read as
// a lost tail at every heartbeat: the snapshot reloaded, the loss counted,
// the instance not live (review: gaps 12, replay_lost 12, not live in 119
// of 120 samples over 12 s). A heartbeat's seq says nothing of a
// re-created stream until the instance has sent into it.
func TestLostTailNotAfterRestream(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.fiveThenApplied(a)
	old := e.oldStreamSnapshot()
	e.putSnapshotBytes("i0", old)
	answered := e.answer("i0", old) // the idle bridge answers with its table (old stream seq 5)
	e.recreateStream()
	testenv.WaitFor(t, 20*time.Second, "re-created stream noticed", func() bool { return counterValue(c.m.streamRecreated) == 1 })
	for seq := uint64(1); seq <= 6; seq++ {
		e.store("i1", seq, 100+seq)
	}
	testenv.WaitFor(t, 20*time.Second, "i1 applied", func() bool { return c.status("i1").LastSeq == 6 })
	live, notLive := 0, 0
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		e.heartbeatAt("i0", 5, 5)
		if c.Live("i0") {
			live++
		} else {
			notLive++
		}
	}
	if st := c.status("i0"); st.Gaps != 0 || st.ReplayLost != 0 || notLive > live/10 || !c.Live("i0") {
		t.Errorf("an idle instance after a stream re-creation read as a lost tail: gaps %d, replay lost %d, not live in %d of %d samples, %v snapshot requests",
			st.Gaps, st.ReplayLost, notLive, live+notLive, answered.Load())
	}
}

type gateApplier struct {
	*recorder
	gate chan struct{}
}

func (g *gateApplier) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	if instance == "slow" {
		select {
		case <-g.gate:
		case <-ctx.Done():
		}
	}
	return g.recorder.Apply(ctx, instance, evs)
}

// A heartbeat whose instance has a message dispatched but not yet
// applied queues the lost-tail check from the heartbeat subscription's
// callback. With that shard's queue full (catching up, or held by a load
// or a slow index) the callback waited, and every other instance's
// heartbeats, on any shard, with it (review: an instance on the other
// shard's last heartbeat did not move in 2 s). The check is dropped when
// the shard is full; the next heartbeat asks again.
func TestLostTailFullShardKeepsHeartbeats(t *testing.T) {
	e := newEnv(t)
	g := &gateApplier{recorder: newRecorder(), gate: make(chan struct{})}
	cfg := e.cfg
	cfg.Applier, cfg.Shards = g, 2
	c := e.start(cfg)
	// i0 and slow on one shard, other on the other shard.
	other := ""
	for i := 0; other == ""; i++ {
		if n := fmt.Sprintf("o%d", i); c.shardOf(n) != c.shardOf("slow") {
			other = n
		}
	}
	i0 := ""
	for i := 0; i0 == ""; i++ {
		if n := fmt.Sprintf("x%d", i); c.shardOf(n) == c.shardOf("slow") {
			i0 = n
		}
	}
	e.store(i0, 1, 1)    // stream seq 1
	e.store(other, 1, 1) // stream seq 2
	testenv.WaitFor(t, 10*time.Second, "applied", func() bool { return c.status(i0).LastSeq == 1 && c.status(other).LastSeq == 1 })
	e.heartbeatAt(other, 1, 2)
	e.heartbeatAt(i0, 1, 1)
	testenv.WaitFor(t, 10*time.Second, "heartbeats", func() bool { return !c.status(other).LastHeartbeat.IsZero() })
	e.store("slow", 1, 1) // seq 3: blocks its shard
	e.store(i0, 2, 2)     // seq 4: queued behind it
	for s := uint64(2); s <= 300; s++ {
		e.store("slow", s, s) // fills the shard's queue
	}
	testenv.WaitFor(t, 10*time.Second, "i0's message dispatched", func() bool { return c.dispatched() >= 4 })
	e.heartbeatAt(i0, 2, 4) // i0: ahead and dispatched: workTail enqueued on the full shard
	time.Sleep(200 * time.Millisecond)
	before := c.status(other).LastHeartbeat
	for range 20 {
		e.heartbeatAt(other, 1, 2)
		time.Sleep(100 * time.Millisecond)
	}
	after := c.status(other).LastHeartbeat
	close(g.gate)
	if !after.After(before) {
		t.Errorf("heartbeats of an instance on another shard not processed while one shard's queue is full")
	}
}

// A lost-tail check the stream does not answer (here its context is
// already done) leaves a stale instance stale: it made it live, on a
// state the check could not vouch for. The next heartbeat asks again.
func TestLostTailUnansweredKeepsStale(t *testing.T) {
	e := newEnv(t)
	c, _ := e.startRecording()
	e.store("i0", 1, 1)
	testenv.WaitFor(t, 10*time.Second, "i0's message applied", func() bool { return c.status("i0").LastSeq == 1 })
	c.mu.Lock()
	in := c.insts["i0"]
	in.status.State = StateStale // as a heartbeat ahead of the stream leaves it
	c.mu.Unlock()
	ctx, cancel := context.WithCancel(e.ctx)
	cancel()
	checked := make(chan struct{})
	// On i0's shard, which owns the fields the check reads.
	c.shardOf("i0") <- work{kind: workBarrier, done: func() { c.lostTail(ctx, "i0", in, 5); close(checked) }}
	<-checked
	if c.Live("i0") {
		t.Fatal("i0 made live by a lost-tail check the stream did not answer")
	}
}
