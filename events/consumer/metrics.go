package consumer

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/metricset"
	"github.com/kvrouter/kvrouter/kvindex"
)

// metrics are the consumer's series, labelled with its pool.
type metrics struct {
	messages        *prometheus.CounterVec
	events          *prometheus.CounterVec
	unknown         prometheus.Counter
	invalid         prometheus.Counter
	gaps            prometheus.Counter
	stored          prometheus.Counter
	removed         prometheus.Counter
	dropped         *prometheus.CounterVec
	applyErrors     prometheus.Counter
	consumeErrors   prometheus.Counter
	stalls          prometheus.Counter
	twoBridges      prometheus.Counter
	streamRecreated prometheus.Counter
	snapshotLoads   *prometheus.CounterVec
	heartbeats      *prometheus.CounterVec
	purges          prometheus.Counter
	replayed        prometheus.Counter
	replayLost      prometheus.Counter
	instances       *prometheus.GaugeVec
	queue           prometheus.Gauge
	// consistentFn is what kvrouter_events_index_consistent reads at each
	// collection (set by New): the gauge is derived, never set, so a check
	// loop stuck on a hung Redis cannot leave it at 1.
	consistentFn atomic.Pointer[func() float64]
	indexLost    prometheus.Counter
	indexRewound prometheus.Counter
	takeovers    prometheus.Counter
	lag          prometheus.Histogram

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

// countEvents counts a batch's engine events by kind: one add per kind present
// rather than an atomic increment per event (a 16-block message is
// typically 16 stores of one kind).
func (m *metrics) countEvents(evs []events.Event) {
	var n [len(m.byKind)]int
	for i := range evs {
		if k := evs[i].Kind; k > 0 && int(k) < len(n) {
			n[k] += evs[i].EngineEvents() // a joined removal: its engine events
		} else {
			m.eventCounter(k).Inc()
		}
	}
	for k, c := range n {
		if c > 0 {
			m.byKind[k].Add(float64(c))
		}
	}
}

func newMetrics(reg prometheus.Registerer, pool string) (*metrics, error) {
	// Every series carries the pool label.
	ms := metricset.Set{ConstLabels: prometheus.Labels{"pool": pool}}
	m := &metrics{
		messages: ms.CounterVec("kvrouter_events_messages_total",
			"kv.events messages consumed, by result (applied, malformed, covered_by_snapshot, bad_subject, purged_instance, unknown_instance, over_cap).", "result"),
		events: ms.CounterVec("kvrouter_events_applied_total",
			"Engine events applied to the index, by type.", "type"),
		unknown: ms.Counter("kvrouter_events_unknown_total",
			"Events of unknown type skipped (the rest of their batch applied)."),
		invalid: ms.Counter("kvrouter_events_invalid_total",
			"Events skipped because they could not be read (a field of an unexpected type or out of range; the rest of their batch applied)."),
		gaps: ms.Counter("kvrouter_events_seq_gaps_total",
			"Engine sequence gaps seen in the stream (the bridge repaired or cleared them)."),
		stored: ms.Counter("kvrouter_events_blocks_stored_total",
			"Block placements the index added."),
		removed: ms.Counter("kvrouter_events_blocks_removed_total",
			"Block placements the index dropped."),
		dropped: ms.CounterVec("kvrouter_events_blocks_dropped_total",
			"Blocks of applied events the index could not use, by reason: orphan (parent never seen), unmapped (hash never stored with tokens), other_group (a KV-cache group that is not full attention), invalid (block size or token count wrong; whole events), unknown_medium (placed in the CPU tier).", "reason"),
		applyErrors: ms.Counter("kvrouter_events_apply_errors_total",
			"Index Apply calls that failed."),
		consumeErrors: ms.Counter("kvrouter_events_consume_errors_total",
			"JetStream consume errors (the ordered consumer recovers by itself)."),
		streamRecreated: ms.Counter("kvrouter_events_stream_recreated_total",
			"Times the watchdog found the stream re-created (a JetStream store wiped, the stream deleted and made again: its creation time changed, or its last sequence fell below the last one delivered) and, with the memory index, consumed it from its start reloading every instance; with a shared index the router turns unhealthy instead (kv_aware falls back)."),
		twoBridges: ms.Counter("kvrouter_events_two_bridges_total",
			"Messages of an instance from a bridge run that had already been followed by another run's: two kvbridges publish for one instance (a bridge restart moves to a new run for good)."),
		stalls: ms.Counter("kvrouter_events_consumer_stalls_total",
			"Checks that found the consumer stalled (a stored message undelivered for 3 heartbeats, nothing delivered meanwhile) and re-created it."),
		snapshotLoads: ms.CounterVec("kvrouter_events_snapshot_loads_total",
			"Instance snapshot loads, by source (request, bucket, none, malformed).", "source"),
		heartbeats: ms.CounterVec("kvrouter_events_heartbeats_total",
			"Bridge heartbeats received, by result (ok, malformed, refused, over_cap).", "result"),
		purges: ms.Counter("kvrouter_events_instance_purges_total",
			"Instances purged from the index after PurgeAfter of silence."),
		replayed: ms.Counter("kvrouter_events_replayed_total",
			"Stream messages re-applied after a snapshot reload older than what had been applied."),
		replayLost: ms.Counter("kvrouter_events_replay_lost_total",
			"Holes in an instance's engine seqs (messages the stream no longer held) that the snapshot loaded for them did not reach; the instance is not live until a snapshot past the hole or a clear after it."),
		instances: ms.GaugeVec("kvrouter_events_instances",
			"Known instances by state (live, stale, purged).", "state"),
		queue: ms.Gauge("kvrouter_events_shard_queue",
			"Messages waiting in a shard's queue (last sampled)."),
		indexLost: ms.Counter("kvrouter_events_index_lost_total",
			"Times the shared index was found to have lost its data (its epoch changed: Redis restarted empty or was flushed)."),
		indexRewound: ms.Counter("kvrouter_events_index_rewound_total",
			"Times the shared index was found restarted (its run_id changed: every restart counts, whatever it lost) or gone back in time (a check counter went back) with its epoch kept: the instances' positions are read before it is trusted again."),
		takeovers: ms.Counter("kvrouter_events_shared_takeovers_total",
			"Writes to a shared (Redis) index that took an instance over from another router's writer (or this router's before a restart) and so rewrote the instance's whole map under a new field id: a router died or stalled, or restarted."),
		lag: ms.Histogram("kvrouter_events_lag_seconds",
			"Time from a message's JetStream store to its application to the index.",
			prometheus.ExponentialBuckets(0.0001, 2, 18)),
	}
	m.applied = m.messages.WithLabelValues("applied")
	for k := events.BlockStored; int(k) < len(m.byKind); k++ {
		m.byKind[k] = m.events.WithLabelValues(k.String())
	}
	ms.Add(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_events_index_consistent",
		Help:        "1 while the index can be trusted; 0 while a shared (Redis) index is unreachable, lost its data or has instances being repaired (those count as stale).",
		ConstLabels: ms.ConstLabels}, func() float64 {
		if f := m.consistentFn.Load(); f != nil {
			return (*f)()
		}
		return 1
	}))
	if err := ms.Register(reg); err != nil {
		return nil, err
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
