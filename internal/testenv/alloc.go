package testenv

import "runtime"

// Allocated is the heap f allocates, in bytes (runtime.MemStats.TotalAlloc
// after a GC, before and after): the measure of the tests that bound what
// hostile input may cost. Other goroutines' allocations count too, so a
// bound is to be set with room, as a multiple of the input.
func Allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}
