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
// instance) entries: 4M entries are about 200 MB at the measured ~45 bytes
// each, enough for 64 instances with 60,000 cached blocks apiece (an 80 GB
// GPU holding ~1M tokens of a 8B model's KV is 60k blocks of 16).
const DefaultCapacity = 4_000_000

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
	if c.Capacity > math.MaxInt32/2 {
		return fmt.Errorf("%w: memory: capacity %d above %d", ErrConfig, c.Capacity, math.MaxInt32/2)
	}
	return nil
}

// Memory is the embedded Index backend. It is sharded by instance: each
// instance's blocks live in their own slab and hash tables under their own
// lock, so Apply for one instance never contends with another's, and a
// Lookup takes each instance's read lock once.
type Memory struct {
	model    string
	capacity int64
	now      func() time.Time
	start    time.Time
	bs       blockSizer

	mu    sync.RWMutex // guards insts and list
	insts map[string]*memInstance
	list  []*memInstance

	entries atomic.Int64 // (block, instance) entries over all instances
	evicted atomic.Int64 // entries evicted for capacity, ever

	evictMu sync.Mutex // serialises eviction passes
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
	if m.now == nil {
		m.now = time.Now
	}
	m.start = m.now()
	m.bs.configured = cfg.BlockSize
	return m, nil
}

// memInstance is one instance's shard.
type memInstance struct {
	name string

	mu      sync.RWMutex // guards everything below but the atomics
	slab    slab
	byKey   table // router key → entries (several when engine hashes alias)
	byHash  table // engine hash → entry
	head    int32 // most recently stored; -1 when empty
	tail    int32 // least recently stored; -1 when empty
	n       int   // live entries
	count   [tiers.Count]int
	purged  bool   // removed from the index: Apply must re-resolve
	stamp   uint32 // current Apply's clock, for entries it places
	scratch []Key

	lastEvent atomic.Int64  // unix nanoseconds of the last Apply
	tailStamp atomic.Uint32 // stamp of the tail entry; MaxUint32 when empty
}

func newMemInstance(name string) *memInstance {
	in := &memInstance{name: name, head: -1, tail: -1}
	in.slab.free = -1
	in.tailStamp.Store(math.MaxUint32)
	return in
}

func (m *Memory) instance(name string) *memInstance {
	m.mu.RLock()
	in := m.insts[name]
	m.mu.RUnlock()
	if in != nil {
		return in
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if in = m.insts[name]; in == nil {
		in = newMemInstance(name)
		m.insts[name] = in
		m.list = append(m.list, in)
	}
	return in
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
	for {
		in := m.instance(instance)
		in.mu.Lock()
		if in.purged {
			in.mu.Unlock()
			continue // purged between lookup and lock: use the new shard
		}
		before := in.n
		in.stamp = stamp
		in.scratch = applyEvents(in, m.model, &m.bs, evs, &res, in.scratch)
		delta := in.n - before
		in.syncTail()
		in.mu.Unlock()
		in.lastEvent.Store(now.UnixNano())
		if m.entries.Add(int64(delta)) > m.capacity {
			m.evict(stamp)
		}
		return res, nil
	}
}

// Lookup implements Index.
func (m *Memory) Lookup(ctx context.Context, keys []Key) ([]Match, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if len(keys) == 0 {
		return nil, nil
	}
	var out []Match
	m.mu.RLock()
	for _, in := range m.list {
		if b, ok := in.match(keys); ok {
			out = append(out, Match{Instance: in.name, Blocks: b})
		}
	}
	m.mu.RUnlock()
	return m.bs.roundUnits(out), nil
}

// Purge implements Index.
func (m *Memory) Purge(ctx context.Context, instance string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	in := m.insts[instance]
	if in != nil {
		delete(m.insts, instance)
		for i, x := range m.list {
			if x == in {
				m.list[i] = m.list[len(m.list)-1]
				m.list[len(m.list)-1] = nil
				m.list = m.list[:len(m.list)-1]
				break
			}
		}
	}
	m.mu.Unlock()
	if in == nil {
		return nil
	}
	in.mu.Lock()
	n := in.n
	in.clearAll()
	in.purged = true
	in.syncTail()
	in.mu.Unlock()
	m.entries.Add(-int64(n))
	return nil
}

// Instances implements Index.
func (m *Memory) Instances(ctx context.Context) ([]InstanceStats, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.RLock()
	list := append([]*memInstance(nil), m.list...)
	m.mu.RUnlock()
	out := make([]InstanceStats, 0, len(list))
	for _, in := range list {
		in.mu.RLock()
		s := InstanceStats{Instance: in.name, Blocks: in.count}
		in.mu.RUnlock()
		if ns := in.lastEvent.Load(); ns != 0 {
			s.LastEvent = time.Unix(0, ns)
		}
		out = append(out, s)
	}
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
// move to the head) instead of being evicted.
func (m *Memory) evict(now uint32) {
	m.evictMu.Lock()
	defer m.evictMu.Unlock()
	for m.entries.Load() > m.capacity {
		m.mu.RLock()
		var victim *memInstance
		oldest, cutoff := uint32(math.MaxUint32), uint32(math.MaxUint32)
		for _, in := range m.list {
			switch s := in.tailStamp.Load(); {
			case s == math.MaxUint32:
			case victim == nil || s < oldest:
				if victim != nil {
					cutoff = oldest
				}
				victim, oldest = in, s
			case s < cutoff:
				cutoff = s
			}
		}
		m.mu.RUnlock()
		if victim == nil {
			return // everything is empty; the count will settle
		}
		victim.mu.Lock()
		victim.stamp = now
		evicted, rotations := 0, 0
		for m.entries.Load() > m.capacity && victim.tail >= 0 && !victim.purged {
			j := victim.tail
			e := victim.slab.at(j)
			if atomic.LoadUint32(&e.meta)&flagHit != 0 && rotations < victim.n {
				rotations++
				e.meta &^= flagHit
				victim.moveToHead(j)
				continue
			}
			// Past the next-oldest instance's tail: pick again. A pass that
			// neither rotated nor evicted evicts one entry regardless, so a
			// stale tailStamp cannot make the loop spin.
			if e.stamp > cutoff && (evicted > 0 || rotations > 0) {
				break
			}
			victim.drop(j)
			evicted++
			m.entries.Add(-1)
		}
		victim.syncTail()
		victim.mu.Unlock()
		m.evicted.Add(int64(evicted))
	}
}

// allTiers masks the tier bits of a tier set.
const allTiers = 1<<tiers.Count - 1

// match returns the leading blocks of keys the instance holds per tier.
func (in *memInstance) match(keys []Key) (blocks [tiers.Count]int, ok bool) {
	in.mu.RLock()
	defer in.mu.RUnlock()
	bits, j := in.probe(keys[0])
	if bits&allTiers == 0 {
		return blocks, false
	}
	// alive holds the tiers whose run is still contiguous; a block present
	// in tier f counts for every tier >= f (Match counts "that tier or a
	// faster one"), i.e. the mask of bits at or above its lowest set bit.
	alive := uint32(allTiers)
	i := 0
	for {
		b := bits & allTiers
		if b == 0 {
			break
		}
		if lost := alive &^ (^(b&-b - 1) & allTiers); lost != 0 {
			for t := range tiers.Count {
				if lost&(1<<t) != 0 {
					blocks[t] = i
				}
			}
			alive &^= lost
		}
		if i++; i == len(keys) {
			break
		}
		// Blocks of a chain are usually stored by one event, hence in
		// adjacent slab slots (last block first, see applyEvents): try the
		// neighbouring slots before the hash table.
		bits = 0
		if j > 0 {
			bits, j = in.neighbour(j-1, keys[i], j)
		}
		if bits == 0 && j+1 < in.slab.n {
			bits, j = in.neighbour(j+1, keys[i], j)
		}
		if bits == 0 {
			bits, j = in.probe(keys[i])
		}
	}
	for t := range tiers.Count {
		if alive&(1<<t) != 0 {
			blocks[t] = i
		}
	}
	return blocks, true
}

// neighbour returns the bits of slab slot j when it holds k alone (no
// aliased entries), else 0 and fallback.
func (in *memInstance) neighbour(j int32, k Key, fallback int32) (uint32, int32) {
	e := in.slab.at(j)
	if m := atomic.LoadUint32(&e.meta); e.key == k && m&flagLive != 0 && m&flagDup == 0 && m&tierMask != 0 {
		markHit(e, m)
		return m & tierMask, j
	}
	return 0, fallback
}

// probe returns the tier bits the instance holds key k in (OR over aliased
// entries) and one entry's slab index; it marks the entries matched.
func (in *memInstance) probe(k Key) (uint32, int32) {
	j := in.byKey.find(&in.slab, uint64(k), byKeyOf)
	if j < 0 {
		return 0, -1
	}
	e := in.slab.at(j)
	m := atomic.LoadUint32(&e.meta)
	markHit(e, m)
	bits := m & tierMask
	if m&flagDup != 0 {
		bits = in.aliasBits(k, bits)
	}
	return bits, j
}

// aliasBits ORs the tier bits of every entry indexed under k (rare: two
// engine hashes for one router key).
func (in *memInstance) aliasBits(k Key, bits uint32) uint32 {
	t := &in.byKey
	n := len(t.fp)
	i, f := home(uint64(k), n)
	for t.fp[i] != 0 {
		if t.fp[i] == f {
			if e := in.slab.at(t.idx[i]); e.key == k {
				m := atomic.LoadUint32(&e.meta)
				markHit(e, m)
				bits |= m & tierMask
			}
		}
		if i++; i == n {
			i = 0
		}
	}
	return bits
}

// markHit flags an entry as matched, writing only when the flag is not yet
// set so that hot entries do not bounce cache lines between readers.
func markHit(e *entry, m uint32) {
	if m&flagHit == 0 {
		atomic.OrUint32(&e.meta, flagHit)
	}
}

// --- instanceOps, called with in.mu held for writing ---

var _ instanceOps = (*memInstance)(nil)

func (in *memInstance) keyOf(h uint64) (Key, bool) {
	j := in.byHash.find(&in.slab, h, byHashOf)
	if j < 0 {
		return 0, false
	}
	return in.slab.at(j).key, true
}

func (in *memInstance) store(h uint64, k Key, t tiers.Tier) bool {
	bit := uint32(t.Bit())
	if j := in.byHash.find(&in.slab, h, byHashOf); j >= 0 {
		e := in.slab.at(j)
		if e.key != k {
			// The engine re-keyed a hash (should not happen): start over.
			in.drop(j)
		} else {
			added := e.meta&bit == 0
			if added {
				e.meta |= bit
				in.count[t]++
			}
			in.touch(j)
			return added
		}
	}
	j := in.slab.alloc()
	e := in.slab.at(j)
	// Not live until indexed: a table growing during insert rebuilds from
	// the live slab entries and must not index this one twice.
	*e = entry{key: k, ehash: h, prev: -1, next: -1, meta: bit}
	in.byHash.insert(&in.slab, j, h, byHashOf)
	if d := in.byKey.insert(&in.slab, j, uint64(k), byKeyOf); d >= 0 {
		e.meta |= flagDup
		in.slab.at(d).meta |= flagDup
	}
	e.meta |= flagLive
	in.pushHead(j)
	in.n++
	in.count[t]++
	return true
}

func (in *memInstance) addTier(h uint64, t tiers.Tier) (mapped, added bool) {
	j := in.byHash.find(&in.slab, h, byHashOf)
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
	j := in.byHash.find(&in.slab, h, byHashOf)
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
		in.drop(j)
	}
	return true, true
}

func (in *memInstance) clearAll() {
	in.slab = slab{free: -1}
	in.byKey.reset()
	in.byHash.reset()
	in.head, in.tail, in.n = -1, -1, 0
	in.count = [tiers.Count]int{}
}

// drop removes entry j entirely (both indexes, LRU list, counts).
func (in *memInstance) drop(j int32) {
	e := in.slab.at(j)
	m := e.meta
	for t := range tiers.Count {
		if m&(1<<t) != 0 {
			in.count[t]--
		}
	}
	in.byHash.remove(&in.slab, j, e.ehash, byHashOf)
	in.byKey.remove(&in.slab, j, uint64(e.key), byKeyOf)
	in.unlink(j)
	in.slab.release(j)
	in.n--
}

// touch moves j to the LRU head with the current Apply's stamp.
func (in *memInstance) touch(j int32) {
	e := in.slab.at(j)
	e.stamp = in.stamp
	e.meta &^= flagHit
	in.moveToHead(j)
}

func (in *memInstance) moveToHead(j int32) {
	if in.head == j {
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

// syncTail publishes the tail's stamp for the eviction pass.
func (in *memInstance) syncTail() {
	if in.tail < 0 {
		in.tailStamp.Store(math.MaxUint32)
		return
	}
	in.tailStamp.Store(in.slab.at(in.tail).stamp)
}
