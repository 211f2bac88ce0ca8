package kvindex

import (
	"math/bits"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/tiers"
)

// blockMap is the memory backend's global block map: one node per router
// key held by any instance, saying which instances (by slot) hold it and in
// which tiers. A lookup walks a chain through it once, whatever the number
// of instances sharing the chain (see lookup.go).
//
// Nodes are stored column-wise in fixed chunks (a key and a holder word, 12
// bytes per node, no pointers), indexed by router key through one
// open-addressing table. A node's holder word is either one holder inline
// (the common case: most blocks are held by one instance) or, with the
// spill bit, the index of a spill record holding a sorted holder list or,
// once many instances hold the block, per-tier bitsets over instance slots.
//
// Writers hold Memory.mu for writing. Readers hold it for reading and may
// only set hit bits, atomically (holder words and hit bitsets).
type blockMap struct {
	keys  [][]Key    // node → router key; for a free node, the next free node
	hold  [][]uint32 // node → holder word (below); 0 = free
	n     int32      // nodes handed out so far (high-water mark)
	free  int32      // head of the free list, -1 when empty
	index table      // router key → node (live and dormant)
	// dormant counts nodes that lost their last holder but stay indexed
	// (hold 0, key kept): removing a key from the index reads the keys of
	// the probe run behind it, at random, so released nodes wait for the
	// next rebuild instead, and a key that comes back (a popular prefix
	// evicted and stored again) finds its node still there.
	dormant int

	spills    []spill
	freeSpill []int32
}

// Holder words: a holder is an instance slot with its tier bits and a hit
// flag; a node's word is one holder, or hSpill | spill index.
const (
	hTiers     = allTiers // tier bits (tiers.Count of them)
	hHit       = 1 << 7   // matched by a lookup since last placed (second chance)
	hSlotShift = 8
	hSpill     = 1 << 31
	// maxSlots bounds instance slots to what a holder word encodes.
	maxSlots = 1 << (31 - hSlotShift)
)

// listMax is the longest holder list: a lookup merges a node's list with
// its candidates, so a list stays one or two cache lines (32 bytes).
const listMax = 8

func holderWord(slot uint32, tierBits uint32) uint32 { return slot<<hSlotShift | tierBits }
func holderSlot(w uint32) uint32                     { return w >> hSlotShift &^ (hSpill >> hSlotShift) }

// level is the fastest tier in a tier set (tiers.Count when empty): a
// holder matches tier t of a lookup when level <= t.
func level(tierBits uint32) uint8 {
	return uint8(min(bits.TrailingZeros32(tierBits&hTiers), tiers.Count))
}

// spill holds a node's holders when more than one instance holds it.
type spill struct {
	list []uint32   // holder words sorted by slot, when set is nil
	set  *holderSet // when many instances hold the block
}

// holderSet is a node's holders as bitsets over instance slots: lv[t]
// holds the slots whose fastest tier is t or faster (so lv[0] ⊆ lv[1] ⊆
// ... and lv[tiers.Count-1] is every holder), each words long.
type holderSet struct {
	words int
	lv    [tiers.Count][]uint64
	hit   []uint64 // updated atomically by lookups
	n     int      // holders
	slow  int      // holders whose fastest tier is not the GPU: 0 = every lv[t] is lv[0]
}

// newBlockMap returns an empty block map whose index is sized for nodes
// distinct keys (see Memory's presizing).
func newBlockMap(nodes int) blockMap {
	bm := blockMap{free: -1}
	bm.index.presize(nodes)
	return bm
}

func (bm *blockMap) keyAt(j int32) *Key     { return &bm.keys[j>>chunkBits][j&chunkMask] }
func (bm *blockMap) holdAt(j int32) *uint32 { return &bm.hold[j>>chunkBits][j&chunkMask] }
func (bm *blockMap) src() keySrc            { return keySrc{bm: bm, kf: nodeKeyOf} }

// find returns the node of k, or -1.
func (bm *blockMap) find(k Key) int32 {
	j := bm.index.find(bm.src(), uint64(k))
	if j >= 0 && atomic.LoadUint32(bm.holdAt(j)) == 0 {
		return -1 // dormant
	}
	return j
}

// nodeFor returns the node of k, creating an empty one (no holder yet:
// the caller adds one at once) when k has none.
func (bm *blockMap) nodeFor(k Key) int32 {
	size := len(bm.index.slots)
	j, at := bm.index.findOrSlot(bm.src(), uint64(k))
	if len(bm.index.slots) != size {
		bm.refree() // the index grew, without the dormant nodes
	}
	if j >= 0 {
		if *bm.holdAt(j) == 0 {
			bm.dormant--
		}
		return j
	}
	if bm.free >= 0 {
		j = bm.free
		bm.free = int32(*bm.keyAt(j))
	} else {
		if int(bm.n)>>chunkBits == len(bm.keys) {
			bm.keys = append(bm.keys, make([]Key, chunkSize))
			bm.hold = append(bm.hold, newSlots(chunkSize)) // read (holds) before written (set)
		}
		j = bm.n
		bm.n++
	}
	*bm.keyAt(j) = k
	bm.index.put(at, j)
	return j
}

// full reports whether every node index a table can hold is in use.
func (bm *blockMap) full() bool { return bm.free < 0 && bm.n > maxIndex }

// release makes node j, which has no holder left, dormant; once dormant
// nodes are as many as live ones, the index is rebuilt without them (at
// the same size: sequential reads, amortised over as many releases).
func (bm *blockMap) release(j int32) {
	*bm.holdAt(j) = 0
	bm.dormant++
	if live := bm.index.n - bm.dormant; bm.dormant > max(live, 64) {
		bm.index.rebuild(bm.src(), len(bm.index.slots))
		bm.refree()
	}
}

// refree puts every node without a holder on the free list, after the
// index was rebuilt from the live ones.
func (bm *blockMap) refree() {
	bm.free, bm.dormant = -1, 0
	for j := bm.n - 1; j >= 0; j-- {
		if *bm.holdAt(j) == 0 {
			*bm.keyAt(j) = Key(bm.free)
			bm.free = j
		}
	}
}

// holds reports whether slot holds node j.
func (bm *blockMap) holds(j int32, slot uint32) bool {
	w := *bm.holdAt(j)
	if w&hSpill == 0 {
		return w != 0 && holderSlot(w) == slot
	}
	sp := &bm.spills[w&^hSpill]
	if sp.set != nil {
		return sp.set.has(slot)
	}
	_, ok := listFind(sp.list, slot)
	return ok
}

// set makes slot hold node j in tierBits (0 = not at all; the node is
// released when that was its last holder). A holder keeps its hit flag
// when keepHit is set, else the flag is cleared (the entry was just placed
// at its LRU head: the second chance starts over).
func (bm *blockMap) set(j int32, slot uint32, tierBits uint32, keepHit bool) {
	tierBits &= hTiers
	p := bm.holdAt(j)
	w := *p
	if w&hSpill == 0 {
		switch {
		case w == 0:
			if tierBits != 0 {
				*p = holderWord(slot, tierBits)
			}
		case holderSlot(w) == slot && tierBits == 0:
			bm.release(j)
		case holderSlot(w) == slot:
			*p = holderWord(slot, tierBits) | w&hHit&keepMask(keepHit)
		case tierBits != 0: // a second holder: spill into a list
			nw := holderWord(slot, tierBits)
			list := []uint32{w, nw}
			if slot < holderSlot(w) {
				list[0], list[1] = nw, w
			}
			*p = hSpill | uint32(bm.newSpill(spill{list: list}))
		}
		return
	}
	si := int32(w &^ hSpill)
	sp := &bm.spills[si]
	if sp.set != nil {
		sp.set.put(slot, tierBits, keepHit)
		if sp.set.n <= listMax/2 {
			sp.list, sp.set = sp.set.toList(), nil
		}
	} else {
		i, ok := listFind(sp.list, slot)
		switch {
		case ok && tierBits == 0:
			sp.list = append(sp.list[:i], sp.list[i+1:]...)
		case ok:
			sp.list[i] = holderWord(slot, tierBits) | sp.list[i]&hHit&keepMask(keepHit)
		case tierBits != 0:
			sp.list = append(sp.list, 0)
			copy(sp.list[i+1:], sp.list[i:])
			sp.list[i] = holderWord(slot, tierBits)
			if len(sp.list) > listMax && preferSet(len(sp.list), int(holderSlot(sp.list[len(sp.list)-1]))/64+1) {
				sp.set, sp.list = listToSet(sp.list), nil
			}
		}
	}
	if sp.set == nil && len(sp.list) <= 1 {
		// Back to one holder inline (or none, when the list emptied).
		if len(sp.list) == 1 {
			*p = sp.list[0]
		} else {
			*p = 0
		}
		bm.freeSpillAt(si)
		if *p == 0 {
			bm.release(j)
		}
	}
}

func keepMask(keep bool) uint32 {
	if keep {
		return ^uint32(0)
	}
	return 0
}

// takeHit reports whether slot's hold of node j was matched by a lookup
// since it was last placed, and clears the flag.
func (bm *blockMap) takeHit(j int32, slot uint32) bool {
	p := bm.holdAt(j)
	w := *p
	if w&hSpill == 0 {
		if w&hHit == 0 || holderSlot(w) != slot {
			return false
		}
		*p = w &^ hHit
		return true
	}
	sp := &bm.spills[w&^hSpill]
	if sp.set != nil {
		return sp.set.takeHit(slot)
	}
	i, ok := listFind(sp.list, slot)
	if !ok || sp.list[i]&hHit == 0 {
		return false
	}
	sp.list[i] &^= hHit
	return true
}

func (bm *blockMap) newSpill(sp spill) int32 {
	if n := len(bm.freeSpill); n > 0 {
		i := bm.freeSpill[n-1]
		bm.freeSpill = bm.freeSpill[:n-1]
		bm.spills[i] = sp
		return i
	}
	bm.spills = append(bm.spills, sp)
	return int32(len(bm.spills) - 1)
}

func (bm *blockMap) freeSpillAt(i int32) {
	bm.spills[i] = spill{}
	bm.freeSpill = append(bm.freeSpill, i)
}

// listFind returns where slot is (or would be inserted) in a sorted
// holder list.
func listFind(list []uint32, slot uint32) (int, bool) {
	for i, w := range list {
		switch s := holderSlot(w); {
		case s == slot:
			return i, true
		case s > slot:
			return i, false
		}
	}
	return len(list), false
}

// preferSet reports whether n holders over slots below 64*words are
// better kept as bitsets than as a list: bitsets cost 8 bytes per word per
// tier plus the hit bitset, a list 4 bytes per holder but a lookup merges
// it entry by entry. Bitsets win once they cost at most 16 bytes per
// holder, so a large fleet's sparse holder sets stay lists.
func preferSet(n, words int) bool { return (tiers.Count+1)*8*words <= 16*n }

func listToSet(list []uint32) *holderSet {
	hs := &holderSet{}
	for _, w := range list {
		hs.put(holderSlot(w), w&hTiers, true)
		if w&hHit != 0 {
			hs.hit[holderSlot(w)/64] |= 1 << (holderSlot(w) % 64)
		}
	}
	return hs
}

func (hs *holderSet) toList() []uint32 {
	list := make([]uint32, 0, hs.n)
	top := hs.lv[tiers.Count-1]
	for wi, word := range top {
		for word != 0 {
			b := bits.TrailingZeros64(word)
			word &= word - 1
			slot := uint32(wi*64 + b)
			// The set keeps levels, not tier sets: the fastest tier stands
			// for the holder, which is all a lookup reads.
			t := uint32(0)
			for hs.lv[t][wi]&(1<<b) == 0 {
				t++
			}
			w := holderWord(slot, 1<<t)
			if hs.hit[wi]&(1<<b) != 0 {
				w |= hHit
			}
			list = append(list, w)
		}
	}
	return list
}

func (hs *holderSet) has(slot uint32) bool {
	wi := int(slot / 64)
	return wi < hs.words && hs.lv[tiers.Count-1][wi]&(1<<(slot%64)) != 0
}

// put sets slot's level from tierBits (0 removes it).
func (hs *holderSet) put(slot uint32, tierBits uint32, keepHit bool) {
	wi, bit := int(slot/64), uint64(1)<<(slot%64)
	if wi >= hs.words {
		if tierBits == 0 {
			return
		}
		hs.grow(wi + 1)
	}
	was := hs.lv[tiers.Count-1][wi]&bit != 0
	if was && hs.lv[0][wi]&bit == 0 {
		hs.slow--
	}
	lv := int(level(tierBits))
	if tierBits != 0 && lv > 0 {
		hs.slow++
	}
	for t := range tiers.Count {
		if t >= lv {
			hs.lv[t][wi] |= bit
		} else {
			hs.lv[t][wi] &^= bit
		}
	}
	if !keepHit || tierBits == 0 {
		hs.hit[wi] &^= bit
	}
	switch {
	case !was && tierBits != 0:
		hs.n++
	case was && tierBits == 0:
		hs.n--
	}
}

func (hs *holderSet) grow(words int) {
	words = max(words, 2*hs.words)
	// The tier bitsets and the hit bitset share one backing array: one
	// allocation per growth where there were tiers.Count+1 (a block
	// turning into a set when its ninth holder arrives paid five).
	buf := make([]uint64, (tiers.Count+1)*words)
	for t := range hs.lv {
		lv := buf[t*words : (t+1)*words : (t+1)*words]
		copy(lv, hs.lv[t])
		hs.lv[t] = lv
	}
	hit := buf[tiers.Count*words:]
	copy(hit, hs.hit)
	hs.hit = hit
	hs.words = words
}

func (hs *holderSet) takeHit(slot uint32) bool {
	wi, bit := int(slot/64), uint64(1)<<(slot%64)
	if wi >= hs.words || hs.hit[wi]&bit == 0 {
		return false
	}
	hs.hit[wi] &^= bit
	return true
}

// markHit sets the hit flag of a holder word a lookup matched, writing only
// when it is not yet set so that hot nodes do not bounce cache lines
// between readers.
func markHit(p *uint32) {
	if atomic.LoadUint32(p)&hHit == 0 {
		atomic.OrUint32(p, hHit)
	}
}

// markHits sets hit bits for the slots in alive (a lookup's matched
// holders of a set node).
func (hs *holderSet) markHits(alive []uint64) {
	for wi := range min(len(alive), hs.words) {
		if a := alive[wi]; a != 0 && atomic.LoadUint64(&hs.hit[wi])&a != a {
			atomic.OrUint64(&hs.hit[wi], a)
		}
	}
}
