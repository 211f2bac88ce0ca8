package kvaware

import (
	"sync"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/internal/metricset"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
	"github.com/prometheus/client_golang/prometheus"
)

// KVMetrics are the metrics of exact routing, shadow comparison and load
// scraping, labelled by pool. One value serves every pool of a server.
type KVMetrics struct {
	decisions         *prometheus.CounterVec
	matched           *prometheus.CounterVec
	prompt            *prometheus.CounterVec
	tokenErrs         *prometheus.CounterVec
	lookupErrs        *prometheus.CounterVec
	streamUp          *prometheus.GaugeVec
	streamTransitions *prometheus.CounterVec
	spec              *specCollector
	pending           *pendingCollector
	scrapes           *prometheus.CounterVec
	usage             *prometheus.CounterVec
	reportedCached    *prometheus.CounterVec
	predictedCached   *prometheus.CounterVec
	predictionError   *prometheus.HistogramVec
	shadow            *prometheus.CounterVec
	shadowMatched     *prometheus.CounterVec
	shadowTTFT        *prometheus.HistogramVec
	set               metricset.Set // all of the above, registered together
}

// NewKVMetrics creates the exact-routing metrics and registers them on reg.
func NewKVMetrics(reg prometheus.Registerer) (*KVMetrics, error) {
	m := newKVMetrics()
	if err := m.set.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}

func newKVMetrics() *KVMetrics {
	ttftBuckets := prometheus.ExponentialBuckets(0.001, 2, 17) // 1ms .. 65s
	var ms metricset.Set
	m := &KVMetrics{
		decisions: ms.CounterVec("kvrouter_kv_decisions_total",
			"kv_aware decisions by reason (kv_match, heuristic, load_bound, overflow, saturated, stale_fallback, stream_down).", "pool", "reason"),
		matched: ms.CounterVec("kvrouter_kv_matched_tokens_total",
			"Prompt tokens the chosen instance was predicted to hold, by tier (each beyond faster tiers).", "pool", "tier"),
		prompt: ms.CounterVec("kvrouter_kv_prompt_tokens_total",
			"Prompt tokens of requests routed by kv_aware with known token ids.", "pool"),
		tokenErrs: ms.CounterVec("kvrouter_kv_tokenize_errors_total",
			"Requests whose token ids could not be produced (routed heuristically).", "pool"),
		lookupErrs: ms.CounterVec("kvrouter_kv_lookup_errors_total",
			"Index lookups that failed (routed on speculative entries, else heuristically), by reason: timeout (the index slow or hung), canceled (the client went away), error.", "pool", "reason"),
		streamUp: ms.GaugeVec("kvrouter_kv_stream_healthy",
			"1 while the pool's KV event stream is healthy (exact routing), 0 while kv_aware falls back to prefix_aware.", "pool"),
		streamTransitions: ms.CounterVec("kvrouter_kv_stream_transitions_total",
			"Changes of the KV event stream's health as seen by kv_aware, by the new state.", "pool", "state"),
		spec:    newSpecCollector(),    // read at scrape time
		pending: newPendingCollector(), // compare.go: read at scrape time
		scrapes: ms.CounterVec("kvrouter_kv_load_scrapes_total",
			"Scrapes of instances' /metrics for vllm:num_requests_waiting/running, by result.", "pool", "instance", "result"),
		usage: ms.CounterVec("kvrouter_kv_usage_reports_total",
			"Finished kv-scored requests by whether the engine reported usage.prompt_tokens_details.cached_tokens (reported, missing).", "pool", "result"),
		reportedCached: ms.CounterVec("kvrouter_kv_engine_cached_tokens_total",
			"Cached prompt tokens reported by engines (usage.prompt_tokens_details.cached_tokens).", "pool"),
		predictedCached: ms.CounterVec("kvrouter_kv_predicted_cached_tokens_total",
			"Matched tokens predicted at routing for requests whose engine reported cached tokens (compare with kvrouter_kv_engine_cached_tokens_total).", "pool"),
		predictionError: ms.HistogramVec("kvrouter_kv_prediction_error_tokens",
			"|predicted matched − engine-reported cached| tokens per request.", []float64{0, 16, 64, 256, 1024, 4096, 16384, 65536}, "pool"),
		shadow: ms.CounterVec("kvrouter_shadow_decisions_total",
			"Shadow-mode decisions by whether prefix_aware and kv_aware picked the same instance.", "pool", "agree"),
		shadowMatched: ms.CounterVec("kvrouter_shadow_predicted_matched_tokens_total",
			"Shadow mode: matched tokens the index predicts for each strategy's pick.", "pool", "strategy"),
		shadowTTFT: ms.HistogramVec("kvrouter_shadow_predicted_ttft_seconds",
			"Shadow mode: predicted time to first token of each strategy's pick.", ttftBuckets, "pool", "strategy"),
	}
	ms.Add(m.pending)
	ms.Add(m.spec)
	m.set = ms
	return m
}

// decisionMetrics are one pool's per-decision metric children, looked up
// by label on first use and kept: a vector's WithLabelValues hashes the
// labels and takes the vector's lock, several times per decision
// otherwise. Resolved lazily so that /metrics shows a series only once it
// has counted something, as before. A KVState's pool never changes and
// these series are never deleted, so a kept child stays the exported one.
type decisionMetrics struct {
	reasons [len(kvReasons)]lazyChild[prometheus.Counter] // decisions, by kvReasons position
	matched [tiers.Count]lazyChild[prometheus.Counter]    // matched tokens, by tier
	prompt  lazyChild[prometheus.Counter]
}

// kvReasons are the reasons a kv_aware decision counts under; another
// reason is looked up by label each time.
var kvReasons = [...]router.Reason{
	router.ReasonKVMatch, router.ReasonHeuristic, router.ReasonStaleFallback, router.ReasonStreamDown,
	router.ReasonLoadBound, router.ReasonOverflow, router.ReasonSaturated, router.ReasonReplicate, router.ReasonHash,
}

// lazyChild is a metric vector's child, resolved once.
type lazyChild[M any] struct{ p atomic.Pointer[M] }

func (l *lazyChild[M]) get(resolve func() M) M {
	if p := l.p.Load(); p != nil {
		return *p
	}
	m := resolve()
	l.p.Store(&m) // racing resolvers store the same child
	return m
}

// decisionCounter is the decisions counter for reason.
func (st *KVState) decisionCounter(reason router.Reason) prometheus.Counter {
	for i, r := range kvReasons {
		if r == reason {
			return st.dm.reasons[i].get(func() prometheus.Counter { return st.m.decisions.WithLabelValues(st.pool, string(reason)) })
		}
	}
	return st.m.decisions.WithLabelValues(st.pool, string(reason))
}

// matchedCounter is the matched-tokens counter for tier t.
func (st *KVState) matchedCounter(t tiers.Tier) prometheus.Counter {
	return st.dm.matched[t].get(func() prometheus.Counter { return st.m.matched.WithLabelValues(st.pool, t.String()) })
}

// specCollector exports each pool's speculative overlay as the (block,
// instance) entries it holds at the scrape (unexpired, not confirmed):
// a gauge set at each pick kept its last value after the entries had
// expired or been confirmed, and read as requests in flight on an idle
// pool.
type specCollector struct {
	desc  *prometheus.Desc
	pools sync.Map // pool -> *speculative
}

var _ prometheus.Collector = (*specCollector)(nil)

func newSpecCollector() *specCollector {
	return &specCollector{desc: prometheus.NewDesc("kvrouter_kv_speculative_entries",
		"(block, instance) entries in the speculative overlay at the scrape: routed, not yet confirmed by events, not expired.",
		[]string{"pool"}, nil)}
}

// track exports sp as pool's overlay (a strategy built for a reload
// brings a new one: the latest to record an entry is the one in use).
func (c *specCollector) track(pool string, sp *speculative) {
	if v, ok := c.pools.Load(pool); ok && v.(*speculative) == sp {
		return
	}
	c.pools.Store(pool, sp)
}

// Describe implements prometheus.Collector.
func (c *specCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *specCollector) Collect(ch chan<- prometheus.Metric) {
	c.pools.Range(func(k, v any) bool {
		sp := v.(*speculative)
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(sp.set.Live(sp.now().UnixNano())), k.(string))
		return true
	})
}
