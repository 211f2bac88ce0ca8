package kvindex

import (
	"encoding/hex"
	"testing"

	"github.com/kvrouter/kvrouter/events"
)

// TestSectionEnd: Memory.Apply joins consecutive events into one locked
// section while their blocks stay within SectionBlocks, never joins a
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
		{"up to SectionBlocks", []events.Event{ev(st, SectionBlocks-1), ev(rm, 1), ev(st, 1)}, 0, 2},
		{"a large event alone", []events.Event{ev(st, SectionBlocks+5), ev(st, 1)}, 0, 1},
		{"a large event after small ones ends them", []events.Event{ev(st, 1), ev(st, SectionBlocks)}, 0, 1},
		{"a clear alone", []events.Event{ev(clr, 0), ev(st, 1)}, 0, 1},
		{"a clear ends a section", []events.Event{ev(st, 1), ev(rm, 1), ev(clr, 0), ev(st, 1)}, 0, 2},
		{"from the middle", []events.Event{ev(st, 1), ev(clr, 0), ev(st, 1), ev(rm, 1)}, 2, 4},
	} {
		if got := sectionEnd(c.evs, c.i); got != c.want {
			t.Errorf("%s: sectionEnd(…, %d) = %d, want %d", c.name, c.i, got, c.want)
		}
	}
}

// A store with a parent and no blocks in a section of several events: the
// section's prefetch took the first block's tokens of a store whose
// token count matched its (zero) blocks, and panicked slicing an empty
// token list, holding the index's lock, on one engine payload the decoder
// accepts (found by this session's review of the prefetch change). Such a
// store changes nothing; the removal after it applies.
func TestSectionEmptyStoreWithParent(t *testing.T) {
	ctx := t.Context()
	// ["BlockStored",[],1,[],16] then ["BlockRemoved",[1]], as an engine
	// could send them.
	raw, err := hex.DecodeString("93cb3ff80000000000009295ab426c6f636b53746f7265649001901092ac426c6f636b52656d6f766564910100")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := events.Decode(raw)
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	m, err := NewMemory(MemoryConfig{Model: testModel, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Apply(ctx, "a", []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{1}, TokenIDs: make([]uint32, 16), BlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	res, err := m.Apply(ctx, "a", batch.Events)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := m.Len(ctx); err != nil || res.Removed != 1 || n != 0 {
		t.Fatalf("removed %d, %d blocks left (%v); want 1 and 0", res.Removed, n, err)
	}
}
