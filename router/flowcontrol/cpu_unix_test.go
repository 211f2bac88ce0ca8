//go:build unix

package flowcontrol

import (
	"syscall"
	"time"
)

// processCPU is the process's user+system CPU time (-1 where unknown).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
