// Package spechold keeps speculative holds: block keys counted as held by
// an instance until an expiry, while the instance's cache epoch stays the
// one they were made in. A router's own speculative overlay is a Chains
// (a record per run of a prompt's chain, chains.go); the holds its peer
// replicas announce (replicasync) are a Set (an entry per block). Both
// are bounded in (block, instance) entries: insertions go into a FIFO
// ring whose capacity is the bound, so the oldest make way, and since
// holds mostly share one lifetime, insertion order is expiry order and
// the ring also finds the expired.
package spechold

import (
	"sync"

	"github.com/kvrouter/kvrouter/internal/fmix"
)

// Set is a bounded set of holds of keys K (block keys: kvindex.Key). Safe
// for concurrent use. Times are unix nanoseconds, given by the caller
// (simulations run on virtual clocks).
//
// A long prompt adds, reads and drops thousands of keys per decision, and
// a fleet's holds in flight outgrow the CPU caches as the fleet grows
// (2^18 entries, a 2^19-slot table), so each key's visit is a cache miss.
// The holds are an open-addressing table whose slot holds a key's first
// hold inline (no allocation for the common single holder; further holders
// go to a list beside it), and every batch of keys first loads its keys'
// home slots together, independent loads whose misses overlap, before
// visiting them one by one. A hold names its instance by a small id, not
// its name (see ids), so that a slot is 32 bytes: two to a cache line,
// none across two lines (a 2^19-slot table is 16 MB).
type Set[K ~uint64] struct {
	mu    sync.RWMutex // guards everything below
	tab   []slot       // power-of-two size; nil until the first Add
	live  int          // live slots
	lists [][]hold     // the holds after a slot's first, by first.more-1
	free  []int32      // unused lists (indices), their capacity kept
	ring  []ref[K]     // FIFO of insertions, capacity = the bound
	head  int          // oldest entry in ring
	n     int          // live ring entries
	ids   ids          // instance names <-> the ids holds and ring name them by
	sink  uint32       // keeps touch's loads from being optimised away
}

// hold is an instance's hold of a key. more is used in a slot's first
// hold only (a list's holds leave it 0): it shares the padding a 4-byte
// inst leaves, so that a slot is the key and one hold, 32 bytes.
type hold struct {
	exp   int64
	epoch uint64
	inst  uint32 // the instance's id (ids); 0 in an empty slot
	more  int32  // 1 + the index of the rest's list in Set.lists; 0: none
}

// slot is one key's holds, in their order: first, then lists[more-1]. It
// is live when first.inst != 0.
type slot struct {
	key   uint64
	first hold
}

// ref is a ring entry: key held by instance id inst until exp.
type ref[K ~uint64] struct {
	key  K
	exp  int64
	inst uint32
}

// New returns an empty Set holding at most capacity (key, instance)
// entries (0: holds nothing).
func New[K ~uint64](capacity int) *Set[K] {
	return &Set[K]{ring: make([]ref[K], max(capacity, 0))}
}

// Cap is the bound.
func (s *Set[K]) Cap() int { return len(s.ring) }

// Len is the number of entries held, expired ones included until the
// next Add sweeps them.
func (s *Set[K]) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.n
}

// Add records keys as held by inst until exp in cache epoch epoch (a key
// already held by inst keeps the later expiry and takes the new epoch),
// after dropping the entries expired at now. It returns how many
// unexpired entries made way for these.
func (s *Set[K]) Add(keys []K, inst string, exp int64, epoch uint64, now int64) (evicted int) {
	if len(s.ring) == 0 || len(keys) == 0 {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// inst's id, pinned while this Add pops entries (its own among them)
	// and pushes its own.
	id := s.ids.intern(inst)
	s.ids.refs[id]++
	defer s.ids.release(id)
	// The ring entries this Add pops (expired, or making way) and its
	// keys, loaded ahead.
	s.touchRing(len(keys) + max(s.n+len(keys)-len(s.ring), 0))
	for s.n > 0 && s.ring[s.head].exp <= now {
		s.popLocked()
	}
	s.touch(keys)
	for _, k := range keys {
		if s.n == len(s.ring) {
			s.popLocked()
			evicted++
		}
		held := exp
		if i := s.find(uint64(k)); i < 0 {
			s.insert(uint64(k), hold{inst: id, exp: exp, epoch: epoch})
		} else if h := s.holdOf(&s.tab[i], id); h != nil {
			h.exp, h.epoch = max(h.exp, exp), epoch
			held = h.exp
		} else {
			s.push(&s.tab[i], hold{inst: id, exp: exp, epoch: epoch})
		}
		s.ring[(s.head+s.n)%len(s.ring)] = ref[K]{key: k, inst: id, exp: held}
		s.ids.refs[id]++
		s.n++
	}
	return evicted
}

// popLocked drops the oldest ring entry and, unless a later Add refreshed
// it (its expiry differs), its hold.
func (s *Set[K]) popLocked() {
	r := s.ring[s.head]
	s.ring[s.head] = ref[K]{}
	s.head = (s.head + 1) % len(s.ring)
	s.n--
	if i := s.find(uint64(r.key)); i >= 0 {
		s.dropAt(i, func(h *hold) bool { return h.inst == r.inst && h.exp == r.exp })
	}
	s.ids.release(r.inst)
}

// dropAt removes the first of slot i's holds that match (the last takes
// its place), and the slot when that was its last.
func (s *Set[K]) dropAt(i int, match func(*hold) bool) {
	sl := &s.tab[i]
	c := s.count(sl)
	for j := 0; j < c; j++ {
		if !match(s.at(sl, j)) {
			continue
		}
		if c == 1 {
			s.remove(i)
			return
		}
		last := s.at(sl, c-1)
		h := s.at(sl, j)
		h.exp, h.epoch, h.inst = last.exp, last.epoch, last.inst
		l := &s.lists[sl.first.more-1]
		(*l)[len(*l)-1] = hold{}
		*l = (*l)[:len(*l)-1]
		if cap(*l) > listKeep && len(*l) <= cap(*l)/4 {
			// Room for a crowd of holders that has left: given back
			// (the list reallocated, or dropped when empty).
			*l = append([]hold(nil), *l...)
		}
		if len(*l) == 0 {
			s.free = append(s.free, sl.first.more-1)
			sl.first.more = 0
		}
		return
	}
}

// listKeep is the most room for holds a holder list keeps beyond four
// times what it holds, in use or free: there are at most Cap/2 lists
// (each is a key's with two holders or more), so the lists' room stays
// within 2·Cap holds for the kept room plus four times the holds, next
// to the table's 2·Cap slots, whatever crowd of instances once held a
// key (replicas announce holds for any instance); lists of up to four
// (a block held by five instances) are reused without reallocating.
const listKeep = 4

// count is how many holds slot sl has (0 when it is not live).
func (s *Set[K]) count(sl *slot) int {
	switch {
	case sl.first.inst == 0:
		return 0
	case sl.first.more == 0:
		return 1
	default:
		return 1 + len(s.lists[sl.first.more-1])
	}
}

// at is hold j of a live slot.
func (s *Set[K]) at(sl *slot, j int) *hold {
	if j == 0 {
		return &sl.first
	}
	return &s.lists[sl.first.more-1][j-1]
}

// holdOf is instance id inst's hold in slot sl, or nil.
func (s *Set[K]) holdOf(sl *slot, inst uint32) *hold {
	for j, c := 0, s.count(sl); j < c; j++ {
		if h := s.at(sl, j); h.inst == inst {
			return h
		}
	}
	return nil
}

// push appends h to live slot sl's holds.
func (s *Set[K]) push(sl *slot, h hold) {
	if sl.first.more == 0 {
		if n := len(s.free); n > 0 {
			sl.first.more = s.free[n-1] + 1
			s.free = s.free[:n-1]
		} else {
			s.lists = append(s.lists, nil)
			sl.first.more = int32(len(s.lists))
		}
	}
	l := &s.lists[sl.first.more-1]
	*l = append(*l, h)
}

// home is key k's home slot in a table of size n (a power of two).
func home(k uint64, n int) int { return int(fmix.Mix64(k) & uint64(n-1)) }

// find returns the live slot of key k, or -1.
func (s *Set[K]) find(k uint64) int {
	n := len(s.tab)
	if n == 0 {
		return -1
	}
	for i := home(k, n); ; i = (i + 1) & (n - 1) {
		switch sl := &s.tab[i]; {
		case sl.first.inst == 0:
			return -1
		case sl.key == k:
			return i
		}
	}
}

// insert adds a live slot for key k (absent) with its first hold,
// doubling the table first when one more key would take it past half
// full: linear probing's runs stay short (~2.5 slots for a miss at 1/2).
// Keys never outnumber the ring's entries, so the table stops at the
// first power of two of twice the bound.
func (s *Set[K]) insert(k uint64, h hold) {
	if (s.live+1)*2 > len(s.tab) && len(s.tab) < 2*len(s.ring) {
		s.grow()
	}
	n := len(s.tab)
	i := home(k, n)
	for s.tab[i].first.inst != 0 {
		i = (i + 1) & (n - 1)
	}
	s.tab[i] = slot{key: k, first: h}
	s.live++
}

// remove empties live slot i (see backshift).
func (s *Set[K]) remove(i int) {
	backshift(s.tab, i, slotLive, slotKey)
	s.live--
}

// grow moves the live slots into a table of twice the size.
func (s *Set[K]) grow() { s.tab = rehash(s.tab, max(2*len(s.tab), 16), slotLive, slotKey) }

func slotLive(sl *slot) bool  { return sl.first.inst != 0 }
func slotKey(sl *slot) uint64 { return sl.key }

// backshift empties slot i of a linear-probing table, moving later slots
// of its probe run back where their home allows (no tombstones: the key
// is in the slot, so its home is known without another read).
func backshift[T any](tab []T, i int, live func(*T) bool, key func(*T) uint64) {
	n := len(tab)
	for j := (i + 1) & (n - 1); live(&tab[j]); j = (j + 1) & (n - 1) {
		// Slot j may move to i unless its home lies cyclically in (i, j].
		if h := home(key(&tab[j]), n); (j-h)&(n-1) >= (j-i)&(n-1) {
			tab[i] = tab[j]
			i = j
		}
	}
	var zero T
	tab[i] = zero
}

// rehash returns a table of size slots holding old's live ones.
func rehash[T any](old []T, size int, live func(*T) bool, key func(*T) uint64) []T {
	tab := make([]T, size)
	for i := range old {
		if sl := &old[i]; live(sl) {
			j := home(key(sl), size)
			for live(&tab[j]) {
				j = (j + 1) & (size - 1)
			}
			tab[j] = *sl
		}
	}
	return tab
}

// touch loads the home slots of keys, independent loads whose cache misses
// overlap, ahead of visiting them one by one.
func (s *Set[K]) touch(keys []K) {
	n := len(s.tab)
	if n == 0 {
		return
	}
	var x uint32
	for _, k := range keys {
		x |= s.tab[home(uint64(k), n)].first.inst
	}
	s.sink ^= x
}

// touchRing loads the home slots of the oldest m ring entries' keys.
func (s *Set[K]) touchRing(m int) {
	n := len(s.tab)
	if n == 0 {
		return
	}
	var x uint32
	for j := range min(m, s.n) {
		x |= s.tab[home(uint64(s.ring[(s.head+j)%len(s.ring)].key), n)].first.inst
	}
	s.sink ^= x
}

// extendAhead is how many keys Extend loads ahead of the one it visits:
// enough misses in flight to overlap (a core keeps ~10–20 outstanding),
// few enough that a chain ending early loads little it does not read.
const extendAhead = 16

// Extend returns how far inst's holds continue keys from block from: the
// largest k >= from such that keys[from:k] are all held by inst,
// unexpired at now, in epoch.
func (s *Set[K]) Extend(keys []K, from int, inst string, epoch uint64, now int64) int {
	if from >= len(keys) {
		return from
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	id := s.ids.byName[inst]
	if s.live == 0 || id == 0 {
		return from // no instance of that name holds anything
	}
	k := from
	var loaded uint32
	for ; k < len(keys); k++ {
		if (k-from)%extendAhead == 0 {
			loaded |= s.touchRO(keys[k:min(k+extendAhead, len(keys))])
		}
		i := s.find(uint64(keys[k]))
		if i < 0 {
			break
		}
		h := s.holdOf(&s.tab[i], id)
		if h == nil || h.exp <= now || h.epoch != epoch {
			break
		}
	}
	// Ids are below 2^31 (at most one per ring entry): this adds 0, and
	// keeps the loads.
	return k + int(loaded>>31)
}

// touchRO is touch for readers (holding the read lock): the loads' result
// is discarded, not stored.
func (s *Set[K]) touchRO(keys []K) uint32 {
	n := len(s.tab)
	var x uint32
	for _, k := range keys {
		x |= s.tab[home(uint64(k), n)].first.inst
	}
	return x
}

// Holders appends to dst the instances holding key, unexpired at now.
func (s *Set[K]) Holders(dst []string, key K, now int64) []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if i := s.find(uint64(key)); i >= 0 {
		sl := &s.tab[i]
		for j, c := 0, s.count(sl); j < c; j++ {
			if h := s.at(sl, j); h.exp > now {
				dst = append(dst, s.ids.names[h.inst])
			}
		}
	}
	return dst
}

// HeldBy reports whether inst holds key (expired or not).
func (s *Set[K]) HeldBy(key K, inst string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	id := s.ids.byName[inst]
	if id == 0 {
		return false
	}
	i := s.find(uint64(key))
	return i >= 0 && s.holdOf(&s.tab[i], id) != nil
}

// Any reports whether any instance holds key (expired or not).
func (s *Set[K]) Any(key K) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.find(uint64(key)) >= 0
}

// Drop removes inst's holds of keys (their ring entries expire later
// without effect).
func (s *Set[K]) Drop(keys []K, inst string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.ids.byName[inst]
	if id == 0 {
		return
	}
	s.touch(keys)
	for _, k := range keys {
		if i := s.find(uint64(k)); i >= 0 {
			s.dropAt(i, func(h *hold) bool { return h.inst == id })
		}
	}
}

// ids interns the instance names holds are made by: a hold and a ring
// entry carry a 4-byte id where a name's string header took 16 bytes.
//
// A name keeps its id while any ring entry names it (refs counts them),
// and every hold has one: the ring entry that set its expiry, which
// removes the hold when it is popped (a refresh pushes a newer entry with
// the hold's new expiry; a Drop removes the hold and leaves its entries,
// which then pop without effect). So once a name's last entry is popped
// none of its holds remain, and its id is given back for reuse: an
// instance that left the fleet keeps its id, and its holds count, until
// they expire or make way, as before; a new instance given that id
// later finds no hold under it; a name added again while its old holds
// remain gets the same id and finds them, as the name did. A peer's
// holds in replicasync name instances of the peer's choosing: their ids
// are bounded by the ring (one per entry at most), and given back the
// same way. Nothing is told when an instance leaves; none is needed.
type ids struct {
	byName map[string]uint32 // live names' ids
	names  []string          // by id; names[0] unused (0 is no instance)
	refs   []int32           // ring entries naming each id, plus Add's pin
	free   []uint32          // ids given back, reused last first
}

// intern returns name's id, a free or new one when it has none.
func (d *ids) intern(name string) uint32 {
	if id, ok := d.byName[name]; ok {
		return id
	}
	if d.byName == nil {
		d.byName = map[string]uint32{}
		d.names, d.refs = []string{""}, []int32{0}
	}
	var id uint32
	if n := len(d.free); n > 0 {
		id, d.free = d.free[n-1], d.free[:n-1]
		d.names[id] = name
	} else {
		id = uint32(len(d.names))
		d.names, d.refs = append(d.names, name), append(d.refs, 0)
	}
	d.byName[name] = id
	return id
}

// release drops one reference to id, giving the id back with its last.
func (d *ids) release(id uint32) {
	if d.refs[id]--; d.refs[id] == 0 {
		delete(d.byName, d.names[id])
		d.names[id] = ""
		d.free = append(d.free, id)
	}
}
