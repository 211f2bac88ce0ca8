package kvindex

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/tiers"
)

// An instance's engine-hash map (engine hash → router key, tier bits) is
// needed by whoever writes the instance: to key a BlockStored's chain from
// its parent, to place tokenless (CPU) stores and removals, to count. In
// Redis it lives as an append-only log, one 17-byte record per change
// (engine hash, router key, tier bits; bits 0 = gone), the last record of
// a hash winning, kept as a list with one element per commit (a string
// grown by APPEND would hold up to twice its length): 17-34 bytes per
// entry, where a Redis hash costs ~70.
// Redis never reads it; the writer keeps the map in process (instMap),
// current to the generation a random token every commit sets, and reads
// the log back only when it is not current: its first write, a takeover
// from another writer, Redis restarted.

// logRecord is the size of one log record.
const logRecord = 17

// errLogCorrupt: the log's length is not a whole number of records.
var errLogCorrupt = errors.New("kvindex: redis: engine-hash log is not a whole number of records")

func appendLogRecord(b []byte, h uint64, v mapVal) []byte {
	b = binary.BigEndian.AppendUint64(b, h)
	b = binary.BigEndian.AppendUint64(b, uint64(v.key))
	return append(b, byte(v.bits&allTiers))
}

// replayLog applies log's records to into. A trailing partial record (a
// log written by something else) is an error; the whole records before it
// are applied.
func replayLog(log string, into map[uint64]mapVal) error {
	n := len(log) / logRecord
	for i := range n {
		r := log[i*logRecord : (i+1)*logRecord]
		h := binary.BigEndian.Uint64([]byte(r[:8]))
		v := mapVal{key: Key(binary.BigEndian.Uint64([]byte(r[8:16]))), bits: tiers.Set(r[16]) & allTiers}
		if v.bits == 0 {
			delete(into, h)
		} else {
			into[h] = v
		}
	}
	if len(log)%logRecord != 0 {
		return fmt.Errorf("%w (%d bytes)", errLogCorrupt, len(log))
	}
	return nil
}

// joinChunks concatenates the log's list elements, as a script returns
// them.
func joinChunks(chunks []any) string {
	n := 0
	for _, c := range chunks {
		s, _ := c.(string)
		n += len(s)
	}
	var b strings.Builder
	b.Grow(n)
	for _, c := range chunks {
		s, _ := c.(string)
		b.WriteString(s)
	}
	return b.String()
}

// mapCounts returns the entry count and per-tier block counts of a map,
// as the metadata hash keeps them.
func mapCounts(vals map[uint64]mapVal) [1 + tiers.Count]int {
	var c [1 + tiers.Count]int
	for _, v := range vals {
		c[0]++
		for t := range tiers.Count {
			if v.bits&(1<<t) != 0 {
				c[1+t]++
			}
		}
	}
	return c
}

// instMap is one instance's engine-hash map as this process last wrote or
// read it.
type instMap struct {
	name string
	mu   sync.Mutex // guards the fields below; held for a whole Apply
	// vals is the map, current to gen (nil: not known here).
	vals   map[uint64]mapVal
	gen    string
	counts [1 + tiers.Count]int // of vals
	logLen int                  // bytes of the log in Redis
	fid    string               // the instance's field id in block keys (see fieldIDs)
	// pos and leased: the position this process last saw applied and when
	// it took or renewed the instance's writer lease (zero: never).
	pos    Position
	leased time.Time
	used   uint64 // mapCache.tick at the last use
	// size is what the map counts in mapCache.total: its entries, plus
	// one for the map itself while it is kept (an empty map costs memory
	// too, and must be a victim like any other).
	size int
	// refs counts the get()s not yet released (guarded by mapCache.mu):
	// an instMap is removed from the cache only when none holds it.
	refs int
	// unsettled: writes of this process with an unknown outcome whose
	// instance mark did not get through (see Redis.unsettle), counted so
	// that a mark answering earlier ones does not clear a later one;
	// 0: none. Kept across drop.
	unsettled atomic.Uint64
}

// load replaces the map with the log's contents at generation gen.
func (m *instMap) load(gen, log string) error {
	vals := make(map[uint64]mapVal, len(log)/logRecord)
	err := replayLog(log, vals)
	m.vals, m.gen, m.logLen, m.counts = vals, gen, len(log), mapCounts(vals)
	return err
}

// mapCache holds the instMaps of the instances this index writes, bounded
// in entries. An instMap whose map is not kept (dropped for room, after a
// failed or refused write, or with no cache) and that nobody holds and
// that owes no mark (unsettled) is removed: it carries nothing then, and
// on a shared index a router never purges the instances another router's
// Sweep removes, so the names of instances long gone (pods replaced under
// new names) would otherwise stay for the process's life, each scanned by
// every eviction.
type mapCache struct {
	limit  int        // entries; < 0: none kept between Applies
	mu     sync.Mutex // guards byInst, total, tick
	byInst map[string]*instMap
	total  int
	tick   uint64
}

// get returns the instance's instMap (created empty), marked used and
// held until release.
func (c *mapCache) get(instance string) *instMap {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.byInst[instance]
	if m == nil {
		m = &instMap{name: instance}
		c.byInst[instance] = m
	}
	c.tick++
	m.used = c.tick
	m.refs++
	return m
}

// release ends a get's hold; the caller holds m.mu.
func (c *mapCache) release(m *instMap) {
	c.mu.Lock()
	m.refs--
	c.prune(m)
	c.mu.Unlock()
}

// prune removes m from the cache when it carries nothing (see mapCache);
// the caller holds m.mu and c.mu.
func (c *mapCache) prune(m *instMap) {
	if m.refs == 0 && m.vals == nil && m.unsettled.Load() == 0 && c.byInst[m.name] == m {
		delete(c.byInst, m.name)
	}
}

// peek returns the instance's instMap, nil if it has none.
func (c *mapCache) peek(instance string) *instMap {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byInst[instance]
}

// drop forgets m's map; the caller holds m.mu.
func (c *mapCache) drop(m *instMap) {
	m.vals, m.gen, m.logLen, m.counts = nil, "", 0, [1 + tiers.Count]int{}
	m.leased, m.pos = time.Time{}, Position{}
	c.resize(m, 0)
}

// forget removes the instance (Purge); the caller holds m.mu and one
// hold. A record another caller holds too (an Apply that called get and
// waits on m.mu) stays the instance's: that caller loads the map into it
// next, and a record no longer listed would keep its size in total for
// good (release cannot prune it, eviction never sees it) while a later
// get made a second one. The last release prunes it (see prune).
func (c *mapCache) forget(m *instMap) {
	c.drop(m)
	c.mu.Lock()
	if m.refs == 1 && c.byInst[m.name] == m {
		delete(c.byInst, m.name)
	}
	c.mu.Unlock()
}

// resize records m's new size (the caller holds m.mu) and, over the limit,
// drops the least recently used other maps that are not in use.
func (c *mapCache) resize(m *instMap, size int) {
	if c.limit < 0 && size > 0 {
		m.vals, m.gen, size = nil, "", 0
	}
	if m.vals != nil {
		size++ // the map itself
	}
	c.mu.Lock()
	c.total += size - m.size
	m.size = size
	c.prune(m)
	if c.total <= c.limit || c.limit < 0 {
		c.mu.Unlock()
		return
	}
	victims := make([]*instMap, 0, len(c.byInst))
	for _, o := range c.byInst {
		if o != m && o.size > 0 {
			victims = append(victims, o)
		}
	}
	c.mu.Unlock()
	sort.Slice(victims, func(i, j int) bool { return victims[i].used < victims[j].used })
	for _, o := range victims {
		if !o.mu.TryLock() {
			continue // being applied: it is recent anyway
		}
		c.drop(o)
		o.mu.Unlock()
		c.mu.Lock()
		over := c.total > c.limit
		c.mu.Unlock()
		if !over {
			return
		}
	}
}
