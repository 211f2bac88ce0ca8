package kvaware

import (
	"cmp"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/replicasync"
)

// With replica sync, the placement term's two inputs (placement.go) were
// each replica's own: it averaged an instance's predicted queue, W̄_i, at
// its own committed decisions, and measured ū from its own picks. Two
// replicas that had applied each other's latest state still priced the
// same request's later requests differently, and on the code workload
// (sessions bringing ~6,000 new tokens, where the term decides) settled
// agreement fell to 97–98 % (docs/BENCHMARKS.md §11). So, as for pending
// prefill (kvaware_sharedq.go), every replica computes the term from facts
// every replica has once the sync has settled:
//
//   - each replica publishes, every sync interval (replicasync version 4,
//     a placement message), its ū and its W̄_i per instance as they are
//     then, and keeps that snapshot as its own published value;
//   - the term reads, for ū, the mean over the replicas of their published
//     ū (those that have measured one), and for W̄_i the mean over the
//     replicas of their published W̄_i (those that have one for i), own
//     included as published, each set sorted before it is summed.
//
// Each replica's W̄_i samples the same shared queue model (the queue is
// computed from the same facts, kvaware_sharedq.go) at its own decisions;
// the mean over replicas samples it at all the pool's decisions, as one
// router's did. The same for ū: one router's average over its picks, here
// over each replica's share, which a balancer makes alike. The published
// values lag the live ones by at most one interval (50 ms against the 10 s
// window of W̄ and the 64 picks of ū). Every replica keeps its own live
// averages (what it publishes next). Without a live peer that publishes
// placement averages (a lone replica, or version 3 peers only), the term
// reads the live averages, as one router does: bit for bit the same.

// PlacementPeers is a PeerState that also shares the placement term's
// averages (replicasync version 4). *replicasync.Syncer implements it.
type PlacementPeers interface {
	// AttachPlacement gives the peer state this replica's placement
	// averages, which it publishes every interval.
	AttachPlacement(func(dst []replicasync.Queued) ([]replicasync.Queued, float64))
	// PeerComputed appends the live peers' published ū (> 0) to dst and
	// counts the live peers that publish placement averages.
	PeerComputed(dst []float64) ([]float64, int)
	// PeerQueued appends the live peers' published W̄ for inst to dst.
	PeerQueued(inst string, dst []float64) []float64
}

var _ PlacementPeers = (*replicasync.Syncer)(nil)

// placeSnap is this replica's placement averages as last published.
type placeSnap struct {
	mu       sync.RWMutex
	computed float64
	queues   map[string]float64
}

// publishPlacement takes this replica's placement averages now, in
// instance order, keeps them as the published snapshot and appends them
// to dst (PlacementPeers.AttachPlacement).
func (st *KVState) publishPlacement(dst []replicasync.Queued) ([]replicasync.Queued, float64) {
	computed := st.computed.mean()
	start := len(dst)
	st.pendMu.RLock()
	st.placeMu.RLock()
	for id, pc := range st.pend {
		dst = append(dst, replicasync.Queued{Instance: id, Wait: pc.queued.value()})
	}
	st.placeMu.RUnlock()
	st.pendMu.RUnlock()
	own := dst[start:]
	slices.SortFunc(own, func(a, b replicasync.Queued) int { return cmp.Compare(a.Instance, b.Instance) })
	queues := make(map[string]float64, len(own))
	for _, q := range own {
		queues[q.Instance] = q.Wait
	}
	s := &st.peers.snap
	s.mu.Lock()
	s.computed, s.queues = computed, queues
	s.mu.Unlock()
	return dst, computed
}

// placementShared reports whether the term reads the pool's averages (a
// live peer publishes its own) and, if so, ū: the mean of the replicas'
// published ū. scratch is reused.
func (st *KVState) placementShared(scratch *[]float64) (bool, float64) {
	pp := st.peers.pp
	if pp == nil {
		return false, 0
	}
	vals, n := pp.PeerComputed((*scratch)[:0])
	if n == 0 {
		*scratch = vals
		return false, 0
	}
	s := &st.peers.snap
	s.mu.RLock()
	if s.computed > 0 {
		vals = append(vals, s.computed)
	}
	s.mu.RUnlock()
	*scratch = vals
	return true, sortedMean(vals)
}

// sharedQueued is W̄ for inst from the pool's published averages: their
// mean, 0 when no replica has one.
func (st *KVState) sharedQueued(inst string, scratch *[]float64) float64 {
	vals := st.peers.pp.PeerQueued(inst, (*scratch)[:0])
	s := &st.peers.snap
	s.mu.RLock()
	if w, ok := s.queues[inst]; ok {
		vals = append(vals, w)
	}
	s.mu.RUnlock()
	*scratch = vals
	return sortedMean(vals)
}

// sortedMean is the mean of vals summed in ascending order (so that every
// replica adding the same numbers gets the same bits), 0 for none. vals
// is sorted in place.
func sortedMean(vals []float64) float64 {
	if len(vals) == 0 {
		return 0
	}
	slices.Sort(vals)
	var sum float64
	for _, v := range vals {
		sum += v
	}
	return sum / float64(len(vals))
}
