package kvindex

import (
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU is the calling OS thread's CPU time (CLOCK_THREAD_CPUTIME_ID),
// for per-operation CPU time: callers lock their goroutine to its thread.
// -1 when the clock is unavailable.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return -1
	}
	return time.Duration(ts.Nano())
}
