package config

import (
	"fmt"
	"time"
)

// ReplicaSyncConfig is events.replica_sync: router replicas of the same
// pools share their requests in flight, pending prefill and speculative
// blocks over the events' NATS connection (docs/replicas.md). Off unless
// enabled; zero values mean the defaults named (replicasync.Default*).
type ReplicaSyncConfig struct {
	// Enabled turns replica sync on for every pool of the router.
	Enabled bool `yaml:"enabled" json:"enabled"`
	// Replica names this router among the replicas; unique per process.
	// Default hostname-pid (a pod's name is its hostname).
	Replica string `yaml:"replica" json:"replica,omitempty"`
	// Interval between sends of what changed. Default 50ms.
	Interval time.Duration `yaml:"interval" json:"interval,omitempty"`
	// MinGap: after a change (a routing decision, a request's end, a
	// peer's hello) what changed is sent this much later, ahead of the
	// interval, at most once per gap and only within the byte budget.
	// Default 1ms; 100µs..interval.
	MinGap time.Duration `yaml:"min_gap" json:"min_gap,omitempty"`
	// DisableEarlySend: changes wait for the next interval (the
	// behaviour before min_gap; for comparisons).
	DisableEarlySend bool `yaml:"disable_early_send" json:"disable_early_send,omitempty"`
	// Heartbeat: the whole load table is sent this often. Default 1s.
	Heartbeat time.Duration `yaml:"heartbeat" json:"heartbeat,omitempty"`
	// PeerTimeout: a replica silent this long counts nothing. Default 3s;
	// at least two heartbeats.
	PeerTimeout time.Duration `yaml:"peer_timeout" json:"peer_timeout,omitempty"`
	// MaxMessageBytes bounds one message. Default 64 KiB.
	MaxMessageBytes int `yaml:"max_message_bytes" json:"max_message_bytes,omitempty"`
	// MaxBytesPerSecond bounds what this router sends per pool. Default 4 MiB.
	MaxBytesPerSecond int `yaml:"max_bytes_per_second" json:"max_bytes_per_second,omitempty"`
	// Sequence is δ, the epoch of same-instant burst sequencing
	// (docs/replicas.md "Sequencing a burst"): while a peer is live, a
	// kv_aware request is held until its epoch (plus a 500µs grace) is
	// due and decided in one order with its peers'. 0 = off (default).
	// At least min_gap + 100µs (a peer must hear an epoch's decisions
	// before the next epoch is decided), at most 100ms.
	Sequence time.Duration `yaml:"sequence" json:"sequence,omitempty"`
}

// The replica sync's default interval and least min_gap, as
// replicasync.DefaultInterval and replicasync.MinMinGap (config imports no
// other package of the project; a test holds them equal).
const (
	defaultSyncInterval = 50 * time.Millisecond
	minSyncGap          = 100 * time.Microsecond
	defaultSyncMinGap   = time.Millisecond
	maxSequence         = 100 * time.Millisecond
)

// validate checks what does not depend on the other fields' defaults
// (the router checks the rest when it starts the sync).
func (r *ReplicaSyncConfig) validate() error {
	if r == nil {
		return nil
	}
	if r.Replica != "" && !replicaName(r.Replica) {
		return fmt.Errorf("%w: events.replica_sync.replica %q: 1..128 of [A-Za-z0-9_-]", ErrInvalidConfig, r.Replica)
	}
	if r.Interval < 0 || r.Heartbeat < 0 || r.PeerTimeout < 0 || r.MaxMessageBytes < 0 || r.MaxBytesPerSecond < 0 {
		return fmt.Errorf("%w: events.replica_sync: interval, heartbeat, peer_timeout, max_message_bytes and max_bytes_per_second must be >= 0", ErrInvalidConfig)
	}
	if r.MinGap != 0 {
		interval := r.Interval
		if interval == 0 {
			interval = defaultSyncInterval
		}
		if r.MinGap < minSyncGap || r.MinGap > interval {
			return fmt.Errorf("%w: events.replica_sync.min_gap %v out of range %v..interval (%v)", ErrInvalidConfig, r.MinGap, minSyncGap, interval)
		}
	}
	if r.Sequence != 0 {
		gap := r.MinGap
		if gap == 0 {
			gap = min(defaultSyncMinGap, r.Interval)
			if r.Interval == 0 {
				gap = defaultSyncMinGap
			}
		}
		if r.Sequence < gap+minSyncGap || r.Sequence > maxSequence {
			return fmt.Errorf("%w: events.replica_sync.sequence %v out of range min_gap + %v (%v)..%v", ErrInvalidConfig, r.Sequence, minSyncGap, gap+minSyncGap, maxSequence)
		}
	}
	return nil
}

// replicaName accepts what the sync's wire format carries (as NATS
// subject tokens: no dots).
func replicaName(s string) bool { return nameOf(s, 128, false) }
