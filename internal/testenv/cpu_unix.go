//go:build unix

package testenv

import (
	"syscall"
	"time"
)

// ProcessCPU is the CPU time (user + system) this process has used so far,
// or -1 where unknown. On a shared machine wall time mostly measures the
// wait for a core, so benchmarks report CPU time beside it.
func ProcessCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
