// Package cputime reads the process's CPU time and an OS thread's, for
// benchmarks that report CPU time per op beside wall time: on a shared
// machine wall time per op mostly measures waiting for a core; and the
// live heap, for benchmarks that report the memory a structure holds.
package cputime

import (
	"runtime"
	"time"
)

// Process is the process's user+system CPU time (GC included), -1 where
// the platform does not report it.
func Process() time.Duration { return process() }

// OfProcess is process pid's user+system CPU time, all its threads, -1
// where the platform does not let one process read another's (Linux does):
// for benchmarks that run a server in its own process and report its CPU
// beside their own.
func OfProcess(pid int) time.Duration { return ofProcess(pid) }

// Thread is the calling OS thread's CPU time (CLOCK_THREAD_CPUTIME_ID), -1
// where the platform has no per-thread CPU clock. Callers lock their
// goroutine to its thread (runtime.LockOSThread) for differences to mean
// anything; reading it is a system call, a few hundred nanoseconds.
func Thread() time.Duration { return thread() }

// Metrics is where Report puts its figure: a *testing.B. An interface, so
// that binaries that read CPU time (kvbench's simulator) do not link the
// testing package.
type Metrics interface {
	ReportMetric(n float64, unit string)
}

// Report starts counting b's CPU time and returns the function that, run
// after b's loop with the number of ops n, reports cpu-ns/op (nothing when
// n is 0 or the platform reports no CPU time).
func Report(b Metrics) func(n int) {
	cpu0 := Process()
	return func(n int) {
		if cpu1 := Process(); n > 0 && cpu0 >= 0 && cpu1 >= 0 {
			b.ReportMetric(float64(cpu1-cpu0)/float64(n), "cpu-ns/op")
		}
	}
}

// LiveHeap is the heap in use after a full collection (two, so that
// objects freed by finalizers run in the first are gone too): the
// difference of two readings is what the code between them keeps live.
func LiveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
