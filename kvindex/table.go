package kvindex

import (
	"math/bits"

	"github.com/kvrouter/kvrouter/internal/fmix"
)

// chunkBits sizes the memory backend's slab chunks (1024 entries, 32 KiB):
// a slab grows a chunk at a time, so no growth ever copies entries and the
// unused tail is at most one chunk per instance.
const (
	chunkBits = 10
	chunkSize = 1 << chunkBits
	chunkMask = chunkSize - 1
)

// entry is one (engine block, instance) placement: 28 bytes, no pointers,
// so a million of them are 28 MB the garbage collector never scans. The
// router key lives in the global block node (node), not here.
type entry struct {
	hashLo uint32 // engine block hash, low and high halves: two uint32s keep
	hashHi uint32 // the entry 4-byte aligned (28 bytes, not 32)
	node   int32  // the block's node in the global block map
	prev   int32  // LRU neighbour toward the head (more recent); -1 none
	next   int32  // LRU neighbour toward the tail; -1 none; free-list link when free
	stamp  uint32 // clock (clockUnit) when last placed at the LRU head
	meta   uint32 // tier bits (low byte) and flags
}

func (e *entry) ehash() uint64 { return uint64(e.hashHi)<<32 | uint64(e.hashLo) }

const (
	tierMask = 0xff
	// flagLive marks a slot in use (free slots have it clear).
	flagLive = 1 << 8
	// flagDup marks an entry whose key another entry of the instance shares
	// (two engine hashes for one router key): the block's holder record is
	// then the OR of their tier bits.
	flagDup = 1 << 10
)

// slab stores entries in fixed chunks addressed by int32 indices.
type slab struct {
	chunks [][]entry
	n      int32 // slots handed out so far (high-water mark)
	free   int32 // head of the free list, -1 when empty
}

func (s *slab) at(i int32) *entry { return &s.chunks[i>>chunkBits][i&chunkMask] }

// full reports whether the slab has handed out every index a table can hold.
func (s *slab) full() bool { return s.free < 0 && s.n > maxIndex }

func (s *slab) alloc() int32 {
	if s.free >= 0 {
		i := s.free
		s.free = s.at(i).next
		return i
	}
	if int(s.n)>>chunkBits == len(s.chunks) {
		s.chunks = append(s.chunks, make([]entry, chunkSize))
	}
	i := s.n
	s.n++
	return i
}

func (s *slab) release(i int32) {
	e := s.at(i)
	*e = entry{next: s.free, prev: -1}
	s.free = i
}

// table is an open-addressing hash index from a 64-bit key to int32
// indices into a store (an instance's slab, indexed by engine hash or by
// block node; or the global block map's nodes, indexed by router key), with
// linear probing. Each slot is one uint32: a 6-bit fingerprint of the key
// above the index plus one (0 = empty), so a probe reads one cache line and
// rarely touches the store, and an insert writes that same line. 4 bytes
// per slot at a load factor of 3/8..3/4: 5.3-10.7 bytes per indexed item.
// Several slots may hold the same key (byNode, when two engine hashes of
// one instance map to one router key).
//
// Removal leaves a tombstone (unless the slot after it is empty: then it
// and the tombstones just before it are emptied, since no probe run
// passes an empty slot): shifting the rest of the probe run back
// would read each moved item's key from the store, at random (with 6
// fingerprint bits a slot does not say where its item's home is). Items
// and tombstones together stay under 3/4 of the slots; an insert that
// would pass it rebuilds the table, at the same size when tombstones are
// at least half the items, so probe runs stay those of a 3/4-full table.
type table struct {
	slots []uint32
	n     int    // items
	tombs int    // tombstones
	sink  uint32 // keeps grow's grouped loads from being optimised away
}

// Slot layout: fingerprint in the top fpBits, index+1 below.
const (
	fpBits   = 6
	idxBits  = 32 - fpBits
	idxMask  = 1<<idxBits - 1
	maxIndex = idxMask - 2 // highest index a table can hold
	tomb     = ^uint32(0)  // a removed item's slot (index+1 = idxMask is never used)
)

func slotIdx(s uint32) int32 { return int32(s&idxMask) - 1 }

// home returns the home slot of k in a table of size n, and its
// fingerprint already in slot position.
func home(k uint64, n int) (int, uint32) {
	h := fmix.Mix64(k) // engine hashes are not always uniform
	hi, _ := bits.Mul64(h, uint64(n))
	return int(hi), uint32(h) << idxBits
}

// keyFunc selects what a table indexes: slab entries by engine hash or by
// block node, or block-map nodes by router key. An enum switched on rather
// than a func value, so that the probe loops stay free of indirect calls.
type keyFunc uint8

const (
	byHashOf keyFunc = iota
	byNodeOf
	nodeKeyOf
)

// keySrc is a table's store: the slab (byHashOf, byNodeOf) or the block
// map (nodeKeyOf).
type keySrc struct {
	s  *slab
	bm *blockMap
	kf keyFunc
}

func (ks keySrc) of(j int32) uint64 {
	switch ks.kf {
	case byHashOf:
		return ks.s.at(j).ehash()
	case byNodeOf:
		return uint64(ks.s.at(j).node)
	default:
		return uint64(*ks.bm.keyAt(j))
	}
}

// live reports whether index j holds an item to index (table growth
// re-inserts from the store, in store order).
func (ks keySrc) live(j int32) bool {
	if ks.kf == nodeKeyOf {
		return *ks.bm.holdAt(j) != 0
	}
	return ks.s.at(j).meta&flagLive != 0
}

// highWater is one past the highest index the store has handed out.
func (ks keySrc) highWater() int32 {
	if ks.kf == nodeKeyOf {
		return ks.bm.n
	}
	return ks.s.n
}

// find returns the index of the first item with key k, or -1.
func (t *table) find(ks keySrc, k uint64) int32 {
	j, _ := t.findAt(ks, k)
	return j
}

// findAt is find that also returns the slot the item was found in (-1
// with it), for removeAt: a removal found by key then probes once, not
// twice.
func (t *table) findAt(ks keySrc, k uint64) (int32, int) {
	n := len(t.slots)
	if n == 0 {
		return -1, -1
	}
	i, f := home(k, n)
	for {
		c := t.slots[i]
		if c == 0 {
			return -1, -1
		}
		if c&^idxMask == f && c != tomb {
			if j := slotIdx(c); ks.of(j) == k {
				return j, i
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// makeRoom rebuilds the table before an insert that would take items and
// tombstones past 3/4 of the slots: at twice the size, or at the same size
// when tombstones are half the items or more.
func (t *table) makeRoom(ks keySrc) {
	if (t.n+t.tombs+1)*4 <= len(t.slots)*3 {
		return
	}
	if t.tombs*2 >= t.n && len(t.slots) > 0 {
		t.rebuild(ks, len(t.slots))
		return
	}
	t.grow(ks)
}

// touch loads the home slots of keys, independent loads whose cache
// misses overlap, ahead of probing them one by one.
func touch[K ~uint64](t *table, keys []K) {
	n := len(t.slots)
	if n == 0 {
		return
	}
	var x uint32
	for _, k := range keys {
		i, _ := home(uint64(k), n)
		x |= t.slots[i]
	}
	t.sink ^= x
}

// presize makes an empty table room for n items without growing.
func (t *table) presize(n int) { t.slots = newSlots(slotsFor(n)) }

// slotsFor is the smallest table size (a power of two, at least 16) that
// holds n items at most 3/4 full.
func slotsFor(n int) int {
	size := 16
	for size*3 < n*4 {
		size *= 2
	}
	return size
}

// newSlots returns size empty slots (a table's, or a block map chunk's
// holder words), every page of them written once.
// A fresh allocation can be memory the kernel has not mapped yet (a
// process's first fill: its start-up), and a table's first access to a
// page is often a read (touch, rebuild's group loads, a probe): the kernel
// maps its shared zero page, then the first put faults again to replace
// it, a copy-on-write fault that also flushes the page's TLB entry on
// every CPU the process has run on. Writing one word per page here takes
// one plain fault per page, in address order; on memory the heap reuses
// (already mapped and zeroed by the allocator) it is one store per 4 KiB.
func newSlots(size int) []uint32 {
	s := make([]uint32, size)
	for i := 0; i < len(s); i += pageSlots {
		s[i] = 0
	}
	if len(s) > 0 {
		s[len(s)-1] = 0 // the last page, when s does not start on one
	}
	return s
}

// pageSlots is how many slots a 4 KiB page holds.
const pageSlots = 4096 / 4

// slotRef is where findOrSlot found room for a key.
type slotRef struct {
	i int
	f uint32
}

// findOrSlot returns the index of the item with key k, or -1 and the empty
// slot where k goes: put fills it, provided nothing else changed the table
// meanwhile. One probe where find then insert would take two; it grows the
// table first when one more item would pass 3/4 load. For tables whose
// keys are unique (byHash, the block map's index).
func (t *table) findOrSlot(ks keySrc, k uint64) (int32, slotRef) {
	t.makeRoom(ks)
	n := len(t.slots)
	i, f := home(k, n)
	free := -1 // the first tombstone passed: where k goes when absent
	for {
		c := t.slots[i]
		if c == 0 {
			if free < 0 {
				free = i
			}
			return -1, slotRef{free, f}
		}
		if c == tomb {
			if free < 0 {
				free = i
			}
		} else if c&^idxMask == f {
			if j := slotIdx(c); ks.of(j) == k {
				return j, slotRef{}
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// put indexes j at the slot findOrSlot returned.
func (t *table) put(at slotRef, j int32) {
	if t.slots[at.i] == tomb {
		t.tombs--
	}
	t.slots[at.i] = at.f | uint32(j+1)
	t.n++
}

// insert adds index j under key k. It returns the index of an item
// already indexed under k, or -1: the caller marks duplicates.
func (t *table) insert(ks keySrc, j int32, k uint64) int32 {
	t.makeRoom(ks)
	n := len(t.slots)
	i, f := home(k, n)
	dup := int32(-1)
	free := -1
	for c := t.slots[i]; c != 0; c = t.slots[i] {
		switch {
		case c == tomb:
			if free < 0 {
				free = i
			}
		case dup < 0 && c&^idxMask == f && ks.of(slotIdx(c)) == k:
			dup = slotIdx(c)
		}
		if i++; i == n {
			i = 0
		}
	}
	if free < 0 {
		free = i
	}
	t.put(slotRef{free, f}, j)
	return dup
}

func (t *table) grow(ks keySrc) { t.rebuild(ks, max(2*len(t.slots), 16)) }

// build indexes ks's live items, n of them, in a table made for them: the
// size growing from empty would have reached (at most 3/4 full with one
// more), not grow's next size, which only fits a table that already
// holds them all (rebuild would probe for a free slot forever).
func (t *table) build(ks keySrc, n int) { t.rebuild(ks, slotsFor(n+1)) }

// rebuild indexes the store's live items afresh in size slots. At the
// same size it clears the slots in place: the items are re-read from the
// store, never from the old slots, and a fresh array would be pages the
// kernel maps anew (a fault per 4 KiB) while the old one waits for the
// collector.
func (t *table) rebuild(ks keySrc, size int) {
	if size == len(t.slots) {
		clear(t.slots)
	} else {
		t.slots = newSlots(size)
	}
	t.n, t.tombs = 0, 0
	// Re-insert from the store, in store order: reading it sequentially is
	// much cheaper than following the old table's indices at random. The
	// slots are random, so items go in groups: the homes of a group are
	// loaded first, independent loads whose cache misses overlap, then the
	// group is placed.
	const group = 16
	var homes [group]int
	var vals [group]uint32
	var sink uint32
	hw := ks.highWater()
	for j := int32(0); j < hw; {
		g := 0
		for ; g < group && j < hw; j++ {
			if !ks.live(j) {
				continue
			}
			h, f := home(ks.of(j), size)
			homes[g], vals[g] = h, f|uint32(j+1)
			sink |= t.slots[h]
			g++
		}
		for x := range g {
			p := homes[x]
			for t.slots[p] != 0 {
				if p++; p == size {
					p = 0
				}
			}
			t.slots[p] = vals[x]
			t.n++
		}
	}
	t.sink ^= sink
}

// remove drops index j (indexed under k): see removeAt.
func (t *table) remove(j int32, k uint64) {
	n := len(t.slots)
	if n == 0 {
		return
	}
	i, _ := home(k, n)
	for c := t.slots[i]; c != 0; c = t.slots[i] {
		if c != tomb && slotIdx(c) == j {
			t.removeAt(i)
			return
		}
		if i++; i == n {
			i = 0
		}
	}
}

// removeAt drops the item in slot i (as findAt returned it, the table
// unchanged since), leaving a tombstone; at the end of a probe run (the
// next slot empty), where no probe passes, the slot is emptied instead,
// and so are the tombstones just before it.
func (t *table) removeAt(i int) {
	n := len(t.slots)
	t.n--
	next := i + 1
	if next == n {
		next = 0
	}
	if t.slots[next] != 0 {
		t.slots[i] = tomb
		t.tombs++
		return
	}
	// A table is never all tombstones (at most 3/4 full).
	for t.slots[i] = 0; ; t.slots[i] = 0 {
		if i == 0 {
			i = n
		}
		i--
		if t.slots[i] != tomb {
			return
		}
		t.tombs--
	}
}

func (t *table) reset() { *t = table{} }
