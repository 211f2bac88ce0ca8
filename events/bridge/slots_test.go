package bridge

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/events"
)

// checkSlots holds the table's storage to what it stores: every indexed
// block in its slot under its hash, in the list its tiers say, each list
// linked both ways with its length, children counted, names beside exactly
// the named blocks, and the free slots in no list and not indexed.
func checkSlots(t testing.TB, tab *Table) {
	t.Helper()
	inList := map[slot]*blockList{}
	for _, l := range []*blockList{&tab.live, &tab.ghosts} {
		n, prev := 0, slot(0)
		for s := l.head; s != 0; s = tab.at(s).next {
			if inList[s] != nil {
				t.Fatalf("slot %d twice in the lists", s)
			}
			inList[s] = l
			if tab.at(s).prev != prev {
				t.Fatalf("slot %d: prev %d, want %d", s, tab.at(s).prev, prev)
			}
			prev = s
			n++
		}
		if l.tail != prev || l.n != n {
			t.Fatalf("list tail %d len %d, walked to %d over %d", l.tail, l.n, prev, n)
		}
	}
	children := map[uint64]int32{}
	for h, s := range tab.index {
		b := tab.at(s)
		if b.hash != h {
			t.Fatalf("index %x → slot %d holding %x", h, s, b.hash)
		}
		if inList[s] != tab.listOf(b) {
			t.Fatalf("block %x (tiers %b) not in its list", h, b.tiers)
		}
		if b.hasParent {
			if _, ok := tab.index[b.parent]; ok {
				children[b.parent]++
			}
		}
		if _, ok := tab.names[s]; ok != b.named {
			t.Fatalf("block %x: named %v, in names %v", h, b.named, ok)
		}
	}
	if len(inList) != len(tab.index) || len(tab.names) > len(tab.index) {
		t.Fatalf("%d blocks in the lists, %d indexed, %d named", len(inList), len(tab.index), len(tab.names))
	}
	for h, s := range tab.index {
		// At most the indexed blocks naming it (a self parent counts
		// itself): a child stored before its parent, which vLLM never
		// does, is not counted when the parent comes.
		if b := tab.at(s); b.children > children[h] {
			t.Fatalf("block %x counts %d children, %d indexed", h, b.children, children[h])
		}
	}
	free := 0
	for s := tab.free; s != 0; s = tab.at(s).next {
		if inList[s] != nil {
			t.Fatalf("free slot %d is in a list", s)
		}
		if free++; free > tab.used {
			t.Fatal("free list loops")
		}
	}
	if used := max(tab.used-1, 0); free+len(tab.index) != used {
		t.Fatalf("%d free + %d indexed slots, %d used", free, len(tab.index), used)
	}
}

// chain is a store of n fresh blocks from first, under parent (0: a root),
// with bs tokens each (the block's hash, then its place), and an optional
// LoRA name and cache salt.
func chain(first uint64, n, bs int, parent uint64, lora, salt string) events.Event {
	e := events.Event{Kind: events.BlockStored, BlockSize: bs, Medium: "GPU", LoraName: lora, CacheSalt: salt,
		ParentHash: parent, HasParent: parent != 0}
	for i := range n {
		h := first + uint64(i)
		e.BlockHashes = append(e.BlockHashes, h)
		for j := range bs {
			e.TokenIDs = append(e.TokenIDs, uint32(h)<<8|uint32(j))
		}
	}
	return e
}

// Blocks stored after others went take their slots and token room: the
// table grows no slot, no token chunk, and a store into reused slots
// allocates nothing; what the snapshot renders is the new blocks'.
func TestTableSlotReuse(t *testing.T) {
	tab := NewTable(0)
	tab.Apply([]events.Event{chain(1, 64, 16, 0, "", "")})
	used, chunks := tab.used, len(tab.chunks)
	// The rounds' events, made before: each removes the 64 held blocks
	// tail first, as vLLM frees a request's blocks, then stores 64 others.
	const rounds = 200
	type round struct{ rm, st []events.Event }
	rs := make([]round, rounds+1) // AllocsPerRun runs once more, first
	prev := chain(1, 64, 16, 0, "", "")
	for i := range rs {
		hs := slices.Clone(prev.BlockHashes)
		slices.Reverse(hs)
		prev = chain(uint64(i+1)*1000, 64, 16, 0, "", "")
		rs[i] = round{[]events.Event{{Kind: events.BlockRemoved, BlockHashes: hs, Medium: "GPU"}}, []events.Event{prev}}
	}
	i := 0
	allocs := testing.AllocsPerRun(rounds, func() {
		tab.Apply(rs[i].rm)
		tab.Apply(rs[i].st)
		i++
	})
	checkSlots(t, tab)
	if tab.used != used || len(tab.chunks) != chunks || tab.Len() != 64 || tab.Ghosts() != 0 {
		t.Fatalf("slots used %d → %d, chunks %d → %d, %d held, %d ghosts", used, tab.used, chunks, len(tab.chunks), tab.Len(), tab.Ghosts())
	}
	// Per round: the removal's Removed entry, and now and then the map's
	// own upkeep; before slots, 2 per new block (128 a round).
	t.Logf("%.2f allocations per round", allocs)
	if allocs > 4 {
		t.Fatalf("%.1f allocations per round of 64 stores and 64 removals", allocs)
	}
	// The snapshot holds the last 64 blocks with their own tokens.
	evs := tab.Events()
	want := prev
	if len(evs) != 1 || !slices.Equal(evs[0].BlockHashes, want.BlockHashes) || !slices.Equal(evs[0].TokenIDs, want.TokenIDs) {
		t.Fatalf("snapshot after reuse: %d events, want the last chain", len(evs))
	}
}

// A slot reused by a block of another size or without the strings of the
// block before keeps nothing of it: its tokens, LoRA name and salt are the
// new block's, after a removal and after a clear.
func TestTableSlotReuseKeepsNothing(t *testing.T) {
	for _, how := range []string{"removed", "cleared"} {
		t.Run(how, func(t *testing.T) {
			tab := NewTable(0)
			tab.Apply([]events.Event{chain(1, 4, 4, 0, "adapter", "salt")})
			if how == "removed" {
				tab.Apply([]events.Event{{Kind: events.BlockRemoved, BlockHashes: []uint64{4, 3, 2, 1}, Medium: "GPU"}})
			} else {
				tab.Apply([]events.Event{{Kind: events.AllBlocksCleared}})
			}
			// Larger blocks first (the old room is too small), then
			// smaller ones (it is large enough), neither named.
			big, small := chain(10, 2, 8, 0, "", ""), chain(20, 2, 2, 11, "", "")
			tab.Apply([]events.Event{big, small})
			checkSlots(t, tab)
			if len(tab.names) != 0 {
				t.Fatalf("names kept for reused slots: %v", tab.names)
			}
			fresh := NewTable(0)
			fresh.Apply([]events.Event{big, small})
			if got, want := tab.Events(), fresh.Events(); !reflect.DeepEqual(got, want) {
				t.Fatalf("snapshot after reuse\n%+v\nwant\n%+v", got, want)
			}
		})
	}
}

// The bound holds the storage too: with max blocks, churn (chains stored,
// parents removed before children, blocks evicted by the bound) never uses
// more slots than 2×max (held blocks and ghosts) plus one batch's stores.
func TestTableSlotsBounded(t *testing.T) {
	const maxBlocks, batch = 32, 12
	rng := rand.New(rand.NewPCG(3, 4))
	tab := NewTable(maxBlocks)
	next := uint64(1)
	for step := range 3000 {
		var evs []events.Event
		parent := uint64(0)
		if tab.Len() > 0 && rng.IntN(2) == 0 {
			parent = tab.at(tab.live.tail).hash
		}
		evs = append(evs, chain(next, 1+rng.IntN(batch), 2, parent, "", ""))
		next += batch
		// Remove a few held blocks, any of them: parents before children
		// leave ghosts.
		var rm []uint64
		for h := range tab.index {
			if len(rm) == rng.IntN(4) {
				break
			}
			rm = append(rm, h)
		}
		evs = append(evs, events.Event{Kind: events.BlockRemoved, BlockHashes: rm, Medium: "GPU"})
		tab.Apply(evs)
		if tab.Len() > maxBlocks || tab.Ghosts() > maxBlocks {
			t.Fatalf("step %d: %d held, %d ghosts past the bound %d", step, tab.Len(), tab.Ghosts(), maxBlocks)
		}
		if step%100 == 0 {
			checkSlots(t, tab)
		}
	}
	checkSlots(t, tab)
	if tab.used-1 > 2*maxBlocks+batch {
		t.Fatalf("%d slots used for a bound of %d", tab.used-1, maxBlocks)
	}
	if tab.Ghosts() == 0 && tab.used-1 <= maxBlocks+batch {
		t.Fatal("the churn never left ghosts: it does not test their slots")
	}
}

// BenchmarkTableChurn stores chains of fresh 16-token blocks into a table
// at its bound, each store evicting the oldest: a table at an engine's
// size, every block new.
func BenchmarkTableChurn(b *testing.B) {
	for _, size := range []int{1 << 10, 1 << 16} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			tab := NewTable(size)
			evs := make([]events.Event, 64)
			for i := range evs {
				evs[i] = chain(uint64(i)*16+1, 16, 16, 0, "", "")
			}
			for i := 0; i < size/16; i++ {
				tab.Apply(evs[i%len(evs) : i%len(evs)+1])
				for j := range evs[i%len(evs)].BlockHashes {
					evs[i%len(evs)].BlockHashes[j] += uint64(len(evs)) * 16
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				e := evs[i%len(evs) : i%len(evs)+1]
				tab.Apply(e)
				for j := range e[0].BlockHashes {
					e[0].BlockHashes[j] += uint64(len(evs)) * 16
				}
			}
			b.ReportMetric(float64(b.N)*16/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
