package kvindex

import (
	"testing"

	"github.com/kvrouter/kvrouter/events"
)

// TestSectionEnd: Memory.Apply joins consecutive events into one locked
// section while their blocks stay within sectionBlocks, never joins a
// clear, and always takes at least one event.
func TestSectionEnd(t *testing.T) {
	ev := func(kind events.Kind, blocks int) events.Event {
		return events.Event{Kind: kind, BlockHashes: make([]uint64, blocks)}
	}
	st, rm, clr := events.BlockStored, events.BlockRemoved, events.AllBlocksCleared
	for _, c := range []struct {
		name string
		evs  []events.Event
		i    int
		want int
	}{
		{"empty batch", nil, 0, 1},
		{"one event", []events.Event{ev(st, 3)}, 0, 1},
		{"small events join", []events.Event{ev(st, 1), ev(rm, 1), ev(st, 2)}, 0, 3},
		{"up to sectionBlocks", []events.Event{ev(st, sectionBlocks-1), ev(rm, 1), ev(st, 1)}, 0, 2},
		{"a large event alone", []events.Event{ev(st, sectionBlocks+5), ev(st, 1)}, 0, 1},
		{"a large event after small ones ends them", []events.Event{ev(st, 1), ev(st, sectionBlocks)}, 0, 1},
		{"a clear alone", []events.Event{ev(clr, 0), ev(st, 1)}, 0, 1},
		{"a clear ends a section", []events.Event{ev(st, 1), ev(rm, 1), ev(clr, 0), ev(st, 1)}, 0, 2},
		{"from the middle", []events.Event{ev(st, 1), ev(clr, 0), ev(st, 1), ev(rm, 1)}, 2, 4},
	} {
		if got := sectionEnd(c.evs, c.i); got != c.want {
			t.Errorf("%s: sectionEnd(…, %d) = %d, want %d", c.name, c.i, got, c.want)
		}
	}
}
