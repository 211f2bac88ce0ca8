package replicasync

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/metricset"
)

// Metrics are the replica sync metrics of every pool of one router; make
// them once per registry and share them between the pools' Syncers.
type Metrics struct {
	messages *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	dropped  *prometheus.CounterVec
	peers    *prometheus.GaugeVec
	early    *prometheus.CounterVec
	// Sequencing (intents.go).
	sequenced *prometheus.CounterVec
	hold      *prometheus.HistogramVec
}

// NewMetrics registers the metrics on reg (nil = kept but registered
// nowhere).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	var ms metricset.Set
	m := &Metrics{
		messages: ms.CounterVec("kvrouter_replica_sync_messages_total",
			"Replica sync messages, by pool, direction (sent, received) and kind (load, spec, hello).", "pool", "direction", "kind"),
		bytes: ms.CounterVec("kvrouter_replica_sync_bytes_total",
			"Replica sync payload bytes, by pool and direction (sent, received).", "pool", "direction"),
		dropped: ms.CounterVec("kvrouter_replica_sync_dropped_total",
			"Replica sync data not sent or not applied, by pool and reason (rate: over max_bytes_per_second; queue: speculative blocks beyond the send queue; "+
				"publish: NATS refused; malformed, version: undecodable messages; stale: an older load message; capacity: peer speculative entries evicted; duplicate_replica: another process uses this replica's name; size: an intent larger than max_message_bytes with no key left to trim).", "pool", "reason"),
		peers: ms.GaugeVec("kvrouter_replica_sync_peers",
			"Peer replicas of the pool heard from within peer_timeout.", "pool"),
		early: ms.CounterVec("kvrouter_replica_sync_early_sends_total",
			"Replica sync early sends (min_gap after a change), by pool and outcome (sent; deferred: the byte budget did not hold a whole message, the next interval carries the change; no_peer: no live peer to send to).", "pool", "outcome"),
		sequenced: ms.CounterVec("kvrouter_replica_sync_sequenced_total",
			"Same-instant burst sequencing (events.replica_sync.sequence), by pool and outcome (held: own requests held for their epoch; alone: own requests decided at once, no live peer or a full or partial epoch; "+
				"received: peers' intents sequenced; late: peers' intents received after their epoch was due, left to their owner; dropped: peers' intents beyond the epoch's bound; future: peers' intents due more than an epoch and two graces ahead of this replica's clock, left to their owner).", "pool", "outcome"),
		hold: ms.HistogramVec("kvrouter_replica_sync_hold_seconds",
			"How long a held request waited for its turn (its epoch, delta plus the grace, and its epoch's earlier decisions).",
			[]float64{.0002, .0005, .001, .002, .003, .005, .01, .02, .05, .1}, "pool"),
	}
	if err := ms.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}
