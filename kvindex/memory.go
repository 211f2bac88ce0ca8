package kvindex

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// DefaultCapacity is the memory backend's default bound, in (block,
// instance) entries: 4M entries are about 230 MB at the measured ~57 bytes
// each, enough for 64 instances with 60,000 cached blocks apiece (an 80 GB
// GPU holding ~1M tokens of a 8B model's KV is 60k blocks of 16).
const DefaultCapacity = 4_000_000

// MaxCapacity bounds MemoryConfig.Capacity to half of what a table slot
// can index (2^26 blocks and entries per instance), leaving room for the
// entries one event adds before eviction brings the index back within
// capacity: 33M entries are ~2 GB.
const MaxCapacity = maxIndex / 2

// presizeDivisor sizes the block map's index up front for capacity/2
// distinct keys (16 MB at the default capacity): growing it doubles a table
// of millions of slots under the write lock, a pause every lookup waits
// behind and, with its slots at random, the costliest part of ingesting
// new blocks. An index that fills past half its capacity with distinct
// keys (little sharing) grows once more; one that stays small pays 4 bytes
// per slot for the room.
const presizeDivisor = 2

// clockUnit is the resolution of LRU stamps: a uint32 of 10 ms units wraps
// after 497 days.
const clockUnit = 10 * time.Millisecond

// MemoryConfig configures the in-process backend. The zero value is valid.
type MemoryConfig struct {
	// Model is the pool's model name, folded into the root of chains that
	// carry no LoRA adapter (see Root).
	Model string
	// BlockSize in tokens; 0 = learn it from the first event that has one.
	BlockSize int
	// Capacity bounds the (block, instance) entries held; beyond it the
	// least recently stored or matched entries are evicted. 0 = DefaultCapacity.
	Capacity int
	// Now is the clock; nil = time.Now. Tests inject one.
	Now func() time.Time
}

func (c MemoryConfig) validate() error {
	if c.BlockSize < 0 {
		return fmt.Errorf("%w: memory: block size %d < 0", ErrConfig, c.BlockSize)
	}
	if c.Capacity < 0 {
		return fmt.Errorf("%w: memory: capacity %d < 0", ErrConfig, c.Capacity)
	}
	if c.Capacity > MaxCapacity {
		return fmt.Errorf("%w: memory: capacity %d above %d", ErrConfig, c.Capacity, MaxCapacity)
	}
	return nil
}

// Memory is the embedded Index backend: a global block map (router key →
// the instances holding it, per tier; blockmap.go) that a lookup walks once
// per chain, and per instance an engine-hash map and an LRU list over a
// slab of entries, one per (block, instance).
//
// One RWMutex guards it all. Lookups share it and touch only the block map
// (so their cost does not grow with the number of instances sharing a
// prefix); Apply takes it for writing one event at a time, so a lookup
// waits at most for one event's blocks.
type Memory struct {
	model    string
	capacity int64
	now      func() time.Time
	start    time.Time
	bs       blockSizer

	mu        sync.RWMutex // guards everything below but the atomics
	insts     map[string]*memInstance
	purges    uint64         // Purge calls: an instance found before one may be gone
	slots     []*memInstance // by slot; nil = free
	freeSlots []uint32
	blocks    blockMap
	scratch   []Key
	pfNodes   []int32 // prefetchEvents' scratch
	pfKeys    []Key   // prefetchEvents' scratch

	entries atomic.Int64 // (block, instance) entries over all instances
	evicted atomic.Int64 // entries evicted for capacity, ever

	lookups sync.Pool // *lookupState
}

var _ Index = (*Memory)(nil)

// NewMemory returns an empty in-process index.
func NewMemory(cfg MemoryConfig) (*Memory, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m := &Memory{
		model:    cfg.Model,
		capacity: int64(cfg.Capacity),
		now:      cfg.Now,
		insts:    make(map[string]*memInstance),
	}
	if m.capacity == 0 {
		m.capacity = DefaultCapacity
	}
	m.blocks = newBlockMap(int(m.capacity) / presizeDivisor)
	if m.now == nil {
		m.now = time.Now
	}
	m.start = m.now()
	m.bs.configured = cfg.BlockSize
	return m, nil
}

// memInstance is one instance's part of the index. Its fields are guarded
// by Memory.mu.
type memInstance struct {
	name   string
	slot   uint32
	blocks *blockMap

	slab   slab
	byHash table // engine hash → entry
	// byNode indexes entries by block node once the instance has mapped two
	// engine hashes to one router key (aliasing: e.g. multimodal prompts
	// with equal token ids); empty, costing nothing, until then.
	byNode  table
	aliased bool
	head    int32 // most recently stored; -1 when empty
	tail    int32 // least recently stored; -1 when empty
	n       int   // live entries
	count   [tiers.Count]int
	stamp   uint32 // current Apply's clock, for entries it places
	// sizeHint is what an empty instance's engine-hash table is sized for
	// when its first blocks arrive (see sizeEmpty); set by Apply.
	sizeHint int
	// sectioned is set while Apply applies a section of several events
	// that prefetchEvents has loaded: prefetchRemove then has nothing left
	// to load.
	sectioned bool

	lastEvent int64 // unix nanoseconds of the last Apply
}

// instance returns name's part, creating it. Called with mu held for writing.
func (m *Memory) instance(name string) (*memInstance, error) {
	if in := m.insts[name]; in != nil {
		return in, nil
	}
	var slot uint32
	if n := len(m.freeSlots); n > 0 {
		slot = m.freeSlots[n-1]
		m.freeSlots = m.freeSlots[:n-1]
	} else {
		if len(m.slots) >= maxSlots {
			return nil, fmt.Errorf("%w: memory: more than %d instances", ErrConfig, maxSlots)
		}
		slot = uint32(len(m.slots))
		m.slots = append(m.slots, nil)
	}
	in := &memInstance{name: name, slot: slot, blocks: &m.blocks, head: -1, tail: -1}
	in.slab.free = -1
	m.insts[name] = in
	m.slots[slot] = in
	return in, nil
}

// BlockSize implements Index.
func (m *Memory) BlockSize() int { return m.bs.get() }

// Apply implements Index.
func (m *Memory) Apply(ctx context.Context, instance string, evs []events.Event) (ApplyResult, error) {
	var res ApplyResult
	if err := ctx.Err(); err != nil {
		return res, err
	}
	now := m.now()
	stamp := uint32(now.Sub(m.start) / clockUnit)
	// One event per write-locked section, or several small ones (see
	// sectionEnd): a lookup waits for at most one event's blocks, or
	// SectionBlocks, not a whole batch's. The instance is looked up by
	// name again only when a Purge ran between two sections.
	var in *memInstance
	var purges uint64
	for i, j := 0, 0; i < len(evs) || i == 0; i = j {
		j = sectionEnd(evs, i)
		m.mu.Lock()
		if in == nil || m.purges != purges {
			var err error
			if in, err = m.instance(instance); err != nil {
				m.mu.Unlock()
				return res, err
			}
			purges = m.purges
		}
		before := in.n
		in.stamp = stamp
		if in.n == 0 && len(in.byHash.slots) == 0 {
			in.sizeHint = m.peerMean(in)
		}
		if i < len(evs) {
			if in.sectioned = j-i > 1; in.sectioned {
				m.pfNodes, m.pfKeys = in.prefetchEvents(evs[i:j], m.bs.get(), m.pfNodes, m.pfKeys)
			}
			m.scratch = applyEvents(in, m.model, &m.bs, evs[i:j], &res, m.scratch)
			in.sectioned = false
		}
		if m.entries.Add(int64(in.n-before)) > m.capacity {
			m.evict(stamp)
		}
		if j >= len(evs) {
			in.lastEvent = now.UnixNano()
		}
		m.mu.Unlock()
	}
	return res, nil
}

// SectionBlocks bounds the blocks of the several events one write-locked
// section of Memory.Apply takes together: no more than one event of a
// 1,024-token prompt chunk holds, which a section of one event may already
// hold (a vLLM prefill chunk's BlockStored can be 32 times that), so joining
// events adds no wait for a lookup beyond what one event can cause. A step's
// batch often holds many one-block events (one BlockStored per decoding
// request that filled a block, one BlockRemoved per block evicted to make
// room); in sections they share the lock, the capacity check, and a prefetch
// (memInstance.prefetchEvents) whose loads overlap across them. The
// router's consumer joins a run of one-block removals into events of at
// most this many hashes (events.Decoder.JoinRemovals), so that a joined
// event holds the lock no longer than a section of the run would.
const SectionBlocks = 64

// sectionEnd returns where the write-locked section of evs starting at i
// ends: after evs[i], and after each next event while the section's blocks
// stay within SectionBlocks; a clear (whose cost is the instance's whole
// table) is always a section of its own. For i at or past the end, i+1.
func sectionEnd(evs []events.Event, i int) int {
	if i >= len(evs) || evs[i].Kind == events.AllBlocksCleared {
		return i + 1
	}
	n, j := len(evs[i].BlockHashes), i+1
	for ; j < len(evs) && evs[j].Kind != events.AllBlocksCleared; j++ {
		if n += len(evs[j].BlockHashes); n > SectionBlocks {
			break
		}
	}
	return j
}

// Purge implements Index.
func (m *Memory) Purge(ctx context.Context, instance string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	in := m.insts[instance]
	if in == nil {
		return nil
	}
	n := in.n
	in.clearAll()
	m.purges++
	delete(m.insts, instance)
	m.slots[in.slot] = nil
	m.freeSlots = append(m.freeSlots, in.slot)
	m.entries.Add(-int64(n))
	return nil
}

// Instances implements Index.
func (m *Memory) Instances(ctx context.Context) ([]InstanceStats, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.RLock()
	out := make([]InstanceStats, 0, len(m.insts))
	for _, in := range m.slots {
		if in == nil {
			continue
		}
		s := InstanceStats{Instance: in.name, Blocks: in.count}
		if ns := in.lastEvent; ns != 0 {
			s.LastEvent = time.Unix(0, ns)
		}
		out = append(out, s)
	}
	m.mu.RUnlock()
	return out, nil
}

// Len implements Index.
func (m *Memory) Len(ctx context.Context) (int, error) {
	return int(m.entries.Load()), ctx.Err()
}

// Evicted is the number of entries evicted for capacity so far.
func (m *Memory) Evicted() int64 { return m.evicted.Load() }

// evict drops entries until the index is within capacity, oldest first
// across all instances: it repeatedly takes the instance whose LRU tail is
// oldest and evicts from it down to the next-oldest instance's tail stamp.
// Entries a lookup matched since they were stored get a second chance (they
// move to the head) instead of being evicted. Called with mu held for
// writing.
func (m *Memory) evict(now uint32) {
	for m.entries.Load() > m.capacity {
		var victim *memInstance
		oldest, cutoff := uint32(math.MaxUint32), uint32(math.MaxUint32)
		for _, in := range m.slots {
			if in == nil || in.tail < 0 {
				continue
			}
			switch s := in.slab.at(in.tail).stamp; {
			case victim == nil || s < oldest:
				if victim != nil {
					cutoff = oldest
				}
				victim, oldest = in, s
			case s < cutoff:
				cutoff = s
			}
		}
		if victim == nil {
			return // everything is empty; the count will settle
		}
		stamp := victim.stamp
		victim.stamp = now
		evicted, rotations := 0, 0
		for m.entries.Load() > m.capacity && victim.tail >= 0 {
			j := victim.tail
			e := victim.slab.at(j)
			if rotations < victim.n && m.blocks.takeHit(e.node, victim.slot) {
				rotations++
				victim.moveToHead(j)
				continue
			}
			// Past the next-oldest instance's tail: pick again. A pass that
			// neither rotated nor evicted evicts one entry regardless.
			if e.stamp > cutoff && (evicted > 0 || rotations > 0) {
				break
			}
			victim.drop(j)
			evicted++
			m.entries.Add(-1)
		}
		victim.stamp = stamp
		m.evicted.Add(int64(evicted))
	}
}

// allTiers masks the tier bits of a tier set.
const allTiers = 1<<tiers.Count - 1

// --- instanceOps, called with Memory.mu held for writing ---

var _ instanceOps = (*memInstance)(nil)

func (in *memInstance) hashSrc() keySrc { return keySrc{s: &in.slab, kf: byHashOf} }
func (in *memInstance) nodeSrc() keySrc { return keySrc{s: &in.slab, kf: byNodeOf} }

func (in *memInstance) keyOf(h uint64) (Key, bool) {
	node := in.nodeOf(h)
	if node == noNode {
		return 0, false
	}
	return *in.blocks.keyAt(node), true
}

// noNode is nodeOf's answer for an engine hash the instance does not hold.
const noNode = int32(-1)

// nodeOf returns the block-map node of the instance's engine hash h, or
// noNode.
func (in *memInstance) nodeOf(h uint64) int32 {
	if j := in.byHash.find(in.hashSrc(), h); j >= 0 {
		return in.slab.at(j).node
	}
	return noNode
}

func (in *memInstance) store(h uint64, k Key, t tiers.Tier) bool {
	bit := uint32(t.Bit())
	j, at := in.byHash.findOrSlot(in.hashSrc(), h)
	if j >= 0 {
		e := in.slab.at(j)
		if *in.blocks.keyAt(e.node) == k {
			added := e.meta&bit == 0
			if added {
				e.meta |= bit
				in.count[t]++
			}
			in.touch(j)
			return added
		}
		// The engine re-keyed a hash (should not happen): start over.
		in.drop(j)
		_, at = in.byHash.findOrSlot(in.hashSrc(), h)
	}
	if in.slab.full() || in.blocks.full() {
		return false // past what the tables index: dropped (see MaxCapacity)
	}
	node := in.blocks.nodeFor(k)
	alias := in.blocks.holds(node, in.slot)
	j = in.slab.alloc()
	e := in.slab.at(j)
	// Not live until indexed: a table growing rebuilds from the live slab
	// entries and must not index this one twice.
	*e = entry{hashLo: uint32(h), hashHi: uint32(h >> 32), node: node, prev: -1, next: -1, meta: bit}
	in.byHash.put(at, j)
	if alias && !in.aliased {
		// First alias: index the instance's entries by node from now on
		// (every live one; j is not live yet).
		in.aliased = true
		in.byNode.build(in.nodeSrc(), in.n)
	}
	if in.aliased {
		if d := in.byNode.insert(in.nodeSrc(), j, uint64(node)); d >= 0 {
			in.markDups(node)
			e.meta |= flagDup
		}
	}
	e.meta |= flagLive
	in.pushHead(j)
	in.n++
	in.count[t]++
	in.syncHolder(e, false)
	return true
}

// peerMean is the mean number of entries the other instances hold (0
// when there are none). Called with mu held for writing.
func (m *Memory) peerMean(self *memInstance) int {
	peers := len(m.insts) - 1
	if peers <= 0 {
		return 0
	}
	return int(max(0, m.entries.Load()-int64(self.n)) / int64(peers))
}

// sizeEmpty sizes an empty instance's engine-hash table, before its first
// stores, for the larger of the event's blocks and what an instance of the
// pool holds on average (sizeHint). Growing a table from empty one
// doubling at a time re-inserts every item about once more over the
// doublings (half the items at the last, a quarter at the one before, ...):
// 14–18 % of filling the index from empty (docs/BENCHMARKS.md §10). The
// engines of a pool are alike (one model, one KV-cache size), so an
// instance that starts empty (new, purged and reloaded from a snapshot,
// or cleared by a restart) fills to about what its peers hold; a snapshot
// load is one event of all its blocks. The table gets the size doubling
// would reach for that many, so a full instance costs the same memory; one
// that stays smaller costs at most a peer's table (4 bytes a slot, 5.3–10.7
// bytes per peer entry).
//
// It reports whether it made new slots.
func (in *memInstance) sizeEmpty(blocks int) bool {
	if in.n != 0 || in.byHash.n != 0 || in.byHash.tombs != 0 {
		return false
	}
	want := max(blocks, in.sizeHint)
	if want*4 <= len(in.byHash.slots)*3 {
		return false
	}
	in.byHash.presize(want)
	return true
}

// prefetchHashes loads the engine-hash table slots a stored event's
// blocks will probe (with hundreds of instances their tables do not all
// stay in cache) before the event's parent is looked up and its keys are
// made, so that those misses overlap with that work rather than with
// each other only (a short event's keys take about as long to make as one
// miss to serve).
func (in *memInstance) prefetchHashes(hs []uint64) { touch(&in.byHash, hs) }

// prefetch loads the block map's index slots a stored event's keys will
// probe, so that their cache misses overlap instead of coming one store
// at a time; an empty instance's table is sized first (and its slots
// loaded then: they are new).
func (in *memInstance) prefetch(hs []uint64, keys []Key) {
	if in.sizeEmpty(len(hs)) {
		touch(&in.byHash, hs)
	}
	touch(&in.blocks.index, keys)
}

// prefetchRemove loads what removing blocks hs will read, in two rounds
// of independent loads: their engine-hash table slots, then their entries
// and the holder words of their block nodes.
func (in *memInstance) prefetchRemove(hs []uint64) {
	if in.sectioned {
		return // prefetchEvents loaded the same, for the whole section
	}
	touch(&in.byHash, hs)
	var x uint32
	for _, h := range hs {
		if node := in.nodeOf(h); node != noNode {
			x |= *in.blocks.holdAt(node)
		}
	}
	in.byHash.sink ^= x
}

// prefetchEvents loads, before a section of several events is applied
// (Memory.Apply), what their look-ups and stores will read, in rounds of
// loads that are independent across the events: the engine-hash slots of
// each stored event's parent, its new blocks and each removed block; then
// the entries found there; then the block-map words they lead to (a
// parent's router key, a removed block's holder word); then, from the
// parents' keys, the block-map index slot of each stored event's first key
// (size is the pool's block size, 0 when not yet known). Applied one event
// at a time, each one-block event's misses come one after another. nodes
// and keys are scratch space, returned grown.
func (in *memInstance) prefetchEvents(evs []events.Event, size int, nodes []int32, keys []Key) ([]int32, []Key) {
	n := len(in.byHash.slots)
	if n == 0 {
		return nodes, keys
	}
	var x uint32
	for i := range evs {
		ev := &evs[i]
		if ev.Kind == events.BlockStored && ev.HasParent {
			k, _ := home(ev.ParentHash, n)
			x |= in.byHash.slots[k]
		}
		if ev.Kind == events.BlockStored || ev.Kind == events.BlockRemoved {
			for _, h := range ev.BlockHashes {
				k, _ := home(h, n)
				x |= in.byHash.slots[k]
			}
		}
	}
	// The entries: each stored event's parent's node, each removed
	// block's node; noNode where there is none.
	nodes = nodes[:0]
	for i := range evs {
		ev := &evs[i]
		switch {
		case ev.Kind == events.BlockStored && ev.HasParent:
			nodes = append(nodes, in.nodeOf(ev.ParentHash))
		case ev.Kind == events.BlockRemoved:
			for _, h := range ev.BlockHashes {
				nodes = append(nodes, in.nodeOf(h))
			}
		}
	}
	keys = keys[:0]
	at := 0
	for i := range evs {
		ev := &evs[i]
		switch {
		case ev.Kind == events.BlockStored && ev.HasParent:
			node := nodes[at]
			at++
			if node != noNode && size > 0 && len(ev.BlockHashes) > 0 && len(ev.TokenIDs) == size*len(ev.BlockHashes) {
				// The first block's key only: the store makes the keys
				// again and loads the slots of all of them in one round
				// (prefetch), so keying a long event here would hash its
				// blocks twice to save nothing but that round's first miss.
				keys = AppendKeys(keys, *in.blocks.keyAt(node), ev.TokenIDs[:size], size)
			}
		case ev.Kind == events.BlockRemoved:
			for range ev.BlockHashes {
				if node := nodes[at]; node != noNode {
					x |= *in.blocks.holdAt(node)
				}
				at++
			}
		}
	}
	touch(&in.blocks.index, keys)
	in.byHash.sink ^= x
	return nodes, keys
}

func (in *memInstance) addTier(h uint64, t tiers.Tier) (mapped, added bool) {
	j := in.byHash.find(in.hashSrc(), h)
	if j < 0 {
		return false, false
	}
	e := in.slab.at(j)
	bit := uint32(t.Bit())
	added = e.meta&bit == 0
	if added {
		e.meta |= bit
		in.count[t]++
	}
	in.touch(j)
	return true, added
}

func (in *memInstance) removeTier(h uint64, t tiers.Tier) (mapped, removed bool) {
	j, at := in.byHash.findAt(in.hashSrc(), h)
	if j < 0 {
		return false, false
	}
	e := in.slab.at(j)
	bit := uint32(t.Bit())
	if e.meta&bit == 0 {
		return true, false
	}
	e.meta &^= bit
	in.count[t]--
	if e.meta&tierMask == 0 {
		in.dropAt(j, at)
	} else {
		in.syncHolder(e, true)
	}
	return true, true
}

// clearAll drops every block of the instance from the block map, then its
// own structures.
func (in *memInstance) clearAll() {
	for j := int32(0); j < in.slab.n; j++ {
		if e := in.slab.at(j); e.meta&flagLive != 0 {
			in.blocks.set(e.node, in.slot, 0, false)
		}
	}
	in.slab = slab{free: -1}
	in.byHash.reset()
	in.byNode.reset()
	in.aliased = false
	in.head, in.tail, in.n = -1, -1, 0
	in.count = [tiers.Count]int{}
}

// syncHolder writes e's tier bits (ORed with its aliases') into its block
// node's holder record.
func (in *memInstance) syncHolder(e *entry, keepHit bool) {
	bits := e.meta & tierMask
	if e.meta&flagDup != 0 {
		bits = in.aliasBits(e.node)
	}
	in.blocks.set(e.node, in.slot, bits, keepHit)
}

// aliasBits ORs the tier bits of the instance's live entries of node.
func (in *memInstance) aliasBits(node int32) uint32 {
	var bits uint32
	in.eachAlias(node, func(e *entry) { bits |= e.meta & tierMask })
	return bits
}

func (in *memInstance) markDups(node int32) {
	in.eachAlias(node, func(e *entry) { e.meta |= flagDup })
}

func (in *memInstance) eachAlias(node int32, do func(*entry)) {
	t := &in.byNode
	n := len(t.slots)
	if n == 0 {
		return
	}
	i, f := home(uint64(node), n)
	for c := t.slots[i]; c != 0; c = t.slots[i] {
		if c&^idxMask == f && c != tomb {
			if e := in.slab.at(slotIdx(c)); e.node == node && e.meta&flagLive != 0 {
				do(e)
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// drop removes entry j entirely (both indexes, LRU list, counts, its hold
// of the block).
func (in *memInstance) drop(j int32) { in.dropAt(j, -1) }

// dropAt is drop for an entry whose engine-hash slot is known (at, from
// findAt; -1 when not): its removal from the table probes no more.
func (in *memInstance) dropAt(j int32, at int) {
	e := in.slab.at(j)
	m := e.meta
	for t := range tiers.Count {
		if m&(1<<t) != 0 {
			in.count[t]--
		}
	}
	e.meta &^= tierMask
	in.syncHolder(e, true)
	if at >= 0 {
		in.byHash.removeAt(at)
	} else {
		in.byHash.remove(j, e.ehash())
	}
	if in.aliased {
		in.byNode.remove(j, uint64(e.node))
	}
	in.unlink(j)
	in.slab.release(j)
	in.n--
}

// touch moves j to the LRU head with the current Apply's stamp and
// refreshes its holder record (tier bits; the second chance starts over).
func (in *memInstance) touch(j int32) {
	e := in.slab.at(j)
	e.stamp = in.stamp
	in.syncHolder(e, false)
	in.moveToHead(j)
}

func (in *memInstance) moveToHead(j int32) {
	if in.head == j {
		in.slab.at(j).stamp = in.stamp
		return
	}
	in.unlink(j)
	in.pushHead(j)
}

func (in *memInstance) pushHead(j int32) {
	e := in.slab.at(j)
	e.stamp = in.stamp
	e.prev, e.next = -1, in.head
	if in.head >= 0 {
		in.slab.at(in.head).prev = j
	}
	in.head = j
	if in.tail < 0 {
		in.tail = j
	}
}

func (in *memInstance) unlink(j int32) {
	e := in.slab.at(j)
	if e.prev >= 0 {
		in.slab.at(e.prev).next = e.next
	} else if in.head == j {
		in.head = e.next
	}
	if e.next >= 0 {
		in.slab.at(e.next).prev = e.prev
	} else if in.tail == j {
		in.tail = e.prev
	}
	e.prev, e.next = -1, -1
}
