// Package metricset builds a component's Prometheus collectors and
// registers them together: each metric is written once, where it is
// declared, instead of once in a struct literal and again in the list
// handed to Register.
package metricset

import "github.com/prometheus/client_golang/prometheus"

// Set collects what its constructors build. The zero value is ready;
// ConstLabels, when set before the first constructor, go on every series.
type Set struct {
	ConstLabels prometheus.Labels
	all         []prometheus.Collector
}

// Add adds collectors built elsewhere (a custom Collector) to the set.
func (s *Set) Add(cs ...prometheus.Collector) { s.all = append(s.all, cs...) }

// add adds c to s and returns it.
func add[C prometheus.Collector](s *Set, c C) C {
	s.all = append(s.all, c)
	return c
}

// Counter builds a counter.
func (s *Set) Counter(name, help string) prometheus.Counter {
	return add(s, prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: s.ConstLabels}))
}

// CounterVec builds a counter vector with the given labels.
func (s *Set) CounterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return add(s, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: s.ConstLabels}, labels))
}

// Gauge builds a gauge.
func (s *Set) Gauge(name, help string) prometheus.Gauge {
	return add(s, prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: s.ConstLabels}))
}

// GaugeVec builds a gauge vector with the given labels.
func (s *Set) GaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	return add(s, prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: s.ConstLabels}, labels))
}

// Histogram builds a histogram with the given buckets.
func (s *Set) Histogram(name, help string, buckets []float64) prometheus.Histogram {
	return add(s, prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: s.ConstLabels, Buckets: buckets}))
}

// HistogramVec builds a histogram vector with the given buckets and labels.
func (s *Set) HistogramVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return add(s, prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: s.ConstLabels, Buckets: buckets}, labels))
}

// Register registers every collector of the set on reg, in the order
// they were built, stopping at the first error; a nil reg registers
// nothing (the metrics are kept, read by nobody).
func (s *Set) Register(reg prometheus.Registerer) error {
	if reg == nil {
		return nil
	}
	for _, c := range s.all {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
