package kvaware

import (
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// PeerState is what the pool's other router replicas add to this one's
// picture (replica sync, docs/replicas.md): their requests in flight and
// pending prefill per instance, and their speculative blocks. A Freshness
// that implements it (the KV-state pipeline's does when events.replica_sync is on) is
// picked up by NewKVState (router/kvstate's PeerFreshness is one), which then also reports its own counters and
// speculative blocks to it. *replicasync.Syncer implements it.
type PeerState interface {
	PeerLoad(inst string) (inflight, pendingTokens, pendingRequests int64)
	// PeerQueue sets q to the peers' pending requests on inst.
	PeerQueue(inst string, q *replicasync.PeerQueue)
	// PeerEnded counts the peers' requests on inst that ended since an
	// engine-load sample asked for at asked and answered at got (Unix ns)
	// may have counted them (loadended.go).
	PeerEnded(inst string, asked, got int64) int
	PeerExtend(keys []kvindex.Key, from int, inst string, epoch uint64) int
	PeerHolders(dst []string, key kvindex.Key) []string
	// Speculate announces this replica's speculative blocks; it must not
	// block (it runs on the request path).
	Speculate(inst string, keys []kvindex.Key, ttl time.Duration)
	// AttachLocal gives the peer state this replica's own counters.
	AttachLocal(func(dst []replicasync.Load) []replicasync.Load)
	// Changed tells the peer state that this replica's counters changed
	// (a decision, a request's end), so that it may send early; it must
	// not block.
	Changed()
}

var _ PeerState = (*replicasync.Syncer)(nil)

// kvPeers holds a KVState's replica-sync state.
type kvPeers struct {
	ps PeerState // nil without replica sync
	// pp is ps when it shares placement averages (placement_shared.go);
	// snap is what this replica last published of them.
	pp   PlacementPeers
	snap placeSnap
	// insts lists the pool's instances (set when the pool's loops start),
	// whose in-flight counters this replica reports.
	insts atomic.Pointer[func() []*router.Instance]
}

// attachPeers wires st to the Freshness's PeerState, if it has one.
func (st *KVState) attachPeers() {
	ps, ok := st.fresh.(PeerState)
	if !ok {
		return
	}
	st.peers.ps = ps
	ps.AttachLocal(st.localLoads)
	st.attachSequencing(ps) // sequence_live.go
	if pp, ok := ps.(PlacementPeers); ok {
		st.peers.pp = pp
		pp.AttachPlacement(st.publishPlacement)
	}
	if rp, ok := ps.(RentPeers); ok {
		st.rent.share(rp) // replicate_shared.go
	}
}

// SetInstances tells st where the pool's instances are, whose in-flight
// counters it publishes to its replica-sync peers. Run sets it; a caller
// that routes without Run (the simulator) sets it itself.
func (st *KVState) SetInstances(f func() []*router.Instance) { st.peers.insts.Store(&f) }

// localLoads appends this replica's counters: requests in flight per
// instance (all strategies: the proxy counts them) and kv_aware's pending
// prefill.
func (st *KVState) localLoads(dst []replicasync.Load) []replicasync.Load {
	seen := map[string]int{}
	if f := st.peers.insts.Load(); f != nil {
		for _, in := range (*f)() {
			if n := in.InFlight(); n > 0 {
				seen[in.ID()] = len(dst)
				dst = append(dst, replicasync.Load{Instance: in.ID(), InFlight: int64(n)})
			}
		}
	}
	rate := st.publishedRate()
	now, keep := st.now().UnixNano(), st.endKeep.get()
	st.pendMu.RLock()
	defer st.pendMu.RUnlock()
	for id, pc := range st.pend {
		tok, reqs := pc.load()
		ended := pc.ends.snapshot(nil, now, keep)
		i, ok := seen[id]
		if !ok && tok <= 0 && reqs <= 0 && len(ended) == 0 {
			continue
		}
		if !ok {
			i = len(dst)
			dst = append(dst, replicasync.Load{Instance: id})
		}
		l := &dst[i]
		l.PendingTokens, l.PendingRequests = max(tok, 0), max(reqs, 0)
		// The facts its peers drain this replica's pending prefill by
		// (kvaware_sharedq.go).
		l.Pending, l.Started = pc.pl.snapshot(nil, replicasync.MaxPending)
		if len(l.Pending) > 0 {
			l.Rate = rate
		}
		// What its peers take out of their engine-load samples
		// (loadended.go).
		l.Ended = ended
	}
	return dst
}

// peerCounts is the other replicas' load on one instance.
type peerCounts struct {
	inflight     int
	tokens, reqs int64
}

// extendSpec continues inst's held chain from block g with this
// replica's speculative blocks and its peers', alternately, as far as
// either reaches.
func (st *KVState) extendSpec(spec *speculative, sc *specScan, keys []kvindex.Key, g int, inst string) int {
	epoch := st.lostEpoch(inst)
	for {
		next := spec.extend(sc, keys, g, inst, epoch)
		if st.peers.ps != nil {
			next = st.peers.ps.PeerExtend(keys, next, inst, epoch)
		}
		if next == g {
			return g
		}
		g = next
	}
}

// PeerLoad is the other replicas' counters for inst (zero without replica
// sync).
func (st *KVState) PeerLoad(inst string) (inflight, pendingTokens, pendingRequests int64) {
	if st.peers.ps == nil {
		return 0, 0, 0
	}
	return st.peers.ps.PeerLoad(inst)
}

// changed tells the peers' side that this replica's state changed: after
// a decision (the proxy's in-flight increment follows Pick's return by
// microseconds, well within the early send's min_gap, which reads the
// state only then) and after a request's end (the proxy releases its
// in-flight count before Done).
func (st *KVState) changed() {
	if st.peers.ps != nil {
		st.peers.ps.Changed()
	}
}
