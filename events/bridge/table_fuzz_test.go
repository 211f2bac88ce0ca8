package bridge

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

// stored is a one-block store with tokens.
func stored(h, parent uint64, hasParent bool) events.Event {
	return events.Event{Kind: events.BlockStored, BlockHashes: []uint64{h}, ParentHash: parent, HasParent: hasParent,
		TokenIDs: []uint32{uint32(h), 1}, BlockSize: 2, Medium: "GPU"}
}

func removed(hs ...uint64) events.Event {
	return events.Event{Kind: events.BlockRemoved, BlockHashes: hs, Medium: "GPU"}
}

// A broken engine can name a block its own ancestor (a self parent, or two
// blocks each the other's parent: a hash collision, or a bug). The table
// must not loop or overflow its stack on it: rendering a snapshot and the
// ghost bound both walk parent chains.
func TestTableParentCycle(t *testing.T) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		tb := NewTable(2)
		// A self parent, then a two-block cycle (7's parent 8 unknown when
		// 7 is stored; 8 then stored under 7).
		tb.Apply([]events.Event{stored(5, 5, true), stored(7, 8, true), stored(8, 7, true)})
		if evs := tb.Events(); len(evs) == 0 {
			t.Error("no snapshot events for a table holding blocks")
		}
		// Every block leaves GPU: ghosts, then the bound drops subtrees
		// (cycles included) until at most 2 ghosts remain.
		tb.Apply([]events.Event{removed(5, 7, 8), stored(9, 0, false), stored(10, 9, true), stored(11, 10, true), removed(9, 10, 11)})
		_ = tb.Events()
		if g := tb.Ghosts(); g > 2 {
			t.Errorf("%d ghosts held past the bound of 2", g)
		}
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("the table did not return on a parent cycle")
	}
}

// FuzzTableApply folds arbitrary event sequences — hashes from a small
// alphabet so that parents, cycles, re-stores and removals of unknown
// blocks meet — into a bounded table, and checks that it terminates, keeps
// its bound and its storage's invariants (checkSlots), and renders a
// snapshot that rebuilds what it holds.
func FuzzTableApply(f *testing.F) {
	f.Add([]byte{0, 5, 5, 1, 1, 7, 8, 1, 1, 8, 7, 1, 2, 5, 0, 0})
	f.Add([]byte{0, 1, 0, 0, 0, 2, 1, 1, 0, 3, 2, 1, 2, 2, 0, 0, 3, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		const max = 4
		tb := NewTable(max)
		var evs []events.Event
		for len(data) >= 4 {
			op, h, p, flag := data[0]%4, uint64(data[1]%16), uint64(data[2]%16), data[3]
			data = data[4:]
			switch op {
			case 0:
				evs = append(evs, stored(h, p, flag%2 == 1))
			case 1:
				e := stored(h, p, flag%2 == 1)
				e.TokenIDs, e.Medium = nil, "CPU" // a tokenless offload store
				evs = append(evs, e)
			case 2:
				evs = append(evs, removed(h))
			default:
				if flag%8 == 0 {
					evs = append(evs, events.Event{Kind: events.AllBlocksCleared})
				} else {
					evs = append(evs, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{h}, Medium: "CPU"})
				}
			}
			if len(evs) == 3 {
				tb.Apply(evs)
				checkSlots(t, tb)
				evs = evs[:0]
			}
		}
		tb.Apply(evs)
		checkSlots(t, tb)
		if tb.Len() > max {
			t.Fatalf("%d blocks held past the bound of %d", tb.Len(), max)
		}
		if tb.Ghosts() > max {
			t.Fatalf("%d ghosts past the bound of %d", tb.Ghosts(), max)
		}
		// The snapshot rebuilds the held blocks (parent, tokens, tiers) on
		// an empty table.
		want := tb.Dump()
		re := NewTable(0)
		re.Apply(tb.Events())
		got := re.Dump()
		for h, p := range want {
			if g, ok := got[h]; !ok || g != p {
				t.Fatalf("block %d: snapshot rebuilt %+v, held %+v", h, g, p)
			}
		}
		for h := range got {
			if _, ok := want[h]; !ok {
				t.Fatalf("block %d in the rebuilt table, not held", h)
			}
		}
	})
}
