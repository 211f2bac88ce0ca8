//go:build linux

package cputime

import (
	"runtime"
	"testing"
	"time"
)

// The per-thread CPU clock is Linux's (thread_linux.go); elsewhere Thread
// returns -1 and OpTimes has nothing to measure, so this test is Linux's.

// TestOpTimesNetOfTimer: an op that does nothing measures the timer's own
// cost, which OpTimes subtracts; an op that burns CPU keeps its time.
func TestOpTimesNetOfTimer(t *testing.T) {
	if Thread() < 0 {
		t.Fatal("CLOCK_THREAD_CPUTIME_ID unreadable: Linux always has a per-thread CPU clock")
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
