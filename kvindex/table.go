package kvindex

import "math/bits"

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
// linear probing and a one-byte fingerprint per slot so that probing rarely
// touches the store. 5 bytes per slot at a load factor of 3/8..3/4: 7-13
// bytes per indexed item. Several slots may hold the same key (byNode, when
// two engine hashes of one instance map to one router key).
type table struct {
	idx  []int32
	fp   []uint8 // 0 = empty slot
	n    int
	sink uint8 // keeps grow's grouped loads from being optimised away
}

// mix is a 64-bit finaliser (murmur3 fmix64): engine hashes are not always
// uniform (tests and some engines use small integers).
func mix(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}

// home returns the home slot and fingerprint of k in a table of size n.
func home(k uint64, n int) (int, uint8) {
	h := mix(k)
	hi, _ := bits.Mul64(h, uint64(n))
	f := uint8(h)
	if f == 0 {
		f = 1
	}
	return int(hi), f
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

// find returns the slab index of the first entry with key k, or -1.
func (t *table) find(ks keySrc, k uint64) int32 {
	n := len(t.fp)
	if n == 0 {
		return -1
	}
	i, f := home(k, n)
	for {
		c := t.fp[i]
		if c == 0 {
			return -1
		}
		if c == f {
			if j := t.idx[i]; ks.of(j) == k {
				return j
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// slotRef is where findOrSlot found room for a key.
type slotRef struct {
	i int
	f uint8
}

// findOrSlot returns the index of the item with key k, or -1 and the empty
// slot where k goes: put fills it, provided nothing else changed the table
// meanwhile. One probe where find then insert would take two; it grows the
// table first when one more item would pass 3/4 load. For tables whose
// keys are unique (byHash, the block map's index).
func (t *table) findOrSlot(ks keySrc, k uint64) (int32, slotRef) {
	if (t.n+1)*4 > len(t.fp)*3 {
		t.grow(ks)
	}
	n := len(t.fp)
	i, f := home(k, n)
	for {
		c := t.fp[i]
		if c == 0 {
			return -1, slotRef{i, f}
		}
		if c == f {
			if j := t.idx[i]; ks.of(j) == k {
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
	t.fp[at.i], t.idx[at.i] = at.f, j
	t.n++
}

// insert adds slab index j under key k. It returns the slab index of an
// entry already indexed under k, or -1: the caller marks duplicates.
func (t *table) insert(ks keySrc, j int32, k uint64) int32 {
	if (t.n+1)*4 > len(t.fp)*3 {
		t.grow(ks)
	}
	n := len(t.fp)
	i, f := home(k, n)
	dup := int32(-1)
	for t.fp[i] != 0 {
		if dup < 0 && t.fp[i] == f && ks.of(t.idx[i]) == k {
			dup = t.idx[i]
		}
		if i++; i == n {
			i = 0
		}
	}
	t.fp[i], t.idx[i] = f, j
	t.n++
	return dup
}

func (t *table) grow(ks keySrc) {
	size := 2 * len(t.fp)
	if size < 16 {
		size = 16
	}
	t.idx, t.fp, t.n = make([]int32, size), make([]uint8, size), 0
	// Re-insert from the store, in store order: reading it sequentially is
	// much cheaper than following the old table's indices at random. The
	// slots are random, so items go in groups: the homes of a group are
	// loaded first, independent loads whose cache misses overlap, then the
	// group is placed.
	const group = 16
	var homes [group]int
	var fps [group]uint8
	var js [group]int32
	var sink uint8
	hw := ks.highWater()
	for j := int32(0); j < hw; {
		g := 0
		for ; g < group && j < hw; j++ {
			if !ks.live(j) {
				continue
			}
			homes[g], fps[g] = home(ks.of(j), size)
			sink |= t.fp[homes[g]]
			js[g] = j
			g++
		}
		for x := range g {
			p := homes[x]
			for t.fp[p] != 0 {
				if p++; p == size {
					p = 0
				}
			}
			t.fp[p], t.idx[p] = fps[x], js[x]
			t.n++
		}
	}
	t.sink ^= sink
}

// remove drops slab index j (indexed under k) and closes the gap by
// shifting later members of the probe run back (no tombstones, so probe
// runs never lengthen with churn).
func (t *table) remove(ks keySrc, j int32, k uint64) {
	n := len(t.fp)
	if n == 0 {
		return
	}
	i, _ := home(k, n)
	for t.fp[i] != 0 && t.idx[i] != j {
		if i++; i == n {
			i = 0
		}
	}
	if t.fp[i] == 0 {
		return // not indexed: nothing to drop
	}
	t.n--
	for {
		t.fp[i] = 0
		p := i
		for {
			if p++; p == n {
				p = 0
			}
			if t.fp[p] == 0 {
				return
			}
			h, _ := home(ks.of(t.idx[p]), n)
			// The member at p may move to the gap at i unless its home lies
			// cyclically in (i, p].
			if i <= p {
				if h > i && h <= p {
					continue
				}
			} else if h > i || h <= p {
				continue
			}
			break
		}
		t.fp[i], t.idx[i] = t.fp[p], t.idx[p]
		i = p
	}
}

func (t *table) reset() { *t = table{} }

// bytes is the table's heap footprint.
func (t *table) bytes() int { return 5 * len(t.fp) }
