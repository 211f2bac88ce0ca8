package kvaware

import (
	"cmp"
	"slices"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
)

// With replica sync, a hot prefix's rent-or-buy account (replicate.go)
// was each replica's own, paid from its own decisions: two replicas that
// had applied each other's latest state still compared a request's price
// with different rents, and bought a second copy at different moments
// (the `replicate` splits of docs/BENCHMARKS.md §11). The rule's input is
// the rent the prefix's requests have paid since the last copy was
// bought: with several replicas, all the pool's requests of the prefix,
// wherever they were routed. So every replica computes it from facts
// every replica has once the sync has settled:
//
//   - a copy bought starts a new generation of the prefix's account: a
//     replica counts the purchases it knows of (its own, and the highest
//     generation any live peer publishes), and a purchase takes the
//     next;
//   - each replica publishes, per prefix, its generation and the rent it
//     has itself paid in it (replicasync version 5, a rent message: the
//     accounts that changed, with every send, early ones included, since
//     a decision's rent or purchase is what the next decision reads; the
//     whole table every heartbeat);
//   - the account is the sum, in ascending order, of the rent paid in the
//     latest generation by each live replica that has reached it, own
//     included (its live account: what it publishes next).
//
// A rent paid is counted once (by the replica that paid it) and a
// purchase anywhere resets the account everywhere: it is one router's
// account over the pool's decisions. Two replicas that buy at once each
// start the same next generation. A replica that dies stops counting
// after the peer timeout, its rent with it (the rent it paid then counts
// for nothing, as if the prefix's requests it routed had not come: the
// rule pays at most one price more before buying). Traffic: one entry
// (~17 bytes) per decision that pays rent or buys, and each replica's
// table (at most 4,096 accounts, ~70 KB) once a heartbeat. Without a
// live peer that publishes accounts (a lone replica, or version 4 peers
// only) the account is the replica's own, as one router's.

// RentPeers is a PeerState that also shares the rent-or-buy accounts
// (replicasync version 5). *replicasync.Syncer implements it.
type RentPeers interface {
	// AttachRent gives the peer state this replica's accounts: the
	// function appends all of them (full) or those changed since its
	// previous call.
	AttachRent(func(dst []replicasync.Rent, full bool) []replicasync.Rent)
	// RentAccount is the pool's account of key given this replica's
	// own: the latest generation and the rent paid in it.
	RentAccount(key, gen uint64, rent float64) (uint64, float64)
}

var _ RentPeers = (*replicasync.Syncer)(nil)

// share makes t's accounts the pool's: rp answers for the peers, and t
// keeps what changed for it to send.
func (t *rentTable) share(rp RentPeers) {
	t.mu.Lock()
	t.peers, t.dirty = rp, map[kvindex.Key]struct{}{}
	t.mu.Unlock()
	rp.AttachRent(t.publish)
}

// publish appends t's accounts, all (full) or those changed since the
// previous call (a dropped one as removed), in key order, and forgets the
// changes (RentPeers.AttachRent).
func (t *rentTable) publish(dst []replicasync.Rent, full bool) []replicasync.Rent {
	start := len(dst)
	t.mu.Lock()
	if full {
		for i := range t.sets {
			for _, e := range t.sets[i] {
				if e.used {
					dst = append(dst, replicasync.Rent{Key: uint64(e.key), Gen: e.gen, Rent: e.rent})
				}
			}
		}
	} else {
		for k := range t.dirty {
			r := replicasync.Rent{Key: uint64(k)} // removed
			if e := t.find(k); e != nil {
				r.Gen, r.Rent = e.gen, e.rent
			}
			dst = append(dst, r)
		}
	}
	clear(t.dirty)
	t.mu.Unlock()
	slices.SortFunc(dst[start:], func(a, b replicasync.Rent) int { return cmp.Compare(a.Key, b.Key) })
	return dst
}
