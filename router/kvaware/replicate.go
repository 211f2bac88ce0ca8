package kvaware

import (
	"math"
	"sync"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// Hot-prefix replication: rent or buy.
//
// The score prices a move off a prefix's holder as if the recompute served
// only the request that pays it. For a prefix that many requests share (one
// system prompt for every tenant, a coding assistant's instructions) that
// is wrong: a second copy costs one recompute and then serves every later
// request of the prefix, so each request of it, one at a time, declines a
// move that the prefix's requests together would have paid for many times
// over, and one instance keeps the whole prefix's traffic.
//
// This is the ski-rental problem. Each request the rule sends to the busy
// holder rather than the least-loaded instance pays rent: the queue it waits
// for beyond that instance's, q_pick − q_alt, which a copy there would have
// saved it. Buying is making the copy, priced as sending this request to
// the alternative, at the difference of their scores, score_alt −
// score_pick (the request's own longer prefill and the weighted delay of
// the requests behind the recompute, less the queue it saves); where the
// edge can, the copy is a warm-up request of the prefix beside the request,
// which stays where the score put it (replicate, below). The deterministic rule —
// keep paying rent until the rent paid since the last purchase reaches the
// price, then buy — never pays more than twice what an offline optimum that
// knew the prefix's future would pay (Karlin, Manasse, Rudolph, Sleator,
// "Competitive snoopy caching", 1988), and it needs no constant: no rate
// window, no horizon, no threshold on how hot "hot" is. A prefix with one
// request never pays rent twice; one whose holders are not busier than the
// rest of the fleet pays none.
//
// Rent is kept per prefix: on the first block of the stretch a copy on the
// alternative would add (the first block the alternative does not hold,
// below the pick's match). Every request that needed that stretch passes
// through that block, so the requests a copy there would have served share
// one account: every tenant of one system prompt; the requests of a coding
// assistant's users, whose prompts share its instructions, when the
// least-loaded instance holds none of them (the copy carries the
// instructions and moves one user's context: the holder's excess load is
// what the rent measured); the turns of one conversation, when the
// alternative holds only what all conversations share.

// rentSets is the number of sets of the rent table (two entries each): far
// more than the prefixes hot at once (each needs many requests to matter),
// and 128 KiB per pool (32-byte entries).
const rentSets = 2048

type rentEntry struct {
	key  kvindex.Key
	rent float64 // seconds of waiting paid since the last copy
	// gen counts the copies bought of the prefix, as far as this replica
	// knows (its own purchases and, with replica sync, the pool's:
	// replicate_shared.go); the rent is that generation's.
	gen  uint64
	used bool
}

// rentTable is the rent accounts of recently used prefixes: a two-way
// set-associative table that, on a miss in a full set, replaces the entry
// with less rent (a cold prefix's account, not a hot one's). Safe for
// concurrent use.
//
// A purchase leaves its entry in place with no rent and the next
// generation (the peers must hear of it); as the victim of a miss it
// behaves as the free slot it was before (no other entry holds no rent),
// and rent paid on it again starts from nothing, as on a new entry: one
// router's accounts are the same either way.
type rentTable struct {
	mu   sync.Mutex
	sets [rentSets][2]rentEntry
	// peers makes the accounts the pool's (replicate_shared.go); nil
	// without replica sync (or peers that do not share them).
	peers RentPeers
	// dirty holds the keys whose account changed or was dropped since
	// the peers were last sent them (only while peers is set).
	dirty map[kvindex.Key]struct{}
}

func (t *rentTable) set(k kvindex.Key) *[2]rentEntry {
	return &t.sets[(uint64(k)^uint64(k)>>29)%rentSets]
}

// find is k's entry, nil if none; t.mu held.
func (t *rentTable) find(k kvindex.Key) *rentEntry {
	s := t.set(k)
	for i := range s {
		if s[i].used && s[i].key == k {
			return &s[i]
		}
	}
	return nil
}

// own is this replica's account of k: the generation and the rent it has
// paid in it (zero without one).
func (t *rentTable) own(k kvindex.Key) (gen uint64, rent float64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.find(k); e != nil {
		return e.gen, e.rent
	}
	return 0, 0
}

// get is the rent paid on k since its last copy: this replica's own, or
// with peers that share theirs the pool's (replicate_shared.go).
func (t *rentTable) get(k kvindex.Key) float64 {
	if t.peers == nil {
		_, rent := t.own(k)
		return rent
	}
	_, acc := t.pool(k)
	return acc
}

// poolGen is the latest generation of k any live replica knows of, at
// least this replica's own (0 without peers).
func (t *rentTable) poolGen(k kvindex.Key) uint64 {
	if t.peers == nil {
		return 0
	}
	g, _ := t.pool(k)
	return g
}

// pool is the pool's account of k (RentPeers.RentAccount). A generation
// above this replica's own is adopted at once (its entry moves to it with
// no rent, and the peers hear of it): a purchase seen once is never
// un-seen, even when the replica that made it restarts or dies before
// this one pays rent again. Without an entry this replica has no rent
// that could count again, and none is made (it would evict an account).
func (t *rentTable) pool(k kvindex.Key) (uint64, float64) {
	gen, rent := t.own(k)
	g, acc := t.peers.RentAccount(uint64(k), gen, rent)
	if g > gen {
		t.mu.Lock()
		if e := t.find(k); e != nil && e.gen < g {
			e.gen, e.rent = g, 0
			t.touch(k)
		}
		t.mu.Unlock()
	}
	return g, acc
}

// entry is k's entry, made (in generation gen) if there is none; t.mu
// held.
func (t *rentTable) entry(k kvindex.Key, gen uint64) *rentEntry {
	if e := t.find(k); e != nil {
		return e
	}
	s := t.set(k)
	v := 0
	if s[0].used && (!s[1].used || s[1].rent < s[0].rent) {
		v = 1
	}
	if s[v].used {
		t.touch(s[v].key) // dropped: the peers forget it too
	}
	s[v] = rentEntry{key: k, gen: gen, used: true}
	return &s[v]
}

// touch marks k's account as changed since the last send; t.mu held.
// The sync drains the changes every interval; should it stop, they are
// bounded by what a peer holds of one replica (replicasync.MaxPeerRents),
// and beyond that forgotten: the next whole table (every heartbeat)
// carries them.
func (t *rentTable) touch(k kvindex.Key) {
	if t.peers == nil {
		return
	}
	if len(t.dirty) >= replicasync.MaxPeerRents {
		clear(t.dirty)
	}
	t.dirty[k] = struct{}{}
}

// add pays rent r on k.
func (t *rentTable) add(k kvindex.Key, r float64) {
	if !(r > 0) || math.IsInf(r, 0) {
		return
	}
	g := t.poolGen(k)
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entry(k, g)
	if e.gen < g { // a peer bought a copy since: its rent starts again
		e.gen, e.rent = g, 0
	}
	e.rent = min(e.rent+r, replicasync.MaxRent) // what the wire carries
	t.touch(k)
}

// reset clears k's account: a copy was bought.
func (t *rentTable) reset(k kvindex.Key) {
	g := t.poolGen(k)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.peers == nil && t.find(k) == nil {
		return // one router: nothing to clear, nobody to tell
	}
	e := t.entry(k, g)
	// A generation at the wire's bound (a peer's, 2^62 purchases) stays
	// there rather than wrap or go where peers refuse it.
	e.gen, e.rent = min(max(e.gen, g)+1, replicasync.MaxRentGen), 0
	t.touch(k)
}

// rentNote is what a decision leaves for its commit: pay rent on key, or
// (bought) reset its account.
type rentNote struct {
	key    kvindex.Key
	rent   float64
	bought bool
	ok     bool
	// warm is set when the purchase is a warm-up copy on the candidate
	// at warmAt, made beside the request instead of moving it, of the
	// prompt's first warmBlocks blocks (the prefix the holder has stored).
	warm       bool
	warmAt     int
	warmBlocks int
}

// replicate applies the rent-or-buy rule to a kv_match pick: it returns the
// least-queue candidate instead (reason replicate) when the rent the pick's
// prefix has paid covers the price of a copy there, and otherwise notes the
// rent this request pays.
func (s *KVAware) replicate(ev *kvEval, pick int, reason router.Reason) (int, router.Reason) {
	ev.rent = rentNote{}
	if reason != router.ReasonKVMatch || s.sc.loadBound < 0 {
		return pick, reason
	}
	pc := &ev.cands[pick]
	// Only what the engine has stored counts: while the holder's match is
	// still being computed (speculative entries), the wait there is the
	// prefix's own prefill, which a copy would take as long to make, and
	// the first requests of a burst stay together.
	depth := min(pc.indexed, len(ev.keys))
	// No candidate's queue is below zero, so a holder whose own queue is
	// within the tie tolerance saves nobody anything: skip the pass over
	// the candidates (the common case of a fleet with room).
	if depth == 0 || !(pc.queue > s.sc.tieTol) {
		return pick, reason
	}
	alt := s.copyDest(ev, pick)
	if alt < 0 || alt == pick {
		return pick, reason
	}
	ac := &ev.cands[alt]
	// The alternative already holds the whole stored prefix (in any
	// tier, or being computed there): there is no copy to buy, and the
	// score has already weighed going there.
	if ac.blocks[len(ac.blocks)-1] >= depth {
		return pick, reason
	}
	saved := pc.queue - ac.queue
	if !(saved > s.sc.tieTol) {
		return pick, reason
	}
	if !ac.scored {
		s.sc.score(ev, ac)
	}
	key := ev.keys[ac.blocks[len(ac.blocks)-1]]
	price := ac.score - pc.score
	if s.st.rent.get(key) >= price {
		ev.rent = rentNote{key: key, bought: true, ok: true}
		// Two decisions meet here: where this request goes, and whether
		// the prefix buys a copy. The score answered the first — the
		// holder, counting what moving it would cost the fleet — and the
		// rent the second, for the prefix's later requests. Where the edge
		// can, the copy is made beside the request, not by moving it: a
		// warm-up request to the alternative (router.Warm) of the prefix
		// the holder has stored (depth blocks), not of the request's own
		// tail. The fleet computes what a move would have recomputed; the
		// request keeps its cache (docs/kv-aware.md, "Who pays for the
		// copy"). An edge that cannot send one moves the request.
		if ev.warmable {
			ev.rent.warm, ev.rent.warmAt, ev.rent.warmBlocks = true, alt, depth
			return pick, reason
		}
		return alt, router.ReasonReplicate
	}
	ev.rent = rentNote{key: key, rent: saved, ok: true}
	return pick, reason
}

// copyDest is where a copy of the pick's prefix would go: the candidate
// with the least queue among those with room that the admission queue
// keeps free of long prompts (kvEval.keptFree), other than the pick; else
// the least-queue candidate of all. On an instance running long contexts
// a copy serves its requests behind their decode steps, and is evicted
// by them within seconds (docs/BENCHMARKS.md §12, session 13).
func (s *KVAware) copyDest(ev *kvEval, pick int) int {
	if len(ev.keptFree) > 0 {
		if ev.keptSet == nil {
			ev.keptSet = make(map[string]struct{}, len(ev.keptFree))
		}
		for _, name := range ev.keptFree {
			ev.keptSet[name] = struct{}{}
		}
		if best := s.leastQueueOf(ev, true, pick, ev.keptSet); best >= 0 {
			return best
		}
	}
	return s.leastQueue(ev, true, -1)
}

// commitRent records what the committed decision paid or bought.
func (st *KVState) commitRent(n rentNote) {
	switch {
	case !n.ok:
	case n.bought:
		st.rent.reset(n.key)
	default:
		st.rent.add(n.key, n.rent)
	}
}
