package consumer

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// putSnapshot writes a bucket snapshot of instance at stream position
// streamSeq (engine seq engineSeq) holding one block per hash, as a
// bridge does every refresh period.
func (e *env) putSnapshot(instance string, streamSeq, engineSeq uint64, hashes ...uint64) {
	e.t.Helper()
	e.putSnapshotBytes(instance, e.snapshot(instance, streamSeq, engineSeq, hashes...))
}

// snapshot is instance's snapshot at stream position streamSeq (engine
// seq engineSeq) holding one block per hash.
func (e *env) snapshot(instance string, streamSeq, engineSeq uint64, hashes ...uint64) []byte {
	e.t.Helper()
	var evs []events.Event
	for _, h := range hashes {
		evs = append(evs, storedBlock(h))
	}
	batch, err := events.Encode(nil, events.Batch{Events: evs}, events.EncodingMap)
	if err != nil {
		e.t.Fatal(err)
	}
	snap, _ := kvstream.Snapshot{Pool: e.pool, Instance: instance, Blocks: len(hashes), StreamSeq: streamSeq,
		EngineSeq: engineSeq, HasSeq: true, Taken: time.Now(), Batch: batch}.MarshalBinary()
	return snap
}

func (c *Consumer) status(instance string) InstanceStatus {
	for _, s := range c.Instances() {
		if s.Instance == instance {
			return s
		}
	}
	return InstanceStatus{}
}

// A reload after a gap or a failed Apply, from a bucket snapshot older
// than what the consumer has applied (the bridge is down: nothing answers
// the snapshot request), must not lose the messages applied since the
// snapshot: they are replayed from the stream. Only messages the stream
// no longer holds are lost, and that is counted.
func TestReloadReplaysMessagesAfterSnapshot(t *testing.T) {
	tests := []struct {
		name string
		// maxMsgs limits the stream (0: unlimited) so that retention
		// drops messages after the snapshot.
		maxMsgs int64
		// failHash makes the Apply of that block fail once (0: none).
		failHash uint64
		// middle publishes what is applied after the snapshot (nil:
		// engine seqs 3 and 4, one message each, blocks 3 and 4).
		middle func(e *env)
		// trigger publishes the messages that cause the reload.
		trigger    func(e *env)
		want       []uint64
		wantLost   uint64
		wantPurges int
	}{
		{
			name: "engine seq gap",
			// Engine seqs 5..9 never reached the stream: a real gap,
			// which no snapshot older than it can cover, so it counts as
			// lost; 2..4, applied since the snapshot, must survive.
			trigger:    func(e *env) { e.store("i0", 10, 10) },
			want:       []uint64{1, 2, 3, 4, 10},
			wantLost:   1,
			wantPurges: 2,
		},
		{
			name: "engine seq gap after a coalesced message",
			// Engine seqs 3 and 4 in one coalesced message (blocks 30,
			// 40): the replay after the snapshot applies both.
			middle:     func(e *env) { e.coalesced("i0", 3, 4, 0) },
			trigger:    func(e *env) { e.store("i0", 10, 10) },
			want:       []uint64{1, 2, 30, 40, 10},
			wantLost:   1,
			wantPurges: 2,
		},
		{
			name:       "failed apply",
			failHash:   5,
			trigger:    func(e *env) { e.store("i0", 5, 5); e.store("i0", 6, 6) },
			want:       []uint64{1, 2, 3, 4, 5, 6},
			wantPurges: 2,
		},
		{
			name: "retention dropped messages after the snapshot",
			// The stream keeps 3 messages: when engine seq 10 arrives it
			// holds 4, 5 and 10; 2 and 3 are gone.
			maxMsgs:    3,
			trigger:    func(e *env) { e.store("i0", 5, 5); e.store("i0", 10, 10) },
			want:       []uint64{1, 4, 5, 10},
			wantLost:   1,
			wantPurges: 2,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			if tc.maxMsgs != 0 {
				if err := e.js.DeleteStream(e.ctx, e.cfg.Stream.Name); err != nil {
					t.Fatal(err)
				}
				e.cfg.Stream.MaxMsgs = tc.maxMsgs
				if _, err := kvstream.EnsureStream(e.ctx, e.js, e.cfg.Stream); err != nil {
					t.Fatal(err)
				}
			}
			// Stream seqs 1 and 2; the bucket snapshot is at stream seq 1.
			e.store("i0", 1, 1)
			e.store("i0", 2, 2)
			e.putSnapshot("i0", 1, 1, 1)
			a := &failOnce{recorder: newRecorder(), hash: tc.failHash}
			cfg := e.cfg
			cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
			c := e.start(cfg)
			testenv.WaitFor(t, 10*time.Second, "snapshot + message 2", func() bool { s, _ := a.get("i0"); return slices.Equal(s, []uint64{1, 2}) })
			if tc.middle != nil {
				tc.middle(e)
			} else {
				e.store("i0", 3, 3)
				e.store("i0", 4, 4)
			}
			testenv.WaitFor(t, 10*time.Second, "messages 3 and 4", func() bool { s, _ := a.get("i0"); return len(s) == 4 })

			tc.trigger(e)
			last := tc.want[len(tc.want)-1]
			testenv.WaitFor(t, 10*time.Second, "the triggering message", func() bool { s, _ := a.get("i0"); return len(s) > 0 && s[len(s)-1] == last })
			s, purges := a.get("i0")
			if !slices.Equal(s, tc.want) || purges != tc.wantPurges {
				t.Fatalf("index holds %v after %d purges, want %v after %d", s, purges, tc.want, tc.wantPurges)
			}
			st := c.status("i0")
			if st.ReplayLost != tc.wantLost {
				t.Fatalf("replay lost = %d, want %d", st.ReplayLost, tc.wantLost)
			}
			if st.LastSeq != last {
				t.Fatalf("last engine seq %d, want %d", st.LastSeq, last)
			}
			// Nothing is applied twice afterwards: the next message follows on.
			e.store("i0", last+1, last+1)
			testenv.WaitFor(t, 10*time.Second, "next message", func() bool { s, _ := a.get("i0"); return len(s) == len(tc.want)+1 })
			if s, _ := a.get("i0"); !slices.Equal(s, append(slices.Clone(tc.want), last+1)) {
				t.Fatalf("after the next message the index holds %v", s)
			}
		})
	}
}

// An instance listed from the bucket whose snapshot cannot be loaded (gone
// between the listing and the read, or unreadable) still starts its
// silence clock, so it goes stale and is purged instead of lingering.
func TestUnloadableSnapshotStillAgesOut(t *testing.T) {
	tests := []struct {
		name  string
		value []byte // nil: no key at all
	}{
		{"no snapshot", nil},
		{"unreadable snapshot", []byte("not a snapshot")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			kv, err := kvstream.EnsureBucket(e.ctx, e.js, e.cfg.Bucket)
			if err != nil {
				t.Fatal(err)
			}
			if tc.value != nil {
				key, _ := kvstream.SnapshotKey(e.pool, "ghost")
				if _, err := kv.Put(e.ctx, key, tc.value); err != nil {
					t.Fatal(err)
				}
			}
			cfg := e.cfg
			cfg.Applier, cfg.SnapshotTimeout = newRecorder(), 100*time.Millisecond
			cfg.StaleAfter, cfg.PurgeAfter = 50*time.Millisecond, 200*time.Millisecond
			c, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			res, err := kvstream.EnsureAll(e.ctx, e.js, cfg.Stream, cfg.Bucket, cfg.Logger)
			if err != nil {
				t.Fatal(err)
			}
			c.stream, c.kv, c.obs = res.Stream, res.Bucket, res.ObjectStore
			// As loadKnown does for a listed key: never seen yet.
			in := c.newInst("ghost", time.Time{})
			c.insts["ghost"] = in
			c.load(e.ctx, "ghost", in, 0)
			c.mu.RLock()
			seen := in.lastSeen
			c.mu.RUnlock()
			if seen.IsZero() {
				t.Fatal("last seen still zero after the failed load: check() would never age it out")
			}
			if c.Live("ghost") {
				t.Fatal("an instance nothing vouches for reported live")
			}
			time.Sleep(cfg.PurgeAfter + 50*time.Millisecond)
			c.check(e.ctx)
			if st := c.status("ghost").State; st != StatePurged {
				t.Fatalf("state %v after PurgeAfter of silence, want purged", st)
			}
		})
	}
}

// A consumer whose stream configuration conflicts with an existing stream
// (another stream already holds kv.events.>) returns the error from Run
// instead of retrying forever.
func TestRunReturnsConfigError(t *testing.T) {
	e := newEnv(t)
	cfg := e.cfg
	cfg.Applier = newRecorder()
	cfg.Stream.Name = "OTHER_" + cfg.Stream.Name
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = c.Run(e.ctx)
	if err == nil || e.ctx.Err() != nil || !kvstream.IsConfigError(err) {
		t.Fatalf("Run = %v, want a config error before the deadline", err)
	}
}

// A message stored twice (re-sent after JetStream's duplicate window)
// that a reload's replay meets is skipped, as the live path skips it: the
// engine stored block 2 (engine seq 2) and removed it (3), then the
// duplicate of seq 2 reached the stream; a failed apply of seq 4 reloads
// the bucket's snapshot (engine seq 1) and replays seqs 2, 3 and the
// duplicate. Applied again, the duplicate brought block 2 back: the
// index held [1 2 5 6] against the engine's [1 5 6] until the bridge's
// resync.
func TestReplaySkipsDuplicateSeq(t *testing.T) {
	e := newEnv(t)
	e.putSnapshot("i0", 1, 1, 1)
	e.store("i0", 1, 1)
	e.store("i0", 2, 2)
	a := &failOnce{recorder: newRecorder(), hash: 5}
	cfg := e.cfg
	cfg.Applier, cfg.SnapshotTimeout = a, 100*time.Millisecond
	c := e.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "blocks 1 and 2", func() bool { s, _ := a.get("i0"); return slices.Equal(s, []uint64{1, 2}) })
	e.send("i0", 3, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{2}, Medium: "GPU"})
	e.store("i0", 2, 2) // the duplicate
	testenv.WaitFor(t, 10*time.Second, "the duplicate skipped", func() bool {
		return counterValue(c.m.messages.WithLabelValues("duplicate_seq")) == 1
	})
	e.store("i0", 4, 5) // its apply fails once: the next message reloads and replays
	e.store("i0", 5, 6)
	testenv.WaitFor(t, 10*time.Second, "engine seq 5 applied", func() bool { s, _ := a.get("i0"); return len(s) > 0 && s[len(s)-1] == 6 })
	if s, purges := a.get("i0"); !slices.Equal(s, []uint64{1, 5, 6}) || purges != 2 {
		t.Fatalf("index holds %v after %d purges, the engine [1 5 6] (want 2 purges: the start's load, the reload)", s, purges)
	}
	if n := counterValue(c.m.messages.WithLabelValues("duplicate_seq")); n != 1 {
		t.Fatalf("%v messages counted duplicate_seq, want 1 (consumed once; the replay skips it again uncounted)", n)
	}
	if st := c.status("i0"); st.Gaps != 0 || st.ReplayLost != 0 {
		t.Fatalf("a duplicate counted as a gap or loss: %+v", st)
	}
}
