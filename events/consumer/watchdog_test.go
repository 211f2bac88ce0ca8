package consumer

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// The ordered consumer stops delivering without a word (as when its
// re-create request after a reconnect goes unanswered for nats.go's fixed
// 10s): the watchdog notices the stored messages left undelivered and a
// new consumer delivers them from right after
// the last one delivered: nothing skipped, nothing twice, nothing from
// before a DeliverNew start.
func TestWatchdogReplacesStalledConsumer(t *testing.T) {
	for _, shared := range []bool{false, true} {
		name := "deliver_all"
		if shared {
			name = "deliver_new"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			a := newRecorder()
			cfg := e.cfg
			cfg.Applier, cfg.SharedIndex = a, shared
			e.store("i0", 1, 1) // before the start: replayed unless DeliverNew
			c := e.start(cfg)
			e.store("i0", 2, 2)
			want := []uint64{1, 2}
			if shared {
				want = []uint64{2}
			}
			testenv.WaitFor(t, 10*time.Second, "first events applied", func() bool { s, _ := a.get("i0"); return len(s) == len(want) })

			// Stall: the consumer in use stops, silently.
			c.sc.mu.Lock()
			c.sc.cc.Stop()
			c.sc.mu.Unlock()
			stalled := time.Now()
			for i := uint64(3); i <= 6; i++ {
				e.store("i0", i, i)
				want = append(want, i)
			}
			testenv.WaitFor(t, 20*time.Second, "events after the stall applied", func() bool {
				s, _ := a.get("i0")
				return len(s) >= len(want)
			})
			took := time.Since(stalled)
			time.Sleep(200 * time.Millisecond) // a duplicate would show by now
			if got, _ := a.get("i0"); !slices.Equal(got, want) {
				t.Fatalf("applied %v, want %v", got, want)
			}
			if n := counterValue(c.m.stalls); n < 1 {
				t.Fatalf("stalls counted %v, want ≥ 1", n)
			}
			// Expected 5–6s: a heartbeat of silence, the look that first
			// sees the message waiting, then stallHeartbeats more. Twice
			// that for a loaded machine; without the watchdog it never
			// recovers at all.
			if took > 12*time.Second {
				t.Fatalf("recovered %v after the stall", took)
			}
			t.Logf("recovered %.2fs after the stall", took.Seconds())
		})
	}
}

// A stream re-created under a running consumer (a JetStream store wiped, the
// stream deleted and made again) starts its sequences over. The ordered
// consumer resumed after the old last sequence and delivered nothing of the
// new stream until it grew past it (thousands of messages), while the
// instance stayed live with its old blocks: stale state presented as fresh.
// The watchdog notices the stream's last sequence below the consumer's and
// consumes the new stream from its start.
func TestStreamRecreatedConsumedFromStart(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.fiveThenApplied(a)
	// The bridge's snapshot, current to the old stream's last message
	// (stream seq 5): the bridge has not published since the wipe.
	snap := e.oldStreamSnapshot()
	e.putSnapshotBytes("i0", snap)
	e.recreateStream()
	// The bridge carries on: the engine's next seqs go to the new stream, at
	// stream sequences 1 and 2, below the snapshot's old-stream position.
	e.store("i0", 6, 16)
	e.store("i0", 7, 17)
	testenv.WaitFor(t, 20*time.Second, "re-created stream applied", func() bool {
		got, _ := a.get("i0")
		return slices.Contains(got, 16) && slices.Contains(got, 17)
	})
	if n := counterValue(c.m.streamRecreated); n != 1 {
		t.Fatalf("re-created stream counted %v times, want 1", n)
	}
}

// With a shared index the re-created stream's messages fall below the
// positions the index keeps of the old one: the consumer reports itself
// unhealthy (kv_aware falls back) instead of presenting the index as
// current.
func TestStreamRecreatedSharedUnhealthy(t *testing.T) {
	e := newEnv(t)
	cfg := e.cfg
	cfg.Applier, cfg.SharedIndex = newRecorder(), true
	c := e.start(cfg)
	for seq := uint64(1); seq <= 3; seq++ {
		e.store("i0", seq, 10+seq)
	}
	testenv.WaitFor(t, 20*time.Second, "first stream delivered", func() bool {
		for _, s := range c.Instances() {
			if s.Instance == "i0" && s.LastSeq == 3 {
				return true
			}
		}
		return false
	})
	e.recreateStream()
	e.store("i0", 4, 14)
	testenv.WaitFor(t, 20*time.Second, "re-created stream noticed", func() bool { return counterValue(c.m.streamRecreated) == 1 })
	// Past the 10 s a consume error keeps it unhealthy: still unhealthy.
	c.lastErr.Store(0)
	if c.Healthy() {
		t.Fatal("healthy over a shared index whose positions number the old stream")
	}
}

// A re-created stream that has already passed the old one's last
// sequence when the watchdog looks (a busy fleet, a stream other pools
// share) is still noticed: by its creation time, not by its sequences.
// Before, the consumer went on from the old position and the new
// stream's first messages were never applied.
func TestStreamRecreatedPastOldSeqNoticed(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.fiveThenApplied(a)
	e.putSnapshotBytes("i0", e.oldStreamSnapshot())
	e.recreateStream()
	// The bridge carries on at once: eight messages in the new stream,
	// past the old one's last sequence (5) before the watchdog's next look.
	for seq := uint64(6); seq <= 13; seq++ {
		e.store("i0", seq, 10+seq)
	}
	testenv.WaitFor(t, 20*time.Second, "re-created stream applied from its start", func() bool {
		got, _ := a.get("i0")
		for h := uint64(16); h <= 23; h++ {
			if !slices.Contains(got, h) {
				return false
			}
		}
		return true
	})
	if n := counterValue(c.m.streamRecreated); n != 1 {
		t.Fatalf("re-created stream counted %v times, want 1", n)
	}
}

// A re-created stream's reload that fails (the snapshot unreadable) is
// retried at the instance's next message: while its bridge has not
// published in the new stream (another instance's message showed the
// re-creation), its snapshot numbers the old stream, and that position
// must not skip the new stream's messages, which sit below it.
func TestStreamRecreatedRetriedLoadSkipsNothing(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.fiveThenApplied(a)
	e.putSnapshotBytes("i0", []byte("not a snapshot"))
	e.recreateStream()
	e.store("i1", 1, 91) // the new stream's seq 1, another bridge's
	testenv.WaitFor(t, 20*time.Second, "re-created stream noticed", func() bool { return counterValue(c.m.streamRecreated) == 1 })
	testenv.WaitFor(t, 20*time.Second, "reload failed", func() bool {
		c.mu.RLock()
		defer c.mu.RUnlock()
		return c.insts["i0"].loadFailed
	})
	// i0's bridge's snapshot, current to the old stream's seq 5.
	snap := e.oldStreamSnapshot()
	e.putSnapshotBytes("i0", snap)
	time.Sleep(1500 * time.Millisecond) // past the failed load's retry time
	e.store("i0", 6, 16)                // the new stream's seq 2: its load retried first
	e.store("i0", 7, 17)
	testenv.WaitFor(t, 20*time.Second, "re-created stream applied", func() bool {
		got, _ := a.get("i0")
		return slices.Contains(got, 16) && slices.Contains(got, 17)
	})
}

// fiveThenApplied stores i0's engine seqs 1-5 (blocks 11-15) and waits for
// them applied.
func (e *env) fiveThenApplied(a *recorder) {
	e.t.Helper()
	for seq := uint64(1); seq <= 5; seq++ {
		e.store("i0", seq, 10+seq)
	}
	testenv.WaitFor(e.t, 20*time.Second, "first stream applied", func() bool {
		got, _ := a.get("i0")
		return slices.Contains(got, 15)
	})
}

// oldStreamSnapshot is i0's bridge's snapshot after fiveThenApplied,
// current to the old stream's seq 5.
func (e *env) oldStreamSnapshot() []byte {
	batch, _ := events.Encode(nil, events.Batch{Events: []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{11, 12, 13, 14, 15},
		TokenIDs: make([]uint32, 5*16), BlockSize: 16, Medium: "GPU"}}}, events.EncodingMap)
	snap, _ := kvstream.Snapshot{Pool: e.pool, Instance: "i0", Blocks: 5, Batch: batch, StreamSeq: 5, EngineSeq: 5, HasSeq: true}.MarshalBinary()
	return snap
}

// recreateStream deletes the stream and creates it again (its sequences
// start over), as a wiped JetStream store does.
func (e *env) recreateStream() {
	e.t.Helper()
	if err := e.js.DeleteStream(e.ctx, e.cfg.Stream.Name); err != nil {
		e.t.Fatal(err)
	}
	if _, err := kvstream.EnsureStream(e.ctx, e.js, e.cfg.Stream); err != nil {
		e.t.Fatal(err)
	}
}
