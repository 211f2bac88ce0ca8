package kvindex

import (
	"context"
	"math/bits"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/tiers"
)

// Lookup implements Index. It walks the chain through the global block map
// once, intersecting the holders of each block with the instances still
// matching, and stops when none is left: its cost is the matched length
// plus the number of instances in the result, however many instances share
// the prefix (each block costs O(1) while its holders are the same few
// instances, or a few word operations per 64 instance slots while many
// instances hold it).
func (m *Memory) Lookup(ctx context.Context, keys []Key) ([]Match, error) {
	return m.LookupAppend(ctx, nil, keys)
}

// LookupAppend is Lookup writing its matches into dst's storage (its
// contents are replaced), so that a caller deciding often reuses one
// buffer instead of allocating a Match per holder per lookup.
func (m *Memory) LookupAppend(ctx context.Context, dst []Match, keys []Key) ([]Match, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if len(keys) == 0 {
		return dst[:0], nil
	}
	ck := chainKeys{keys: keys, n: len(keys)}
	return m.lookup(dst, &ck), nil
}

// LookupTokens is AppendKeys(keys, parent, tokens, blockSize) and
// LookupAppend(ctx, dst, the appended keys) in one walk: it returns the
// matches and keys with the keys of every full block appended, also when
// ctx is done (then with no matches and ctx's error) or the walk stops
// early.
//
// Keying a block is one chain of dependent multiplies on the previous
// block's key: the CPU waits on that chain with most of its units idle.
// The walk's work on a block does not depend on the next key, so making
// each key as the walk reaches it lets the CPU do both at once; keying
// first and walking after pays for them one after the other.
func (m *Memory) LookupTokens(ctx context.Context, dst []Match, keys []Key, parent Key, tokens []uint32, blockSize int) ([]Match, []Key, error) {
	start := len(keys)
	if err := ctx.Err(); err != nil || blockSize <= 0 || len(tokens) < blockSize {
		keys = AppendKeys(keys, parent, tokens, blockSize)
		if err != nil {
			return nil, keys, err
		}
		out, err := m.LookupAppend(ctx, dst, keys[start:])
		return out, keys, err
	}
	n := len(tokens) / blockSize
	keys = grow(keys, n)
	ck := chainKeys{keys: keys[start:start], n: n, parent: parent, tokens: tokens[:n*blockSize], bs: blockSize}
	out := m.lookup(dst, &ck)
	ck.rest()
	return out, keys[:start+n], nil
}

// lookup runs one lookup of ck's keys into dst's storage.
func (m *Memory) lookup(dst []Match, ck *chainKeys) []Match {
	ls, _ := m.lookups.Get().(*lookupState)
	if ls == nil {
		ls = &lookupState{}
	}
	ls.out = dst[:0]
	m.mu.RLock()
	out := ls.run(m, ck)
	m.mu.RUnlock()
	ls.out, ls.bm = nil, nil // the pool must not keep results or the map alive
	m.lookups.Put(ls)
	return m.bs.roundUnits(out)
}

// chainKeys is a lookup's keys: n in all, keys[i] made when first asked
// for from the blocks of tokens (LookupTokens), or all given.
type chainKeys struct {
	keys   []Key // made so far; its storage holds n
	n      int
	parent Key      // of block 0
	tokens []uint32 // n blocks of bs tokens; unused when all keys are given
	bs     int
}

// at returns key i (< n).
func (ck *chainKeys) at(i int) Key {
	if i < len(ck.keys) {
		return ck.keys[i]
	}
	return ck.make(i)
}

// make makes the keys up to i, as AppendKeys does.
func (ck *chainKeys) make(i int) Key {
	j := len(ck.keys)
	k := ck.parent
	if j > 0 {
		k = ck.keys[j-1]
	}
	if ck.bs == 16 {
		for ; j <= i; j++ {
			k = Key(xxh64Block16(uint64(k), (*[16]uint32)(ck.tokens[j*16:])))
			ck.keys = append(ck.keys, k)
		}
		return ck.keys[i]
	}
	ck.keys = AppendKeys(ck.keys, k, ck.tokens[j*ck.bs:(i+1)*ck.bs], ck.bs)
	return ck.keys[i]
}

// rest makes the keys the walk did not ask for.
func (ck *chainKeys) rest() {
	if len(ck.keys) < ck.n {
		ck.make(ck.n - 1)
	}
}

// lookupState is one lookup's working set, pooled. The instances still
// matching are kept either as a list of candidates (few) or as per-tier
// bitsets over instance slots (many, while the chain's blocks are held by
// holder sets).
type lookupState struct {
	bm  *blockMap
	out []Match

	// list mode: candidates sorted by slot.
	cands []cand

	// set mode: alive[t] holds the slots whose run in tier t (or a faster
	// one) is still unbroken; outIdx maps a slot to its Match.
	set    bool
	words  int
	alive  [tiers.Count][]uint64
	outIdx []int32
	n      int // slots alive in some tier
	// uniform: every alive[t] equals alive[0] (all matched in the GPU tier
	// so far), so a holder set whose holders are all on GPU is intersected
	// once rather than once per tier.
	uniform bool
}

// cand is one instance still matching: from is the fastest tier whose run
// is unbroken (tiers.Count: none), out its Match.
type cand struct {
	slot uint32
	from uint8
	out  int32
}

func (ls *lookupState) run(m *Memory, keys *chainKeys) []Match {
	bm := &m.blocks
	ls.bm = bm
	node := bm.find(keys.at(0))
	if node < 0 {
		return ls.out
	}
	ls.start(m.slots, node)
	i := 1
	for ; i < keys.n && ls.alive1(); i++ {
		if len(ls.cands) == 1 && !ls.set {
			if i, node = ls.runOne(keys, i, node); i == keys.n {
				break
			}
		}
		// The blocks of a chain stored by one event got adjacent nodes (last
		// block first): try the neighbours before the table.
		k, next := keys.at(i), int32(-1)
		switch {
		case node > 0 && *bm.keyAt(node - 1) == k && atomic.LoadUint32(bm.holdAt(node-1)) != 0:
			next = node - 1
		case node+1 < bm.n && *bm.keyAt(node + 1) == k && atomic.LoadUint32(bm.holdAt(node+1)) != 0:
			next = node + 1
		default:
			next = bm.find(k)
		}
		if next < 0 {
			break
		}
		node = next
		if len(ls.cands) == 1 && !ls.set {
			// One instance left (the common tail of a lookup): its block
			// held inline by it alone is the fast path.
			p := bm.holdAt(node)
			if w := atomic.LoadUint32(p); w&hSpill == 0 && holderSlot(w) == ls.cands[0].slot {
				c := &ls.cands[0]
				if l := level(w); l > c.from {
					ls.advance(c, l, int32(i))
				}
				if w&hHit == 0 {
					atomic.OrUint32(p, hHit)
				}
				continue
			}
		}
		ls.step(node, int32(i))
	}
	ls.finish(int32(i))
	return ls.out
}

// runOne follows the one candidate left from node along the nodes before
// it (a chain stored by one event, last block first), while each is the
// next key and held inline by the candidate alone: the tail of most
// lookups, one instance's own continuation, without the general step's
// checks per block. It returns the position of the first key it did not
// take and the last node it took; the caller goes on from there.
func (ls *lookupState) runOne(keys *chainKeys, i int, node int32) (int, int32) {
	bm, c := ls.bm, &ls.cands[0]
	made, n := keys.keys, keys.n // in registers: the loop stores through pointers
	for ; i < n && node > 0; i++ {
		j := node - 1
		if i >= len(made) {
			keys.make(i)
			made = keys.keys
		}
		if bm.keys[j>>chunkBits][j&chunkMask] != made[i] {
			break
		}
		p := &bm.hold[j>>chunkBits][j&chunkMask]
		w := atomic.LoadUint32(p)
		if w == 0 || w&hSpill != 0 || holderSlot(w) != c.slot {
			break
		}
		if l := level(w); l > c.from {
			ls.advance(c, l, int32(i))
		}
		if w&hHit == 0 {
			atomic.OrUint32(p, hHit)
		}
		node = j
	}
	return i, node
}

// alive1 reports whether any instance still matches.
func (ls *lookupState) alive1() bool {
	if ls.set {
		return ls.n > 0
	}
	return len(ls.cands) > 0
}

// start takes the holders of the chain's first block as the result.
func (ls *lookupState) start(slots []*memInstance, node int32) {
	ls.set, ls.cands = false, ls.cands[:0]
	p := ls.bm.holdAt(node)
	w := atomic.LoadUint32(p)
	if w&hSpill == 0 {
		ls.out = append(ls.out, Match{Instance: slots[holderSlot(w)].name})
		ls.cands = append(ls.cands, cand{slot: holderSlot(w), from: level(w)})
		markHit(p)
		return
	}
	sp := &ls.bm.spills[w&^hSpill]
	if sp.set == nil {
		ls.out = resize(ls.out, len(sp.list))
		for k := range sp.list {
			w := atomic.LoadUint32(&sp.list[k])
			ls.out[k].Instance = slots[holderSlot(w)].name
			ls.cands = append(ls.cands, cand{slot: holderSlot(w), from: level(w), out: int32(k)})
			markHit(&sp.list[k])
		}
		return
	}
	hs := sp.set
	ls.set, ls.words, ls.n, ls.uniform = true, hs.words, hs.n, hs.slow == 0
	for t := range ls.alive {
		ls.alive[t] = append(ls.alive[t][:0], hs.lv[t]...)
	}
	if need := hs.words * 64; len(ls.outIdx) < need {
		ls.outIdx = make([]int32, need)
	}
	ls.out = resize(ls.out, hs.n)
	k := int32(0)
	eachBit(ls.alive[tiers.Count-1], func(slot int) {
		ls.outIdx[slot] = k
		ls.out[k].Instance = slots[slot].name
		k++
	})
	hs.markHits(ls.alive[tiers.Count-1])
}

// step intersects the instances still matching with node's holders; i is
// the node's position in the chain.
func (ls *lookupState) step(node int32, i int32) {
	p := ls.bm.holdAt(node)
	w := atomic.LoadUint32(p)
	var sp *spill
	if w&hSpill != 0 {
		sp = &ls.bm.spills[w&^hSpill]
	}
	if ls.set {
		if sp != nil && sp.set != nil {
			ls.stepSets(sp.set, i)
			return
		}
		if sp == nil && ls.uniform {
			ls.stepOne(p, w, i)
			return
		}
		ls.toList() // few holders: at most that many instances go on
	}
	kept := 0
	switch {
	case sp == nil: // one holder
		slot, lv := holderSlot(w), level(w)
		for _, c := range ls.cands {
			l := uint8(tiers.Count)
			if c.slot == slot {
				l = lv
			}
			if ls.advance(&c, l, i) {
				ls.cands[kept] = c
				kept++
				markHit(p)
			}
		}
	case sp.set == nil: // a holder list, sorted by slot like the candidates
		list, k := sp.list, 0
		for _, c := range ls.cands {
			for k < len(list) && holderSlot(atomic.LoadUint32(&list[k])) < c.slot {
				k++
			}
			l := uint8(tiers.Count)
			if k < len(list) {
				if lw := atomic.LoadUint32(&list[k]); holderSlot(lw) == c.slot {
					l = level(lw)
				}
			}
			if ls.advance(&c, l, i) {
				ls.cands[kept] = c
				kept++
				markHit(&list[k])
			}
		}
	default: // a holder set
		hs := sp.set
		for _, c := range ls.cands {
			wi, bit := int(c.slot/64), uint64(1)<<(c.slot%64)
			l := uint8(tiers.Count)
			if wi < hs.words {
				for t := c.from; t < tiers.Count; t++ {
					if hs.lv[t][wi]&bit != 0 {
						l = t
						break
					}
				}
			}
			if ls.advance(&c, l, i) {
				ls.cands[kept] = c
				kept++
				if atomic.LoadUint64(&hs.hit[wi])&bit == 0 {
					atomic.OrUint64(&hs.hit[wi], bit)
				}
			}
		}
	}
	ls.cands = ls.cands[:kept]
}

// stepOne is step from set mode onto a block one instance holds (where a
// shared prefix ends and one instance's own chain goes on), while every
// instance still matching matches in every tier: the others' runs end at
// i without first becoming candidates one by one.
func (ls *lookupState) stepOne(p *uint32, w uint32, i int32) {
	slot := holderSlot(w)
	a, out, outIdx := ls.alive[0], ls.out, ls.outIdx
	var ended [tiers.Count]int
	for t := range ended {
		ended[t] = int(i)
	}
	held := false
	for wi, x := range a {
		for ; x != 0; x &= x - 1 {
			s := wi*64 + bits.TrailingZeros64(x)
			if uint32(s) == slot {
				held = true
				continue
			}
			out[outIdx[s]].Blocks = ended
		}
	}
	ls.set, ls.cands = false, ls.cands[:0]
	if !held {
		return
	}
	c := cand{slot: slot, out: ls.outIdx[slot]}
	if ls.advance(&c, level(w), i) {
		ls.cands = append(ls.cands, c)
		markHit(p)
	}
}

// advance applies a block whose fastest tier held by c is l (tiers.Count:
// not held): the runs of the tiers faster than l end at i. It reports
// whether c still matches in some tier.
func (ls *lookupState) advance(c *cand, l uint8, i int32) bool {
	for ; c.from < l; c.from++ {
		ls.out[c.out].Blocks[c.from] = int(i)
	}
	return c.from < tiers.Count
}

// word is word wi of the bitset lv, zero past its end (a holder set's
// words stop at its highest slot): what stepSets and stepUniform intersect
// an alive word with.
func word(lv []uint64, wi int) uint64 {
	if wi < len(lv) {
		return lv[wi]
	}
	return 0
}

// stepSets intersects the alive bitsets with a holder set's.
func (ls *lookupState) stepSets(hs *holderSet, i int32) {
	if ls.uniform && hs.slow == 0 {
		ls.stepUniform(hs, i)
		return
	}
	ls.uniform = false
	for t := range tiers.Count {
		a, lv := ls.alive[t], hs.lv[t]
		for wi, x := range a {
			if x == 0 {
				continue
			}
			y := x & word(lv, wi)
			for d := x &^ y; d != 0; d &= d - 1 {
				ls.out[ls.outIdx[wi*64+bits.TrailingZeros64(d)]].Blocks[t] = int(i)
			}
			a[wi] = y
		}
	}
	ls.settle(hs)
}

// stepUniform is stepSets when every tier's alive set and every tier's
// holder set are the same: one intersection, its drops ending every tier.
//
// Along a prefix every instance still matching holds (the common case:
// a fleet-wide system prompt) nothing drops: the alive sets stay as they
// are, unwritten, and so does their count.
func (ls *lookupState) stepUniform(hs *holderSet, i int32) {
	a, lv := ls.alive[0], hs.lv[0]
	dropped := false
	for wi, x := range a {
		if x == 0 {
			continue
		}
		y := x & word(lv, wi)
		if y == x {
			continue
		}
		dropped = true
		for d := x &^ y; d != 0; d &= d - 1 {
			m := &ls.out[ls.outIdx[wi*64+bits.TrailingZeros64(d)]]
			for t := range tiers.Count {
				m.Blocks[t] = int(i)
			}
		}
		for t := range tiers.Count {
			ls.alive[t][wi] = y
		}
	}
	if !dropped && !(ls.n > 0 && ls.n <= listMax) {
		hs.markHits(a) // settle's work, with n unchanged
		return
	}
	ls.settle(hs)
}

// settle counts the instances still matching after a set step, marks their
// holds as hit, and goes to list mode when few are left.
func (ls *lookupState) settle(hs *holderSet) {
	top := ls.alive[tiers.Count-1]
	n := 0
	for _, x := range top {
		n += bits.OnesCount64(x)
	}
	ls.n = n
	hs.markHits(top)
	if n > 0 && n <= listMax {
		ls.toList()
	}
}

// toList turns the alive bitsets into candidates.
func (ls *lookupState) toList() {
	ls.cands = ls.cands[:0]
	eachBit(ls.alive[tiers.Count-1], func(slot int) {
		wi, bit := slot/64, uint64(1)<<(slot%64)
		from := uint8(0)
		for ls.alive[from][wi]&bit == 0 {
			from++
		}
		ls.cands = append(ls.cands, cand{slot: uint32(slot), from: from, out: ls.outIdx[slot]})
	})
	ls.set = false
}

// finish ends the runs still unbroken after n blocks.
func (ls *lookupState) finish(n int32) {
	if !ls.set {
		for _, c := range ls.cands {
			ls.advance(&c, tiers.Count, n)
		}
		return
	}
	for t := range tiers.Count {
		eachBit(ls.alive[t], func(slot int) { ls.out[ls.outIdx[slot]].Blocks[t] = int(n) })
	}
}

// resize returns ms holding n zero Matches, reusing its storage.
func resize(ms []Match, n int) []Match {
	if cap(ms) < n {
		return make([]Match, n)
	}
	ms = ms[:n]
	clear(ms)
	return ms
}

func eachBit(words []uint64, f func(int)) {
	for wi, x := range words {
		for ; x != 0; x &= x - 1 {
			f(wi*64 + bits.TrailingZeros64(x))
		}
	}
}
