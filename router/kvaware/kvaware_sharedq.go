package kvaware

import (
	"math"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/replicasync"
)

// With replica sync, an instance's prefill queue holds requests routed by
// every replica. Each replica used to drain its own pending prefill by its
// own FIFO prediction (kvaware_drain.go) and count its peers' in full: two
// replicas saw two different queues for the same instance and, once state
// had settled, still disagreed on 3–5 % of decisions (docs/BENCHMARKS.md
// §11). So with sync every replica computes an instance's queue by one
// model from facts every replica has once the sync has settled:
//
//   - the pending requests of every replica, each with its routing time and
//     tokens (the sync message lists them, replicasync.Pending);
//   - the latest first byte any replica with load there has seen from the
//     instance (Load.Started): the engine was past that request's prefill,
//     so the queue's work starts no earlier;
//   - one rate: the mean of the rates of the replicas with listed pending
//     requests there (each publishes the rate it measures, Load.Rate).
//
// The queue is then simulated first come, first served (the finishing
// time of a work-conserving FIFO queue, as addWork does for one replica)
// over all of them in routing-time order, and counts min(pending tokens,
// rate × (end − now)) as before. Every input is either this replica's own
// (equal to what it last published, once settled) or a peer's published
// value, and the computation orders them before summing, so replicas that
// have applied each other's latest messages compute the same queue to the
// bit. Unlisted pending prefill (a version 1 peer, or beyond
// replicasync.MaxPending) counts in full, as before.

// pendEntry is one of this replica's pending requests on an instance.
type pendEntry struct {
	o   *kvObserver
	at  int64 // routing time, Unix ns
	tok int64
}

// pendList is an instance's pending requests of this replica, in routing
// order, and the latest first byte it saw there.
type pendList struct {
	mu      sync.Mutex
	list    []pendEntry
	started int64
}

func (l *pendList) add(o *kvObserver, at int64) {
	l.mu.Lock()
	l.list = append(l.list, pendEntry{o: o, at: at, tok: o.pendTok})
	l.mu.Unlock()
}

// remove drops o's entry; at is when its prefill ended (first byte, or
// the release timer).
func (l *pendList) remove(o *kvObserver, at int64) {
	l.mu.Lock()
	for i := range l.list {
		if l.list[i].o == o {
			l.list = slices.Delete(l.list, i, i+1)
			break
		}
	}
	l.started = max(l.started, at)
	l.mu.Unlock()
}

// snapshot appends the listed requests (at most max, the oldest) to dst
// and returns the latest first byte.
func (l *pendList) snapshot(dst []replicasync.Pending, limit int) ([]replicasync.Pending, int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, e := range l.list {
		if i == limit {
			break
		}
		dst = append(dst, replicasync.Pending{At: e.at, Tokens: e.tok})
	}
	return dst, l.started
}

// publishedRate is the rate this replica publishes: the measured rate as
// kv_aware reads it, truncated to whole tokens/s as it goes on the wire.
func (st *KVState) publishedRate() int64 {
	def := math.Float64frombits(st.prefillDef.Load())
	if !(def > 0) {
		return 0
	}
	return int64(st.drainRate.rate(def))
}

// sharedQueue is the tokens of prefill work left on an instance at now
// (Unix ns): this replica's pending requests own (oldest MaxPending, as
// published) and started, the peers' q, and rate own for this replica's
// (0: none). mine says this replica has load there (a Load entry it
// publishes), so that its own Started counts exactly when its peers see
// it. scratch is reused.
func sharedQueue(now int64, own []replicasync.Pending, started int64, mine bool, ownRate int64, q *replicasync.PeerQueue, scratch *sharedScratch) float64 {
	all := append(scratch.all[:0], own...)
	all = append(all, q.Pending...)
	scratch.all = all
	rates := append(scratch.rates[:0], q.Rates...)
	if len(own) > 0 && ownRate > 0 {
		rates = append(rates, ownRate)
	}
	scratch.rates = rates
	floor := q.Started
	if mine {
		floor = max(floor, started)
	}
	left := float64(q.Unlisted)
	if len(all) == 0 {
		return left
	}
	var sum int64
	for _, p := range all {
		sum = replicasync.AddSat(sum, p.Tokens)
	}
	if len(rates) == 0 {
		return left + float64(sum) // no rate known: count in full
	}
	slices.Sort(rates)
	var rs int64
	for _, r := range rates {
		rs = replicasync.AddSat(rs, r)
	}
	rate := float64(rs) / float64(len(rates))
	slices.SortFunc(all, func(a, b replicasync.Pending) int {
		if a.At != b.At {
			if a.At < b.At {
				return -1
			}
			return 1
		}
		return int(min(max(a.Tokens-b.Tokens, -1), 1))
	})
	done := floor
	for _, p := range all {
		d := float64(p.Tokens) / rate * 1e9
		start := max(done, p.At)
		if d >= float64(math.MaxInt64-start) {
			done = math.MaxInt64
			continue
		}
		done = start + int64(d)
	}
	work := float64(done-now) / 1e9 * rate
	return left + max(0, min(float64(sum), work))
}

// sharedScratch is sharedQueue's reusable memory (per evaluation).
type sharedScratch struct {
	own   []replicasync.Pending
	all   []replicasync.Pending
	rates []int64
	peers []replicasync.PeerQueue // per candidate
	place []float64               // placement averages (placement_shared.go)
}

// peerQ is candidate i's peer queue, kept for reuse.
func (s *sharedScratch) peerQ(i int) *replicasync.PeerQueue {
	for len(s.peers) <= i {
		s.peers = append(s.peers, replicasync.PeerQueue{})
	}
	return &s.peers[i]
}
