//go:build linux && !race

package kvindex

import (
	"runtime"
	"syscall"
	"testing"
)

// threadFaults is the calling thread's minor page faults so far.
func threadFaults(t *testing.T) int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_THREAD, &ru); err != nil {
		t.Fatal(err)
	}
	return ru.Minflt
}

// TestTableSlotsFaultOnce: a presized table's pages are written when it
// is made, so the access pattern of a fill, a read of a page's slots
// (touch, a probe) before the first write to it, takes no further page
// fault. With the slots left as the allocator hands them over (fresh
// memory, unmapped), the read maps the kernel's zero page and the write
// faults again to replace it: two faults per page, the cost of a
// process's first fill (docs/BENCHMARKS.md §10, "Session 15 (second)").
// Not under -race: the detector's shadow memory faults on its own.
func TestTableSlotsFaultOnce(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var tb table
	tb.presize(8 << 20) // 16 Mi slots, 64 MiB: more than the test heap has free
	pages := len(tb.slots) / pageSlots
	before := threadFaults(t)
	var x uint32
	for i := 0; i < len(tb.slots); i += pageSlots {
		x |= tb.slots[i+pageSlots/2]
	}
	for i := 0; i < len(tb.slots); i += pageSlots {
		tb.slots[i+pageSlots/2] = x + 1
	}
	faults := threadFaults(t) - before
	t.Logf("%d faults over %d pages read then written", faults, pages)
	if faults > int64(pages/8) {
		t.Fatalf("%d page faults reading then writing %d pages of a new table, want under %d (each page written when made)", faults, pages, pages/8)
	}
}
