package metricset

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Every constructor's collector is registered, with the set's constant
// labels, and a second registration of the same names fails.
func TestSetRegisters(t *testing.T) {
	s := Set{ConstLabels: prometheus.Labels{"pool": "p"}}
	s.Counter("t_c_total", "c").Inc()
	s.CounterVec("t_cv_total", "cv", "k").WithLabelValues("a").Inc()
	s.Gauge("t_g", "g").Set(2)
	s.GaugeVec("t_gv", "gv", "k").WithLabelValues("a").Set(3)
	s.Histogram("t_h_seconds", "h", []float64{1}).Observe(0.5)
	s.HistogramVec("t_hv_seconds", "hv", []float64{1}, "k").WithLabelValues("a").Observe(0.5)
	reg := prometheus.NewRegistry()
	if err := s.Register(reg); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != 6 {
		t.Fatalf("gathered %d families, want 6", len(mfs))
	}
	for _, mf := range mfs {
		m := mf.GetMetric()[0]
		pool := ""
		for _, l := range m.GetLabel() {
			if l.GetName() == "pool" {
				pool = l.GetValue()
			}
		}
		if pool != "p" || mf.GetHelp() == "" {
			t.Errorf("%s: pool label %q, help %q", mf.GetName(), pool, mf.GetHelp())
		}
	}
	if err := s.Register(reg); err == nil {
		t.Fatal("registering the same set twice succeeded")
	}
	if err := s.Register(nil); err != nil {
		t.Fatalf("nil registerer: %v", err)
	}
}
