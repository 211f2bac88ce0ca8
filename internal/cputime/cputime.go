// Package cputime reads the process's CPU time, for benchmarks that report
// CPU time per op beside wall time: on a shared machine wall time per op
// mostly measures waiting for a core.
package cputime

import (
	"testing"
	"time"
)

// Process is the process's user+system CPU time (GC included), -1 where
// the platform does not report it.
func Process() time.Duration { return process() }

// Report starts counting b's CPU time and returns the function that, run
// after b's loop with the number of ops n, reports cpu-ns/op (nothing when
// n is 0 or the platform reports no CPU time).
func Report(b *testing.B) func(n int) {
	cpu0 := Process()
	return func(n int) {
		if cpu1 := Process(); n > 0 && cpu0 >= 0 && cpu1 >= 0 {
			b.ReportMetric(float64(cpu1-cpu0)/float64(n), "cpu-ns/op")
		}
	}
}
