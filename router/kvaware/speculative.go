package kvaware

import (
	"time"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/spechold"
)

// speculative is a small, bounded overlay in front of the index: after
// kv_aware routes a request, the blocks of its prompt count as held on GPU
// by the chosen instance for a short TTL. Without it, a burst of requests
// sharing a new prefix would all see an empty index (the engine has not
// finished the first prefill, so no BlockStored event exists yet) and the
// load term would spread them over instances — each paying the full prefill.
// With it, the second request already sees the first one's blocks "held" by
// the first one's instance and follows it.
//
// Once the engine's events reach the index, the index reports the same
// blocks: a committed decision that finds its candidate's guess confirmed
// by the index drops the holds it covers (confirm), so that a later
// eviction the index sees is not masked by a hold; an entry the engine
// never confirms (the request failed, the blocks were evicted at once)
// simply expires. The holds are kept per run of a
// prompt's chain (spechold.Chains: one record per pick, bounded in
// (block, instance) entries, oldest first out) and read through the
// decision's Scan of its prompt; the peers' announced holds are a
// spechold.Set (replicasync).
type speculative struct {
	ttl time.Duration
	now func() time.Time
	set *spechold.Chains[kvindex.Key]
}

// specScan is a decision's scan of its prompt's keys in the overlay.
type specScan = spechold.Scan[kvindex.Key]

func newSpeculative(ttl time.Duration, capacity int, now func() time.Time) *speculative {
	return &speculative{ttl: ttl, now: now, set: spechold.NewChains[kvindex.Key](capacity)}
}

// Len is the number of (key, instance) entries held, expired ones included
// until the next insertion sweeps them.
func (s *speculative) Len() int { return s.set.Len() }

// add records keys (a run of a prompt's chain) as held by inst until
// now+ttl, while inst's cache epoch stays epoch.
func (s *speculative) add(keys []kvindex.Key, inst string, epoch uint64) {
	if s == nil || len(keys) == 0 || s.set.Cap() == 0 {
		return
	}
	if len(keys) > s.set.Cap() {
		keys = keys[:s.set.Cap()] // the leading blocks matter most: matches are prefixes
	}
	now := s.now().UnixNano()
	s.set.Add(keys, inst, now+int64(s.ttl), epoch, now)
}

// extend returns how far inst's speculative holds continue the chain keys
// from block `from`: the largest k >= from such that keys[from:k] are all
// held by inst, unexpired, and made in inst's current cache epoch.
func (s *speculative) extend(sc *specScan, keys []kvindex.Key, from int, inst string, epoch uint64) int {
	if s == nil {
		return from
	}
	return s.set.Extend(sc, keys, from, inst, epoch, s.now().UnixNano())
}

// any reports whether any instance holds keys[j] speculatively (expired
// or not).
func (s *speculative) any(sc *specScan, keys []kvindex.Key, j int) bool {
	return s.set.Any(sc, keys, j)
}

// holders appends to dst the instances holding keys[0] speculatively.
func (s *speculative) holders(dst []string, sc *specScan, keys []kvindex.Key) []string {
	if s == nil {
		return dst
	}
	return s.set.Holders(dst, sc, keys, s.now().UnixNano())
}

// heldBy reports whether inst holds keys[j] speculatively (expired or not).
func (s *speculative) heldBy(sc *specScan, keys []kvindex.Key, j int, inst string) bool {
	return s.set.HeldBy(sc, keys, j, inst)
}

// confirm drops inst's holds of keys[:n]: the index now reports those
// blocks itself, and a hold left behind would outlive a later eviction
// (the index would say "gone", the overlay "held") until its TTL.
func (s *speculative) confirm(sc *specScan, keys []kvindex.Key, n int, inst string) {
	s.set.Drop(sc, keys, n, inst)
}
