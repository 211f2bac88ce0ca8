package cputime

import (
	"time"

	"golang.org/x/sys/unix"
)

// ofProcess reads pid's process-wide CPU clock: the clock id
// clock_getcpuclockid(3) returns, ((^pid) << 3) | CPUCLOCK_SCHED (2), as
// glibc computes it; Linux lets any process read another's.
func ofProcess(pid int) time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(int32(^pid<<3|2), &ts); err != nil {
		return -1
	}
	return time.Duration(ts.Nano())
}
