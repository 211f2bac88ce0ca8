//go:build unix

package kvindex

import (
	"syscall"
	"time"
)

// processCPU is the CPU time (user + system) this process has used. The
// benchmarks report throughput per CPU second beside wall-clock figures:
// on a shared machine wall time includes waiting for a core.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
