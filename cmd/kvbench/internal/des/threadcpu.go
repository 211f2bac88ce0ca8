package des

import "time"

// ThreadCPU is the calling OS thread's CPU time, -1 where the platform has
// no per-thread CPU clock. Callers lock their goroutine to its thread
// (runtime.LockOSThread) for differences to mean anything.
func ThreadCPU() time.Duration { return threadCPU() }
