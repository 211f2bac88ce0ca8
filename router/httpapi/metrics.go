package httpapi

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/metricset"
)

// metrics are the router's Prometheus metrics, registered on the
// Registerer given to NewServer (never the global one).
type metrics struct {
	requests  *prometheus.CounterVec
	overflows *prometheus.CounterVec
	retries   *prometheus.CounterVec
	decision  *prometheus.HistogramVec
	ttfb      *prometheus.HistogramVec
	probes    *prometheus.CounterVec
	ejections *prometheus.CounterVec
	streamErr *prometheus.CounterVec
	flow      *flowMetrics
	// Disaggregated serving (disagg.go).
	disagg              *prometheus.CounterVec
	disaggPrefillErrors *prometheus.CounterVec
	// Warm-up copies of hot prefixes (warm.go).
	warms *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, s *Server) (*metrics, error) {
	var ms metricset.Set
	m := &metrics{
		requests: ms.CounterVec("kvrouter_requests_total",
			"Requests answered, by pool, instance, strategy, reason and HTTP status (instance empty when none was picked).",
			"pool", "instance", "strategy", "reason", "status"),
		overflows: ms.CounterVec("kvrouter_overflows_total",
			"Requests not sent to their first-choice instance because it was at the concurrency threshold (reason overflow or saturated).",
			"pool", "strategy", "reason"),
		retries: ms.CounterVec("kvrouter_retries_total",
			"Requests retried on another instance after the first failed before any byte reached the client.",
			"pool", "instance"),
		decision: ms.HistogramVec("kvrouter_decision_seconds",
			"Time to pick an instance (candidate filtering and strategy).",
			prometheus.ExponentialBuckets(250e-9, 2, 16), // 250ns .. 8ms
			"pool", "strategy"),
		ttfb: ms.HistogramVec("kvrouter_upstream_ttfb_seconds",
			"Time from sending a request upstream to its first response body byte (prefill plus queueing for streams).",
			prometheus.ExponentialBuckets(0.0005, 2, 18), // 0.5ms .. 65s
			"pool", "instance"),
		probes: ms.CounterVec("kvrouter_health_probes_total",
			"Active health probes by result.",
			"pool", "instance", "result"),
		ejections: ms.CounterVec("kvrouter_instance_ejections_total",
			"Instances taken out of routing, by reason: health_checks (unhealthy_threshold failed probes in a row), engine_down (the instance's kvbridge reports its engine down; the router's own probes re-admit it).",
			"pool", "instance", "reason"),
		streamErr: ms.CounterVec("kvrouter_stream_errors_total",
			"Upstream responses that failed after bytes reached the client (streams end with an error event).",
			"pool", "instance"),
		disagg: ms.CounterVec("kvrouter_disagg_requests_total",
			"Requests of pools with disaggregation on, by how they were served (disaggregated, or aggregated with the reason).",
			"pool", "mode", "reason"),
		disaggPrefillErrors: ms.CounterVec("kvrouter_disagg_prefill_errors_total",
			"Prefill requests that failed (transport error or a non-200 answer); the request was tried on another prefill instance or went aggregated.",
			"pool", "instance"),
		warms: ms.CounterVec("kvrouter_warm_copies_total",
			"Warm-up copies of a hot prefix sent beside the request that bought them (kv_aware's rent or buy), by outcome: ok, error (transport or timeout), status (a non-200 answer), body (the request could not be rewritten).",
			"pool", "instance", "outcome"),
	}
	ms.Add(&liveCollector{s: s})
	m.flow = newFlowMetrics(&ms, s)
	if err := ms.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}

// ForgetInstanceSeries deletes the per-instance series of an instance that
// left its pool, and the pool's exact-routing state for it, so that
// instance names that come and go (heartbeat discovery) do not accumulate
// series or state. It is called for every instance a reload removes,
// once nothing is in flight there (sweepLeft).
func (s *Server) ForgetInstanceSeries(pool, instance string) {
	l := prometheus.Labels{"pool": pool, "instance": instance}
	s.m.requests.DeletePartialMatch(l)
	s.m.retries.DeletePartialMatch(l)
	s.m.ttfb.DeletePartialMatch(l)
	s.m.probes.DeletePartialMatch(l)
	s.m.ejections.DeletePartialMatch(l)
	s.m.streamErr.DeletePartialMatch(l)
	s.m.disaggPrefillErrors.DeletePartialMatch(l)
	s.m.warms.DeletePartialMatch(l)
	if s.kv != nil {
		s.kv.ForgetInstance(pool, instance)
	}
	if p, ok := s.table.Load().Pool(pool); ok && p.Exact() != nil {
		p.Exact().ForgetInstance(instance) // kv_aware's per-instance state
	}
}

// liveCollector reports gauges read from the live instance state at scrape
// time, so they follow reloads without stale series.
type liveCollector struct{ s *Server }

var (
	inflightDesc = prometheus.NewDesc("kvrouter_instance_in_flight", "Requests in flight per instance (router-local).", []string{"pool", "instance"}, nil)
	healthyDesc  = prometheus.NewDesc("kvrouter_instance_healthy", "1 when the instance is admitted by health checks (0 after they ejected it, or after its kvbridge reported its engine down, until they re-admit it).", []string{"pool", "instance"}, nil)
	strategyDesc = prometheus.NewDesc("kvrouter_pool_strategy", "The pool's current strategy (value 1).", []string{"pool", "strategy"}, nil)
	bodyUsedDesc = prometheus.NewDesc("kvrouter_body_memory_bytes", "Bytes of the request-body memory budget held by requests in progress.", nil, nil)
	bodyMaxDesc  = prometheus.NewDesc("kvrouter_body_memory_limit_bytes", "The request-body memory budget (limits.max_body_memory_bytes).", nil, nil)
	bodyRejDesc  = prometheus.NewDesc("kvrouter_body_budget_rejected_total", "Requests answered 503 because the request-body memory budget was exhausted.", nil, nil)
)

func (c *liveCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- inflightDesc
	ch <- healthyDesc
	ch <- strategyDesc
	ch <- bodyUsedDesc
	ch <- bodyMaxDesc
	ch <- bodyRejDesc
}

func (c *liveCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.table.Load()
	if st == nil {
		return
	}
	if b := c.s.body; b != nil {
		ch <- prometheus.MustNewConstMetric(bodyUsedDesc, prometheus.GaugeValue, float64(b.used.Load()))
		ch <- prometheus.MustNewConstMetric(bodyMaxDesc, prometheus.GaugeValue, float64(b.limit.Load()))
		ch <- prometheus.MustNewConstMetric(bodyRejDesc, prometheus.CounterValue, float64(b.rejected.Load()))
	}
	for _, p := range st.Pools() {
		_, strat := p.Routing()
		ch <- prometheus.MustNewConstMetric(strategyDesc, prometheus.GaugeValue, 1, p.Name(), strat.Name())
		for _, in := range p.Instances() {
			ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(in.InFlight()), p.Name(), in.ID())
			h := 0.0
			if in.Healthy() {
				h = 1
			}
			ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, h, p.Name(), in.ID())
		}
	}
}
