package httpapi

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/metricset"
)

// flowMetrics are the flow-control queue's metrics: counters and the wait
// histogram on the request path, gauges read from each pool's queue at
// scrape time. Tenants are not a label (unbounded); the admin API lists
// the tenants with the most queued tokens.
type flowMetrics struct {
	admitted *prometheus.CounterVec
	shed     *prometheus.CounterVec
	wait     *prometheus.HistogramVec
}

// newFlowMetrics builds the queue's metrics in ms, its scrape-time gauges
// read from s.
func newFlowMetrics(ms *metricset.Set, s *Server) *flowMetrics {
	m := &flowMetrics{
		admitted: ms.CounterVec("kvrouter_queue_admitted_total",
			"Requests admitted by the pool's flow-control queue, by priority (clamped to -10..10).",
			"pool", "priority"),
		shed: ms.CounterVec("kvrouter_queue_shed_total",
			"Requests the flow-control queue answered 429 (queue_full, displaced, deadline, timeout) or lost to their client while waiting (canceled).",
			"pool", "priority", "reason"),
		wait: ms.HistogramVec("kvrouter_queue_wait_seconds",
			"Time admitted requests waited in the flow-control queue (0 when admitted at once).",
			prometheus.ExponentialBuckets(0.001, 2, 16), // 1ms .. 33s
			"pool", "priority"),
	}
	ms.Add(&flowCollector{s: s})
	return m
}

var (
	queueDepthDesc   = prometheus.NewDesc("kvrouter_queue_depth", "Requests waiting in the pool's flow-control queue, by priority band.", []string{"pool", "priority"}, nil)
	queueTokensDesc  = prometheus.NewDesc("kvrouter_queue_tokens", "Tokens (prompt plus output bound) of the requests waiting.", []string{"pool"}, nil)
	queueOldestDesc  = prometheus.NewDesc("kvrouter_queue_oldest_wait_seconds", "Wait so far of the oldest waiting request.", []string{"pool"}, nil)
	queueFlightDesc  = prometheus.NewDesc("kvrouter_queue_in_flight", "Requests admitted by the queue and not finished.", []string{"pool"}, nil)
	queueLimitDesc   = prometheus.NewDesc("kvrouter_queue_concurrency_limit", "The pool's in-flight budget (0 = none).", []string{"pool"}, nil)
	queuePrefillDesc = prometheus.NewDesc("kvrouter_queue_pending_prefill_tokens", "Prompt tokens admitted and not yet answered with a first byte.", []string{"pool"}, nil)
	queueLIFODesc    = prometheus.NewDesc("kvrouter_queue_newest_first_tenants", "Waiting tenants whose requests go newest first: one of them was shed for its deadline or wait bound while others waited (docs/flow-control.md).", []string{"pool"}, nil)
)

type flowCollector struct{ s *Server }

func (c *flowCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{queueDepthDesc, queueTokensDesc, queueOldestDesc, queueFlightDesc, queueLimitDesc, queuePrefillDesc, queueLIFODesc} {
		ch <- d
	}
}

func (c *flowCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.table.Load()
	if st == nil {
		return
	}
	for _, p := range st.Pools() {
		gate, _ := p.Queue()
		if gate == nil {
			continue
		}
		q := gate.Stats()
		depth := map[string]int{}
		for _, b := range q.Bands {
			depth[priorityLabel(b.Priority)] += b.Queued
		}
		for prio, n := range depth {
			ch <- prometheus.MustNewConstMetric(queueDepthDesc, prometheus.GaugeValue, float64(n), p.Name(), prio)
		}
		ch <- prometheus.MustNewConstMetric(queueTokensDesc, prometheus.GaugeValue, float64(q.QueuedTokens), p.Name())
		ch <- prometheus.MustNewConstMetric(queueOldestDesc, prometheus.GaugeValue, q.OldestWait.Seconds(), p.Name())
		ch <- prometheus.MustNewConstMetric(queueFlightDesc, prometheus.GaugeValue, float64(q.InFlight), p.Name())
		ch <- prometheus.MustNewConstMetric(queueLimitDesc, prometheus.GaugeValue, float64(q.MaxConcurrency), p.Name())
		ch <- prometheus.MustNewConstMetric(queuePrefillDesc, prometheus.GaugeValue, float64(q.PendingPrefill), p.Name())
		ch <- prometheus.MustNewConstMetric(queueLIFODesc, prometheus.GaugeValue, float64(q.NewestFirstTenants), p.Name())
	}
}
