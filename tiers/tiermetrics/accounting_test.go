package tiermetrics

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/tiers"
	dto "github.com/prometheus/client_model/go"
)

func TestAccounting(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	a, err := NewAccounting(reg)
	if err != nil {
		t.Fatal(err)
	}
	type op struct {
		f    func()
		held map[string][tiers.Count]int64
	}
	steps := []op{
		{func() { a.Stored("i1", tiers.GPU, 10); a.Stored("i1", tiers.CPU, 4); a.Stored("i2", tiers.GPU, 3) },
			map[string][tiers.Count]int64{"i1": {10, 4, 0, 0}, "i2": {3, 0, 0, 0}}},
		{func() { a.Evicted("i1", tiers.GPU, 6) }, map[string][tiers.Count]int64{"i1": {4, 4, 0, 0}}},
		{func() { a.Evicted("i2", tiers.GPU, 5) }, map[string][tiers.Count]int64{"i2": {0, 0, 0, 0}}}, // never negative
		{func() {
			a.Stored("i1", tiers.Tier(7), 5)
			a.Stored("i1", tiers.Disk, 0)
			a.Evicted("i1", tiers.GPU, -1)
		},
			map[string][tiers.Count]int64{"i1": {4, 4, 0, 0}}}, // ignored
		{func() { a.Cleared("i1") }, map[string][tiers.Count]int64{"i1": {0, 0, 0, 0}}},
	}
	for i, s := range steps {
		s.f()
		for inst, want := range s.held {
			if got := a.Held(inst); got != want {
				t.Fatalf("step %d: %s holds %v, want %v", i, inst, got, want)
			}
		}
	}
	wantEvicted := map[string]float64{"i1/gpu": 10, "i1/cpu": 4, "i1/disk": 0, "i2/gpu": 5, "i2/cpu": 0}
	for k, want := range wantEvicted {
		inst, tier, _ := strings.Cut(k, "/")
		if got := metricValue(t, reg, MetricBlocksEvicted, inst, tier); got != want {
			t.Errorf("evicted %s = %v, want %v", k, got, want)
		}
	}
	if got := metricValue(t, reg, MetricBlocksStored, "i1", "gpu"); got != 10 {
		t.Errorf("stored gpu %v", got)
	}
	if got := metricValue(t, reg, MetricBlocksHeld, "i1", "gpu"); got != 0 {
		t.Errorf("held gauge after clear %v", got)
	}
	if got := metricValue(t, reg, MetricBlocksHeld, "i2", "gpu"); got != 0 {
		t.Errorf("held gauge i2 %v", got)
	}
	a.Forget("i1")
	if n := seriesCount(t, reg, MetricBlocksHeld); n != tiers.Count {
		t.Errorf("after Forget, %d held series, want %d (i2 only)", n, tiers.Count)
	}
	if a.Held("i1") != ([tiers.Count]int64{}) {
		t.Error("forgotten instance still held")
	}
}

func TestAccountingMedium(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	a, err := NewAccounting(reg)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		medium string
		want   tiers.Tier
	}{
		{"GPU", tiers.GPU}, {"", tiers.GPU}, {"cpu_pinned", tiers.CPU}, {"NVME", tiers.Disk}, {"REMOTE", tiers.Shared}, {"QUANTUM", tiers.UnknownMediumTier},
	}
	for _, tc := range tests {
		if got := a.Medium(tc.medium); got != tc.want {
			t.Errorf("%q: %v, want %v", tc.medium, got, tc.want)
		}
	}
	if got := metricValue(t, reg, MetricUnknownMediums, "QUANTUM"); got != 1 {
		t.Errorf("unknown QUANTUM counted %v", got)
	}
	// The label set stays bounded whatever arrives.
	for i := 0; i < 100; i++ {
		a.Medium(fmt.Sprintf("junk-%d", i))
	}
	if n := seriesCount(t, reg, MetricUnknownMediums); n != maxMediumLabels+1 {
		t.Errorf("%d medium series, want %d", n, maxMediumLabels+1)
	}
	if got := metricValue(t, reg, MetricUnknownMediums, "other"); got != 100-(maxMediumLabels-1) {
		t.Errorf("other = %v", got)
	}
}

func TestAccountingRegisterTwice(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := NewAccounting(reg); err != nil {
		t.Fatal(err)
	}
	if _, err := NewAccounting(reg); err == nil {
		t.Fatal("second registration on one registry succeeded")
	}
}

func TestAccountingConcurrent(t *testing.T) {
	a, _ := NewAccounting(prometheus.NewRegistry())
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inst := fmt.Sprintf("i%d", g%2)
			for i := 0; i < 1000; i++ {
				a.Stored(inst, tiers.CPU, 2)
				a.Evicted(inst, tiers.CPU, 1)
				a.Medium("ODD")
			}
		}()
	}
	wg.Wait()
	if got := a.Held("i0")[tiers.CPU] + a.Held("i1")[tiers.CPU]; got != 8000 {
		t.Errorf("held %d, want 8000", got)
	}
}

func BenchmarkAccountingStored(b *testing.B) {
	a, _ := NewAccounting(prometheus.NewRegistry())
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		a.Stored("instance-1", tiers.GPU, 16)
	}
}

// metricValue gathers reg and returns the value of the series of name whose
// label values are labels (in label order).
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	for _, m := range family(t, reg, name) {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		match := true
		for i, l := range m.GetLabel() {
			match = match && l.GetValue() == labels[i]
		}
		if !match {
			continue
		}
		if m.GetCounter() != nil {
			return m.GetCounter().GetValue()
		}
		return m.GetGauge().GetValue()
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

func seriesCount(t *testing.T, reg prometheus.Gatherer, name string) int {
	return len(family(t, reg, name))
}

func family(t *testing.T, reg prometheus.Gatherer, name string) []*dto.Metric {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			return f.GetMetric()
		}
	}
	return nil
}
