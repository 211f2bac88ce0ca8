package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
)

// loadKnown queues a snapshot load for every instance of the pool that has
// one in the bucket, before any stream message: the shard applies the
// snapshot, then skips the stream up to its sequence.
func (c *Consumer) loadKnown(ctx context.Context) {
	c.forSnapshots(ctx, func(instance string) {
		c.mu.Lock()
		if c.insts[instance] == nil {
			if reason := c.refuseNew(instance, false); reason != "" {
				c.mu.Unlock()
				c.dropNew(instance, reason, "snapshot")
				return
			}
			c.insts[instance] = c.newInst(instance, time.Time{})
		}
		c.mu.Unlock()
		c.enqueue(ctx, work{kind: workLoad, instance: instance})
	})
}

// forSnapshots calls f for every instance of the pool that has a snapshot
// in the bucket (keys whose instance is not a valid token are skipped); a
// failed listing is logged and calls f for none.
func (c *Consumer) forSnapshots(ctx context.Context, f func(instance string)) {
	lister, err := c.kv.ListKeysFiltered(ctx, c.cfg.Pool+".*")
	if err != nil {
		c.cfg.Logger.Warn("consumer: list snapshots", "err", err)
		return
	}
	for key := range lister.Keys() {
		instance := key[len(c.cfg.Pool)+1:]
		if kvstream.ValidToken("instance", instance) == nil {
			f(instance)
		}
	}
}

// foreignSnapshot reports whether snap's stream seq cannot be a position
// in the stream this consumer reads: past the stream's last message, or
// the snapshot taken before the stream was created. An idle bridge puts
// its snapshot again unchanged after a wiped store, and an operator's
// delete and re-create leaves the bucket's snapshots in place, so a router
// started after either would skip, as covered by the snapshot, every
// message of the instance in the new stream below the old number (a
// running router learns of the re-creation from its watchdog:
// inst.restreamed). The snapshot's blocks still stand: its engine seq
// tells which of the instance's messages it holds. A stream that does not
// answer leaves the snapshot trusted, as before.
func (c *Consumer) foreignSnapshot(ctx context.Context, instance string, snap kvstream.Snapshot) bool {
	if c.stream == nil || snap.StreamSeq == 0 {
		return false
	}
	ictx, cancel := context.WithTimeout(ctx, apiTimeout)
	info, err := c.stream.Info(ictx)
	cancel()
	if err != nil {
		// Not the cached info: its last message is as old as the last
		// answer, and a fresh snapshot would read as past it.
		return false
	}
	foreign := snap.StreamSeq > info.State.LastSeq || !snap.Taken.IsZero() && snap.Taken.Before(info.Created)
	if foreign {
		if ok, suppressed := c.logLimit.Allow("foreign_snapshot"); ok {
			c.cfg.Logger.Warn("consumer: the instance's snapshot numbers another stream (taken before this one was created, or past its last message); its blocks loaded, its stream seq not trusted",
				"instance", instance, "snapshot_stream_seq", snap.StreamSeq, "stream_last_seq", info.State.LastSeq,
				"taken", snap.Taken, "stream_created", info.Created, "suppressed", suppressed)
		}
	}
	return foreign
}

// load replaces the instance's index state with its snapshot: from the
// bridge (request-reply, the freshest), else the bucket, else nothing (the
// stream alone then rebuilds what it still holds).
//
// cur is the stream sequence of the message being processed (0 for a load
// with none: start-up, heartbeat). Every message of the instance below cur
// (or, without one, up to the last one processed) has already gone
// through this shard, so when the snapshot is older than that (a bucket
// snapshot, up to its refresh period old, while the bridge is down) the
// messages between the snapshot and cur are replayed from the stream
// after it; otherwise a reload would drop everything applied since the
// snapshot was taken.
func (c *Consumer) load(ctx context.Context, instance string, in *inst, cur uint64) {
	in.needLoad, in.retryAt = false, time.Time{}
	start := time.Now()
	defer c.retryHole(in, start)
	c.mu.Lock()
	done := in.status.StreamSeq
	in.loadFailed = false
	c.mu.Unlock()
	if cur != 0 {
		done = cur - 1
	}
	snap, source, err := c.fetchSnapshot(ctx, instance)
	if err != nil {
		if !errors.Is(err, errNoSnapshot) && ctx.Err() == nil {
			// There is one but it could not be read: try again at the
			// instance's next event or heartbeat after loadRetryAt
			// rather than trust the stream alone.
			in.needLoad, in.retryAt = true, loadRetryAt(start, time.Now(), c.cfg.StaleAfter)
			c.mu.Lock()
			in.loadFailed = true
			c.mu.Unlock()
			c.m.snapshotLoads.WithLabelValues("error").Inc()
			c.cfg.Logger.Warn("consumer: snapshot unreadable, will retry", "instance", instance, "err", err)
		} else {
			c.m.snapshotLoads.WithLabelValues("none").Inc()
			c.cfg.Logger.Info("consumer: no snapshot, using the stream alone", "instance", instance, "err", err)
		}
		c.seenIfNever(in)
		return
	}
	batch, err := events.Decode(snap.Batch)
	if err != nil {
		c.m.snapshotLoads.WithLabelValues("malformed").Inc()
		c.cfg.Logger.Warn("consumer: malformed snapshot batch", "instance", instance, "source", source, "err", err)
		c.seenIfNever(in)
		return
	}
	if err := c.cfg.Applier.Purge(ctx, instance); err != nil {
		c.cfg.Logger.Warn("consumer: purge before snapshot", "instance", instance, "err", err)
	}
	if _, err := c.cfg.Applier.Apply(ctx, instance, batch.Events); err != nil {
		c.m.applyErrors.Inc()
		c.cfg.Logger.Warn("consumer: apply snapshot", "instance", instance, "err", err)
	}
	// pos: the stream seq the snapshot covers, none when it may number
	// a re-created stream's predecessor (inst.restreamed, or the stream
	// says so: foreignSnapshot).
	pos := snap.StreamSeq
	if in.restreamed || c.foreignSnapshot(ctx, instance, snap) {
		pos = 0
	}
	in.skipUpTo = pos
	c.m.snapshotLoads.WithLabelValues(source).Inc()
	c.mu.Lock()
	in.short = false         // a snapshot replaced the state; the replay below decides again
	in.resync = resyncClosed // never inside a resync (orphanChunk); the replay below follows on
	in.status.SnapshotSeq = pos
	if pos > in.status.StreamSeq {
		in.status.StreamSeq = pos
	}
	if snap.HasSeq {
		in.status.LastSeq, in.hasSeq = snap.EngineSeq, true
	} else {
		in.hasSeq, in.clearAt = false, pos // the bridge's table after a clear
	}
	if in.hole != 0 && (pos >= in.hole || in.restreamed && source == "request") {
		// The bridge's table past the hole (or, the stream re-created,
		// its table now) replaced the state the lost messages left wrong.
		in.hole = 0
	}
	if in.status.State == StatePurged {
		in.status.State = StateStale // seen() decides from the snapshot's age
	}
	c.seen(in, snap.Taken)
	c.mu.Unlock()
	c.cfg.Logger.Info("consumer: loaded snapshot", "instance", instance, "source", source, "blocks", snap.Blocks, "stream_seq", snap.StreamSeq)
	if done > pos {
		c.replay(ctx, instance, in, pos, done)
	}
}

// loadRetryAt is when an instance whose snapshot load failed (it began
// at start and gave up at end) may try again: a second later at the
// soonest, and never sooner than nine times that load's own duration
// after it, but no later than ceiling (the consumer's StaleAfter: the
// window in which an instance is trusted without news). A load holds its
// shard (every instance on it waits), so a snapshot that stays unreadable
// takes at most a tenth of the shard's time, however many events the
// instance sends — unless its loads fail by timing out (seconds each: the
// bridge or the bucket not answering), where the ceiling keeps the next
// try within one stale window. Its events apply from the stream
// meanwhile. The second bounds the retries of a fast failure (a corrupt
// bucket entry fails in well under a millisecond) to the pace of the
// bridge's heartbeats, and its log line to one a second.
func loadRetryAt(start, end time.Time, ceiling time.Duration) time.Time {
	return end.Add(min(ceiling, max(time.Second, 9*end.Sub(start))))
}

// holdHole records, for the memory index, a hole in the instance's engine
// seqs before its message at stream seq at that no snapshot loaded since
// reaches (inst.hole, the latest kept): the stream lost messages whose
// stores and removals the index misses, so the instance is not live
// (seenAt, heartbeat) until a snapshot at or past it is loaded (load;
// retried at its next message or heartbeat, loadRetryAt apart:
// retryHole) or a clear after it is applied (applyBatch, replay). It
// reports whether the hole is past the one pending: a hole met again by
// every retry is counted once.
func (c *Consumer) holdHole(in *inst, at uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	past := at > in.hole
	in.hole = max(in.hole, at)
	if in.status.State == StateLive {
		in.status.State = StateStale
	}
	return past
}

// retryHole: a hole still pending after a load that began at start (or,
// found after it, by the message it was loaded for), or a replay that
// stopped short of it (inst.short; also a load that found no snapshot to
// replace the state with), is loaded for again
// at the instance's next message or heartbeat, loadRetryAt apart, as a
// failed load is: until the bridge answers with its table, the snapshot
// found is the bucket's, older than the hole.
func (c *Consumer) retryHole(in *inst, start time.Time) {
	// Read without c.mu: hole and short are written only by the
	// instance's shard, which runs this.
	if in.hole != 0 || in.short {
		in.needLoad, in.retryAt = true, loadRetryAt(start, time.Now(), c.cfg.StaleAfter)
	}
}

// heldByHole: a memory-index instance with a hole pending (holdHole) is
// not live, whatever arrives. (The shared index holds one not synced.)
// c.mu held.
func (c *Consumer) heldByHole(in *inst) bool {
	return in.hole != 0 && !c.cfg.SharedIndex
}

// loadDue reports whether an instance waiting for its snapshot may load it
// now: its last load neither failed nor fell short of a hole (no clock
// read), or its retry time has come.
func (in *inst) loadDue() bool {
	return in.retryAt.IsZero() || !time.Now().Before(in.retryAt)
}

// seenIfNever starts the silence clock of an instance that has never been
// seen (listed from the bucket, but its snapshot is gone or unreadable):
// without it check() would wait for a first sighting forever and the
// instance would never be aged out. Its state is left as it is (stale):
// nothing says it is alive.
func (c *Consumer) seenIfNever(in *inst) {
	c.mu.Lock()
	if in.lastSeen.IsZero() {
		in.lastSeen = time.Now()
	}
	c.mu.Unlock()
}

// replay re-applies the instance's stream messages with a stream sequence
// in (from, to], in order, after a snapshot taken at from: they had been
// applied before the reload purged them. It reads them one by one with
// the stream's get-next-by-subject (a reload is rare; the messages are few
// seconds' worth), then moves skipUpTo to to so the consumer does not
// apply them twice.
//
// What it cannot replay is real loss: messages the stream no longer holds
// (retention passed them), seen as an engine sequence that does not follow
// on from the snapshot's. The bridge publishes every engine sequence or a
// clear, so the lost messages may have held stores and removals. The
// instance keeps the snapshot plus what survives (clearing would send
// every request to a cold cache), but it is a hole (holdHole): not live
// until a snapshot past it or a clear, counted once
// (kvrouter_events_replay_lost_total, InstanceStatus.ReplayLost) and
// logged. A clear replayed after the hole wipes what the lost messages
// did: no hole then.
func (c *Consumer) replay(ctx context.Context, instance string, in *inst, from, to uint64) {
	subj, _ := kvstream.EventsSubject(c.cfg.Pool, instance)
	var applied int
	var parts [][]byte
	var gapAt uint64 // the stream seq of the message after the last hole, unless a clear followed
	seq := from + 1
	for seq <= to && ctx.Err() == nil {
		m, err := getMsg(ctx, c.stream, seq, subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			// Could not read the stream: leave the snapshot and try the
			// whole reload again at the instance's next event or
			// heartbeat, not live meanwhile (inst.short).
			c.stopShort(in)
			c.m.applyErrors.Inc()
			c.cfg.Logger.Warn("consumer: replay after snapshot failed, will reload", "instance", instance, "stream_seq", seq, "err", err)
			break
		}
		if m.Sequence > to {
			break
		}
		seq = m.Sequence + 1
		h, herr := kvstream.ParseEventHeaders(m.Header)
		engineMsg := herr == nil && h.HasSeq && h.Synthetic == ""
		if engineMsg && in.hasSeq && h.Seq > in.status.LastSeq+1 {
			gapAt = m.Sequence
		}
		// A coalesced message's payloads in order. One that does not
		// split into its headers' count is skipped whole and counted
		// malformed: nothing of it is applied, and its seqs are taken as
		// seen, as a single malformed payload's is (the stream did not
		// lose them: the next message is no gap).
		var serr error
		if parts, serr = kvstream.SplitPayload(h, m.Data, parts); serr != nil {
			parts = parts[:0]
			c.m.messages.WithLabelValues("malformed").Inc()
		}
		failed, clears := false, false
		for i, p := range parts {
			if engineMsg && in.hasSeq && h.Seq+uint64(i) <= in.status.LastSeq {
				// An engine seq already applied (a message stored twice):
				// skipped, as the live path skips it (seqCheck, which
				// counted it when it was consumed); applied again it could
				// bring back blocks removed since.
				continue
			}
			batch, err := events.Decode(p)
			if err != nil {
				continue
			}
			clears = clears || clearsAll(batch.Events)
			if _, aerr := c.cfg.Applier.Apply(ctx, instance, batch.Events); aerr != nil {
				c.stopShort(in)
				c.m.applyErrors.Inc()
				c.cfg.Logger.Warn("consumer: apply during replay failed, will reload", "instance", instance, "stream_seq", m.Sequence, "err", aerr)
				failed = true
				break
			}
			applied++
		}
		if failed {
			break
		}
		c.mu.Lock()
		in.status.StreamSeq = max(in.status.StreamSeq, m.Sequence)
		if engineMsg {
			in.sawSeq(h.LastSeq()) // a duplicate does not lower it
		}
		orphan := !in.restreamed && orphanChunk(h.Synthetic, clears, in.resync)
		if orphan {
			gapAt = m.Sequence // a resync's chunk without its clear (orphanChunk)
		}
		if clearsSeq(h.Synthetic, clears) || orphan {
			in.seqsFrom(m.Sequence)
		}
		in.resync = resyncAfter(h.Synthetic)
		if clears {
			gapAt = 0 // what the lost messages did is wiped
			in.wipeHole(m.Sequence)
		}
		c.mu.Unlock()
	}
	if !in.needLoad {
		in.skipUpTo = max(in.skipUpTo, to)
	}
	c.m.replayed.Add(float64(applied))
	if gapAt != 0 && c.holdHole(in, gapAt) {
		c.countLost(in, "hole", "consumer: messages after the snapshot are gone from the stream; keeping the snapshot and what remains, not live until a snapshot past them or a clear",
			"instance", instance, "snapshot_stream_seq", from, "to", to, "stream_seq", gapAt)
	}
	c.cfg.Logger.Info("consumer: replayed messages after snapshot", "instance", instance, "from", from+1, "to", to, "applied", applied)
}

// stopShort records a replay after a snapshot that stopped before its
// end (inst.short): reloaded at the instance's next message or heartbeat,
// loadRetryAt apart, and not live until then.
func (c *Consumer) stopShort(in *inst) {
	now := time.Now()
	in.needLoad, in.retryAt = true, loadRetryAt(now, now, c.cfg.StaleAfter)
	c.mu.Lock()
	in.short = true
	if in.status.State == StateLive {
		in.status.State = StateStale
	}
	c.mu.Unlock()
}

// errNoSnapshot: neither the bridge nor the bucket has one.
var errNoSnapshot = errors.New("consumer: no snapshot")

func (c *Consumer) fetchSnapshot(ctx context.Context, instance string) (kvstream.Snapshot, string, error) {
	// A snapshot in the object store can be replaced while it is read (the
	// bridge refreshes it); a second try reads the new one.
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return kvstream.Snapshot{}, "", ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
		var s kvstream.Snapshot
		var source string
		s, source, err = c.fetchSnapshotOnce(ctx, instance)
		if err == nil || errors.Is(err, errNoSnapshot) {
			return s, source, err
		}
		c.cfg.Logger.Debug("consumer: snapshot fetch failed, retrying", "instance", instance, "err", err)
	}
	return kvstream.Snapshot{}, "", err
}

func (c *Consumer) fetchSnapshotOnce(ctx context.Context, instance string) (kvstream.Snapshot, string, error) {
	subj, err := kvstream.SnapshotSubject(c.cfg.Pool, instance)
	if err != nil {
		return kvstream.Snapshot{}, "", err
	}
	rctx, cancel := context.WithTimeout(ctx, c.cfg.SnapshotTimeout)
	reply, err := c.cfg.Conn.RequestWithContext(rctx, subj, nil)
	cancel()
	if err == nil && reply.Header.Get("Kv-Error") == "" {
		s, err := kvstream.UnmarshalSnapshot(reply.Data)
		if err == nil {
			s, err = kvstream.ResolveSnapshot(ctx, c.obs, s)
		}
		if err == nil && s.Instance == instance {
			return s, "request", nil
		}
	}
	key, _ := kvstream.SnapshotKey(c.cfg.Pool, instance)
	kctx, cancel := context.WithTimeout(ctx, apiTimeout)
	e, err := c.kv.Get(kctx, key)
	cancel()
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return kvstream.Snapshot{}, "", fmt.Errorf("%w: %w", errNoSnapshot, err)
	}
	if err != nil {
		return kvstream.Snapshot{}, "", fmt.Errorf("consumer: snapshot bucket: %w", err)
	}
	s, err := kvstream.UnmarshalSnapshot(e.Value())
	if err == nil {
		s, err = kvstream.ResolveSnapshot(ctx, c.obs, s)
	}
	if err != nil {
		return kvstream.Snapshot{}, "", err
	}
	if s.Instance != instance {
		return kvstream.Snapshot{}, "", fmt.Errorf("consumer: bucket key %s holds instance %q", key, s.Instance)
	}
	return s, "bucket", nil
}

// apiTimeout bounds each single JetStream request the consumer makes from
// a shard or a check (a stream message, stream or consumer info, a bucket
// entry). A request in flight when its server died is never answered, and
// nats.go bounds it by its own default (the same 5s) only when the
// caller's context has no deadline: under a run context with one (a
// test's, a shutdown deadline) the shard waited until it, and so did every
// instance of the shard and, once the shard's queue filled, the stream.
const apiTimeout = 5 * time.Second

// getMsg reads the stream's first message on subj at or after seq, bounded
// by apiTimeout.
func getMsg(ctx context.Context, s jetstream.Stream, seq uint64, subj string) (*jetstream.RawStreamMsg, error) {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	return s.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subj))
}

// lostTail handles a heartbeat saying the instance's last message is at
// stream seq last, past every message of it this router applied or
// loaded (known), once every message dispatched before the heartbeat has
// been applied (workTail, on the instance's shard). When the stream
// still holds one of its messages after known, up to last, nothing is
// lost (it is on its way, or a repair's replay reads it). When it holds
// none, retention removed them before this router read them, and the
// engine has sent nothing since: no later message shows a seq gap, and
// the index would keep what they stored and removed wrong, live, for as
// long as the engine stays quiet. That is a hole at last, handled as
// one found at a message: the snapshot reloaded, and, when the one
// loaded does not reach last (the bridge did not answer, the bucket's is
// older), the instance not live until a snapshot at or past it or a
// clear after it (retried at heartbeats or, shared, the periodic sync).
func (c *Consumer) lostTail(ctx context.Context, instance string, in *inst, last uint64) {
	unknown := false
	defer func() {
		if unknown {
			// The stream did not answer: the heartbeat's hold stands (a
			// stale instance is not made live on a state not known
			// whole); the next heartbeat asks again.
			return
		}
		// What the heartbeat held back: seenAt decides now, as it would
		// have (not live while a hole is pending; shared, not synced).
		c.mu.Lock()
		c.seen(in, in.lastSeen)
		c.mu.Unlock()
	}()
	if in.restreamed {
		// The stream was re-created and the instance has sent nothing
		// since: its bridge's heartbeat numbers its last message in the
		// old stream, which says nothing of this one's.
		return
	}
	c.mu.Lock()
	known := in.status.StreamSeq
	c.mu.Unlock()
	if c.shared != nil && in.from.Seeded {
		known = max(known, in.from.Seq)
	}
	var err error
	if last > known && last > in.hole && c.stream != nil {
		subj, _ := kvstream.EventsSubject(c.cfg.Pool, instance)
		var m *jetstream.RawStreamMsg
		if m, err = getMsg(ctx, c.stream, known+1, subj); err == nil && m.Sequence > last {
			err = jetstream.ErrMsgNotFound // none of them held
		}
	}
	if errors.Is(err, jetstream.ErrMsgNotFound) && c.shared != nil {
		// Another router may have applied them, or repaired the loss
		// first: the index at or past last, with no hole recorded.
		if p, perr := c.shared.idx.Position(ctx, instance); perr == nil && p.Seeded && p.Hole == 0 && p.Seq >= last {
			if p.Seq == last {
				c.setFrom(in, p) // where its consuming them would have left it
			}
			err = nil
		}
	}
	if !errors.Is(err, jetstream.ErrMsgNotFound) {
		// Reached, or still held (applied in order, or replayed by a
		// repair), or not known (the next heartbeat asks again).
		unknown = err != nil
		return
	}
	c.mu.Lock()
	in.status.Gaps++
	c.mu.Unlock()
	c.m.gaps.Inc()
	if ok, suppressed := c.logLimit.Allow("lost_tail"); ok {
		c.cfg.Logger.Warn("consumer: the stream lost the instance's last messages (its bridge's heartbeat is past them), reloading snapshot",
			"instance", instance, "stream_seq", known, "bridge_stream_seq", last, "suppressed", suppressed)
	}
	if c.shared != nil {
		c.repairHole(ctx, instance, in, last, 0, true)
		return
	}
	lostBefore := in.status.ReplayLost // written only by this goroutine
	start := time.Now()
	c.load(ctx, instance, in, 0)
	c.mu.Lock()
	short := in.status.StreamSeq < last
	c.mu.Unlock()
	if !short {
		return
	}
	c.holdHole(in, last)
	c.retryHole(in, start)
	if in.status.ReplayLost == lostBefore {
		c.countLost(in, "hole", "consumer: the instance's lost last messages not reached by the snapshot reloaded; not live until a snapshot past them or a clear",
			"instance", instance, "stream_seq", in.status.StreamSeq, "bridge_stream_seq", last)
	}
}
