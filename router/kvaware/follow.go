package kvaware

import (
	"math"
	"sync"
)

// The prefill cost weight counts the requests that a recompute's work
// delays: those that join the instance's prefill queue after it, before
// the queue next empties (score.go weight). The mean of that number over
// all requests (kvScoring.weight's "behind") is the wrong mean for the
// decisions the weight matters in. A request is moved off a busy holder
// when the holder's queue is long, i.e. inside a burst, and inside a burst
// more requests follow than on average: the number is conditional on the
// moment. So the followers are also measured per level of the fleet's
// pending prefill at the moment a request is routed, and a decision reads
// the mean at its own level.
//
// The level is the router's pending requests (routed, no first byte yet;
// with replica sync, every replica's) per candidate instance: how many
// prefills the fleet has queued per server, a number without units, the
// same at 8 and at 128 instances. Levels are spaced by factors of two
// (queue lengths matter by their ratio: a burst multiplies the queue, it
// does not add a fixed amount to it) from a quarter of a request per
// instance (below it, at least three of four instances have nothing
// queued: an idle fleet) to 16 per instance (past it, a request finds 16
// or more ahead of it wherever it goes, so its busy period has about as
// many after it, near the weight's cap of 19, MaxAdaptiveCostWeight,
// which then binds). Nothing else is chosen: each level's
// mean is the same exponentially weighted sample mean as the others
// (drainSampleHalfLife samples of the level, drainMinSamples before it is
// read; until then the overall mean stands in).
//
// Measuring followers needs no end of the busy period: when a request
// joins an instance's busy period, every request already in it gains one
// follower, credited to the level each was routed at. A period still open
// has credited only the followers it has had so far, the same
// undercount the overall mean has.

// followLevels is the number of pending-work levels: [0, 1/4), then
// doubling from 1/4 to 16 requests per instance, and 16 or more.
const followLevels = 8

// followLevel maps the fleet's pending requests per instance to its level.
func followLevel(perInstance float64) int {
	if !(perInstance >= 0.25) {
		return 0
	}
	_, e := math.Frexp(perInstance) // perInstance = f × 2^e, f in [0.5, 1)
	// 1/4 → e = −1 → level 1; 1/2 → 2; 1 → 3; … 16 → 7.
	return min(e+2, followLevels-1)
}

// periodLevels counts, per level, the requests of an instance's current
// prefill busy period (as the router saw it).
type periodLevels struct {
	mu sync.Mutex
	n  [followLevels]int32
}

// join records a request routed at level lv; first says it starts a new
// busy period. It returns the requests already in the period, per level:
// each gains this request as a follower.
func (p *periodLevels) join(lv int, first bool) (ahead [followLevels]int32) {
	p.mu.Lock()
	if first {
		p.n = [followLevels]int32{}
	}
	ahead = p.n
	p.n[lv]++
	p.mu.Unlock()
	return ahead
}

// followTable is the mean number of followers per level: per level an
// exponentially weighted sum of followers credited and of requests
// counted, both decayed when a request of the level is counted.
type followTable struct {
	mu       sync.Mutex
	sum, cnt [followLevels]float64
	n        [followLevels]int
}

// add counts a request routed at level lv and credits one follower to
// each request ahead of it in its busy period, at their levels.
func (t *followTable) add(lv int, ahead [followLevels]int32) {
	t.mu.Lock()
	t.sum[lv] *= drainDecay
	t.cnt[lv] = t.cnt[lv]*drainDecay + 1
	t.n[lv]++
	for l, k := range ahead {
		t.sum[l] += float64(k)
	}
	t.mu.Unlock()
}

// mean is the mean number of followers of a request routed at level lv,
// and whether the level has drainMinSamples samples.
func (t *followTable) mean(lv int) (float64, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.n[lv] < drainMinSamples || !(t.cnt[lv] > 0) {
		return 0, false
	}
	return t.sum[lv] / t.cnt[lv], true
}

// fleetLevel is the level of the fleet's pending requests over the
// decision's candidates.
func (st *KVState) fleetLevel(ev *kvEval) int {
	if len(ev.cands) == 0 {
		return 0
	}
	var n int64
	st.pendMu.RLock()
	for i := range ev.cands {
		if pc := ev.pending(st, i); pc != nil {
			n += pc.reqs.Load()
		}
		n += ev.cands[i].peer.reqs
	}
	st.pendMu.RUnlock()
	return followLevel(float64(n) / float64(len(ev.cands)))
}

// behindAt is the number of requests a recompute delays at level lv: the
// level's measured mean, or the overall mean until the level has enough
// samples.
func (st *KVState) behindAt(lv int) float64 {
	if m, ok := st.follow.mean(lv); ok {
		return m
	}
	return st.behind.mean()
}
