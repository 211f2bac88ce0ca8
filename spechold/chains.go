package spechold

import (
	"cmp"
	"slices"
	"sync"
)

// Chains is a bounded set of holds kept per run of a prefix chain, for
// the router's own overlay: every Add is a contiguous run of one prompt's
// chain (its blocks after the instance's match), held by one instance
// until one expiry in one cache epoch. A Set keeps one table entry per
// (block, instance), so every Add and every sweep visits each block's
// slot in a table the fleet's holds outgrow the caches with (a miss per
// block at 128 instances); Chains keeps one record per run, its keys
// copied into a FIFO ring of keys (written and read in order), and
// indexes only the first key a run still holds, a table of one entry per
// run in flight. A lookup walks the prompt's keys from its first: where
// a run starts, the prompt's following keys are compared with the run's
// stored ones, in order (Scan). Safe for concurrent use.
//
// Keys must be chains (kvindex's block keys: a key names its block and
// every block before it), so that a run shares with a prompt a stretch
// from the run's first held key on, and a prompt's prefix meets a run in
// the run's front. Then Chains answers as a Set fed the same calls would,
// given that (as the router's overlay does) each Add's expiry is at
// least every earlier one's; a (block, instance) held by several runs
// counts with the latest run's expiry and epoch (a Set: the larger expiry,
// the latest epoch). The bound is in (block, instance) entries, as a
// Set's: a Drop leaves a run's entries counted until they pop.
type Chains[K ~uint64] struct {
	mu    sync.RWMutex
	bound int
	keys  []K    // ring of keys by absolute position; power-of-two size
	first uint64 // absolute position of the oldest entry
	n     int    // entries (positions first..first+n)
	runs  []run  // ring of runs by number; power-of-two size
	r0    uint64 // number of the oldest run
	rn    int    // runs (numbers r0..r0+rn)
	idx   []islot
	ilive int
	ids   ids
	ver   uint64 // bumped by every change a Scan may have read
}

// run is one Add: ring entries [start, hi), of which [lo, hi) are held
// (entries before lo were dropped). A run is indexed under keys[lo]
// while lo < hi.
type run struct {
	start, lo, hi uint64
	exp           int64
	epoch         uint64
	next          uint64 // 1 + number of the next run indexed at the same key; 0: none
	inst          uint32
}

// islot maps a key to the runs whose held part starts with it: 1 + the
// number of one of them (0: empty slot), the rest through run.next.
type islot struct {
	key uint64
	run uint64
}

// NewChains returns an empty Chains holding at most capacity (key,
// instance) entries (0: holds nothing).
func NewChains[K ~uint64](capacity int) *Chains[K] {
	return &Chains[K]{bound: max(capacity, 0)}
}

// Cap is the bound.
func (s *Chains[K]) Cap() int { return s.bound }

// Len is the number of entries held, expired and dropped ones included
// until they pop (as a Set's).
func (s *Chains[K]) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.n
}

// Live is the number of entries held at now: in runs not expired, less
// what Drop took from their fronts (Len also counts those, and expired
// runs, until they pop). It walks the runs, one per Add still in the
// ring: for a metrics scrape, not a decision.
func (s *Chains[K]) Live(now int64) int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := 0
	for num := s.r0; num < s.r0+uint64(s.rn); num++ {
		if r := s.runAt(num); r.exp > now {
			n += int(r.hi - r.lo)
		}
	}
	return n
}

func (s *Chains[K]) runAt(num uint64) *run { return &s.runs[num&uint64(len(s.runs)-1)] }

// Add records keys (a run of one chain) as held by inst until exp in
// cache epoch epoch, after dropping the runs expired at now. It returns
// how many entries made way for these (at the bound, the oldest first;
// a run longer than the bound keeps its last Cap keys).
func (s *Chains[K]) Add(keys []K, inst string, exp int64, epoch uint64, now int64) (evicted int) {
	if s.bound == 0 || len(keys) == 0 {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ver++
	id := s.ids.intern(inst)
	s.ids.refs[id]++ // pinned while older runs pop
	defer s.ids.release(id)
	for s.rn > 0 && s.runAt(s.r0).exp <= now {
		s.popRun()
	}
	if over := s.n + len(keys) - s.bound; over > 0 {
		evicted = over
		s.evict(min(over, s.n))
		if len(keys) > s.bound {
			keys = keys[len(keys)-s.bound:] // its own first entries made way too
		}
	}
	s.reserve(len(keys))
	pos := s.first + uint64(s.n)
	mask := uint64(len(s.keys) - 1)
	for i, k := range keys {
		s.keys[(pos+uint64(i))&mask] = k
	}
	s.n += len(keys)
	if s.rn == len(s.runs) {
		s.growRuns()
	}
	num := s.r0 + uint64(s.rn)
	s.rn++
	*s.runAt(num) = run{start: pos, lo: pos, hi: pos + uint64(len(keys)), exp: exp, epoch: epoch, inst: id}
	s.ids.refs[id]++
	s.index(num)
	return evicted
}

// reserve grows the key ring to hold m more entries (it never exceeds
// the first power of two of the bound).
func (s *Chains[K]) reserve(m int) {
	need := s.n + m
	if need <= len(s.keys) {
		return
	}
	size := max(len(s.keys), 1024)
	for size < need {
		size *= 2
	}
	keys := make([]K, size)
	if len(s.keys) > 0 {
		om, nm := uint64(len(s.keys)-1), uint64(size-1)
		for p := s.first; p < s.first+uint64(s.n); p++ {
			keys[p&nm] = s.keys[p&om]
		}
	}
	s.keys = keys
}

// growRuns doubles the run ring.
func (s *Chains[K]) growRuns() {
	size := max(2*len(s.runs), 64)
	runs := make([]run, size)
	for num := s.r0; num < s.r0+uint64(s.rn); num++ {
		runs[num&uint64(size-1)] = *s.runAt(num)
	}
	s.runs = runs
}

// popRun removes the oldest run and its entries.
func (s *Chains[K]) popRun() {
	r := s.runAt(s.r0)
	if r.lo < r.hi {
		s.unindex(s.r0)
	}
	s.n -= int(r.hi - r.start)
	s.first = r.hi
	s.ids.release(r.inst)
	*r = run{}
	s.r0++
	s.rn--
}

// evict pops the oldest m entries: whole runs, then the front of one.
func (s *Chains[K]) evict(m int) {
	for m > 0 {
		r := s.runAt(s.r0)
		if c := int(r.hi - r.start); c <= m {
			s.popRun()
			m -= c
			continue
		}
		r.start += uint64(m)
		s.first = r.start
		s.n -= m
		if r.lo < r.start {
			s.trim(s.r0, r.start)
		}
		return
	}
}

// trim moves run num's held start to lo (> its current), re-indexing it.
func (s *Chains[K]) trim(num, lo uint64) {
	r := s.runAt(num)
	if r.lo < r.hi {
		s.unindex(num)
	}
	r.lo = min(lo, r.hi)
	if r.lo < r.hi {
		s.index(num)
	}
}

func (s *Chains[K]) keyAt(pos uint64) uint64 { return uint64(s.keys[pos&uint64(len(s.keys)-1)]) }

// index adds run num under its first held key.
func (s *Chains[K]) index(num uint64) {
	if (s.ilive+1)*2 > len(s.idx) {
		s.growIndex()
	}
	r := s.runAt(num)
	k := s.keyAt(r.lo)
	n := len(s.idx)
	i := home(k, n)
	for ; s.idx[i].run != 0; i = (i + 1) & (n - 1) {
		if s.idx[i].key == k {
			r.next, s.idx[i].run = s.idx[i].run, num+1
			return
		}
	}
	r.next = 0
	s.idx[i] = islot{key: k, run: num + 1}
	s.ilive++
}

// unindex takes run num out of its first held key's list.
func (s *Chains[K]) unindex(num uint64) {
	r := s.runAt(num)
	i := s.findIndex(s.keyAt(r.lo))
	if i < 0 {
		panic("spechold: a held run is not indexed")
	}
	if s.idx[i].run == num+1 {
		if r.next != 0 {
			s.idx[i].run = r.next
		} else {
			s.removeIndex(i)
		}
		r.next = 0
		return
	}
	for p := s.runAt(s.idx[i].run - 1); p.next != 0; p = s.runAt(p.next - 1) {
		if p.next == num+1 {
			p.next, r.next = r.next, 0
			return
		}
	}
	panic("spechold: a held run is not in its key's list")
}

// findIndex returns key k's index slot, or -1.
func (s *Chains[K]) findIndex(k uint64) int {
	n := len(s.idx)
	if n == 0 {
		return -1
	}
	for i := home(k, n); s.idx[i].run != 0; i = (i + 1) & (n - 1) {
		if s.idx[i].key == k {
			return i
		}
	}
	return -1
}

// removeIndex empties index slot i (see backshift).
func (s *Chains[K]) removeIndex(i int) {
	backshift(s.idx, i, islotLive, islotKey)
	s.ilive--
}

// growIndex doubles the index (one live slot per held run at most, so it
// stops at twice the run ring).
func (s *Chains[K]) growIndex() { s.idx = rehash(s.idx, max(2*len(s.idx), 64), islotLive, islotKey) }

func islotLive(sl *islot) bool  { return sl.run != 0 }
func islotKey(sl *islot) uint64 { return sl.key }

// Scan is what one prompt's keys meet in a Chains: the runs whose held
// part starts at one of keys[:to], each with how far it has been found
// to continue the prompt. A decision asks several questions about its
// prompt (a Set answered each by visiting a block's slot); they share
// one Scan, which looks further only when asked about a later block. A
// Scan is its caller's (one goroutine's); it is valid while the Chains
// is unchanged and rebuilt when asked after a change or about other keys.
type Scan[K ~uint64] struct {
	set  *Chains[K]
	ver  uint64
	keys []K
	to   int
	met  []meet
}

// meet is a run met at prompt block p: keys[p:end] equal its held keys'
// first end-p (end-p <= room, its held length).
type meet struct {
	p, end int
	room   int
	lo     uint64
	num    uint64
	exp    int64
	epoch  uint64
	inst   uint32
}

// Reset forgets what the Scan found (its keys may be rewritten).
func (sc *Scan[K]) Reset() {
	sc.set, sc.keys, sc.to, sc.met = nil, nil, 0, sc.met[:0]
}

// prepare makes sc a scan of keys in s as it is now (under s.mu).
func (s *Chains[K]) prepare(sc *Scan[K], keys []K) {
	if sc.set == s && sc.ver == s.ver && len(sc.keys) == len(keys) && (len(keys) == 0 || &sc.keys[0] == &keys[0]) {
		return
	}
	sc.set, sc.ver, sc.keys, sc.to, sc.met = s, s.ver, keys, 0, sc.met[:0]
}

// scanTo looks up keys[:j+1] (those not yet) in the index.
func (s *Chains[K]) scanTo(sc *Scan[K], j int) {
	j = min(j, len(sc.keys)-1)
	if sc.to > j || s.ilive == 0 {
		sc.to = max(sc.to, j+1)
		return
	}
	n := len(s.idx)
	for ; sc.to <= j; sc.to++ {
		k := uint64(sc.keys[sc.to])
		for i := home(k, n); s.idx[i].run != 0; i = (i + 1) & (n - 1) {
			if s.idx[i].key != k {
				continue
			}
			for num := s.idx[i].run; num != 0; {
				r := s.runAt(num - 1)
				sc.met = append(sc.met, meet{p: sc.to, end: sc.to + 1, room: int(r.hi - r.lo), lo: r.lo, num: num - 1, exp: r.exp, epoch: r.epoch, inst: r.inst})
				num = r.next
			}
			break
		}
	}
}

// covers reports whether meet m's run holds prompt block j (>= m.p),
// comparing the prompt with the run's keys as far as j when not yet.
func (s *Chains[K]) covers(sc *Scan[K], m *meet, j int) bool {
	for m.end <= j && m.end-m.p < m.room && m.end < len(sc.keys) && uint64(sc.keys[m.end]) == s.keyAt(m.lo+uint64(m.end-m.p)) {
		m.end++
	}
	return m.end > j
}

// latest is the newest run of id holding prompt block j (scanned that
// far), or nil.
func (s *Chains[K]) latest(sc *Scan[K], id uint32, j int) *meet {
	var best *meet
	for i := range sc.met {
		m := &sc.met[i]
		if m.inst == id && m.p <= j && (best == nil || m.num > best.num) && s.covers(sc, m, j) {
			best = m
		}
	}
	return best
}

// Extend returns how far inst's holds continue keys (a chain from its
// first block) from block from: the largest k >= from such that
// keys[from:k] are all held by inst, unexpired at now, in epoch.
func (s *Chains[K]) Extend(sc *Scan[K], keys []K, from int, inst string, epoch uint64, now int64) int {
	if from >= len(keys) {
		return from
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	id := s.ids.byName[inst]
	if s.ilive == 0 || id == 0 {
		return from
	}
	s.prepare(sc, keys)
	s.scanTo(sc, from)
	// mine: the meets of id so far, and then as the scan goes on.
	var buf [8]int
	mine := buf[:0]
	for i := range sc.met {
		if sc.met[i].inst == id {
			mine = append(mine, i)
		}
	}
	k := from
	for ; k < len(keys); k++ {
		if was := len(sc.met); sc.to <= k {
			s.scanTo(sc, k)
			for i := was; i < len(sc.met); i++ {
				if sc.met[i].inst == id {
					mine = append(mine, i)
				}
			}
		}
		var best *meet
		for _, i := range mine {
			if m := &sc.met[i]; (best == nil || m.num > best.num) && m.p <= k && s.covers(sc, m, k) {
				best = m
			}
		}
		if best == nil || best.exp <= now || best.epoch != epoch {
			break
		}
	}
	return k
}

// Holders appends to dst the instances holding keys[0], unexpired at now
// (a run holding a chain's first block starts there), each once, in the
// order their newest such runs were added.
func (s *Chains[K]) Holders(dst []string, sc *Scan[K], keys []K, now int64) []string {
	if len(keys) == 0 {
		return dst
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	s.prepare(sc, keys)
	s.scanTo(sc, 0)
	var buf [8]*meet
	newest := buf[:0] // each instance's newest run holding keys[0]
	for i := range sc.met {
		m := &sc.met[i]
		if m.p != 0 {
			continue
		}
		j := slices.IndexFunc(newest, func(b *meet) bool { return b.inst == m.inst })
		switch {
		case j < 0:
			newest = append(newest, m)
		case m.num > newest[j].num:
			newest[j] = m
		}
	}
	slices.SortFunc(newest, func(a, b *meet) int { return cmp.Compare(a.num, b.num) })
	for _, m := range newest {
		if m.exp > now {
			dst = append(dst, s.ids.names[m.inst])
		}
	}
	return dst
}

// HeldBy reports whether inst holds keys[j] (expired or not).
func (s *Chains[K]) HeldBy(sc *Scan[K], keys []K, j int, inst string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	id := s.ids.byName[inst]
	if id == 0 || j < 0 || j >= len(keys) {
		return false
	}
	s.prepare(sc, keys)
	s.scanTo(sc, j)
	return s.latest(sc, id, j) != nil
}

// Any reports whether any instance holds keys[j] (expired or not).
func (s *Chains[K]) Any(sc *Scan[K], keys []K, j int) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if j < 0 || j >= len(keys) {
		return false
	}
	s.prepare(sc, keys)
	s.scanTo(sc, j)
	for i := range sc.met {
		if m := &sc.met[i]; m.p <= j && s.covers(sc, m, j) {
			return true
		}
	}
	return false
}

// Drop removes inst's holds of keys[:n] (keys a chain from its first
// block): each of inst's runs meeting them loses its front as far as it
// continues keys[:n]. Their entries stay counted until they pop.
func (s *Chains[K]) Drop(sc *Scan[K], keys []K, n int, inst string) {
	n = min(n, len(keys))
	if n <= 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.ids.byName[inst]
	if id == 0 || s.ilive == 0 {
		return
	}
	s.prepare(sc, keys)
	s.scanTo(sc, n-1)
	changed := false
	for i := range sc.met {
		m := &sc.met[i]
		if m.inst != id || m.p >= n {
			continue
		}
		s.covers(sc, m, n-1)
		if r := s.runAt(m.num); r.lo == m.lo {
			s.trim(m.num, m.lo+uint64(min(m.end, n)-m.p))
			changed = true
		}
	}
	if changed {
		s.ver++
	}
}
