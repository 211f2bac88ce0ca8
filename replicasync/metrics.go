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
				"publish: NATS refused; malformed, version: undecodable messages; stale: an older load message; capacity: peer speculative entries evicted; duplicate_replica: another process uses this replica's name).", "pool", "reason"),
		peers: ms.GaugeVec("kvrouter_replica_sync_peers",
			"Peer replicas of the pool heard from within peer_timeout.", "pool"),
		early: ms.CounterVec("kvrouter_replica_sync_early_sends_total",
			"Replica sync early sends (min_gap after a change), by pool and outcome (sent; deferred: the byte budget did not hold a whole message, the next interval carries the change; no_peer: no live peer to send to).", "pool", "outcome"),
	}
	if err := ms.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}
