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
	// Heartbeat: the whole load table is sent this often. Default 1s.
	Heartbeat time.Duration `yaml:"heartbeat" json:"heartbeat,omitempty"`
	// PeerTimeout: a replica silent this long counts nothing. Default 3s;
	// at least two heartbeats.
	PeerTimeout time.Duration `yaml:"peer_timeout" json:"peer_timeout,omitempty"`
	// MaxMessageBytes bounds one message. Default 64 KiB.
	MaxMessageBytes int `yaml:"max_message_bytes" json:"max_message_bytes,omitempty"`
	// MaxBytesPerSecond bounds what this router sends per pool. Default 4 MiB.
	MaxBytesPerSecond int `yaml:"max_bytes_per_second" json:"max_bytes_per_second,omitempty"`
}

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
	return nil
}

// replicaName accepts what the sync's wire format carries (as NATS
// subject tokens: no dots).
func replicaName(s string) bool { return nameOf(s, 128, false) }
