package consumer

import (
	"context"
	"encoding/json"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events/kvstream"
)

// seen records activity at t (an event's store time, a snapshot's time, a
// heartbeat's arrival) and sets the state from it: live when recent, else
// stale. Replaying an hour of stream history must not make instances that
// died long ago look live. c.mu held.
func (c *Consumer) seen(in *inst, t time.Time) { c.seenAt(in, t, time.Now()) }

// seenAt is seen with the clock already read (now): a stream message's
// path reads it once.
func (c *Consumer) seenAt(in *inst, t, now time.Time) {
	if t.After(now) {
		// Stored by a NATS server whose clock runs ahead of ours: it was
		// seen now, not later (else it would stay live for StaleAfter
		// plus the skew after going silent).
		t = now
	}
	if t.After(in.lastSeen) {
		in.lastSeen = t
	}
	if in.status.EngineDown || in.reloading || c.heldByHole(in) || in.short {
		// Not live whatever arrives until the engine is back and the
		// bridge's table reloaded (see heartbeat), or, after a hole in
		// its engine seqs, a snapshot or a clear put its state right.
		if in.status.State == StateLive {
			in.status.State = StateStale
		}
	} else if now.Sub(in.lastSeen) <= c.cfg.StaleAfter {
		in.status.State = StateLive
	} else if in.status.State == StateLive {
		in.status.State = StateStale
	}
}

// bridgeHeard reports whether the instance's bridge was heard from (a
// heartbeat or a message) within StaleAfter and does not report its
// engine down: whether asking it for its table can help.
func (c *Consumer) bridgeHeard(in *inst) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !in.status.EngineDown && time.Since(in.lastSeen) <= c.cfg.StaleAfter
}

// newInst makes an instance record first seen at t (zero: not yet, a
// snapshot load will tell); c.mu held. On a shared index it starts
// unsynced (not live): this router has not seen the instance's state in
// the index, which may miss messages stored before its consumer's start,
// until a sync checks it or a message of it is applied.
func (c *Consumer) newInst(instance string, t time.Time) *inst {
	in := &inst{status: InstanceStatus{Instance: instance, State: StateStale}, needLoad: true}
	if c.shared != nil {
		in.status.IndexUnsynced = true
		c.unsynced.Add(1)
	}
	if !t.IsZero() {
		c.seen(in, t)
	}
	return in
}

// refuseNew says why a name with no record may not get one ("" = it may):
// over the cap, or, for a name seen only in events, not admitted by
// Config.Admit. c.mu held.
func (c *Consumer) refuseNew(instance string, fromEvent bool) string {
	admitted := c.cfg.Admit != nil && c.cfg.Admit(instance)
	if fromEvent && c.cfg.Admit != nil && !admitted {
		return "unknown_instance"
	}
	if len(c.insts) >= c.cfg.MaxInstances && !admitted {
		return "over_cap"
	}
	return ""
}

// dropNew counts and (rate-limited) logs a name refused a record.
func (c *Consumer) dropNew(instance, reason, via string) {
	if via == "heartbeat" {
		c.m.heartbeats.WithLabelValues(reason).Inc()
	} else {
		c.m.messages.WithLabelValues(reason).Inc()
	}
	if ok, suppressed := c.logLimit.Allow(reason + via); ok {
		c.cfg.Logger.Warn("consumer: instance refused a record", "instance", instance, "reason", reason, "via", via,
			"max_instances", c.cfg.MaxInstances, "suppressed", suppressed)
	}
}

// heartbeat records a bridge heartbeat; an instance seen for the first
// time, or purged, gets its snapshot loaded.
func (c *Consumer) heartbeat(ctx context.Context, m *nats.Msg) {
	_, pool, instance, err := kvstream.ParseSubject(m.Subject)
	if err != nil || pool != c.cfg.Pool {
		return
	}
	var hb kvstream.Heartbeat
	if err := json.Unmarshal(m.Data, &hb); err != nil {
		c.m.heartbeats.WithLabelValues("malformed").Inc()
		return
	}
	if f := c.cfg.AdmitHeartbeat; f != nil && f(instance, m, &hb) != nil {
		c.m.heartbeats.WithLabelValues("refused").Inc()
		return
	}
	now := time.Now()
	dispatched := c.dispatched()
	c.mu.Lock()
	in := c.insts[instance]
	if in == nil {
		if reason := c.refuseNew(instance, false); reason != "" {
			c.mu.Unlock()
			c.dropNew(instance, reason, "heartbeat")
			return
		}
	}
	c.m.heartbeats.WithLabelValues("ok").Inc()
	load, reload, needSync, backwards, down := false, false, false, false, false
	// The bridge's last message of the instance is past every one of its
	// messages here. Not yet dispatched (the heartbeat outran it, or the
	// consumer is behind: a router resumed after a stop), the heartbeat
	// does not make the instance live; the next one looks again.
	// Dispatched (tail), lostTail checks, queued behind the messages
	// dispatched before it on the instance's shard, whether the stream
	// still holds them, and sets the state the heartbeat left.
	ahead := in != nil && hb.StreamSeq > max(in.status.StreamSeq, in.expect.Seq)
	tail := ahead && dispatched >= hb.StreamSeq
	if in == nil {
		in = c.newInst(instance, now)
		c.insts[instance] = in
		load = !c.cfg.SharedIndex
		// Shared index: its messages may all precede the consumer's start
		// and it was in no snapshot listed: the sync replays them.
		needSync = c.shared != nil
	} else if in.status.State == StatePurged {
		load = !c.cfg.SharedIndex
		in.status.State = StateLive
	} else if in.status.State == StateStale && !ahead {
		in.status.State = StateLive
	}
	if (in.loadFailed || in.hole != 0 || in.short) && !c.cfg.SharedIndex {
		// Its snapshot could not be read last time, or was older than a
		// hole in its engine seqs: try again now (the shard spaces the
		// tries: loadDue), as an engine with nothing to say sends no
		// event to try at.
		load = true
	}
	switch {
	case hb.EngineDown:
		// The engine is dead: its blocks must not count, now. They stay
		// in the index, since the engine may come back as the same
		// process (the bridge then keeps its table).
		if !in.status.EngineDown {
			c.cfg.Logger.Info("consumer: engine down, instance not live", "instance", instance)
			in.lost++
			down = true
		}
		in.status.EngineDown = true
		in.status.State = StateStale
	case in.status.EngineDown:
		// Back up. The bridge decided before saying so whether this is
		// the same process (table kept) or a new one (cleared), but the
		// stream may not have brought that clear here yet: reload the
		// bridge's table, and count the instance live only after.
		in.status.EngineDown = false
		in.reloading, reload = true, true
		in.status.State = StateStale
	case in.hasSeq && hb.EngineSeq < in.status.LastSeq && hb.StreamSeq != 0 && hb.StreamSeq == in.status.StreamSeq &&
		!in.reloading && (!c.cfg.SharedIndex || in.status.LastSeq != in.backwardsAt):
		// This consumer has taken in every message the bridge published
		// (the bridge's last stream seq is the instance's last here; a
		// heartbeat ahead of that may be overtaking a clear not yet
		// applied), yet the bridge's engine seq is behind one applied
		// here. Within one engine process seqs only grow, so what was
		// applied is another process's: the engine restarted and the
		// bridge's restart clear was gone from the stream before this
		// consumer read it (retention passed it by), and the new
		// process's first messages were skipped as duplicates of the old
		// one's seqs. Memory index: reload the bridge's table, not live
		// until then. Shared index: counted and logged (once until a
		// later seq is applied), not repaired.
		backwards = true
		in.status.Gaps++
		in.backwardsAt = in.status.LastSeq // shared: counted once until a later seq is applied
		if !c.cfg.SharedIndex {
			in.reloading, reload = true, true
			in.status.State = StateStale
		}
	case in.reloading || c.heldByHole(in) || in.short:
		in.status.State = StateStale
	}
	in.status.LastHeartbeat, in.lastSeen = now, now
	in.status.Heartbeat = &hb
	lastSeq := in.status.LastSeq
	c.mu.Unlock()
	if down && c.cfg.EngineDown != nil {
		c.cfg.EngineDown(instance)
	}
	if backwards {
		c.m.gaps.Inc()
		if ok, suppressed := c.logLimit.Allow("seq_backwards"); ok {
			msg := "consumer: the bridge's engine seq is behind the one applied (the engine restarted and its restart clear was lost to the stream's retention), reloading the bridge's table"
			if c.cfg.SharedIndex {
				msg = "consumer: the bridge's engine seq is behind the one applied (the engine restarted and its restart clear was lost to the stream's retention); the shared index keeps the old process's blocks until the bridge publishes a clear: restart the instance's kvbridge"
			}
			c.cfg.Logger.Warn(msg, "instance", instance, "engine_seq", hb.EngineSeq, "applied_seq", lastSeq, "stream_seq", hb.StreamSeq, "suppressed", suppressed)
		}
	}
	switch {
	case reload:
		c.enqueue(ctx, work{kind: workReload, instance: instance})
	case load:
		c.enqueue(ctx, work{kind: workLoad, instance: instance})
	}
	if tail {
		// Without waiting: a shard that is full (catching up, or held by a
		// load or a slow index) must not stall the pool's heartbeats; the
		// next heartbeat asks again.
		c.offer(work{kind: workTail, instance: instance, streamSeq: hb.StreamSeq})
	}
	if needSync {
		c.queueSync(ctx, instance)
	}
}

// check marks silent instances stale and queues purges.
func (c *Consumer) check(ctx context.Context) {
	now := time.Now()
	var purge []string
	counts := map[State]int{}
	c.mu.Lock()
	for name, in := range c.insts {
		if in.lastSeen.IsZero() {
			counts[in.status.State]++ // its snapshot load is still queued
			continue
		}
		silent := now.Sub(in.lastSeen)
		switch in.status.State {
		case StateLive:
			if silent > c.cfg.StaleAfter {
				in.status.State = StateStale
				c.cfg.Logger.Info("consumer: instance stale", "instance", name, "silent", silent.Round(time.Millisecond))
			}
		case StateStale:
			if silent > c.cfg.PurgeAfter {
				in.status.State = StatePurged
				purge = append(purge, name)
			}
		}
		counts[in.status.State]++
	}
	c.mu.Unlock()
	for _, s := range []State{StateLive, StateStale, StatePurged} {
		c.m.instances.WithLabelValues(s.String()).Set(float64(counts[s]))
	}
	for _, name := range purge {
		c.enqueue(ctx, work{kind: workPurge, instance: name})
	}
}
