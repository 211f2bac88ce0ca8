package kvindex

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/tiers"
)

// checkMemory verifies the memory backend's internal invariants: every
// live entry is indexed by its engine hash and linked once in its LRU list;
// the block map holds exactly one node per key held, whose holders are the
// instances with live entries of it, each with the OR of its entries' tier
// bits (the fastest tier, in holder sets); the tables index exactly the
// live items; the counts add up.
func checkMemory(t testing.TB, m *Memory) {
	t.Helper()
	if err := memoryInvariants(m); err != nil {
		t.Fatal(err)
	}
}

func memoryInvariants(m *Memory) error {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return memoryInvariantsLocked(m)
}

func memoryInvariantsLocked(m *Memory) error {
	bm := &m.blocks
	want := map[int32]map[uint32]uint32{} // node → slot → tier bits
	total := 0
	for slot, in := range m.slots {
		if in == nil {
			continue
		}
		if int(in.slot) != slot || m.insts[in.name] != in {
			return fmt.Errorf("slot %d: instance %q has slot %d", slot, in.name, in.slot)
		}
		live := 0
		var count [tiers.Count]int
		for j := int32(0); j < in.slab.n; j++ {
			e := in.slab.at(j)
			if e.meta&flagLive == 0 {
				continue
			}
			live++
			if e.meta&tierMask == 0 {
				return fmt.Errorf("%s: entry %d has no tier", in.name, j)
			}
			for t := range tiers.Count {
				if e.meta&(1<<t) != 0 {
					count[t]++
				}
			}
			if f := in.byHash.find(in.hashSrc(), e.ehash()); f != j {
				return fmt.Errorf("%s: hash %x finds entry %d, want %d", in.name, e.ehash(), f, j)
			}
			if e.node < 0 || e.node >= bm.n || *bm.holdAt(e.node) == 0 {
				return fmt.Errorf("%s: entry %d points at dead node %d", in.name, j, e.node)
			}
			if want[e.node] == nil {
				want[e.node] = map[uint32]uint32{}
			}
			want[e.node][in.slot] |= e.meta & tierMask
		}
		if live != in.n || in.byHash.n != live || in.aliased && in.byNode.n != live || count != in.count {
			return fmt.Errorf("%s: %d live entries, n %d, byHash %d, byNode %d (aliased %v), counts %v want %v",
				in.name, live, in.n, in.byHash.n, in.byNode.n, in.aliased, in.count, count)
		}
		seen := 0
		prev := int32(-1)
		for j := in.head; j >= 0; j = in.slab.at(j).next {
			if seen++; seen > in.n {
				return fmt.Errorf("%s: LRU list has a cycle", in.name)
			}
			if in.slab.at(j).prev != prev {
				return fmt.Errorf("%s: LRU entry %d prev %d, want %d", in.name, j, in.slab.at(j).prev, prev)
			}
			prev = j
		}
		if seen != in.n || in.tail != prev {
			return fmt.Errorf("%s: LRU list has %d entries ending at %d, want %d ending at tail %d", in.name, seen, prev, in.n, in.tail)
		}
		total += live
	}
	if int64(total) != m.entries.Load() {
		return fmt.Errorf("entries %d, live entries %d", m.entries.Load(), total)
	}
	nodes := 0
	for j := int32(0); j < bm.n; j++ {
		w := *bm.holdAt(j)
		if w == 0 {
			continue
		}
		nodes++
		k := *bm.keyAt(j)
		if f := bm.find(k); f != j {
			return fmt.Errorf("node %d: key %x finds node %d", j, k, f)
		}
		if w&hSpill != 0 {
			if hs := bm.spills[w&^hSpill].set; hs != nil {
				slow := 0
				for _, x := range hs.toList() {
					if level(x) > 0 {
						slow++
					}
				}
				if slow != hs.slow {
					return fmt.Errorf("node %d: holder set counts %d holders off the GPU, has %d", j, hs.slow, slow)
				}
			}
		}
		got := holdersOf(bm, j)
		exp := want[j]
		if len(got) != len(exp) {
			return fmt.Errorf("node %d: holders %v, want %v", j, got, exp)
		}
		// Lookups read a holder's fastest tier only, and holder sets (and
		// lists made back from them) keep only that.
		for slot, bits := range exp {
			if g, ok := got[slot]; !ok || level(g) != level(bits) {
				return fmt.Errorf("node %d: holders %v, want %v", j, got, exp)
			}
		}
		delete(want, j)
	}
	if len(want) != 0 {
		return fmt.Errorf("entries point at %d nodes that are not live", len(want))
	}
	if bm.index.n != nodes+bm.dormant {
		return fmt.Errorf("block index has %d nodes, %d live and %d dormant", bm.index.n, nodes, bm.dormant)
	}
	free := 0
	for j := bm.free; j >= 0; j = int32(*bm.keyAt(j)) {
		if *bm.holdAt(j) != 0 || free > int(bm.n) {
			return fmt.Errorf("free list holds live node %d or loops", j)
		}
		free++
	}
	if free+nodes+bm.dormant != int(bm.n) {
		return fmt.Errorf("%d free + %d live + %d dormant nodes, %d handed out", free, nodes, bm.dormant, bm.n)
	}
	return nil
}

// holdersOf decodes node j's holders: slot → tier bits (holder sets keep
// only the fastest tier).
func holdersOf(bm *blockMap, j int32) map[uint32]uint32 {
	out := map[uint32]uint32{}
	w := *bm.holdAt(j)
	if w&hSpill == 0 {
		out[holderSlot(w)] = w & hTiers
		return out
	}
	sp := &bm.spills[w&^hSpill]
	if sp.set == nil {
		for _, x := range sp.list {
			out[holderSlot(x)] = x & hTiers
		}
		return out
	}
	for _, x := range sp.set.toList() {
		out[holderSlot(x)] = x & hTiers
	}
	return out
}
