package cputime

import (
	"runtime"
	"testing"
	"time"
)

type metrics map[string]float64

func (m metrics) ReportMetric(n float64, unit string) { m[unit] = n }

func TestQuantile(t *testing.T) {
	ts := []time.Duration{9, 1, 8, 2, 7, 3, 6, 4, 5, 10}
	for _, c := range []struct {
		p    float64
		want time.Duration
	}{{0, 1}, {0.5, 6}, {0.99, 10}, {1, 10}} {
		if got := Quantile(ts, c.p); got != c.want {
			t.Errorf("Quantile(%v) = %v, want %v", c.p, got, c.want)
		}
	}
	if got := Quantile(nil, 0.5); got != 0 {
		t.Errorf("Quantile(nil) = %v, want 0", got)
	}
}

// TestOpTimesNetOfTimer: an op that does nothing measures the timer's own
// cost, which OpTimes subtracts; an op that burns CPU keeps its time.
func TestOpTimesNetOfTimer(t *testing.T) {
	if Thread() < 0 {
		t.Skip("no per-thread CPU clock on this platform") // Linux has one: CI runs there
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	o := NewOpTimes(2000)
	if o.overhead <= 0 || o.overhead > time.Millisecond {
		t.Fatalf("timer overhead %v, want a system call's cost (0, 1 ms]", o.overhead)
	}
	for range 1000 {
		o.Stop(o.Start())
	}
	m := metrics{}
	o.Report(m, "cpu-ns")
	// Half the empty ops cost at most the median the overhead was taken
	// from; whatever the machine did, the net median is a small fraction
	// of the raw one.
	if m["p50-cpu-ns"] >= m["timer-cpu-ns"] {
		t.Errorf("empty op p50 %v ns net of a %v ns timer: not subtracted", m["p50-cpu-ns"], m["timer-cpu-ns"])
	}
	busy := NewOpTimes(10)
	start := busy.Start()
	x := 0
	for c0 := Thread(); Thread()-c0 < 2*time.Millisecond; x++ {
	}
	busy.Stop(start)
	m = metrics{}
	busy.Report(m, "cpu-ns")
	if m["p50-cpu-ns"] < float64(time.Millisecond) {
		t.Errorf("a 2 ms CPU burn measured %v ns (after %d spins)", m["p50-cpu-ns"], x)
	}
	if len(busy.times) != 1 {
		t.Fatalf("%d samples, want 1", len(busy.times))
	}
	for range 20 {
		busy.Stop(busy.Start())
	}
	if len(busy.times) != 10 {
		t.Errorf("%d samples kept, want the cap of 10", len(busy.times))
	}
}
