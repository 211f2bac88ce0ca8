package kvaware

import (
	"context"
	"math"
	"slices"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
)

// candIndex maps instance ids to positions in one candidate list, so that
// kv_aware finds each index match's candidate in O(1) rather than by
// scanning the list (which made a decision quadratic in the fleet when
// many instances share a prefix). kv_aware keeps the last index it built
// and reuses it while the candidate list is the same one (same instances,
// same order): checking that costs a pointer comparison per candidate.
type candIndex struct {
	insts []*router.Instance
	pos   map[string]int32
	// pend caches each candidate's pending-prefill counter (KVState drops
	// one only when its instance leaves the pool, which no later candidate
	// list holds); nil where none existed yet when the index was built.
	pend []atomic.Pointer[pendingCounter]
	// pendMiss is, per candidate without a counter, 1 + the number of
	// counters KVState had made when its lookup found none: while that number
	// stands, none was made for it since (a fleet mostly idle but for a
	// few instances skips a map lookup by id per candidate and decision).
	pendMiss []atomic.Int64
	// load caches each candidate's load slot (dropped only as pend is),
	// loadMiss, per candidate without one, 1 + loadStore.made when its
	// lookup found none: as pend and pendMiss, for the load samples.
	load     []atomic.Pointer[loadSlot]
	loadMiss []atomic.Int64
}

// candIndexMin is the fewest matches for which the index pays: below it a
// scan of the candidates is cheaper than hashing the ids.
const candIndexMin = 8

// candIndexCache holds kv_aware's last candIndex.
type candIndexCache struct{ last atomic.Pointer[candIndex] }

// get returns an index of cands, the cached one when cands is its list.
func (c *candIndexCache) get(cands []*router.Instance) *candIndex {
	if ci := c.last.Load(); ci != nil && slices.Equal(ci.insts, cands) {
		return ci
	}
	ci := &candIndex{insts: slices.Clone(cands), pos: make(map[string]int32, len(cands)), pend: make([]atomic.Pointer[pendingCounter], len(cands)),
		pendMiss: make([]atomic.Int64, len(cands)), load: make([]atomic.Pointer[loadSlot], len(cands)), loadMiss: make([]atomic.Int64, len(cands))}
	for i, in := range cands {
		if _, dup := ci.pos[in.ID()]; !dup {
			ci.pos[in.ID()] = int32(i) // the first, as a scan would find
		}
	}
	c.last.Store(ci)
	return ci
}

// peek returns the index of cands when the cached one is theirs, or a new
// one when none was ever built; nil when the cache holds another list
// (a decision whose matches are few does not rebuild it: the finder
// does, for one whose matches are many).
func (c *candIndexCache) peek(cands []*router.Instance) *candIndex {
	ci := c.last.Load()
	switch {
	case ci == nil:
		return c.get(cands)
	case slices.Equal(ci.insts, cands):
		return ci
	}
	return nil
}

// candFinder finds the candidate evaluation of an instance id: by the
// index when there are many matches to place, else by scanning.
type candFinder struct {
	ev *kvEval
	ci *candIndex
}

func (s *KVAware) finder(ev *kvEval, cands []*router.Instance, matches int) candFinder {
	f := candFinder{ev: ev}
	if matches >= candIndexMin {
		if ev.ci == nil {
			ev.ci = s.cands.get(cands)
		}
		f.ci = ev.ci
		if ev.permOf != f.ci {
			ev.perm, ev.permOf = ev.perm[:0], f.ci
		}
	}
	return f
}

// pending returns candidate i's pending-prefill counter (nil: none yet),
// from the candidate index's cache when there is one. Called with
// st.pendMu held for reading.
func (ev *kvEval) pending(st *KVState, i int) *pendingCounter {
	var cache *cachedSlots[pendingCounter]
	if ci := ev.ci; ci != nil {
		cache = &cachedSlots[pendingCounter]{ci.pend, ci.pendMiss}
	}
	// One counter per id while its instance is in the pool: decisions
	// sharing the index agree.
	return cache.get(i, st.pendMade, st.pend, ev.cands[i].inst.ID())
}

// loadSlot returns candidate i's load slot (nil: none yet), from the
// candidate index's cache when there is one. Called with st.loads.mu held
// for reading.
func (ev *kvEval) loadSlot(st *KVState, i int) *loadSlot {
	var cache *cachedSlots[loadSlot]
	if ci := ev.ci; ci != nil {
		cache = &cachedSlots[loadSlot]{ci.load, ci.loadMiss}
	}
	return cache.get(i, st.loads.made, st.loads.samples, ev.cands[i].inst.ID())
}

// cachedSlots is a candidate index's per-candidate cache of a map's
// values that are made once per instance id and removed only when the
// instance leaves the pool (no later list holds it): a hit is kept, and a
// miss stands while the map has made no value since (made, the
// values ever made, as counted when the miss was recorded, plus one).
type cachedSlots[T any] struct {
	got  []atomic.Pointer[T]
	miss []atomic.Int64
}

// get returns candidate i's value, id's in m (nil: none), through the
// cache when c is not nil.
func (c *cachedSlots[T]) get(i int, made int64, m map[string]*T, id string) *T {
	if c == nil {
		return m[id]
	}
	if v := c.got[i].Load(); v != nil {
		return v
	}
	n := made + 1
	if c.miss[i].Load() == n {
		return nil
	}
	v := m[id]
	if v != nil {
		c.got[i].Store(v)
	} else {
		c.miss[i].Store(n)
	}
	return v
}

// scoreMemo is the part of a prediction that depends only on the blocks
// a candidate holds (see kvScoring.score).
type scoreMemo struct {
	ok            bool
	blocks        [tiers.Count]int
	matched       [tiers.Count]int
	prefill, cost float64
	rest          int // tokens the candidate would prefill (kvScoring.shareCost)
}

// permEntry is match k's candidate i (-1: none) in an evaluation's last
// decision over a candidate list, and the match's instance id then.
type permEntry struct {
	id string
	i  int32
}

// find returns the candidate of match k, instance id. The index lists
// holders in a stable order (its instance slots), so the candidate that
// match k had in this evaluation's previous decision over the same list is
// tried first: when the id is the one match k had then, so is the
// candidate (the list, hence each position's instance, is the same). The
// index hands out the same string for an instance each time, so comparing
// the two ids is a pointer comparison, reading neither the candidate nor
// its instance.
func (f candFinder) find(k int, id string) *candEval {
	ev := f.ev
	if f.ci == nil {
		return ev.byID(id)
	}
	if k < len(ev.perm) {
		if p := ev.perm[k]; p.i >= 0 && p.id == id {
			return &ev.cands[p.i]
		}
	}
	i, ok := f.ci.pos[id]
	if !ok {
		i = -1
	}
	for len(ev.perm) <= k {
		ev.perm = append(ev.perm, permEntry{i: -1})
	}
	ev.perm[k] = permEntry{id: id, i: i}
	if i < 0 {
		return nil
	}
	return &ev.cands[i]
}

// cold reports whether nothing vouches for any of the prompt's blocks on
// the candidate: its score is then a function of its queue alone.
func (ce *candEval) cold() bool {
	return ce.blocks[len(ce.blocks)-1] == 0 && ce.stale[len(ce.stale)-1] == 0
}

// coldMin tracks the least queue among cold candidates: under the
// concurrency threshold (free) and overall (all). sc and tokens price the
// step a cold candidate's prefill (the whole prompt) shares with the
// requests waiting there (kvScoring.shareCost).
type coldMin struct {
	free, all float64
	sc        *kvScoring
	tokens    int
}

// key is what a cold candidate's score holds beyond the prefill every
// cold one has alike.
func (c *coldMin) key(ce *candEval) float64 {
	return ce.queue + ce.place + c.sc.shareCost(ce, c.tokens)
}

func (c *coldMin) note(ce *candEval) {
	k := c.key(ce)
	c.all = min(c.all, k)
	if !ce.full {
		c.free = min(c.free, k)
	}
}

// scoreCold scores the cold candidates that can matter, and gives the
// others an infinite score: a cold candidate's score is its queue and
// placement term plus the same prefill for every cold one, so one whose
// queue and placement exceed the least cold ones (among those under the threshold, or among all) by
// more than the tie tolerance can neither win nor tie, and kv_aware's
// per-decision work stays with the instances holding something plus the
// cheapest cold ones, however large the fleet. Queues (all candidates
// have theirs) still serve the load-bound and least-queue choices.
func (s *KVAware) scoreCold(ev *kvEval, c coldMin) {
	for _, i := range ev.cold {
		ce := &ev.cands[i]
		if k := c.key(ce); (!ce.full && k <= c.free+s.sc.tieTol) || k <= c.all+s.sc.tieTol {
			s.sc.score(ev, ce)
			continue
		}
		ce.matched, ce.ttft = [len(ce.matched)]int{}, math.Inf(1)
		ce.score, ce.scoreStale, ce.scored = math.Inf(1), math.Inf(1), false
	}
}

// lookupAppender is an index that writes a lookup's matches into the
// caller's buffer (kvindex.Memory does): kv_aware reuses one per pooled
// evaluation instead of allocating a Match per holder per decision.
type lookupAppender interface {
	LookupAppend(ctx context.Context, dst []kvindex.Match, keys []kvindex.Key) ([]kvindex.Match, error)
}

// tokenLookuper is an index that keys a prompt as it looks it up
// (kvindex.Memory.LookupTokens): the keys are as kvindex.AppendKeys makes
// them, the matches as LookupAppend finds them.
type tokenLookuper interface {
	LookupTokens(ctx context.Context, dst []kvindex.Match, keys []kvindex.Key, parent kvindex.Key, tokens []uint32, blockSize int) ([]kvindex.Match, []kvindex.Key, error)
}

// specProbe remembers, for the last match length g asked about, whether
// the speculative overlay holds anything at blocks g-1 and g: candidates
// sharing a prefix share g, so one decision asks the overlay about a few
// keys rather than twice per candidate.
type specProbe struct {
	g           int
	ok          bool
	below, here bool
}

// at reports whether any instance holds keys[g-1] (false when g is 0) and
// keys[g] (false past the end) speculatively.
func (p *specProbe) at(s *speculative, sc *specScan, keys []kvindex.Key, g int) (below, at bool) {
	if !p.ok || p.g != g {
		p.ok, p.g = true, g
		p.below = g > 0 && s.any(sc, keys, g-1)
		p.here = g < len(keys) && s.any(sc, keys, g)
	}
	return p.below, p.here
}
