package consumer

import (
	"context"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/kvstream"
)

// State is an instance's state as the consumer sees it.
type State uint8

const (
	// StateLive: heartbeats or events arrive; its index entries count.
	StateLive State = iota + 1
	// StateStale: silent for longer than StaleAfter; its entries should
	// not count for routing, but are kept in case it comes back.
	StateStale
	// StatePurged: silent for longer than PurgeAfter; its entries are gone.
	StatePurged
)

func (s State) String() string {
	switch s {
	case StateLive:
		return "live"
	case StateStale:
		return "stale"
	case StatePurged:
		return "purged"
	}
	return "unknown"
}

// MarshalText renders the state's name in JSON.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// InstanceStatus is the consumer's view of one instance.
type InstanceStatus struct {
	Instance      string    `json:"instance"`
	State         State     `json:"state"`
	LastSeq       uint64    `json:"last_seq"`
	LastEvent     time.Time `json:"last_event"`
	LastHeartbeat time.Time `json:"last_heartbeat"`
	Gaps          uint64    `json:"gaps"`
	Clears        uint64    `json:"clears"`
	Malformed     uint64    `json:"malformed"`
	Unknown       uint64    `json:"unknown_events"`
	// Invalid counts events skipped because they could not be read
	// (events.Batch.Invalid).
	Invalid     uint64 `json:"invalid_events"`
	SnapshotSeq uint64 `json:"snapshot_stream_seq"`
	// ReplayLost counts holes in the instance's engine seqs (messages the
	// stream no longer holds) that the snapshot loaded for them did not
	// reach (see replay, holdHole, repairHole), each once: the instance is
	// not live until a snapshot past the hole or a clear after it.
	ReplayLost uint64 `json:"replay_lost"`
	// IndexUnsynced: the instance's state in the shared index is not
	// known whole (being repaired); the instance is not live meanwhile.
	IndexUnsynced bool                `json:"index_unsynced,omitempty"`
	StreamSeq     uint64              `json:"stream_seq"`
	Heartbeat     *kvstream.Heartbeat `json:"heartbeat,omitempty"`
	// EngineDown: the bridge reports the engine dead (see
	// kvstream.Heartbeat.EngineDown); the instance is not live meanwhile.
	EngineDown bool `json:"engine_down,omitempty"`
	// NotLive says why the instance is not live (empty when it is, as
	// Consumer.Live): engine_down (its bridge reports the engine dead),
	// hole (messages the stream lost before this router read them, not
	// yet repaired by a snapshot at or past them or a clear), reloading
	// (the engine came back up; its table is being reloaded),
	// index_unsynced (shared index: the instance's state there is being
	// checked or repaired), purged, or silent (nothing heard from its
	// bridge within StaleAfter).
	NotLive string `json:"not_live,omitempty"`
}

// Healthy reports whether the stream is being consumed: NATS connected,
// the consumer running, no consume error (the stream not answering the
// watchdog is one) in the last 10s unless a delivery has followed it, not more than
// MaxLag behind the stream, and a shared index reachable with its data.
// The exact (kv_aware) strategy falls back to the heuristic when it is not.
func (c *Consumer) Healthy() bool {
	if !c.running.Load() || !c.cfg.Conn.IsConnected() {
		return false
	}
	if c.shared != nil && !c.epochFresh() || c.renumbered.Load() {
		return false
	}
	if time.Duration(c.lag.Load()) > c.cfg.MaxLag {
		return false
	}
	last := c.lastErr.Load()
	return last == 0 || time.Since(time.Unix(0, last)) > 10*time.Second
}

// Ready reports whether the index has been rebuilt since Run started:
// the snapshots known at start loaded, the stream's history as of then
// applied, and the consumer healthy. It stays true once set (a later
// outage is what Healthy reports).
func (c *Consumer) Ready() bool { return c.ready.Load() }

// awaitRebuilt sets ready once the consumer is healthy, has been
// delivered everything the stream held for the pool, and every shard has
// applied what was queued before (snapshot loads included).
func (c *Consumer) awaitRebuilt(ctx context.Context, cons func() jetstream.Consumer) {
	t0 := time.Now()
	for !c.delivered(ctx, cons()) {
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	passed := make(chan struct{}, len(c.shards))
	for _, ch := range c.shards {
		select {
		case ch <- work{kind: workBarrier, done: func() { passed <- struct{}{} }}:
		case <-ctx.Done():
			return
		}
	}
	for range c.shards {
		select {
		case <-passed:
		case <-ctx.Done():
			return
		}
	}
	c.ready.Store(true)
	c.cfg.Logger.Info("consumer: index rebuilt", "took", time.Since(t0).Round(time.Millisecond))
}

// delivered: healthy, and nothing of the pool's stream left to dispatch
// (the last message dispatched had none pending, or there was none).
func (c *Consumer) delivered(ctx context.Context, cons jetstream.Consumer) bool {
	if !c.Healthy() {
		return false
	}
	if c.caughtUp.Load() {
		return true
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	info, err := cons.Info(ctx)
	return err == nil && info.NumPending == 0 && info.Delivered.Consumer == 0
}

// Live reports whether the instance is known and live: its index entries
// should count for routing.
func (c *Consumer) Live(instance string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	in := c.insts[instance]
	return in != nil && in.notLive() == ""
}

// notLive is InstanceStatus.NotLive; c.mu held.
func (in *inst) notLive() string {
	switch {
	case in.status.State == StateLive && !in.status.IndexUnsynced:
		return ""
	case in.status.EngineDown:
		return "engine_down"
	case in.hole != 0:
		return "hole"
	case in.reloading:
		return "reloading"
	case in.status.IndexUnsynced:
		return "index_unsynced"
	case in.status.State == StatePurged:
		return "purged"
	}
	return "silent"
}

// LostEpoch counts the times the instance's cache was lost or could not be
// vouched for (cleared, restarted, engine down, purged). A guess about what
// the instance holds made under one epoch — the router's speculative
// entries — is void under the next.
func (c *Consumer) LostEpoch(instance string) uint64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if in := c.insts[instance]; in != nil {
		return in.lost
	}
	return 0
}

// Instances returns every known instance's status, sorted by name.
func (c *Consumer) Instances() []InstanceStatus {
	c.mu.RLock()
	out := make([]InstanceStatus, 0, len(c.insts))
	for _, in := range c.insts {
		s := in.status
		s.NotLive = in.notLive()
		if s.Heartbeat != nil {
			hb := *s.Heartbeat
			s.Heartbeat = &hb
		}
		out = append(out, s)
	}
	c.mu.RUnlock()
	slices.SortFunc(out, func(a, b InstanceStatus) int {
		switch {
		case a.Instance < b.Instance:
			return -1
		case a.Instance > b.Instance:
			return 1
		}
		return 0
	})
	return out
}
