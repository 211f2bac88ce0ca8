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

// entry is one (engine block, instance) placement: 32 bytes, no pointers,
// so a million of them are 32 MB the garbage collector never scans.
type entry struct {
	key   Key    // router block key
	ehash uint64 // engine block hash
	prev  int32  // LRU neighbour toward the head (more recent); -1 none
	next  int32  // LRU neighbour toward the tail; -1 none; free-list link when free
	stamp uint32 // clock (clockUnit) when last placed at the LRU head
	meta  uint32 // tier bits (low byte) and flags; read atomically, see flagHit
}

const (
	tierMask = 0xff
	// flagLive marks a slot in use (free slots have it clear).
	flagLive = 1 << 8
	// flagHit is set (atomically, under the read lock) when a lookup matched
	// the entry since it was last placed at the LRU head: eviction gives it
	// a second chance instead of taking the write lock on every lookup.
	flagHit = 1 << 9
	// flagDup marks an entry whose key another entry of the instance shares
	// (two engine hashes for one router key); lookups then OR them together.
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

// table is an open-addressing hash index from a 64-bit key (an entry's
// router key or engine hash) to slab indices, with linear probing and a
// one-byte fingerprint per slot so that probing rarely touches the slab.
// 5 bytes per slot at a load factor of 1/2..3/4: 7-10 bytes per entry.
// Several slots may hold the same key (byKey, when two engine hashes map
// to one router key).
type table struct {
	idx []int32
	fp  []uint8 // 0 = empty slot
	n   int
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

// keyFunc selects what a table indexes entries by: byKeyOf (the router
// key) or byHashOf (the engine hash). A bool rather than a func value, so
// that the probe loops stay free of indirect calls.
type keyFunc bool

const (
	byKeyOf  keyFunc = false
	byHashOf keyFunc = true
)

func (kf keyFunc) of(e *entry) uint64 {
	if kf {
		return e.ehash
	}
	return uint64(e.key)
}

// find returns the slab index of the first entry with key k, or -1.
func (t *table) find(s *slab, k uint64, kf keyFunc) int32 {
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
			if j := t.idx[i]; kf.of(s.at(j)) == k {
				return j
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// insert adds slab index j under key k. It returns the slab index of an
// entry already indexed under k, or -1: the caller marks duplicates.
func (t *table) insert(s *slab, j int32, k uint64, kf keyFunc) int32 {
	if (t.n+1)*4 > len(t.fp)*3 {
		t.grow(s, kf)
	}
	n := len(t.fp)
	i, f := home(k, n)
	dup := int32(-1)
	for t.fp[i] != 0 {
		if dup < 0 && t.fp[i] == f && kf.of(s.at(t.idx[i])) == k {
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

func (t *table) grow(s *slab, kf keyFunc) {
	size := 2 * len(t.fp)
	if size < 16 {
		size = 16
	}
	t.idx, t.fp, t.n = make([]int32, size), make([]uint8, size), 0
	// Re-insert from the slab, in slab order: reading the entries
	// sequentially is much cheaper than following the old table's indices
	// into the slab at random.
	for c, chunk := range s.chunks {
		for o := range chunk {
			j := int32(c<<chunkBits | o)
			if j >= s.n {
				return
			}
			e := &chunk[o]
			if e.meta&flagLive == 0 {
				continue
			}
			p, f := home(kf.of(e), size)
			for t.fp[p] != 0 {
				if p++; p == size {
					p = 0
				}
			}
			t.fp[p], t.idx[p] = f, j
			t.n++
		}
	}
}

// remove drops slab index j (indexed under k) and closes the gap by
// shifting later members of the probe run back (no tombstones, so probe
// runs never lengthen with churn).
func (t *table) remove(s *slab, j int32, k uint64, kf keyFunc) {
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
			h, _ := home(kf.of(s.at(t.idx[p])), n)
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
