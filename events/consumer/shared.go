package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/kvindex"
)

// SharedApplier is an index several routers share (kvindex.Redis): every
// router consumes the whole stream, each message changes the index once,
// whichever router gets there first, and the index says where each
// instance stands, so that any router can repair what it misses.
//
// With SharedIndex and a SharedApplier the consumer
//   - applies every message with ApplyAt at the position it expects (its
//     previous message of the instance);
//   - when the index is behind (a router died holding the instance's
//     writer lease, a write failed), re-applies the missing messages from
//     the stream, or, when the instance is unseeded (a new Redis, one that
//     restarted empty or was flushed) or the stream no longer holds them,
//     loads the bridge's snapshot with LoadAt and replays the stream after
//     it;
//   - watches the index's epoch: a change means Redis lost its data, and
//     every instance is checked and reloaded;
//   - reports an instance not live while its state in the index is not
//     known to be whole, and the stream unhealthy while Redis cannot be
//     reached (kv_aware then falls back), with kvrouter_events_index_consistent
//     at 0 while either lasts.
type SharedApplier interface {
	Applier
	// ApplyAt's evs, like Apply's, are valid only until it returns.
	ApplyAt(ctx context.Context, instance string, from kvindex.Position, seq uint64, evs []events.Event) (kvindex.SeqResult, error)
	// ApplyAtYielding is ApplyAt leaving an instance another router wrote
	// last to it even once its lease has run out (SeqYielded).
	ApplyAtYielding(ctx context.Context, instance string, from kvindex.Position, seq uint64, evs []events.Event) (kvindex.SeqResult, error)
	// ApplyAtHole is ApplyAt (ApplyAtYielding when yield) recording a
	// hole at seq in the instance's state (kvindex.Position.Hole).
	ApplyAtHole(ctx context.Context, instance string, from kvindex.Position, seq uint64, yield bool, evs []events.Event) (kvindex.SeqResult, error)
	LoadAt(ctx context.Context, instance string, seq uint64, evs []events.Event) (kvindex.SeqResult, error)
	Position(ctx context.Context, instance string) (kvindex.Position, error)
	Epoch(ctx context.Context) (epoch string, created bool, err error)
	// Rewound reports whether Redis went back in time (restarted from its
	// own persistence to an earlier point) since the last call that
	// answered: the epoch survives that (kvindex.Redis.Rewound).
	Rewound(ctx context.Context) (bool, error)
	// Positions reads several instances' positions in one round trip.
	Positions(ctx context.Context, instances []string) ([]kvindex.Position, error)
	// WriterLease is how long a writer keeps an instance after its last
	// write: a skipped message is checked for once it has run out.
	WriterLease() time.Duration
}

var _ SharedApplier = (*kvindex.Redis)(nil)

// errOwned: another router holds the instance's writer lease and is
// bringing it up to date; nothing for this router to do now.
var errOwned = errors.New("consumer: another router is writing the instance")

// errReplayGap: a replay found the instance's engine seqs broken between
// two of its messages the stream still holds (one between them was
// removed: a deletion, or a limit that removed from the middle). Replayed
// over, the index would lack what the missing message did — blocks it
// stored, or, worse, blocks it removed kept as held — and read whole: only
// a snapshot past the hole repairs it.
var errReplayGap = errors.New("consumer: engine seq gap inside the stream")

// engineRef is the engine seq the index's state of an instance is at (the
// last one applied), when known: a replay checks that each message it
// applies continues from it.
type engineRef struct {
	seq   uint64
	known bool
}

// refAt reads the instance's message at stream sequence pos (the last one
// applied to the index) for its engine seq; unknown when pos is no
// position, the message cannot be read, or it is no engine message of its
// own (a synthetic one). gone reports that the stream no longer holds it:
// then whether messages after it are gone too cannot be told from the
// stream (a per-subject limit removes an instance's oldest first), and
// only a snapshot is sure.
func (c *Consumer) refAt(ctx context.Context, instance string, pos kvindex.Position) (ref engineRef, gone bool) {
	if !pos.Seeded || pos.Seq == 0 {
		return engineRef{}, false
	}
	subj, _ := kvstream.EventsSubject(c.cfg.Pool, instance)
	m, err := getMsg(ctx, c.stream, pos.Seq, subj)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return engineRef{}, true // nothing of the instance at or after pos
	case err != nil:
		return engineRef{}, false
	case m.Sequence != pos.Seq:
		return engineRef{}, true
	}
	h, err := kvstream.ParseEventHeaders(m.Header)
	if err != nil || !h.HasSeq || h.Synthetic != "" {
		return engineRef{}, false
	}
	return engineRef{seq: h.LastSeq(), known: true}, false
}

// clearsSeq reports whether a synthetic message of kind synthetic, whose
// events empty the instance's state when clears (an AllBlocksCleared
// among them, the message read whole), starts its engine seqs over: a
// bridge's clear. A resync is a clear, then the bridge's table in chunks
// marked resync too, and keeps the bridge's engine seq: only its clear
// starts over. A chunk taken as one, when retention had removed the
// clear (and the engine message before it) before a lagging router read
// them, hid the engine-seq gap from the next engine message and stood in
// for the clear's stream seq (lostSinceClear): the instance read live
// holding the lost message's removed blocks. Others (aged removals)
// leave the seqs as they were.
func clearsSeq(synthetic string, clears bool) bool {
	switch synthetic {
	case kvstream.SyntheticGap, kvstream.SyntheticRestart:
		return true
	case kvstream.SyntheticResync:
		return clears
	}
	return false
}

// sharedAttempts bounds the repair-and-retry rounds of one message: each
// round either applies it or learns something new about the index (it
// moved on, or another router took the instance); three rounds cover a
// repair that raced another router's, four leave a margin.
const sharedAttempts = 4

// sharedState is the consumer's shared-index bookkeeping.
type sharedState struct {
	idx SharedApplier
	// epoch is the index's epoch as last seen; owned by watchShared.
	epoch string
}

// applyShared applies one stream message (stream sequence seq) to the
// shared index, repairing the instance first when the index is behind.
// Runs on the instance's shard.
func (c *Consumer) applyShared(ctx context.Context, instance string, in *inst, seq uint64, evs []events.Event) (kvindex.ApplyResult, error) {
	from := in.from
	// Processed, whatever happens: a failure leaves the index behind this
	// message, and the next one (or the sync retried by watchShared)
	// repairs it from the stream. expect, which watchShared's check
	// compares with the index, follows once the apply has returned: read
	// while it is under way, the index is behind this message without
	// missing anything, and the check would mark the instance not live.
	next := kvindex.Position{Seq: seq, Seeded: true}
	in.from = next
	defer c.setExpect(next, in)
	yield := true
	for range sharedAttempts {
		r, err := c.applyAt(ctx, instance, in, from, seq, yield, evs)
		// After a repair (below), a message still missing is this
		// router's to apply, whoever wrote last.
		yield = false
		if err != nil {
			c.distrust(in, seq)
			return r.ApplyResult, err
		}
		c.countTakeover(r)
		c.noteHole(in, r.Position)
		switch r.Status {
		case kvindex.SeqApplied, kvindex.SeqDuplicate:
			c.setSyncedAt(in, kvindex.Position{Seq: seq, Seeded: true})
			return r.ApplyResult, nil
		case kvindex.SeqNotOwner:
			// The writer applies it; watchShared checks that it did once
			// its lease could have run out. Live when the index holds
			// what this router last found it missing (inst.await).
			c.leftToWriter(in, seq, false)
			if r.Position.Seeded {
				c.setSyncedAt(in, r.Position)
			}
			return kvindex.ApplyResult{}, nil
		case kvindex.SeqYielded:
			// The last writer's lease ran out (the instance was silent).
			// A change of writer rewrites the instance (kvindex: a
			// takeover starts a new incarnation), so the message is left
			// to that writer, which consumes it too and applies it within
			// milliseconds — unless the index misses a message this
			// router consumed before this one: that writer is dead or
			// stuck, and this router takes the instance over now (the
			// loop's next attempt, ApplyAt). A writer that died after
			// applying everything before this message is found out by
			// watchShared a check interval later (or by this router's
			// next message of the instance, the index then behind it):
			// for that long the instance reads current without this
			// message, as while any writer is applying one.
			if from.Seeded && (!r.Position.Seeded || r.Position.Seq < from.Seq) {
				continue
			}
			c.leftToWriter(in, seq, true)
			if r.Position.Seeded {
				c.setSyncedAt(in, r.Position) // at or past from here, so past await
			}
			return kvindex.ApplyResult{}, nil
		}
		pos, err := c.repairShared(ctx, instance, in, r.Position, seq, from)
		if errors.Is(err, errOwned) {
			// Another router took the instance over meanwhile: it brings
			// it up to date, this message included; checked as above.
			// The index was behind what this router consumed before
			// this message: not live until it holds that.
			c.leftToWriter(in, seq, false)
			c.awaitWriter(instance, in, from.Seq, pos)
			c.setSyncedAt(in, pos)
			return kvindex.ApplyResult{}, nil
		}
		if err != nil {
			c.distrust(in, seq)
			return kvindex.ApplyResult{}, err
		}
		from = pos
	}
	c.distrust(in, seq)
	return kvindex.ApplyResult{}, fmt.Errorf("consumer: shared index of %s kept moving under message %d", instance, seq)
}

// applyAt applies message seq at from: ApplyAtYielding when yield, else
// ApplyAt; ApplyAtHole when it is the message after this router's pending
// hole (inst.hole), which the index then records for every router.
func (c *Consumer) applyAt(ctx context.Context, instance string, in *inst, from kvindex.Position, seq uint64, yield bool, evs []events.Event) (kvindex.SeqResult, error) {
	switch {
	case in.hole == seq: // written by this goroutine only
		return c.shared.idx.ApplyAtHole(ctx, instance, from, seq, yield, evs)
	case yield:
		return c.shared.idx.ApplyAtYielding(ctx, instance, from, seq, evs)
	}
	return c.shared.idx.ApplyAt(ctx, instance, from, seq, evs)
}

// noteHole follows the index's record of a hole pending in the instance's
// state (kvindex.Position.Hole), read with pos. One recorded (by any
// router, or this one before a restart) is this router's too: the
// instance is not live (setSynced) until it is repaired, and this router
// tries to repair it as well (repairHole). This router's own hole is
// cleared once the index is at or past it with none recorded: the message
// after it was applied over a state that held what the lost messages did
// (by a router that consumed them, or whose snapshot reached past them:
// one that did not records the hole with the message), or a snapshot
// past it was loaded, or a clear after it applied. Shard goroutine only.
func (c *Consumer) noteHole(in *inst, pos kvindex.Position) {
	switch {
	case !pos.Seeded:
	case pos.Hole > in.hole:
		c.setHole(in, pos.Hole)
	case pos.Hole == 0 && in.hole != 0 && pos.Seq >= in.hole:
		c.setHole(in, 0)
		in.retryAt = time.Time{}
	}
}

// countTakeover counts a write that took the instance over from another
// writer (a rewrite of its whole map: kvindex.SeqResult.Takeover).
func (c *Consumer) countTakeover(r kvindex.SeqResult) {
	if r.Takeover {
		c.m.takeovers.Inc()
	}
}

// leftToWriter records message seq as left to another router's writer,
// for watchShared to see applied: a lease later, or a check interval later
// when yielded (left to a writer whose lease had run out; see dueShared).
func (c *Consumer) leftToWriter(in *inst, seq uint64, yielded bool) {
	c.mu.Lock()
	in.skipped, in.skippedAt, in.yielded = seq, time.Now(), yielded
	c.mu.Unlock()
}

// repairShared brings the instance's state in the index up to every
// message of the instance before stream sequence upTo, from pos, where
// the index is: by re-applying those messages from the stream, or, when
// the index is unseeded or the stream no longer holds them, by loading the
// snapshot and replaying the stream after it. It returns the new position.
//
// consumed is this router's last message of the instance before upTo
// (unseeded: none). A replay that ends below it found the stream without
// messages this router consumed: removed from its middle (a per-subject
// limit, a deletion), which the stream's first sequence does not tell.
// Their effects are in the instance's snapshot if anywhere, so it is
// loaded and the stream after it replayed; a repair that still ends below
// consumed leaves the instance not live (syncShared).
func (c *Consumer) repairShared(ctx context.Context, instance string, in *inst, pos kvindex.Position, upTo uint64, consumed kvindex.Position) (kvindex.Position, error) {
	if pos.Seeded {
		lost, err := c.streamLost(ctx, pos.Seq)
		if err != nil {
			return pos, err
		}
		var ref engineRef
		if !lost {
			// The index's own message gone while later ones remain: the
			// stream cannot tell whether others after it went too.
			ref, lost = c.refAt(ctx, instance, pos)
		}
		if !lost {
			p, err := c.replayShared(ctx, instance, in, pos, upTo, ref)
			switch {
			case errors.Is(err, errReplayGap):
				if ok, suppressed := c.logLimit.Allow("replay_gap"); ok {
					c.cfg.Logger.Warn("consumer: shared index repair found messages missing from the middle of the stream; reloading the snapshot",
						"instance", instance, "index_at", p.Seq, "err", err, "suppressed", suppressed)
				}
			case err != nil || ctx.Err() != nil || !consumed.Seeded || p.Seq >= consumed.Seq:
				return p, err
			default:
				c.cfg.Logger.Warn("consumer: shared index behind messages this router consumed that the stream no longer holds; reloading the snapshot",
					"instance", instance, "index_at", p.Seq, "consumed", consumed.Seq)
			}
		} else {
			c.cfg.Logger.Warn("consumer: shared index behind messages the stream no longer holds; reloading the snapshot",
				"instance", instance, "index_at", pos.Seq)
		}
	}
	return c.seedShared(ctx, instance, in, upTo)
}

// streamLost reports whether messages after stream sequence seq may be
// gone from the stream (retention passed them).
func (c *Consumer) streamLost(ctx context.Context, seq uint64) (bool, error) {
	ictx, cancel := context.WithTimeout(ctx, apiTimeout)
	info, err := c.stream.Info(ictx)
	cancel()
	if err != nil {
		return false, fmt.Errorf("consumer: stream info: %w", err)
	}
	return seq+1 < info.State.FirstSeq, nil
}

// seedShared loads the instance's snapshot into the index (the bridge's,
// else the bucket's; none: an empty state at the stream's start) and
// replays the stream after it up to upTo (exclusive).
func (c *Consumer) seedShared(ctx context.Context, instance string, in *inst, upTo uint64) (kvindex.Position, error) {
	snap, source, err := c.fetchSnapshot(ctx, instance)
	var evs []events.Event
	switch {
	case err == nil:
		batch, derr := events.Decode(snap.Batch)
		if derr != nil {
			c.m.snapshotLoads.WithLabelValues("malformed").Inc()
			return kvindex.Position{}, fmt.Errorf("consumer: malformed snapshot of %s (%s): %w", instance, source, derr)
		}
		evs = batch.Events
	case errors.Is(err, errNoSnapshot):
		// The stream alone: an empty state before its first message.
		snap, source = kvstream.Snapshot{}, "none"
	default:
		c.m.snapshotLoads.WithLabelValues("error").Inc()
		return kvindex.Position{}, err
	}
	r, err := c.shared.idx.LoadAt(ctx, instance, snap.StreamSeq, evs)
	if err != nil {
		c.m.applyErrors.Inc()
		return kvindex.Position{}, fmt.Errorf("consumer: load snapshot of %s: %w", instance, err)
	}
	pos := r.Position
	var ref engineRef
	switch r.Status {
	case kvindex.SeqNotOwner:
		return pos, errOwned
	case kvindex.SeqApplied:
		ref = engineRef{seq: snap.EngineSeq, known: snap.HasSeq}
		c.m.snapshotLoads.WithLabelValues(source).Inc()
		c.mu.Lock()
		in.status.SnapshotSeq = snap.StreamSeq
		in.status.LastSeq, in.hasSeq, in.clearAt = snap.EngineSeq, snap.HasSeq, snap.StreamSeq
		if in.hole != 0 && snap.StreamSeq >= in.hole {
			in.hole = 0 // the bridge's table past the hole replaced the state
		}
		c.mu.Unlock()
		c.cfg.Logger.Info("consumer: loaded snapshot into the shared index", "instance", instance, "source", source,
			"blocks", snap.Blocks, "stream_seq", snap.StreamSeq)
	}
	if r.Status != kvindex.SeqApplied {
		// SeqDuplicate: another router loaded or applied past the
		// snapshot; the replay continues from where it left the index
		// (unchecked when its message is gone: no snapshot here is newer).
		ref, _ = c.refAt(ctx, instance, pos)
	}
	return c.replayShared(ctx, instance, in, pos, upTo, ref)
}

// replayShared applies the instance's stream messages after pos, below
// upTo, in order, each at the position the previous one left. ref is the
// engine seq the index's state is at, when known: a message whose engine
// seq does not continue from the one before it (a message between them is
// gone from the stream) is a hole, counted as a gap. A clear after it
// below upTo (a bridge's, or the engine's AllBlocksCleared) wipes what the
// lost messages did, so the replay goes on over it, the instance held not
// live (inst.hole) until the clear is applied; without one, the replay
// ends with errReplayGap at the position before it.
func (c *Consumer) replayShared(ctx context.Context, instance string, in *inst, pos kvindex.Position, upTo uint64, ref engineRef) (kvindex.Position, error) {
	subj, _ := kvstream.EventsSubject(c.cfg.Pool, instance)
	applied := 0
	defer func() { c.m.replayed.Add(float64(applied)) }()
	var wipedBy uint64 // the stream seq of a clear found after an accepted hole
	// Whether the index's message at pos is part of a resync: not, when it
	// is an engine message (or a snapshot with an engine seq: never inside
	// one); else not known.
	prev := resyncUnknown
	if ref.known {
		prev = resyncClosed
	}
	for next := pos.Seq + 1; next < upTo && ctx.Err() == nil; {
		m, err := getMsg(ctx, c.stream, next, subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return pos, fmt.Errorf("consumer: read stream after %d: %w", next-1, err)
		}
		if m.Sequence >= upTo {
			break
		}
		next = m.Sequence + 1
		h, herr := kvstream.ParseEventHeaders(m.Header)
		engineMsg := herr == nil && h.HasSeq && h.Synthetic == ""
		batch, derr := decodeJoined(h, m.Data)
		clears := derr == nil && clearsAll(batch.Events)
		// A resync's chunk right after a message of no resync: its clear
		// is gone from the stream (orphanChunk).
		orphan := derr == nil && orphanChunk(h.Synthetic, clears, prev)
		prev = resyncAfter(h.Synthetic)
		if engineMsg && ref.known && h.Seq > ref.seq+1 || orphan {
			// Counted once per hole: a repair that cannot get past it
			// meets it again at every check.
			c.mu.Lock()
			first := in.holeAt != m.Sequence
			if first {
				in.holeAt = m.Sequence
				in.status.Gaps++
			}
			c.mu.Unlock()
			if first {
				c.m.gaps.Inc()
			}
			if m.Sequence > wipedBy {
				at, err := c.clearFollows(ctx, subj, m.Sequence, upTo)
				if err != nil {
					return pos, err
				}
				if at == 0 && orphan {
					return pos, fmt.Errorf("%w: %s, the next message the stream holds (stream seq %d) is a resync's table chunk without its clear",
						errReplayGap, instance, m.Sequence)
				}
				if at == 0 {
					return pos, fmt.Errorf("%w: %s at engine seq %d, the next message the stream holds (stream seq %d) is engine seq %d",
						errReplayGap, instance, ref.seq, m.Sequence, h.Seq)
				}
				wipedBy = at
				c.setHole(in, max(in.hole, m.Sequence))
				if first {
					if ok, suppressed := c.logLimit.Allow("replay_gap"); ok {
						c.cfg.Logger.Info("consumer: shared index repair replays over a hole in the stream that a clear after it wipes; not live until the clear",
							"instance", instance, "engine_seq", ref.seq, "stream_seq", m.Sequence, "next_engine_seq", h.Seq, "clear_stream_seq", at, "suppressed", suppressed)
					}
				}
			}
		}
		switch {
		case engineMsg && (!ref.known || h.LastSeq() > ref.seq):
			// A duplicate (a message stored twice, two bridges
			// overlapping) does not lower it.
			ref = engineRef{seq: h.LastSeq(), known: true}
		case herr == nil && clearsSeq(h.Synthetic, clears) || orphan:
			// A clear, or a chunk standing in for its lost one (seqsFrom):
			// seq continuity starts over.
			ref = engineRef{}
		}
		if derr != nil {
			continue // malformed: skipped (and counted) when consumed, never applied
		}
		r, err := c.applyAt(ctx, instance, in, pos, m.Sequence, false, batch.Events)
		if err != nil {
			c.m.applyErrors.Inc()
			return pos, fmt.Errorf("consumer: replay message %d: %w", m.Sequence, err)
		}
		c.countTakeover(r)
		switch r.Status {
		case kvindex.SeqApplied:
			applied++
		case kvindex.SeqNotOwner:
			c.noteHole(in, r.Position)
			return r.Position, errOwned
		case kvindex.SeqBehind:
			return r.Position, fmt.Errorf("consumer: shared index of %s moved to %v during replay", instance, r.Position)
		}
		pos = r.Position
		c.mu.Lock()
		if herr == nil && h.HasSeq && h.Synthetic == "" {
			// As ref, and as applyBatch: a duplicate does not lower it.
			in.sawSeq(h.LastSeq())
		}
		if herr == nil && clearsSeq(h.Synthetic, clears) || orphan {
			in.seqsFrom(m.Sequence)
		}
		if clears {
			in.wipeHole(m.Sequence)
		}
		c.mu.Unlock()
	}
	return pos, nil
}

// clearFollows returns the stream seq of the instance's first message at
// or after from and below upTo that clears its state: one holding an
// AllBlocksCleared, the engine's or a bridge's (whose clears carry it; the
// table chunks of a resync after one are marked resync too, and clear
// nothing); 0 when there is none.
func (c *Consumer) clearFollows(ctx context.Context, subj string, from, upTo uint64) (uint64, error) {
	for next := from; next < upTo && ctx.Err() == nil; {
		m, err := getMsg(ctx, c.stream, next, subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return 0, nil
		}
		if err != nil {
			return 0, fmt.Errorf("consumer: read stream at %d: %w", next, err)
		}
		if m.Sequence >= upTo {
			break
		}
		next = m.Sequence + 1
		h, _ := kvstream.ParseEventHeaders(m.Header)
		if b, err := decodeJoined(h, m.Data); err == nil && clearsAll(b.Events) {
			return m.Sequence, nil
		}
	}
	return 0, ctx.Err()
}

// syncShared checks an instance's state in the index against what this
// router has consumed and repairs it: queued at start, after an apply
// failed, when Redis lost its data, and when a skipped message's writer
// may have died before applying it.
func (c *Consumer) syncShared(ctx context.Context, instance string, in *inst) {
	c.mu.Lock()
	in.syncQueued = false
	skipped := in.skipped
	toWriter := skipped != 0 && !c.writerLate(in, time.Now(), c.shared.idx.WriterLease())
	c.mu.Unlock()
	pos, err := c.shared.idx.Position(ctx, instance)
	if err != nil {
		c.distrust(in, in.from.Seq)
		c.cfg.Logger.Warn("consumer: shared index unreachable, will retry", "instance", instance, "err", err)
		return
	}
	c.noteHole(in, pos)
	confirmed := func() {
		c.mu.Lock()
		if in.skipped == skipped {
			in.skipped = 0
		}
		c.mu.Unlock()
	}
	if pos.Seeded && in.from.Seeded && pos.Seq >= in.from.Seq {
		confirmed()
		if in.hole != 0 && in.loadDue() && c.bridgeHeard(in) {
			// A hole pending and nothing else to repair: an engine gone
			// quiet sends no message to retry the snapshot at, and its
			// bridge's is at the index's position, which LoadAt takes
			// while the hole is pending (then every router reads it gone).
			// Only while the bridge is heard from and its engine up: a
			// silent bridge answers no request (a hung one would hold the
			// shard for SnapshotTimeout at each try), and the bucket's
			// snapshot, which only the bridge refreshes, is older than the
			// hole.
			c.repairHole(ctx, instance, in, pos.Seq+1, 0, false)
		}
		c.setSyncedAt(in, pos)
		return
	}
	if pos.Seeded && in.from.Seeded && toWriter {
		// Behind, and this router's last message of it was left to a
		// writer whose lease has not run out since (a check after an
		// outage, or a late answer, reads it during that writer's lag
		// or before it repairs a restored state): that writer repairs
		// it, and a repair here would only read the stream to meet its
		// lease (errOwned). Live once the index holds what this router
		// found missing (inst.await); a writer that never gets there
		// is late a lease after the skip, and then this router repairs.
		c.awaitWriter(instance, in, in.from.Seq, pos)
		c.setSyncedAt(in, pos)
		return
	}
	// Behind what this router consumed, or (nothing consumed yet) maybe
	// behind the stream: everything the stream holds after the position.
	upTo := uint64(math.MaxUint64)
	if in.from.Seeded {
		upTo = in.from.Seq + 1
	}
	p, err := c.repairShared(ctx, instance, in, pos, upTo, in.from)
	switch {
	case errors.Is(err, errOwned):
		// Another router is writing it and repairs it (checked again
		// once its lease could have run out). Until the index holds what
		// this router consumed, the instance is not live: the index
		// misses messages (Redis restored to an earlier point while that
		// router's lease held; its writer stuck or dead), and its state
		// is older than this router's stream. An unseeded one is not
		// whole until that router has loaded it.
		if in.from.Seeded {
			c.leftToWriter(in, in.from.Seq, false)
			c.awaitWriter(instance, in, in.from.Seq, p)
		}
		c.noteHole(in, p)
		c.setSyncedAt(in, p)
	case err != nil:
		c.distrust(in, in.from.Seq)
		c.cfg.Logger.Warn("consumer: repair of the shared index failed, will retry", "instance", instance, "err", err)
	case in.from.Seeded && p.Seq < in.from.Seq:
		// The repair ended below what this router consumed: the stream
		// and the snapshot it could read do not hold those messages now
		// (removed, or a read that missed them; a snapshot older than
		// they are while the bridge is unreachable). The index lacks
		// what they did, so the instance is not live — not marked live
		// here to be found behind at the next check, a flap that read
		// it live in between — and the repair is tried again at the
		// next check, until one reaches the position or the instance's
		// next message applies.
		c.distrust(in, in.from.Seq)
		c.cfg.Logger.Warn("consumer: shared index behind messages this router consumed that neither the stream nor the snapshot holds now; not live until repaired",
			"instance", instance, "index_at", p.Seq, "consumed", in.from.Seq)
	default:
		if !in.from.Seeded || p.Seq > in.from.Seq {
			c.setFrom(in, p)
		}
		c.noteHole(in, p)
		confirmed()
		c.setSyncedAt(in, p)
		if p != pos {
			c.cfg.Logger.Info("consumer: shared index repaired", "instance", instance, "was", pos.String(), "now", p.Seq)
		}
	}
}

// setFrom sets where the index should be for the instance's next message.
// Shard goroutine only.
func (c *Consumer) setFrom(in *inst, p kvindex.Position) {
	in.from = p
	c.setExpect(p, in)
}

// setExpect sets where watchShared's check expects the index to be for
// the instance: at or past every message whose apply has returned.
func (c *Consumer) setExpect(p kvindex.Position, in *inst) {
	c.mu.Lock()
	in.expect = p
	c.mu.Unlock()
}

// setSynced records whether the instance's state in the index is known
// whole; not synced means not live for routing. With a hole pending
// (inst.hole) it is not, whatever ok says.
func (c *Consumer) setSynced(in *inst, ok bool) {
	c.mu.Lock()
	c.setSyncedLocked(in, ok)
	c.mu.Unlock()
}

// setSyncedAt records the instance's state whole when the index, at pos,
// holds every message this router last found it might be missing
// (inst.await, then cleared), else not whole.
func (c *Consumer) setSyncedAt(in *inst, pos kvindex.Position) {
	c.mu.Lock()
	ok := pos.Seeded && pos.Seq >= in.await
	if ok {
		in.await = 0
	}
	c.setSyncedLocked(in, ok)
	c.mu.Unlock()
}

// distrust records the instance's state not known whole, the index maybe
// missing this router's messages up to stream seq upTo: live again once
// a sync or a message finds the index at or past it (setSyncedAt), not at
// a message merely left to another router's writer.
func (c *Consumer) distrust(in *inst, upTo uint64) {
	c.mu.Lock()
	in.await = max(in.await, upTo)
	c.setSyncedLocked(in, false)
	c.mu.Unlock()
}

// awaitWriter raises inst.await to upTo, what this router consumed, for
// an instance another router writes, the index found at pos: not live
// until the index holds it (setSyncedAt). An index still below what was
// awaited before (not merely the message or two a writer applies as this
// router reads them) is logged, a few lines per interval.
func (c *Consumer) awaitWriter(instance string, in *inst, upTo uint64, pos kvindex.Position) {
	c.mu.Lock()
	was := in.await
	in.await = max(was, upTo)
	c.mu.Unlock()
	if pos.Seq >= was {
		return
	}
	if ok, suppressed := c.logLimit.Allow("behind_writer"); ok {
		c.cfg.Logger.Warn("consumer: shared index behind messages this router consumed while another router writes the instance; not live until it holds them",
			"instance", instance, "index_at", pos.String(), "consumed", upTo, "suppressed", suppressed)
	}
}

// setSyncedLocked is setSynced with c.mu held.
func (c *Consumer) setSyncedLocked(in *inst, ok bool) {
	ok = ok && in.hole == 0 // a hole pending: not whole, whatever the position
	if in.status.IndexUnsynced == ok {
		in.status.IndexUnsynced = !ok
		if ok {
			c.unsynced.Add(-1)
		} else {
			c.unsynced.Add(1)
		}
	}
}

// IndexConsistent reports whether the shared index can be trusted: Redis
// reachable at the last check, its data not lost since, and every
// instance's state whole. Always true for an index of this router's own.
// kvrouter_events_index_consistent reads it at each collection.
func (c *Consumer) IndexConsistent() bool { return c.consistentValue() == 1 }

// consistentValue is IndexConsistent as the gauge's value.
func (c *Consumer) consistentValue() float64 {
	if c.shared == nil || c.epochFresh() && c.unsynced.Load() == 0 {
		return 1
	}
	return 0
}

// epochDue is how long the epoch check may go unanswered before Redis
// counts as unreachable: a check interval, plus the check's own round
// trip given the interval again and at least a second (a SET NX GET
// answers in well under a millisecond).
func (c *Consumer) epochDue() time.Duration {
	return c.cfg.CheckInterval + max(c.cfg.CheckInterval, time.Second)
}

// epochFresh reports whether the last epoch check succeeded and one has
// answered within epochDue. A hung Redis (stopped, stuck in a fork or on a
// disk, a paused VM: connections held, nothing answered) holds the check
// loop in a call for the client's read timeout times its retries (15 s
// with go-redis's defaults), and the index was reported consistent and
// the stream healthy all the while. The call is not cut short (a write
// whose reply is lost has an unknown outcome — the epoch's creation among
// them); the answer is awaited and, while it is late, the index is not
// trusted.
//
// answered is read before epochOK: watchShared clears epochOK before it
// stores a late answer, so an answer read fresh here is one whose
// epochOK is read after it (a late one's cleared until the positions are
// read), never the one from before it.
func (c *Consumer) epochFresh() bool {
	answered := c.answered.Load()
	if !c.epochOK.Load() {
		return false
	}
	if since := c.monoNow() - time.Duration(answered); since > c.epochDue() {
		if c.hungLogged.CompareAndSwap(false, true) {
			c.cfg.Logger.Warn("consumer: shared index not answering; exact routing off until it does", "waited", since.Round(time.Millisecond))
		}
		return false
	}
	return true
}

// monoNow is the time since the consumer was made, on the monotonic
// clock (a wall clock stepped back during a hang must not hide it), plus
// 1 ns so that 0 stays "never": answered's unit.
func (c *Consumer) monoNow() time.Duration { return time.Since(c.born) + 1 }

// queueSync queues a syncShared of the instance unless one is queued.
func (c *Consumer) queueSync(ctx context.Context, instance string) {
	c.mu.Lock()
	in := c.insts[instance]
	if in == nil {
		in = c.newInst(instance, time.Time{})
		c.insts[instance] = in
	}
	queued := in.syncQueued
	in.syncQueued = true
	c.mu.Unlock()
	if !queued {
		c.enqueue(ctx, work{kind: workLoad, instance: instance})
	}
}

// syncKnown queues a sync of every instance with a snapshot in the bucket:
// at start, and when Redis lost its data, so that instances that send
// nothing are repaired too.
func (c *Consumer) syncKnown(ctx context.Context) {
	c.forSnapshots(ctx, func(instance string) { c.queueSync(ctx, instance) })
}

// watchShared checks the shared index every CheckInterval: its epoch (a
// failure: Redis unreachable; a change: Redis lost its data, so every
// instance is marked unsynced and repaired), instances still unsynced,
// and messages skipped for a writer whose lease has since run out (it may
// have died before applying them).
func (c *Consumer) watchShared(ctx context.Context) {
	leaseWait := c.shared.idx.WriterLease()
	var swept time.Time
	tick := time.NewTicker(c.cfg.CheckInterval)
	defer tick.Stop()
	unseen, _ := c.shared.idx.(interface{ RestartsUnseen() bool })
	for {
		checked := false // dueShared ran in this round
		// The counter first: on a Cluster a master found rewound changes
		// the epoch (kvindex.Redis.Rewound), which this check then sees.
		rewound, rerr := c.shared.idx.Rewound(ctx)
		if rerr == nil && unseen != nil && unseen.RestartsUnseen() {
			unseen = nil // once
			c.cfg.Logger.Warn("consumer: the shared index's Redis refuses INFO to this router's user, so a Redis restart that loses only writes newer than the last check is not seen; grant +info (docs/deploy.md)")
		}
		e, created, err := c.shared.idx.Epoch(ctx)
		if err == nil {
			err = c.checkRewound(rewound, rerr, c.shared.epoch != "" && e == c.shared.epoch)
		}
		if err == nil {
			now := c.monoNow()
			last := time.Duration(c.answered.Load())
			if last != 0 && now-last > c.epochDue() && c.epochOK.Swap(false) {
				// Answered more than the due time after the answer before:
				// a call of this loop (this one, or the last round's
				// positions read) hung or redialled through an outage, or
				// the loop was held (a shard full), and the index was
				// reported untrusted meanwhile (epochFresh). Redis may
				// have restarted from its persistence in that time
				// without any call failing: as after an outage, the
				// positions are read before it is trusted.
				c.cfg.Logger.Warn("consumer: shared index answered late; reading the instances' positions before trusting it again", "since_last_answer", (now - last).Round(time.Millisecond))
			}
			c.answered.Store(int64(now)) // after epochOK's clear (epochFresh reads them in the other order)
			if c.hungLogged.Swap(false) {
				c.cfg.Logger.Info("consumer: shared index answering again")
			}
		}
		switch {
		case err != nil:
			if c.epochOK.Swap(false) {
				c.cfg.Logger.Warn("consumer: shared index unreachable; exact routing off until it is back", "err", err)
			}
		case c.shared.epoch != "" && e != c.shared.epoch || created && c.shared.epoch == "":
			// Lost (or, at the first check, never held) this pool's data:
			// every instance must be checked, whatever it sends.
			if c.shared.epoch != "" {
				c.cfg.Logger.Warn("consumer: shared index lost its data (epoch changed); reloading every instance", "was", c.shared.epoch, "now", e)
				c.m.indexLost.Inc()
			}
			c.mu.Lock()
			names := make([]string, 0, len(c.insts))
			for name, in := range c.insts {
				in.await = max(in.await, in.expect.Seq)
				c.setSyncedLocked(in, false)
				names = append(names, name)
			}
			c.mu.Unlock()
			c.shared.epoch = e
			c.epochOK.Store(true)
			for _, name := range names {
				c.queueSync(ctx, name)
			}
			c.syncKnown(ctx)
		default:
			c.shared.epoch = e
			if !c.epochOK.Load() {
				// Back after an outage, with the same epoch: Redis may
				// have come back from its own persistence, older. Read
				// the positions before trusting the index again: an
				// instance found behind is not live until repaired,
				// rather than its restored state read as fresh until
				// the repair is done. Not read (a Cluster master still
				// down, Redis gone again): not trusted yet, read again
				// at the next check.
				due, err := c.dueShared(ctx, leaseWait, true)
				checked = true
				if err == nil {
					// Those found behind are marked unsynced already (not
					// live): trusted before their syncs are queued, which
					// can wait on a full shard.
					c.epochOK.Store(true)
					c.cfg.Logger.Info("consumer: shared index trusted again, the instances' positions read", "to_sync", len(due))
				}
				for _, name := range due {
					c.queueSync(ctx, name)
				}
			}
		}
		if c.epochOK.Load() && time.Since(swept) >= c.cfg.PurgeAfter {
			swept = time.Now()
			c.sweep(ctx)
		}
		if c.epochOK.Load() && !checked {
			due, err := c.dueShared(ctx, leaseWait, false)
			for _, name := range due {
				c.queueSync(ctx, name)
			}
			if err != nil && c.epochOK.Swap(false) {
				// The positions are what tells a Redis restored to an
				// earlier point (same epoch) from a current one: not read,
				// the index is not trusted until a read succeeds (the
				// branch above, at the next check).
				c.cfg.Logger.Warn("consumer: shared index positions not read; exact routing off until they are", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// checkRewound reads the index's answer to whether Redis went back in
// time since the last check (kvindex.Redis.Rewound): restarted from its
// own persistence between two checks, no call of this router seeing it
// down, the restart shows in nothing else until the positions are read,
// and instances this router leaves to another router's writer are not
// read by an ordinary check. Rewound, the index is untrusted as after an
// outage: the next branch reads every instance's position before trusting
// it again. sameEpoch: the epoch is the one this router holds; a changed
// one (Redis restarted empty: the counter is gone too; a Cluster master
// rewound: its counter bumped the epoch) is handled as lost data, every
// instance reloaded, not counted here. A counter not read (err) is an
// error as the epoch's would be: the index untrusted until a check reads
// it.
func (c *Consumer) checkRewound(rewound bool, err error, sameEpoch bool) error {
	if err != nil {
		return fmt.Errorf("check counter not read: %w", err)
	}
	if !rewound || !sameEpoch {
		return nil
	}
	// Untrusted before counted: whoever reads the count reads the index
	// untrusted.
	if c.epochOK.Swap(false) {
		c.cfg.Logger.Warn("consumer: shared index went back in time (Redis restarted, with its persistence or its counter behind); reading the instances' positions before trusting it again")
	}
	c.m.indexRewound.Inc()
	return nil
}

// dueShared lists the instances to sync: unsynced ones, those with a
// message left to a writer whose lease has run out since, and those whose
// position in the index is behind what this router consumed when no other
// writer can explain it (Redis restored from its persistence to an earlier
// point keeps its epoch: only positions tell), read in one round trip;
// the error is that read's.
//
// all (after an outage, a late answer or a rewind: Redis may have
// restarted unseen) reads the position of every instance not already
// unsynced: those whose last message was left to another router's writer
// too (a busy one's skips never run a lease late, and a restored index
// behind them was read as fresh until that writer repaired it), and those
// already due or queued for a sync (live until it has run). One behind is
// not live until the index holds what this router consumed (inst.await),
// whoever repairs it; a writer's ordinary lag of a message or two reads as
// behind then too, until the next message or sync confirms it.
func (c *Consumer) dueShared(ctx context.Context, leaseWait time.Duration, all bool) (due []string, err error) {
	now := time.Now()
	var check []string
	var want []kvindex.Position
	var checkDue []bool // check[i] is in due already
	c.mu.Lock()
	for name, in := range c.insts {
		writerLate := c.writerLate(in, now, leaseWait)
		isDue := in.status.IndexUnsynced || in.skipped != 0 && writerLate
		if isDue {
			due = append(due, name)
		}
		// With all, one already due or queued is read too: until its
		// sync has run (behind a full shard, maybe) it would read live.
		if in.expect.Seeded && !in.status.IndexUnsynced && (all || writerLate && !isDue && !in.syncQueued) {
			check, want, checkDue = append(check, name), append(want, in.expect), append(checkDue, isDue)
		}
	}
	c.mu.Unlock()
	if len(check) == 0 {
		return due, nil
	}
	got, err := c.shared.idx.Positions(ctx, check)
	if err != nil {
		return due, err
	}
	var behind []string
	var upTo []uint64
	var wasDue []bool
	for i, p := range got {
		if !p.Seeded || p.Seq < want[i].Seq || p.Hole != 0 {
			behind, upTo, wasDue = append(behind, check[i]), append(upTo, want[i].Seq), append(wasDue, checkDue[i])
		}
	}
	// Missing messages this router consumed (Redis restored to an earlier
	// point, or a writer's mark), or a hole another router recorded (the
	// sync adopts it: noteHole): not whole, so not live, until repaired.
	c.mu.Lock()
	for i, name := range behind {
		if in := c.insts[name]; in != nil {
			in.await = max(in.await, upTo[i])
			c.setSyncedLocked(in, false)
		}
	}
	c.mu.Unlock()
	for i, name := range behind {
		if !wasDue[i] {
			due = append(due, name)
		}
	}
	return due, nil
}

// writerLate reports whether the instance has no message left to another
// router's writer, or the last one was left longer ago than that writer
// needs to apply it: its lease, or a check interval when it was yielded
// to a writer whose lease had run out (a live one applies it in
// milliseconds). c.mu held.
func (c *Consumer) writerLate(in *inst, now time.Time, leaseWait time.Duration) bool {
	wait := leaseWait
	if in.yielded {
		wait = c.cfg.CheckInterval
	}
	return in.skipped == 0 || now.Sub(in.skippedAt) > wait
}

// decodeJoined decodes a stream message's payload, a coalesced message's
// payloads joined into one batch in order (the shared index applies a
// message at its stream seq at once). Its events are owned.
func decodeJoined(h kvstream.EventHeaders, data []byte) (events.Batch, error) {
	if !h.Coalesced() {
		return events.Decode(data)
	}
	parts, err := kvstream.SplitPayload(h, data, nil)
	if err != nil {
		return events.Batch{}, err
	}
	var joined events.Batch
	for _, p := range parts {
		b, err := events.Decode(p)
		if err != nil {
			joined.Invalid++ // unreadable payload of a coalesced message: the bridge joins none
			continue
		}
		joined.Events = append(joined.Events, b.Events...)
		joined.Unknown += b.Unknown
		joined.Invalid += b.Invalid
		joined.InvalidErr = cmp.Or(joined.InvalidErr, b.InvalidErr)
	}
	return joined, nil
}
