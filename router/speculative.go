package router

import (
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvindex"
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
// Entries are never confirmed explicitly: once the engine's events reach the
// index, the index reports the same blocks and the overlay adds nothing; an
// entry the engine never confirms (the request failed, the blocks were
// evicted at once) simply expires. Because the TTL is one constant,
// insertion order is expiry order, so a FIFO ring both bounds the overlay
// and finds the expired entries.
type speculative struct {
	ttl time.Duration
	now func() time.Time

	mu    sync.RWMutex // guards holds, ring, head and n
	holds map[kvindex.Key][]specHold
	ring  []specRef // FIFO of insertions, capacity = the bound
	head  int       // oldest entry in ring
	n     int       // live ring entries
}

type specHold struct {
	inst  string
	exp   int64  // unix nanoseconds
	epoch uint64 // the instance's cache epoch when made (CacheEpochs)
}

type specRef struct {
	key  kvindex.Key
	inst string
	exp  int64
}

func newSpeculative(ttl time.Duration, capacity int, now func() time.Time) *speculative {
	return &speculative{ttl: ttl, now: now, holds: make(map[kvindex.Key][]specHold), ring: make([]specRef, capacity)}
}

// Len is the number of (key, instance) entries held, expired ones included
// until the next insertion sweeps them.
func (s *speculative) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.n
}

// add records keys as held by inst until now+ttl, while inst's cache
// epoch stays epoch.
func (s *speculative) add(keys []kvindex.Key, inst string, epoch uint64) {
	if s == nil || len(keys) == 0 || len(s.ring) == 0 {
		return
	}
	now := s.now().UnixNano()
	exp := now + int64(s.ttl)
	s.mu.Lock()
	defer s.mu.Unlock()
	// Sweep expired entries from the old end first.
	for s.n > 0 && s.ring[s.head].exp <= now {
		s.popLocked()
	}
	if len(keys) > len(s.ring) {
		keys = keys[:len(s.ring)] // the leading blocks matter most: matches are prefixes
	}
	for _, k := range keys {
		if s.n == len(s.ring) {
			s.popLocked()
		}
		hs := s.holds[k]
		found := false
		for i := range hs {
			if hs[i].inst == inst {
				hs[i].exp, hs[i].epoch, found = exp, epoch, true
				break
			}
		}
		if !found {
			s.holds[k] = append(hs, specHold{inst: inst, exp: exp, epoch: epoch})
		}
		s.ring[(s.head+s.n)%len(s.ring)] = specRef{key: k, inst: inst, exp: exp}
		s.n++
	}
}

// popLocked drops the oldest ring entry and, unless it was refreshed by a
// later insertion (its expiry differs), its hold.
func (s *speculative) popLocked() {
	r := s.ring[s.head]
	s.ring[s.head] = specRef{}
	s.head = (s.head + 1) % len(s.ring)
	s.n--
	hs := s.holds[r.key]
	for i := range hs {
		if hs[i].inst == r.inst && hs[i].exp == r.exp {
			hs[i] = hs[len(hs)-1]
			hs = hs[:len(hs)-1]
			break
		}
	}
	if len(hs) == 0 {
		delete(s.holds, r.key)
	} else {
		s.holds[r.key] = hs
	}
}

// extend returns how far inst's speculative holds continue the chain keys
// from block `from`: the largest k >= from such that keys[from:k] are all
// held by inst, unexpired, and made in inst's current cache epoch.
func (s *speculative) extend(keys []kvindex.Key, from int, inst string, epoch uint64) int {
	if s == nil || from >= len(keys) {
		return from
	}
	now := s.now().UnixNano()
	s.mu.RLock()
	defer s.mu.RUnlock()
	if len(s.holds) == 0 {
		return from
	}
	k := from
	for ; k < len(keys); k++ {
		held := false
		for _, h := range s.holds[keys[k]] {
			if h.inst == inst && h.exp > now && h.epoch == epoch {
				held = true
				break
			}
		}
		if !held {
			break
		}
	}
	return k
}

// any reports whether any instance holds key speculatively (expired or not).
func (s *speculative) any(key kvindex.Key) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.holds[key]) > 0
}

// holders appends to dst the instances holding keys[0] speculatively.
func (s *speculative) holders(dst []string, key kvindex.Key) []string {
	if s == nil {
		return dst
	}
	now := s.now().UnixNano()
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, h := range s.holds[key] {
		if h.exp > now {
			dst = append(dst, h.inst)
		}
	}
	return dst
}

// heldBy reports whether inst holds key speculatively (expired or not).
func (s *speculative) heldBy(key kvindex.Key, inst string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, h := range s.holds[key] {
		if h.inst == inst {
			return true
		}
	}
	return false
}

// confirm drops inst's holds of keys: the index now reports those blocks
// itself, and a hold left behind would outlive a later eviction (the
// index would say "gone", the overlay "held") until its TTL.
func (s *speculative) confirm(keys []kvindex.Key, inst string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		hs := s.holds[k]
		for i := range hs {
			if hs[i].inst == inst {
				hs[i] = hs[len(hs)-1]
				hs = hs[:len(hs)-1]
				break
			}
		}
		if len(hs) == 0 {
			delete(s.holds, k)
		} else {
			s.holds[k] = hs
		}
	}
}
