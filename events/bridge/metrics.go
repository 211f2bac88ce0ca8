package bridge

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/metricset"
	"github.com/kvrouter/kvrouter/tiers"
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
	reorders    *prometheus.CounterVec
	// oversizeResyncs: engine messages over the max payload published
	// as a resync (bridge.go, publishOversize).
	oversizeResyncs *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	var ms metricset.Set
	m := &metrics{
		batches: ms.CounterVec("kvbridge_batches_total",
			"Event batches published to NATS, by instance (synthetic ones included).", "instance"),
		events: ms.CounterVec("kvbridge_events_total",
			"Engine events published, by type and tier.", "type", "tier"),
		blocks: ms.CounterVec("kvbridge_blocks_total",
			"Blocks in published engine events, by event type and tier.", "type", "tier"),
		gaps: ms.CounterVec("kvbridge_gaps_total",
			"Sequence gaps detected in the engine's PUB stream.", "instance"),
		replays: ms.CounterVec("kvbridge_replays_total",
			"Replay requests to the engine, by result (ok, failed).", "instance", "result"),
		clears: ms.CounterVec("kvbridge_clears_total",
			"Synthetic clears published, by reason (gap, restart, resync).", "instance", "reason"),
		drops: ms.CounterVec("kvbridge_drops_total",
			"Engine messages dropped before publishing, by reason (buffer_full: NATS unreachable or slower than the engine filled the buffer, its messages or bytes; frames: malformed ZMQ frames; oversize: larger than the NATS server's max payload and not readable whole, the instance cleared).", "instance", "reason"),
		malformed: ms.CounterVec("kvbridge_malformed_payloads_total",
			"Engine payloads that did not decode (published unchanged; the table ignores them).", "instance"),
		publishSecs: ms.Histogram("kvbridge_publish_seconds",
			"JetStream publish latency, from send to ack, per attempt that succeeded.",
			prometheus.ExponentialBuckets(0.0001, 2, 16)),
		retries: ms.Counter("kvbridge_publish_retries_total",
			"JetStream publish attempts that failed and were retried."),
		tableBlocks: ms.GaugeVec("kvbridge_table_blocks",
			"Blocks in the instance's live block table.", "instance"),
		bufferDepth: ms.GaugeVec("kvbridge_buffer_depth",
			"Engine messages waiting to be published (outage buffer).", "instance"),
		snapshots: ms.CounterVec("kvbridge_snapshots_total",
			"Snapshots served or stored, by kind (request, store) and result (ok, error).", "kind", "result"),
		storeSecs: ms.Histogram("kvbridge_snapshot_store_seconds",
			"Time to put one snapshot in the bucket (object chunks included), per store that succeeded; near the snapshot interval means the server cannot keep up.",
			prometheus.ExponentialBuckets(0.001, 2, 16)),
		storeBytes: ms.GaugeVec("kvbridge_snapshot_bytes",
			"Size of the instance's last stored snapshot (its encoded block table).", "instance"),
		tableFull: ms.CounterVec("kvbridge_table_evictions_total",
			"Held blocks dropped from the block table by --max-blocks (zero while it is at least the engine's block count).", "instance"),
		engineDown: ms.GaugeVec("kvbridge_engine_down",
			"1 while the engine's HTTP health fails and it publishes no events (heartbeats say so), else 0.", "instance"),
		reorders: ms.CounterVec("kvbridge_publish_reorders_total",
			"Publish failures after which the stream held the instance's messages out of order, repaired by a resync (clear, then the table).", "instance"),
		oversizeResyncs: ms.CounterVec("kvbridge_oversize_resyncs_total",
			"Engine messages larger than the NATS server's max payload, folded into the block table and published as a resync (clear, then the table in chunks that fit).", "instance"),
	}
	if err := ms.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}

// instanceCounters are the series the per-message path of one instance
// updates, each looked up once: WithLabelValues hashes its label values on
// every call, which was ~4 % of a loaded bridge's CPU (docs/BENCHMARKS.md
// §3, "Session 13"). Owned by the instance's process goroutine.
type instanceCounters struct {
	m           *metrics
	batches     prometheus.Counter
	tableBlocks prometheus.Gauge
	// byKind is the events and blocks series by event kind and tier (the
	// last tier slot: kvstream.TierAll, for clears).
	byKind [events.AllBlocksCleared + 1][tiers.Count + 1]*[2]prometheus.Counter
}

func newInstanceCounters(m *metrics, instance string) *instanceCounters {
	return &instanceCounters{m: m,
		batches: m.batches.WithLabelValues(instance), tableBlocks: m.tableBlocks.WithLabelValues(instance)}
}

// kind is the events and blocks series of events of kind k in tier
// (tierIdx tiers.Count: kvstream.TierAll).
func (c *instanceCounters) kind(k events.Kind, tierIdx int, tier string) *[2]prometheus.Counter {
	known := int(k) < len(c.byKind)
	if known && c.byKind[k][tierIdx] != nil {
		return c.byKind[k][tierIdx]
	}
	p := &[2]prometheus.Counter{c.m.events.WithLabelValues(k.String(), tier), c.m.blocks.WithLabelValues(k.String(), tier)}
	if known {
		c.byKind[k][tierIdx] = p
	}
	return p
}
