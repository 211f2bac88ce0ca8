package cputime

import (
	"slices"
	"time"
)

// Overhead is what timing an empty section costs: the medians, over
// many back-to-back pairs of readings, of the thread CPU time and the
// wall time between them. Reading the thread CPU clock is a system call,
// and the part of it that falls between the two readings is counted in
// every timed op: on the 2-core VM the benchmarks in docs/BENCHMARKS.md
// run on, ~1.25 µs of thread CPU time (a fifth of a heavy-sharing
// lookup). CPU is -1 where the platform has no per-thread CPU clock.
func Overhead() (cpu, wall time.Duration) {
	const n = 20000
	cs, ws := make([]time.Duration, n), make([]time.Duration, n)
	for i := range cs {
		c0, w0 := Thread(), time.Now()
		w, c := time.Since(w0), Thread()
		cs[i], ws[i] = c-c0, w
	}
	if Thread() < 0 {
		return -1, Quantile(ws, 0.5)
	}
	return Quantile(cs, 0.5), Quantile(ws, 0.5)
}

// Quantile returns the p-quantile of ts (0 for none), sorting ts.
func Quantile(ts []time.Duration, p float64) time.Duration {
	if len(ts) == 0 {
		return 0
	}
	slices.Sort(ts)
	return ts[min(len(ts)-1, int(p*float64(len(ts))))]
}

// OpTimes collects one operation's thread CPU times, each less the
// timer's own cost, for a benchmark that reports their percentiles. Its
// caller locks its goroutine to its thread (runtime.LockOSThread).
type OpTimes struct {
	times    []time.Duration
	overhead time.Duration
}

// NewOpTimes measures the timer's overhead (Overhead) and keeps room for
// up to max samples; later ones are not kept.
func NewOpTimes(max int) *OpTimes {
	cpu, _ := Overhead()
	return &OpTimes{times: make([]time.Duration, 0, max), overhead: cpu}
}

// Start is the thread CPU time now: pass it to Stop after the op.
func (o *OpTimes) Start() time.Duration { return Thread() }

// Stop records the op that began at start (Start's value).
func (o *OpTimes) Stop(start time.Duration) {
	d := Thread() - start
	if start < 0 || len(o.times) == cap(o.times) {
		return
	}
	o.times = append(o.times, max(d-o.overhead, 0))
}

// Report reports the ops' p50 and p99 (as "p50-"+unit and "p99-"+unit,
// net of the timer) and the timer's own cost subtracted from each
// ("timer-"+unit), so that raw figures from before the subtraction can be
// compared. Nothing when the platform has no per-thread CPU clock.
func (o *OpTimes) Report(b Metrics, unit string) {
	if len(o.times) == 0 || o.overhead < 0 {
		return
	}
	s := slices.Clone(o.times)
	b.ReportMetric(float64(Quantile(s, 0.50)), "p50-"+unit)
	b.ReportMetric(float64(Quantile(s, 0.99)), "p99-"+unit)
	b.ReportMetric(float64(o.overhead), "timer-"+unit)
}
