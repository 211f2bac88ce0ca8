package replicasync

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the replica sync metrics of every pool of one router; make
// them once per registry and share them between the pools' Syncers.
type Metrics struct {
	messages *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	dropped  *prometheus.CounterVec
	peers    *prometheus.GaugeVec
}

// NewMetrics registers the metrics on reg (nil = kept but registered
// nowhere).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_replica_sync_messages_total",
			Help: "Replica sync messages, by pool, direction (sent, received) and kind (load, spec, hello)."}, []string{"pool", "direction", "kind"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_replica_sync_bytes_total",
			Help: "Replica sync payload bytes, by pool and direction (sent, received)."}, []string{"pool", "direction"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_replica_sync_dropped_total",
			Help: "Replica sync data not sent or not applied, by pool and reason (rate: over max_bytes_per_second; queue: speculative blocks beyond the send queue; " +
				"publish: NATS refused; malformed, version: undecodable messages; stale: an older load message; capacity: peer speculative entries evicted; duplicate_replica: another process uses this replica's name)."},
			[]string{"pool", "reason"}),
		peers: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_replica_sync_peers",
			Help: "Peer replicas of the pool heard from within peer_timeout."}, []string{"pool"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.messages, m.bytes, m.dropped, m.peers} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
