package router

import (
	"context"
	"math/rand/v2"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/fmix"
)

// Interface guards.
var (
	_ Strategy = (*Random)(nil)
	_ Strategy = (*RoundRobin)(nil)
	_ Strategy = (*LeastOutstanding)(nil)
	_ Strategy = (*PrefixAware)(nil)
)

// Random picks uniformly among candidates under Threshold; when all are
// full, the least outstanding.
type Random struct {
	Threshold int
	rnd       func(n uint64) uint64
}

// Name implements Strategy.
func (*Random) Name() string { return config.StrategyRandom }

// Pick implements Strategy.
func (s *Random) Pick(_ context.Context, _ *Request, cands []*Instance) (Decision, error) {
	if len(cands) == 0 {
		return Decision{}, ErrNoCandidates
	}
	// Count the available ones, then take the k-th: one random draw, no allocation.
	n := 0
	for _, c := range cands {
		if !c.Full(s.Threshold) {
			n++
		}
	}
	if n == 0 {
		return Decision{Instance: leastOutstanding(cands, s.rnd), Strategy: config.StrategyRandom, Reason: ReasonSaturated}, nil
	}
	k := int(s.rnd(uint64(n)))
	var pick *Instance
	for _, c := range cands {
		if !c.Full(s.Threshold) {
			if k == 0 {
				pick = c
				break
			}
			k--
		}
	}
	if pick == nil { // an in-flight count rose between the passes
		return Decision{Instance: leastOutstanding(cands, s.rnd), Strategy: config.StrategyRandom, Reason: ReasonSaturated}, nil
	}
	return Decision{Instance: pick, Strategy: config.StrategyRandom, Reason: ReasonRandom}, nil
}

// RoundRobin cycles through candidates, skipping full ones; when all are
// full, the least outstanding. With a changing candidate set the cycle is
// over positions, which is as even as a shared counter can be. A
// disaggregated request's prefill pick (candidates of role prefill) turns
// a rotation of its own: sharing one with the decode pick, each stage
// would take every other position, half of each set when both are even.
type RoundRobin struct {
	Threshold int
	next      [2]atomic.Uint64 // [0]: plain and decode picks; [1]: prefill picks
	rnd       func(n uint64) uint64
}

// Name implements Strategy.
func (*RoundRobin) Name() string { return config.StrategyRoundRobin }

// Pick implements Strategy.
func (s *RoundRobin) Pick(_ context.Context, _ *Request, cands []*Instance) (Decision, error) {
	if len(cands) == 0 {
		return Decision{}, ErrNoCandidates
	}
	stage := 0
	if cands[0].role == config.RolePrefill { // PrefillCandidates: all or none are
		stage = 1
	}
	start := s.next[stage].Add(1) - 1
	for k := range uint64(len(cands)) {
		c := cands[(start+k)%uint64(len(cands))]
		if !c.Full(s.Threshold) {
			return Decision{Instance: c, Strategy: config.StrategyRoundRobin, Reason: ReasonRoundRobin}, nil
		}
	}
	return Decision{Instance: leastOutstanding(cands, s.rnd), Strategy: config.StrategyRoundRobin, Reason: ReasonSaturated}, nil
}

// LeastOutstanding picks the candidate with the fewest router-local
// requests in flight, ties broken at random.
type LeastOutstanding struct {
	rnd func(n uint64) uint64
}

// Name implements Strategy.
func (*LeastOutstanding) Name() string { return config.StrategyLeastOutstanding }

// Pick implements Strategy.
func (s *LeastOutstanding) Pick(_ context.Context, _ *Request, cands []*Instance) (Decision, error) {
	if len(cands) == 0 {
		return Decision{}, ErrNoCandidates
	}
	return Decision{Instance: leastOutstanding(cands, s.rnd), Strategy: config.StrategyLeastOutstanding, Reason: ReasonLeastOutstanding}, nil
}

// leastOutstanding returns the candidate with the fewest in flight, a
// uniformly random one among ties. cands must not be empty.
func leastOutstanding(cands []*Instance, rnd func(uint64) uint64) *Instance {
	// Counts move while we look; read each once so that the tie draw and
	// the pick agree.
	var small [64]int
	counts := small[:0]
	best, ties := int(^uint(0)>>1), uint64(0)
	for _, c := range cands {
		n := c.InFlight()
		counts = append(counts, n)
		switch {
		case n < best:
			best, ties = n, 1
		case n == best:
			ties++
		}
	}
	k := uint64(0)
	if ties > 1 {
		k = rnd(ties)
	}
	for i, c := range cands {
		if counts[i] == best {
			if k == 0 {
				return c
			}
			k--
		}
	}
	return cands[0] // unreachable: ties >= 1 entries equal best
}

// PrefixAware is rendezvous (highest-random-weight) hashing of the
// request's (routing text, tenant key) over the candidates: each candidate
// scores fmix64(requestHash ^ instanceHash) (internal/fmix) and the highest wins. Equal
// prefixes land on the same instance; adding an instance moves only the
// prefixes it now wins (~1/n), removing one moves only its own.
//
// When the winner has Threshold requests in flight, the next instance in the
// request's rendezvous order that is under the threshold takes it, so
// overflow of a hot prefix is itself deterministic (it warms one second
// instance, not all). When all are full, the least outstanding.
type PrefixAware struct {
	Threshold int
	rnd       func(n uint64) uint64
}

// NewPrefixAware is prefix_aware with threshold and randomness rnd (nil =
// math/rand/v2): the fallback of the exact strategies.
func NewPrefixAware(threshold int, rnd func(n uint64) uint64) *PrefixAware {
	if rnd == nil {
		rnd = rand.Uint64N
	}
	return &PrefixAware{Threshold: threshold, rnd: rnd}
}

// Name implements Strategy.
func (*PrefixAware) Name() string { return config.StrategyPrefixAware }

// Pick implements Strategy. One pass, no allocation: the request's hash is
// computed once (Request.RoutingHash) and mixed with each instance's.
func (s *PrefixAware) Pick(_ context.Context, req *Request, cands []*Instance) (Decision, error) {
	if len(cands) == 0 {
		return Decision{}, ErrNoCandidates
	}
	h := req.RoutingHash()
	var top, avail *Instance
	var topScore, availScore uint64
	for _, c := range cands {
		sc := rendezvousScore(h, c.hash)
		if top == nil || sc > topScore {
			top, topScore = c, sc
		}
		if !c.Full(s.Threshold) && (avail == nil || sc > availScore) {
			avail, availScore = c, sc
		}
	}
	switch {
	case avail == top:
		return Decision{Instance: top, Strategy: config.StrategyPrefixAware, Reason: ReasonHash}, nil
	case avail != nil:
		return Decision{Instance: avail, Strategy: config.StrategyPrefixAware, Reason: ReasonOverflow}, nil
	}
	return Decision{Instance: leastOutstanding(cands, s.rnd), Strategy: config.StrategyPrefixAware, Reason: ReasonSaturated}, nil
}

// rendezvousScore is the weight of an instance for a request hash.
func rendezvousScore(reqHash, instHash uint64) uint64 { return fmix.Mix64(reqHash ^ instHash) }

// Rendezvous is the instance's weight for a request hash in rendezvous
// order (the highest is first): how kv_aware breaks ties as prefix_aware
// would.
func (in *Instance) Rendezvous(reqHash uint64) uint64 { return rendezvousScore(reqHash, in.hash) }

// RendezvousOrder returns cands sorted by descending rendezvous score for
// req: the order prefix_aware overflows through. For tests, tools and
// explanations; Pick does not allocate it.
func RendezvousOrder(req *Request, cands []*Instance) []*Instance {
	h := req.RoutingHash()
	out := make([]*Instance, len(cands))
	copy(out, cands)
	scores := make(map[*Instance]uint64, len(cands))
	for _, c := range cands {
		scores[c] = rendezvousScore(h, c.hash)
	}
	// Insertion sort: candidate lists are small.
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && scores[out[j]] > scores[out[j-1]]; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}
