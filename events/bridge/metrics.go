package bridge

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are kvbridge's Prometheus series, registered on the Registerer
// given in Config (none: kept unregistered, still counted).
type metrics struct {
	batches     *prometheus.CounterVec
	events      *prometheus.CounterVec
	blocks      *prometheus.CounterVec
	gaps        *prometheus.CounterVec
	replays     *prometheus.CounterVec
	clears      *prometheus.CounterVec
	drops       *prometheus.CounterVec
	malformed   *prometheus.CounterVec
	publishSecs prometheus.Histogram
	retries     prometheus.Counter
	tableBlocks *prometheus.GaugeVec
	bufferDepth *prometheus.GaugeVec
	snapshots   *prometheus.CounterVec
	storeSecs   prometheus.Histogram
	storeBytes  *prometheus.GaugeVec
	tableFull   *prometheus.CounterVec
	engineDown  *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_batches_total",
			Help: "Event batches published to NATS, by instance (synthetic ones included)."}, []string{"instance"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_events_total",
			Help: "Engine events published, by type and tier."}, []string{"type", "tier"}),
		blocks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_blocks_total",
			Help: "Blocks in published engine events, by event type and tier."}, []string{"type", "tier"}),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_gaps_total",
			Help: "Sequence gaps detected in the engine's PUB stream."}, []string{"instance"}),
		replays: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_replays_total",
			Help: "Replay requests to the engine, by result (ok, failed)."}, []string{"instance", "result"}),
		clears: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_clears_total",
			Help: "Synthetic clears published, by reason (gap, restart, resync)."}, []string{"instance", "reason"}),
		drops: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_drops_total",
			Help: "Engine messages dropped before publishing, by reason (buffer_full: NATS outage outlasted the buffer; frames: malformed ZMQ frames)."}, []string{"instance", "reason"}),
		malformed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_malformed_payloads_total",
			Help: "Engine payloads that did not decode (published unchanged; the table ignores them)."}, []string{"instance"}),
		publishSecs: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvbridge_publish_seconds",
			Help:    "JetStream publish latency, from send to ack, per attempt that succeeded.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16)}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvbridge_publish_retries_total",
			Help: "JetStream publish attempts that failed and were retried."}),
		tableBlocks: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvbridge_table_blocks",
			Help: "Blocks in the instance's live block table."}, []string{"instance"}),
		bufferDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvbridge_buffer_depth",
			Help: "Engine messages waiting to be published (outage buffer)."}, []string{"instance"}),
		snapshots: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_snapshots_total",
			Help: "Snapshots served or stored, by kind (request, store) and result (ok, error)."}, []string{"kind", "result"}),
		storeSecs: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvbridge_snapshot_store_seconds",
			Help:    "Time to put one snapshot in the bucket (object chunks included), per store that succeeded; near the snapshot interval means the server cannot keep up.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
		storeBytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvbridge_snapshot_bytes",
			Help: "Size of the instance's last stored snapshot (its encoded block table)."}, []string{"instance"}),
		tableFull: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge_table_evictions_total",
			Help: "Held blocks dropped from the block table by --max-blocks (zero while it is at least the engine's block count)."}, []string{"instance"}),
		engineDown: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvbridge_engine_down",
			Help: "1 while the engine's HTTP health fails and it publishes no events (heartbeats say so), else 0."}, []string{"instance"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.batches, m.events, m.blocks, m.gaps, m.replays, m.clears, m.drops,
			m.malformed, m.publishSecs, m.retries, m.tableBlocks, m.bufferDepth, m.snapshots, m.storeSecs, m.storeBytes, m.tableFull, m.engineDown} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
