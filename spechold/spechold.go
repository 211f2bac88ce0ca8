// Package spechold keeps speculative holds: block keys counted as held by
// an instance until an expiry, while the instance's cache epoch stays the
// one they were made in. A router's own speculative overlay and the holds
// its peer replicas announce (replicasync) are both a Set. The Set is
// bounded: insertions go into a FIFO ring whose capacity is the bound, so
// the oldest make way, and since holds mostly share one lifetime,
// insertion order is expiry order and the ring also finds the expired.
package spechold

import "sync"

// Set is a bounded set of holds of keys K (block keys: kvindex.Key). Safe
// for concurrent use. Times are unix nanoseconds, given by the caller
// (simulations run on virtual clocks).
type Set[K comparable] struct {
	mu    sync.RWMutex // guards holds, ring, head and n
	holds map[K][]hold
	ring  []ref[K] // FIFO of insertions, capacity = the bound
	head  int      // oldest entry in ring
	n     int      // live ring entries
}

type hold struct {
	inst  string
	exp   int64
	epoch uint64
}

type ref[K comparable] struct {
	key  K
	inst string
	exp  int64
}

// New returns an empty Set holding at most capacity (key, instance)
// entries (0: holds nothing).
func New[K comparable](capacity int) *Set[K] {
	return &Set[K]{holds: map[K][]hold{}, ring: make([]ref[K], max(capacity, 0))}
}

// Cap is the bound.
func (s *Set[K]) Cap() int { return len(s.ring) }

// Len is the number of entries held, expired ones included until the
// next Add sweeps them.
func (s *Set[K]) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.n
}

// Add records keys as held by inst until exp in cache epoch epoch (a key
// already held by inst keeps the later expiry and takes the new epoch),
// after dropping the entries expired at now. It returns how many
// unexpired entries made way for these.
func (s *Set[K]) Add(keys []K, inst string, exp int64, epoch uint64, now int64) (evicted int) {
	if len(s.ring) == 0 || len(keys) == 0 {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.n > 0 && s.ring[s.head].exp <= now {
		s.popLocked()
	}
	for _, k := range keys {
		if s.n == len(s.ring) {
			s.popLocked()
			evicted++
		}
		hs := s.holds[k]
		held, found := exp, false
		for i := range hs {
			if hs[i].inst == inst {
				hs[i].exp, hs[i].epoch, found = max(hs[i].exp, exp), epoch, true
				held = hs[i].exp
				break
			}
		}
		if !found {
			s.holds[k] = append(hs, hold{inst: inst, exp: exp, epoch: epoch})
		}
		s.ring[(s.head+s.n)%len(s.ring)] = ref[K]{key: k, inst: inst, exp: held}
		s.n++
	}
	return evicted
}

// popLocked drops the oldest ring entry and, unless a later Add refreshed
// it (its expiry differs), its hold.
func (s *Set[K]) popLocked() {
	r := s.ring[s.head]
	s.ring[s.head] = ref[K]{}
	s.head = (s.head + 1) % len(s.ring)
	s.n--
	s.dropLocked(r.key, func(h hold) bool { return h.inst == r.inst && h.exp == r.exp })
}

func (s *Set[K]) dropLocked(k K, match func(hold) bool) {
	hs := s.holds[k]
	for i := range hs {
		if match(hs[i]) {
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

// Extend returns how far inst's holds continue keys from block from: the
// largest k >= from such that keys[from:k] are all held by inst,
// unexpired at now, in epoch.
func (s *Set[K]) Extend(keys []K, from int, inst string, epoch uint64, now int64) int {
	if from >= len(keys) {
		return from
	}
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

// Holders appends to dst the instances holding key, unexpired at now.
func (s *Set[K]) Holders(dst []string, key K, now int64) []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, h := range s.holds[key] {
		if h.exp > now {
			dst = append(dst, h.inst)
		}
	}
	return dst
}

// HeldBy reports whether inst holds key (expired or not).
func (s *Set[K]) HeldBy(key K, inst string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, h := range s.holds[key] {
		if h.inst == inst {
			return true
		}
	}
	return false
}

// Any reports whether any instance holds key (expired or not).
func (s *Set[K]) Any(key K) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.holds[key]) > 0
}

// Drop removes inst's holds of keys (their ring entries expire later
// without effect).
func (s *Set[K]) Drop(keys []K, inst string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		s.dropLocked(k, func(h hold) bool { return h.inst == inst })
	}
}
