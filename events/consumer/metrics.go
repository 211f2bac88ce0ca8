package consumer

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
)

// metrics are the consumer's series, labelled with its pool.
type metrics struct {
	messages      *prometheus.CounterVec
	events        *prometheus.CounterVec
	unknown       prometheus.Counter
	gaps          prometheus.Counter
	stored        prometheus.Counter
	removed       prometheus.Counter
	dropped       *prometheus.CounterVec
	applyErrors   prometheus.Counter
	consumeErrors prometheus.Counter
	stalls        prometheus.Counter
	snapshotLoads *prometheus.CounterVec
	heartbeats    *prometheus.CounterVec
	purges        prometheus.Counter
	replayed      prometheus.Counter
	replayLost    prometheus.Counter
	instances     *prometheus.GaugeVec
	queue         prometheus.Gauge
	consistent    prometheus.Gauge
	indexLost     prometheus.Counter
	lag           prometheus.Histogram

	// Children every applied message counts in, resolved once: a
	// CounterVec lookup hashes its label values on every call.
	applied prometheus.Counter                              // messages{result="applied"}
	byKind  [events.AllBlocksCleared + 1]prometheus.Counter // events by kind
}

// eventCounter is the applied-events counter for kind k.
func (m *metrics) eventCounter(k events.Kind) prometheus.Counter {
	if k > 0 && int(k) < len(m.byKind) {
		return m.byKind[k]
	}
	return m.events.WithLabelValues(k.String())
}

func newMetrics(reg prometheus.Registerer, pool string) (*metrics, error) {
	cl := prometheus.Labels{"pool": pool}
	m := &metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_messages_total", ConstLabels: cl,
			Help: "kv.events messages consumed, by result (applied, malformed, covered_by_snapshot, bad_subject, purged_instance, unknown_instance, over_cap)."}, []string{"result"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_applied_total", ConstLabels: cl,
			Help: "Engine events applied to the index, by type."}, []string{"type"}),
		unknown: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_unknown_total", ConstLabels: cl,
			Help: "Events of unknown type skipped (the rest of their batch applied)."}),
		gaps: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_seq_gaps_total", ConstLabels: cl,
			Help: "Engine sequence gaps seen in the stream (the bridge repaired or cleared them)."}),
		stored: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_blocks_stored_total", ConstLabels: cl,
			Help: "Block placements the index added."}),
		removed: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_blocks_removed_total", ConstLabels: cl,
			Help: "Block placements the index dropped."}),
		applyErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_apply_errors_total", ConstLabels: cl,
			Help: "Index Apply calls that failed."}),
		consumeErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_consume_errors_total", ConstLabels: cl,
			Help: "JetStream consume errors (the ordered consumer recovers by itself)."}),
		stalls: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_consumer_stalls_total", ConstLabels: cl,
			Help: "Checks that found the consumer stalled (a stored message undelivered for 3 heartbeats, nothing delivered meanwhile) and re-created it."}),
		snapshotLoads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_snapshot_loads_total", ConstLabels: cl,
			Help: "Instance snapshot loads, by source (request, bucket, none, malformed)."}, []string{"source"}),
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_heartbeats_total", ConstLabels: cl,
			Help: "Bridge heartbeats received, by result (ok, malformed, refused, over_cap)."}, []string{"result"}),
		purges: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_instance_purges_total", ConstLabels: cl,
			Help: "Instances purged from the index after PurgeAfter of silence."}),
		replayed: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_replayed_total", ConstLabels: cl,
			Help: "Stream messages re-applied after a snapshot reload older than what had been applied."}),
		replayLost: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_replay_lost_total", ConstLabels: cl,
			Help: "Snapshot reloads that could not replay every message since the snapshot: the stream no longer held them."}),
		instances: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_events_instances", ConstLabels: cl,
			Help: "Known instances by state (live, stale, purged)."}, []string{"state"}),
		queue: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_events_shard_queue", ConstLabels: cl,
			Help: "Messages waiting in a shard's queue (last sampled)."}),
		consistent: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_events_index_consistent", ConstLabels: cl,
			Help: "1 while the index can be trusted; 0 while a shared (Redis) index is unreachable, lost its data or has instances being repaired (those count as stale)."}),
		indexLost: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_index_lost_total", ConstLabels: cl,
			Help: "Times the shared index was found to have lost its data (its epoch changed: Redis restarted empty or was flushed)."}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_blocks_dropped_total", ConstLabels: cl,
			Help: "Blocks of applied events the index could not use, by reason: orphan (parent never seen), unmapped (hash never stored with tokens), other_group (a KV-cache group that is not full attention), invalid (block size or token count wrong; whole events), unknown_medium (placed in the CPU tier)."}, []string{"reason"}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_events_lag_seconds", ConstLabels: cl,
			Help:    "Time from a message's JetStream store to its application to the index.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18)}),
	}
	m.applied = m.messages.WithLabelValues("applied")
	for k := events.BlockStored; int(k) < len(m.byKind); k++ {
		m.byKind[k] = m.events.WithLabelValues(k.String())
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.messages, m.events, m.unknown, m.gaps, m.stored, m.removed, m.dropped, m.applyErrors,
			m.consumeErrors, m.stalls, m.snapshotLoads, m.heartbeats, m.purges, m.replayed, m.replayLost, m.instances, m.queue, m.consistent, m.indexLost, m.lag} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

// countDropped counts what the index could not use of an applied batch
// (docs/engines.md says which sources produce each).
func (c *Consumer) countDropped(res kvindex.ApplyResult) {
	for _, d := range [...]struct {
		reason string
		n      int
	}{{"orphan", res.Orphans}, {"unmapped", res.Unmapped}, {"other_group", res.Skipped}, {"invalid", res.Invalid}, {"unknown_medium", res.UnknownMedium}} {
		if d.n > 0 {
			c.m.dropped.WithLabelValues(d.reason).Add(float64(d.n))
		}
	}
}
