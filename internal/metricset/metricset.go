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

// Counter builds a counter.
func (s *Set) Counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: s.ConstLabels})
	s.Add(c)
	return c
}

// CounterVec builds a counter vector with the given labels.
func (s *Set) CounterVec(name, help string, labels ...string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: s.ConstLabels}, labels)
	s.Add(c)
	return c
}

// Gauge builds a gauge.
func (s *Set) Gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: s.ConstLabels})
	s.Add(g)
	return g
}

// GaugeVec builds a gauge vector with the given labels.
func (s *Set) GaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: s.ConstLabels}, labels)
	s.Add(g)
	return g
}

// Histogram builds a histogram with the given buckets.
func (s *Set) Histogram(name, help string, buckets []float64) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: s.ConstLabels, Buckets: buckets})
	s.Add(h)
	return h
}

// HistogramVec builds a histogram vector with the given buckets and labels.
func (s *Set) HistogramVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: s.ConstLabels, Buckets: buckets}, labels)
	s.Add(h)
	return h
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
