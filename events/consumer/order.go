package consumer

import (
	"context"
	"errors"
	"hash/maphash"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/kvindex"
)

// dispatch runs on the consume goroutine: route the message to its shard.
// md is its JetStream metadata and now the time it was delivered, both
// read once by deliver.
func (c *Consumer) dispatch(ctx context.Context, m jetstream.Msg, md msgMeta, now time.Time) {
	_, pool, instance, err := kvstream.ParseSubject(m.Subject())
	if err != nil || pool != c.cfg.Pool {
		c.m.messages.WithLabelValues("bad_subject").Inc()
		return
	}
	w := work{kind: workEvent, instance: instance, header: m.Headers(), data: m.Data()}
	if md.ok {
		w.streamSeq, w.stored = md.streamSeq, md.stored
		// Measured here, on the one consume goroutine, so that it follows
		// the stream's order (shards finish out of order). The newest
		// message in the stream, however old, leaves nothing to catch up
		// on: without that, a replay whose last message is older than
		// MaxLag (an idle pool) kept the consumer unhealthy, and kv_aware
		// routing by hash, until the next event.
		lag := now.Sub(md.stored)
		if md.pending == 0 {
			lag = 0
			c.caughtUp.Store(true)
		}
		c.lag.Store(int64(lag))
	}
	// A delivery after a consume error: consuming works again (an ordered
	// consumer resumes at the next stream sequence, so nothing was
	// skipped). Without this, losing one NATS node of a cluster cost 10s
	// of routing by hash after the consumer was back.
	if last := c.lastErr.Load(); last != 0 {
		c.lastErr.CompareAndSwap(last, 0)
	}
	c.mu.RLock()
	known := c.insts[instance] != nil
	c.mu.RUnlock()
	if known {
		c.enqueue(ctx, w)
		return
	}
	c.mu.Lock()
	if c.insts[instance] == nil {
		if reason := c.refuseNew(instance, true); reason != "" {
			c.mu.Unlock()
			c.dropNew(instance, reason, "event")
			return
		}
		c.insts[instance] = c.newInst(instance, w.stored)
	}
	c.mu.Unlock()
	c.enqueue(ctx, w)
}

// shardOf is the instance's shard: one goroutine does all of an
// instance's work, so its messages are applied in the stream's order.
func (c *Consumer) shardOf(instance string) chan work {
	return c.shards[maphash.String(c.seed, instance)%uint64(len(c.shards))]
}

// enqueue queues w on its instance's shard, waiting while the shard is full.
func (c *Consumer) enqueue(ctx context.Context, w work) {
	// A shard with room takes w at once: a send on its channel alone,
	// without the two-case select that locks ctx's channel too (once per
	// stream message, and the shards' receives contend for that lock).
	if c.offer(w) {
		return
	}
	select {
	case c.shardOf(w.instance) <- w:
	case <-ctx.Done():
	}
}

// offer queues w on its instance's shard if the shard has room, and
// reports whether it did.
func (c *Consumer) offer(w work) bool {
	select {
	case c.shardOf(w.instance) <- w:
		return true
	default:
		return false
	}
}

// shard runs one shard's queue until ctx is done.
func (c *Consumer) shard(ctx context.Context, ch chan work) {
	// One decoder per shard: a message's batch is applied before the
	// shard takes the next, so its buffers are reused from one message to
	// the next instead of allocated for each. A full cache's one-block
	// removals are joined (the index removes a joined event's hashes as it
	// removes the run's, at a fraction of the per-event work), in events
	// of at most one write-locked section's blocks.
	dec := events.Decoder{JoinRemovals: kvindex.SectionBlocks}
	done := ctx.Done()
	for {
		var w work
		// While work is queued, a receive on the queue alone (see
		// enqueue); the select with ctx only when it is empty. ctx is
		// still checked between two pieces of work.
		select {
		case w = <-ch:
			select {
			case <-done:
				return
			default:
			}
		default:
			select {
			case <-done:
				return
			case w = <-ch:
			}
		}
		c.m.queue.Set(float64(len(ch)))
		if w.kind == workBarrier {
			w.done()
			continue
		}
		c.do(ctx, w, &dec)
	}
}

// do runs one piece of an instance's work: a stream message, a snapshot
// load or reload, or a purge.
func (c *Consumer) do(ctx context.Context, w work, dec *events.Decoder) {
	c.mu.RLock()
	in := c.insts[w.instance]
	purged := in != nil && in.status.State == StatePurged
	c.mu.RUnlock()
	if in == nil {
		// Forgotten after a purge since this was queued: the instance was
		// silent for PurgeAfter; if it is back, its heartbeat (or, for an
		// admitted name, its next event) makes a new record and reloads.
		if w.kind == workEvent {
			c.m.messages.WithLabelValues("purged_instance").Inc()
		}
		return
	}
	switch w.kind {
	case workPurge:
		c.mu.Lock()
		still := in.status.State == StatePurged
		c.mu.Unlock()
		if !still {
			return // came back since the purge was queued
		}
		if !c.cfg.SharedIndex {
			if err := c.cfg.Applier.Purge(ctx, w.instance); err != nil {
				c.cfg.Logger.Warn("consumer: purge", "instance", w.instance, "err", err)
			}
		} else if f, ok := c.cfg.Applier.(Forgetter); ok {
			f.Forget(w.instance)
		}
		in.needLoad, in.skipUpTo = true, 0
		c.m.purges.Inc()
		// Forget it: a purged name keeps no record and no metric series
		// (the router's are read from the records), so names that come
		// and go cannot accumulate.
		c.mu.Lock()
		if c.insts[w.instance] == in && in.status.State == StatePurged {
			delete(c.insts, w.instance)
			if in.status.IndexUnsynced {
				in.status.IndexUnsynced = false
				c.unsynced.Add(-1) // a forgotten record counts no more
			}
		}
		c.mu.Unlock()
		c.cfg.Logger.Info("consumer: instance purged and forgotten", "instance", w.instance)
	case workLoad:
		if c.shared != nil {
			c.syncShared(ctx, w.instance, in)
			return
		}
		if in.needLoad && !c.cfg.SharedIndex && in.loadDue() {
			c.load(ctx, w.instance, in, 0)
		}
	case workReload:
		switch {
		case c.shared != nil:
			// LoadAt takes the bridge's table only when it is newer than
			// the index's position (or at it, while a hole is pending
			// there); otherwise the clear arrives in order through the
			// stream.
			if _, err := c.seedShared(ctx, w.instance, in, 0); err != nil && ctx.Err() == nil {
				c.cfg.Logger.Warn("consumer: reloading a restarted engine's table into the shared index failed; the stream will repair it", "instance", w.instance, "err", err)
			}
		case !c.cfg.SharedIndex:
			c.load(ctx, w.instance, in, 0)
		}
		c.mu.Lock()
		in.reloading = false
		c.seen(in, time.Now())
		c.mu.Unlock()
	case workRestream:
		c.mu.Lock()
		in.status.StreamSeq, in.status.SnapshotSeq = 0, 0
		c.mu.Unlock()
		// The snapshot's stream seq may number the old stream (a bridge
		// that has not published since): as a position in the new one it
		// would skip the new messages it does not hold. Until the
		// instance's first message in the new stream, no load (this one,
		// or its retry after a failure) skips by it; the engine seq, set
		// by the snapshot, still skips what it holds (duplicate_seq), and
		// a bridge's resync or clear in the new stream rebuilds the table
		// in order.
		in.skipUpTo, in.restreamed = 0, true
		if in.hole != 0 && !c.cfg.SharedIndex {
			// A pending hole numbers the old stream: every message of the
			// new one comes after it, so a clear there, or the bridge's
			// table answered now or at any later retry (numbered in the
			// new stream), makes the state exact. Kept at the old number,
			// it held the instance not live until the new stream passed
			// that number (review of d110819).
			c.setHole(in, 1)
		}
		c.load(ctx, w.instance, in, 0)
	case workEvent:
		c.event(ctx, w, in, purged, dec)
	case workTail:
		c.lostTail(ctx, w.instance, in, w.streamSeq)
	}
}

// clearsAll reports whether a batch empties the engine's cache.
func clearsAll(evs []events.Event) bool {
	for i := range evs {
		if evs[i].Kind == events.AllBlocksCleared {
			return true
		}
	}
	return false
}

// event applies one stream message, unless a loaded snapshot covers it.
// purged is whether the instance's record said purged when do read it;
// dec decodes the payload (the shard's). A coalesced message (several
// engine payloads, kvstream.HeaderBatches) is applied payload by payload,
// each checked against the instance's engine seq as a message of its own.
func (c *Consumer) event(ctx context.Context, w work, in *inst, purged bool, dec *events.Decoder) {
	if purged && !c.cfg.SharedIndex {
		if !w.stored.IsZero() && time.Since(w.stored) > c.cfg.StaleAfter {
			// History of an instance purged for silence: not coming back.
			c.m.messages.WithLabelValues("purged_instance").Inc()
			return
		}
		// Fresh events after a purge: the instance is back.
		in.needLoad = true
	}
	if in.needLoad && !c.cfg.SharedIndex && in.loadDue() {
		c.load(ctx, w.instance, in, w.streamSeq)
	}
	if w.streamSeq != 0 && w.streamSeq <= in.skipUpTo {
		c.m.messages.WithLabelValues("covered_by_snapshot").Inc()
		return
	}
	// The instance's first message in a re-created stream: a load for it
	// (its seq gap's) still cannot tell the snapshot's numbering; the next
	// messages' loads can. (Reset before the gap's load, that load took
	// the bucket's old-stream position as a new one and skipped this
	// message as covered by it.)
	defer func() { in.restreamed = false }()
	c.publisher(w, in)
	h, herr := kvstream.ParseEventHeaders(w.header)
	engineMsg := herr == nil && h.HasSeq && h.Synthetic == ""
	if !h.Coalesced() {
		if engineMsg && c.seqCheck(ctx, w, in, h.Seq) != seqApply {
			return
		}
		batch, err := dec.Decode(w.data) // valid until the shard's next message
		if err == nil && !in.restreamed && orphanChunk(h.Synthetic, clearsAll(batch.Events), in.resync) {
			if c.lostBefore(ctx, w, in, 0, lostResyncClear, nil) == seqCovered {
				return
			}
			c.mu.Lock()
			in.seqsFrom(w.streamSeq)
			c.mu.Unlock()
		}
		c.applyBatch(ctx, w, in, h, engineMsg, h.Seq, batch, err)
		return
	}
	if c.shared != nil {
		// The shared index keeps its position by stream seq: the message
		// is applied at once, its payloads' events joined in order.
		if c.seqCheck(ctx, w, in, h.Seq) != seqApply {
			return
		}
		joined, err := decodeJoined(h, w.data)
		c.applyBatch(ctx, w, in, h, err == nil, h.LastSeq(), joined, err)
		return
	}
	parts, err := kvstream.SplitPayload(h, w.data, nil)
	if err != nil {
		// Not the payloads its headers promise: nothing of it can be
		// applied, and what it held is not known. Counted malformed; the
		// instance reloads its snapshot at its next message.
		c.applyBatch(ctx, w, in, kvstream.EventHeaders{}, false, 0, events.Batch{}, err)
		if !c.cfg.SharedIndex {
			in.needLoad = true
		}
		return
	}
	for i, p := range parts {
		seq := h.Seq + uint64(i)
		switch c.seqCheck(ctx, w, in, seq) {
		case seqSkip:
			continue
		case seqCovered:
			return
		}
		batch, err := dec.Decode(p)
		if c.applyBatch(ctx, w, in, h, true, seq, batch, err) {
			return // the apply failed: the snapshot reload brings the rest
		}
	}
}

// publisher notes which bridge run published message w (its message id is
// <pool>.<instance>.<run>.<n>) and counts and logs two bridges publishing
// for the instance at once: a bridge that restarts moves to a new run for
// good, while two live ones alternate. Nothing else notices them: their
// copies of each engine message are applied once (duplicate_seq; the
// shared index re-applies them), but each one's resync rolls the index
// back to its own table, and a bridge given another engine's --instance
// publishes blocks the instance does not hold.
func (c *Consumer) publisher(w work, in *inst) {
	id := w.header.Get(jetstream.MsgIDHeader)
	// The prefix <pool>.<instance>. checked piece by piece: the joined
	// string was an allocation per message once the names passed 32 bytes.
	rest, ok := strings.CutPrefix(id, c.cfg.Pool)
	if ok {
		rest, ok = strings.CutPrefix(rest, ".")
	}
	if ok {
		rest, ok = strings.CutPrefix(rest, w.instance)
	}
	if ok {
		rest, ok = strings.CutPrefix(rest, ".")
	}
	if !ok {
		return
	}
	run, _, ok := strings.Cut(rest, ".")
	if !ok || run == in.run {
		return
	}
	if run == in.prevRun {
		c.m.twoBridges.Inc()
		if ok, suppressed := c.logLimit.Allow("two_bridges"); ok {
			c.cfg.Logger.Warn("consumer: two kvbridges publish for one instance (their messages alternate); stop one, or give it its own engine's --instance",
				"instance", w.instance, "runs", []string{in.run, run}, "suppressed", suppressed)
		}
	}
	in.prevRun, in.run = in.run, run
}

// Outcomes of seqCheck.
const (
	seqApply   = iota // apply the payload
	seqSkip           // an engine seq already applied: skip the payload
	seqCovered        // a snapshot loaded for a gap covers the whole message
)

// seqCheck checks an engine payload's seq against the instance's last:
// one already applied is skipped; a gap reloads the snapshot.
func (c *Consumer) seqCheck(ctx context.Context, w work, in *inst, seq uint64) int {
	// LastSeq and hasSeq are written only by this goroutine, so reading
	// them here without the lock is safe.
	if in.hasSeq && seq <= in.status.LastSeq && c.shared == nil {
		// An engine seq already applied, with no clear since (after one,
		// hasSeq is false): a message stored twice (resent after
		// JetStream's duplicate window), or one stored after a later one
		// (a publish failure mid-window); the bridge publishes a resync
		// right after either. Applying it meanwhile could bring back
		// blocks removed since. (A shared index keeps its position by
		// stream seq and replays every message: there the resync alone
		// repairs it.)
		c.m.messages.WithLabelValues("duplicate_seq").Inc()
		c.mu.Lock()
		in.status.StreamSeq = max(in.status.StreamSeq, w.streamSeq)
		c.mu.Unlock()
		return seqSkip
	}
	gap := in.hasSeq && seq > in.status.LastSeq+1
	var cleared bool // the message follows a clear, and the stream may have lost what lay between
	var clearErr error
	if !in.hasSeq {
		cleared, clearErr = c.lostSinceClear(ctx, w.instance, in, w.streamSeq, seq)
	}
	switch {
	case gap:
		return c.lostBefore(ctx, w, in, seq, lostGap, nil)
	case cleared:
		return c.lostBefore(ctx, w, in, seq, lostAfterClear, clearErr)
	case c.shared != nil && in.hole != 0 && in.loadDue():
		c.repairHole(ctx, w.instance, in, w.streamSeq, seq, false)
	}
	return seqApply
}

// What the stream lost before an instance's message (lostBefore).
const (
	lostGap         = iota // engine seqs do not follow on from the last applied
	lostAfterClear         // the first engine message after a clear the stream no longer holds (lostSinceClear)
	lostResyncClear        // a resync's table chunk whose clear this router never read (orphanChunk)
)

// lostBefore handles messages of the instance the stream lost before its
// message w (engine seq seq; 0 for a resync's table chunk), why says how
// that showed. The bridge publishes every engine seq or a clear, so a
// hole here means retention removed messages before this router read
// them: the snapshot is the only way back to the truth. It reports
// seqCovered when the snapshot loaded covers the whole message, seqSkip
// when it already holds its engine seq, else seqApply.
func (c *Consumer) lostBefore(ctx context.Context, w work, in *inst, seq uint64, why int, err error) int {
	clearAt := in.clearAt // written only by this goroutine
	c.mu.Lock()
	in.status.Gaps++
	c.mu.Unlock()
	c.m.gaps.Inc()
	switch why {
	case lostGap:
		c.cfg.Logger.Warn("consumer: engine seq gap in the stream, reloading snapshot", "instance", w.instance,
			"last_seq", in.status.LastSeq, "seq", seq)
	case lostAfterClear:
		c.cfg.Logger.Warn("consumer: the stream may have lost the instance's messages after a clear (the clear is gone from it), reloading snapshot",
			"instance", w.instance, "clear_stream_seq", clearAt, "stream_seq", w.streamSeq, "seq", seq, "err", err)
	case lostResyncClear:
		c.cfg.Logger.Warn("consumer: the stream lost the instance's resync clear (a table chunk of the resync came without it), reloading snapshot",
			"instance", w.instance, "stream_seq", w.streamSeq, "last_stream_seq", in.status.StreamSeq, "last_seq", in.status.LastSeq)
	}
	// Nothing to follow on from but the message itself: after a clear,
	// or for a resync's chunk (no engine seq).
	cleared := why != lostGap
	if c.cfg.SharedIndex {
		if c.shared != nil {
			if cleared {
				// No engine seq (0, as for a lost tail): none to follow
				// on from since the clear, so a snapshot's seqs say
				// nothing of what the index misses; only a snapshot at
				// or past this message, or the index there with no hole
				// recorded, repairs it.
				seq = 0
			}
			c.repairHole(ctx, w.instance, in, w.streamSeq, seq, true)
		}
		return seqApply
	}
	lostBefore := in.status.ReplayLost // written only by this goroutine
	start := time.Now()
	c.load(ctx, w.instance, in, w.streamSeq)
	if w.streamSeq != 0 && w.streamSeq <= in.skipUpTo {
		c.m.messages.WithLabelValues("covered_by_snapshot").Inc()
		return seqCovered
	}
	// After a clear, only a snapshot taken at or after it numbers this
	// message's process: one taken before (the bucket's, the bridge not
	// answering) holds the old process's blocks and seqs, and none leaves
	// the clear with the lost messages missing. A snapshot's stream seq is
	// the last message its table covers, so one at the clear's was taken
	// after it (a resync of an empty table: the clear alone, the engine
	// seq kept); one after a gap or restart clear has no engine seq
	// (hasSeq false). Counted only strictly past it, a quiet instance
	// whose such resync aged out was held as a hole, though its engine seq
	// followed on. A resync's chunk follows on from nothing short of a
	// snapshot covering it (above): the lost clear and chunks before it
	// rebuilt the bridge's table, which no older snapshot holds.
	followsOn := in.hasSeq && (why == lostGap || why == lostAfterClear && in.status.SnapshotSeq >= clearAt)
	if followsOn && seq <= in.status.LastSeq {
		// The snapshot already holds this engine seq: applying it again
		// could bring back blocks removed since.
		return seqSkip
	}
	if cleared && !followsOn || followsOn && seq > in.status.LastSeq+1 {
		// The snapshot and the replay after it still stop short of this
		// message (the bridge did not answer, and the bucket's is older
		// than the hole): what lay between is gone, and with it stores
		// and removals the index misses. Applied meanwhile, but not live
		// (holdHole) until a snapshot past it or a clear; one hole is
		// counted once, here or by the replay.
		c.holdHole(in, w.streamSeq)
		c.retryHole(in, start)
		if in.status.ReplayLost == lostBefore {
			c.countLost(in, "hole", "consumer: engine seq gap remains after reload; not live until a snapshot past it or a clear",
				"instance", w.instance, "last_seq", in.status.LastSeq, "seq", seq, "stream_seq", w.streamSeq, "after_clear", cleared)
		}
	}
	return seqApply
}

// orphanChunk reports whether a message marked synthetic (clears: it
// holds an AllBlocksCleared), taken in after a message that left prev,
// is a resync's table chunk whose clear this router never read. The
// bridge publishes a resync as its clear, then its table in chunks, with
// none of the instance's other messages between them, and keeps its
// engine seq across it; a snapshot's stream seq is never inside one (the
// bridge moves it past the resync at its end). A chunk after a message
// (or snapshot) of no resync means retention removed its clear, and the
// chunks before it, before this router read them: the state the chunk is
// applied over keeps what the clear wiped (blocks the engine removed in
// messages lost with it, or left out of the bridge's table for another
// reason). With the engine quiet after it nothing else shows it: no
// engine message after it shows a seq gap, and the bridge's heartbeats
// name the chunk's stream seq, this router's own (no lost tail). prev not
// known (a shared index's router that started after the instance's last
// message): not a loss.
func orphanChunk(synthetic string, clears bool, prev resyncState) bool {
	return synthetic == kvstream.SyntheticResync && !clears && prev == resyncClosed
}

// lostSinceClear reports whether the stream may have lost messages of the
// instance before its engine message at stream seq at (engine seq seq),
// the first since a clear at stream seq in.clearAt (hasSeq false: no
// engine seq to follow on from). Its seq cannot tell: after a clear the
// bridge's next message may carry any (a new process's first, the first
// its replay still held, the one after a gap). The stream can: retention
// removes an instance's oldest messages first, so one published after
// the clear is gone only if the clear is gone too. No question is asked
// for a message right after the clear, nor for engine seq 0 (an engine's
// first: nothing of its process comes before it, and what an earlier one
// did is cleared), nor in a re-created stream the instance has sent
// nothing to yet (the clear numbers the old one). A clear gone though
// nothing was lost (it aged out while the instance was quiet) costs a
// snapshot reload, which the bridge's table ends, or, the bridge not
// answering, a snapshot with an engine seq taken at or after the clear
// (seqCheck: followsOn); else the instance is held as a hole until the
// bridge answers. A stream that does not answer cannot rule a loss out:
// reported as one, with the error.
func (c *Consumer) lostSinceClear(ctx context.Context, instance string, in *inst, at, seq uint64) (bool, error) {
	if in.clearAt == 0 || at <= in.clearAt+1 || seq == 0 || in.restreamed || c.stream == nil {
		return false, nil
	}
	subj, _ := kvstream.EventsSubject(c.cfg.Pool, instance)
	m, err := getMsg(ctx, c.stream, in.clearAt, subj)
	switch {
	case err == nil:
		return m.Sequence != in.clearAt, nil
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return true, nil
	default:
		return ctx.Err() == nil, err
	}
}

// repairHole loads the instance's snapshot into the shared index for a
// hole in its engine seqs before its message at stream seq at (engine seq
// seq): found, the hole was seen at that message; else it was seen earlier
// and is still pending, and at is the message in hand or, from a sync
// (syncShared: no message), the one after the index's position. The
// stream lost messages of the instance, so its state in the index misses
// them too: only a snapshot at or past the hole replaces it (seedShared
// clears in.hole then), or a clear after it. One older than the hole (the
// bridge did not answer, and the bucket's was taken before it) leaves the
// instance not live, the message applied meanwhile; the load is tried
// again (loadRetryAt apart) at a later message or at the periodic sync of
// an instance gone quiet, whose bridge's snapshot is at the index's own
// position: LoadAt takes that one while the hole is pending. seq 0 with
// found: a lost tail (lostTail), no message in hand; at is the last one.
func (c *Consumer) repairHole(ctx context.Context, instance string, in *inst, at, seq uint64, found bool) {
	start := time.Now()
	if found {
		c.setHole(in, at)
	}
	pos, err := c.seedShared(ctx, instance, in, at)
	switch {
	case errors.Is(err, errOwned):
		// Another router writes the instance: it meets the same hole in
		// the stream, and records it in the index when its state does not
		// reach past it either (ApplyAtHole); this router's hole is kept
		// until the index is past it with none recorded (noteHole).
		c.noteHole(in, pos)
	case err == nil:
		c.setFrom(in, pos)
		// Past the hole: the index is past it with none recorded
		// (noteHole), or, when the hole was just found, the snapshot
		// (and the replay after it) reached its engine seqs.
		c.noteHole(in, pos)
		if found && seq != 0 && in.hasSeq && seq <= in.status.LastSeq+1 {
			c.setHole(in, 0)
		}
	default:
		c.cfg.Logger.Warn("consumer: snapshot load into the shared index failed, will retry", "instance", instance, "err", err)
	}
	if in.hole == 0 {
		in.retryAt = time.Time{}
		return
	}
	in.retryAt = loadRetryAt(start, time.Now(), c.cfg.StaleAfter)
	c.setSynced(in, false)
	if !found {
		return
	}
	c.countLost(in, "shared_hole", "consumer: engine seq gap in the stream not repaired by a snapshot in the shared index; not live until a snapshot past it or a clear",
		"instance", instance, "last_seq", in.status.LastSeq, "seq", seq, "stream_seq", at)
}

// countLost counts a hole in an instance's engine seqs that the snapshot
// loaded for it does not reach (replay_lost) and logs msg with attrs,
// a few lines per interval under key.
func (c *Consumer) countLost(in *inst, key, msg string, attrs ...any) {
	c.mu.Lock()
	in.status.ReplayLost++
	c.mu.Unlock()
	c.m.replayLost.Inc()
	if ok, suppressed := c.logLimit.Allow(key); ok {
		c.cfg.Logger.Warn(msg, append(attrs, "suppressed", suppressed)...)
	}
}

// sawSeq records engine seq seq as applied: the instance's last engine
// seq, unless one above it was (a duplicate does not lower it). c.mu held.
func (in *inst) sawSeq(seq uint64) {
	if !in.hasSeq || seq > in.status.LastSeq {
		in.status.LastSeq = seq
	}
	in.hasSeq = true
}

// seqsFrom starts the instance's engine seqs over after its message at
// stream seq at: a bridge's clear, or a resync's chunk whose clear was
// lost (orphanChunk), once the loss is handled (held as a hole, or the
// snapshot loaded) and the chunk not covered by it. The bridge keeps its
// engine seq across a resync, so its next engine message follows on from
// that, not from this router's last one, whose gap to it is the loss
// already counted; the chunk stands in for the clear's stream seq
// (lostSinceClear). c.mu held.
func (in *inst) seqsFrom(at uint64) {
	in.hasSeq, in.clearAt = false, at
}

// resyncAfter is what a router knows of an instance after taking in a
// message (orphanChunk): inside a resync after any of its messages (its
// clear opens it; a chunk, found an orphan or not, continues it), else
// not.
func resyncAfter(synthetic string) resyncState {
	if synthetic == kvstream.SyntheticResync {
		return resyncOpen
	}
	return resyncClosed
}

// wipeHole clears the instance's pending hole when a clear at stream seq
// at comes after it: what the lost messages did is wiped. c.mu held.
func (in *inst) wipeHole(at uint64) {
	if in.hole != 0 && at >= in.hole {
		in.hole = 0
	}
}

// setHole sets the instance's pending hole (inst.hole; 0: none).
func (c *Consumer) setHole(in *inst, at uint64) {
	c.mu.Lock()
	in.hole = at
	c.mu.Unlock()
}

// applyBatch applies one decoded engine payload (err: it could not be
// decoded) of message w, whose headers are h; seq is its engine seq when
// engineMsg. It reports whether the index refused the apply (the
// instance then reloads its snapshot, or is repaired in the shared
// index): what follows in the same message is not applied after it.
func (c *Consumer) applyBatch(ctx context.Context, w work, in *inst, h kvstream.EventHeaders, engineMsg bool, seq uint64, batch events.Batch, err error) (failed bool) {
	var res kvindex.ApplyResult
	var aerr error
	if err == nil && in.hole != 0 && clearsAll(batch.Events) {
		// Everything before the clear (the engine's, or a bridge's: its
		// clears carry the event too; a resync's table chunks after one
		// do not) is wiped: the state after it is exact from the stream
		// alone. (In the shared index an apply that fails leaves the
		// instance not live until a repair applies the message.)
		c.setHole(in, 0)
		if !c.cfg.SharedIndex {
			// The memory index's retry of the hole's load is moot (a
			// failed apply of the clear asks for one again).
			in.needLoad, in.retryAt = false, time.Time{}
		}
	}
	switch {
	case err == nil && c.shared != nil:
		res, aerr = c.applyShared(ctx, w.instance, in, w.streamSeq, batch.Events)
	case err == nil:
		res, aerr = c.cfg.Applier.Apply(ctx, w.instance, batch.Events)
	}
	// Status changes only after Apply, so "at seq N" means applied through N.
	now := time.Now()
	c.mu.Lock()
	st := &in.status
	st.StreamSeq = max(st.StreamSeq, w.streamSeq)
	if w.stored.IsZero() {
		c.seenAt(in, now, now)
	} else {
		c.seenAt(in, w.stored, now)
	}
	if engineMsg {
		// A duplicate (applied again in the shared index) does not lower
		// it: lowered, the next message would read as a hole, and a
		// snapshot reload — not live when the snapshot is older — follow.
		in.sawSeq(seq)
	}
	clears := err == nil && clearsAll(batch.Events)
	in.resync = resyncAfter(h.Synthetic)
	if clearsSeq(h.Synthetic, clears) {
		// The bridge cleared the instance: seq continuity starts over.
		st.Clears++
		in.seqsFrom(w.streamSeq)
		in.lost++
	}
	if clears {
		in.lost++ // the engine emptied its cache (reset_prefix_cache)
	}
	if err != nil {
		st.Malformed++
	} else {
		st.Unknown += uint64(batch.Unknown)
		st.Invalid += uint64(batch.Invalid)
		st.LastEvent = now
	}
	c.mu.Unlock()
	if err != nil {
		c.m.messages.WithLabelValues("malformed").Inc()
		if ok, suppressed := c.logLimit.Allow("malformed"); ok {
			c.cfg.Logger.Warn("consumer: malformed payload skipped", "instance", w.instance, "stream_seq", w.streamSeq, "err", err, "suppressed", suppressed)
		}
		return false
	}
	if batch.Unknown > 0 {
		c.m.unknown.Add(float64(batch.Unknown))
	}
	if batch.Invalid > 0 {
		c.m.invalid.Add(float64(batch.Invalid))
		// Counted every time; logged at most a few lines per interval, as
		// an engine whose every batch carries one would flood the log.
		if ok, suppressed := c.logLimit.Allow("invalid"); ok {
			c.cfg.Logger.Warn("consumer: unreadable events skipped", "instance", w.instance, "stream_seq", w.streamSeq,
				"events", batch.Invalid, "first", batch.InvalidErr, "suppressed", suppressed)
		}
	}
	if aerr != nil {
		c.m.applyErrors.Inc()
		if c.shared != nil {
			// Not live until repaired: by the next message of the
			// instance, or the sync watchShared queues meanwhile.
			// Counted every time (kvrouter_events_apply_errors_total);
			// logged a few lines per interval, as every message fails
			// alike while Redis is down.
			if ok, suppressed := c.logLimit.Allow("shared_apply"); ok {
				c.cfg.Logger.Warn("consumer: apply to the shared index failed, will repair", "instance", w.instance, "err", aerr, "suppressed", suppressed)
			}
			return true
		}
		c.cfg.Logger.Warn("consumer: apply failed, will reload the snapshot", "instance", w.instance, "err", aerr)
		// The index may now hold part of the batch or miss it: the next
		// event of the instance reloads its snapshot to get back in step.
		in.needLoad = true
		return true
	}
	c.m.applied.Inc()
	c.m.countEvents(batch.Events)
	c.m.stored.Add(float64(res.Stored))
	c.m.removed.Add(float64(res.Removed))
	c.countDropped(res)
	if !w.stored.IsZero() {
		c.m.lag.Observe(now.Sub(w.stored).Seconds())
	}
	return false
}
