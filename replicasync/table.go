package replicasync

import (
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/spechold"
)

// Table holds what the peers of one replica have published: per peer, its
// load counters per instance; and, for all peers together, their
// speculative blocks, bounded in number. A peer silent for longer than the
// timeout counts for nothing until it publishes again. Safe for
// concurrent use.
type Table struct {
	timeout time.Duration
	now     func() time.Time

	mu    sync.RWMutex // guards peers
	peers map[string]*peer

	// spec holds the peers' speculative blocks, all peers together.
	spec *spechold.Set[kvindex.Key]

	// ov is the epoch's overlay (overlay.go): the effects of the peers'
	// intents decided dry so far in the epoch being decided; guarded by mu.
	ov overlay
}

type peer struct {
	incarnation uint64
	seq         uint64 // last load message applied
	seen        time.Time
	// synced is when the peer's whole table was last known current: a
	// complete table, or a delta that followed the previous message with
	// no gap since the last complete one (chain). Entries count while
	// either they or the whole table were refreshed within the timeout.
	synced time.Time
	chain  bool
	loads  map[string]loadAt
	// place is the peer's latest placement averages (version 4), nil
	// before its first placement message.
	place *placement
	// rents is the peer's rent accounts by prefix key (version 5), nil
	// before its first rent message.
	rents map[uint64]Rent
	// committed is the highest intent seq the peer has decided for real
	// (version 7 commit messages).
	committed uint64
}

// MaxPeerRents bounds the rent accounts held per peer: twice what one
// kv_aware replica keeps (its table holds 4,096), so that a whole table
// and the deltas of the heartbeat that follows it fit. Beyond it a peer's
// new accounts are left out until its next whole table.
const MaxPeerRents = 1 << 13

// placement is one peer's placement averages (Message.Computed, Queues).
type placement struct {
	computed float64
	queues   map[string]float64
}

type loadAt struct {
	Load
	at time.Time
}

// NewTable returns an empty table; peers silent for timeout stop counting,
// and at most capacity speculative (block, instance) entries are held
// (the oldest make way).
func NewTable(timeout time.Duration, capacity int, now func() time.Time) *Table {
	if now == nil {
		now = time.Now
	}
	return &Table{timeout: timeout, now: now, peers: map[string]*peer{}, spec: spechold.New[kvindex.Key](capacity)}
}

// Result of applying a load message.
type Result int

const (
	Applied Result = iota
	// Stale: an older message of the peer's current incarnation.
	Stale
	// Restarted: a new incarnation replaced the peer's old counters.
	Restarted
)

// ApplyLoad records a peer's load message.
func (t *Table) ApplyLoad(m *Message) Result {
	now := t.now()
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.peers[m.Replica]
	res := Applied
	switch {
	case p == nil:
		p = &peer{incarnation: m.Incarnation, loads: map[string]loadAt{}}
		t.peers[m.Replica] = p
	case p.incarnation != m.Incarnation:
		// A restarted process: its requests in flight died with the old
		// one. (Incarnations are random, not ordered: a late message of
		// the old one would reset the new one's counters until its next
		// message, at most a heartbeat later.)
		*p = peer{incarnation: m.Incarnation, loads: map[string]loadAt{}}
		res = Restarted
	case m.Seq <= p.seq:
		return Stale
	}
	switch {
	case m.Complete:
		clear(p.loads)
		p.chain, p.synced = true, now
	case m.Seq == p.seq+1 && p.chain:
		p.synced = now // every entry not in this delta is unchanged
	default:
		p.chain = false // a lost message: unlisted entries age until refreshed
	}
	p.seq, p.seen = m.Seq, now
	for _, l := range m.Loads {
		if l.Empty() { // the sender holds nothing there, ends included
			delete(p.loads, l.Instance)
			continue
		}
		// A delta's ends add to those held (Load.sinceSent); a complete
		// table has cleared them.
		l.Ended = mergeEnded(p.loads[l.Instance].Ended, l.Ended)
		p.loads[l.Instance] = loadAt{Load: l, at: now}
	}
	return res
}

// heard is the peer that sent m (a placement or rent message), seen now:
// a new one (its load messages start it counting; until then it is
// seen), or a new incarnation's, which replaces the old one's state.
// t.mu held.
func (t *Table) heard(m *Message) *peer {
	p := t.peers[m.Replica]
	switch {
	case p == nil:
		p = &peer{incarnation: m.Incarnation, loads: map[string]loadAt{}}
		t.peers[m.Replica] = p
	case p.incarnation != m.Incarnation:
		*p = peer{incarnation: m.Incarnation, loads: map[string]loadAt{}}
	}
	p.seen = t.now()
	return p
}

// ApplyPlacement records a peer's placement message (KindPlacement): a
// complete one replaces what the peer's previous ones said, a partial one
// (the rest of a list too long for one message) adds to it. A new
// incarnation's placement replaces the old one's (its counters follow
// with its load messages).
func (t *Table) ApplyPlacement(m *Message) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.heard(m)
	if p.place == nil || m.Complete {
		p.place = &placement{queues: make(map[string]float64, len(m.Queues))}
	}
	p.place.computed = m.Computed
	for _, q := range m.Queues {
		p.place.queues[q.Instance] = q.Wait
	}
}

// ApplyCommit records a peer's commit message (KindCommit).
func (t *Table) ApplyCommit(m *Message) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.heard(m)
	p.committed = max(p.committed, m.Committed)
}

// Committed is the highest intent seq replica's incarnation has said it
// decided for real (0: none, or another incarnation's).
func (t *Table) Committed(replica string, incarnation uint64) uint64 {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if p := t.peers[replica]; p != nil && p.incarnation == incarnation {
		return p.committed
	}
	return 0
}

// ApplyRent records a peer's rent message (KindRent): a complete one
// replaces the accounts its previous ones gave, a partial one (a delta,
// or the rest of a whole table too long for one message) replaces the
// listed accounts and drops those it says the peer removed. A new
// incarnation's accounts replace the old one's.
func (t *Table) ApplyRent(m *Message) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.heard(m)
	if p.rents == nil || m.Complete {
		p.rents = make(map[uint64]Rent, len(m.Rents))
	}
	for _, r := range m.Rents {
		switch _, held := p.rents[r.Key]; {
		case r.Removed():
			delete(p.rents, r.Key)
		case held || len(p.rents) < MaxPeerRents:
			p.rents[r.Key] = r
		}
	}
}

// RentAccount is the pool's rent-or-buy account of the prefix key, given
// this replica's own (gen purchases known, rent paid since the last):
// gen is the most purchases any live replica knows of, and account the
// sum, in ascending order (so that every replica adding the same numbers
// gets the same bits), of the rent each replica at that gen has paid,
// own included, at most MaxRent. Without a live peer's account of key it is own's.
func (t *Table) RentAccount(key, own uint64, rent float64) (uint64, float64) {
	var buf [16]float64
	vals, gen := buf[:0], own
	now := t.now()
	t.mu.RLock()
	for _, p := range t.peers {
		if p.rents == nil || now.Sub(p.seen) > t.timeout {
			continue
		}
		r, ok := p.rents[key]
		switch {
		case !ok || r.Gen < gen:
		case r.Gen > gen:
			gen, vals = r.Gen, append(vals[:0], r.Rent)
		default:
			vals = append(vals, r.Rent)
		}
	}
	t.mu.RUnlock()
	if len(vals) == 0 {
		return gen, rent
	}
	if own == gen {
		vals = append(vals, rent)
	}
	slices.Sort(vals)
	var sum float64
	for _, v := range vals {
		sum += v
	}
	return gen, min(sum, MaxRent)
}

// PeerComputed appends to dst the mean tokens per pick of each live peer
// that has published one (> 0), in no particular order (a caller that sums
// them sorts first, so that every replica adds the same numbers in the
// same order), and counts the live peers that have published placement
// averages at all.
func (t *Table) PeerComputed(dst []float64) (_ []float64, peers int) {
	t.livePlacements(func(p *placement) {
		peers++
		if p.computed > 0 {
			dst = append(dst, p.computed)
		}
	})
	return dst, peers
}

// PeerQueued appends to dst each live peer's averaged queue on inst, in no
// particular order (as PeerComputed).
func (t *Table) PeerQueued(inst string, dst []float64) []float64 {
	t.livePlacements(func(p *placement) {
		if w, ok := p.queues[inst]; ok {
			dst = append(dst, w)
		}
	})
	return dst
}

// livePlacements calls f, under the read lock, with each live peer's
// placement averages.
func (t *Table) livePlacements(f func(p *placement)) {
	now := t.now()
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, p := range t.peers {
		if p.place != nil && now.Sub(p.seen) <= t.timeout {
			f(p.place)
		}
	}
}

// Hello records a peer's hello: a peer that has just started (or
// restarted: a new incarnation's counters replace the old one's) is live
// from now, before its first load message, so that the early send that
// answers it goes out (Syncer.early sends only while a peer is live).
func (t *Table) Hello(replica string, incarnation uint64) {
	now := t.now()
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.peers[replica]
	if p == nil || p.incarnation != incarnation {
		p = &peer{incarnation: incarnation, loads: map[string]loadAt{}}
		t.peers[replica] = p
	}
	p.seen = now
}

// Live counts the peers heard from within the timeout.
func (t *Table) Live() (n int) {
	now := t.now()
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, p := range t.peers {
		if now.Sub(p.seen) <= t.timeout {
			n++
		}
	}
	return n
}

// Touch records that a peer is alive (any message from it).
func (t *Table) Touch(replica string, incarnation uint64) {
	now := t.now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if p := t.peers[replica]; p != nil && p.incarnation == incarnation {
		p.seen = now
	}
}

// PeerLoad sums the live peers' counters for inst: a peer silent for the
// timeout, or an entry not refreshed for as long (a lost update), counts
// nothing.
func (t *Table) PeerLoad(inst string) (inflight, pendingTokens, pendingRequests int64) {
	t.livePeerLoads(inst, func(l loadAt) {
		inflight = AddSat(inflight, l.InFlight)
		pendingTokens = AddSat(pendingTokens, l.PendingTokens)
		pendingRequests = AddSat(pendingRequests, l.PendingRequests)
	})
	return inflight, pendingTokens, pendingRequests
}

// livePeerLoads calls f, under the read lock, with each live peer's entry
// for inst that is still current: a peer silent for the timeout, or an
// entry not refreshed for as long (a lost update), is skipped. The entry
// is passed by value: a pointer to the loop's copy escaped to the heap,
// one allocation per live peer per call (per candidate of a decision).
func (t *Table) livePeerLoads(inst string, f func(l loadAt)) {
	now := t.now()
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, p := range t.peers {
		if now.Sub(p.seen) > t.timeout {
			continue
		}
		if l, ok := p.loads[inst]; ok && (now.Sub(l.at) <= t.timeout || now.Sub(p.synced) <= t.timeout) {
			f(l)
		}
	}
	if l, ok := t.ov.loads[inst]; ok {
		f(loadAt{Load: l})
	}
}

// PeerQueue is what the live peers have pending on one instance, for a
// replica to drain with its own by the same model (docs/replicas.md,
// "Pending prefill: one model, the same facts").
type PeerQueue struct {
	// Pending lists the peers' listed pending requests.
	Pending []Pending
	// Rates holds the rate of each live peer with pending requests on the
	// instance (version 2 peers; 0 entries skipped).
	Rates []int64
	// Unlisted is pending prefill the peers did not list (version 1 peers,
	// or beyond MaxPending): it counts in full.
	Unlisted int64
	// Started is the latest first byte any of those peers saw from the
	// instance (their clocks, Unix ns).
	Started int64
	// InFlight, Tokens and Requests are the sums PeerLoad returns, read
	// in the same pass.
	InFlight, Tokens, Requests int64
}

// PeerQueue appends to q (reset first) the live peers' pending requests on
// inst; the same liveness rules as PeerLoad.
func (t *Table) PeerQueue(inst string, q *PeerQueue) {
	q.Pending, q.Rates = q.Pending[:0], q.Rates[:0]
	q.Unlisted, q.Started, q.InFlight, q.Tokens, q.Requests = 0, 0, 0, 0, 0
	t.livePeerLoads(inst, func(l loadAt) {
		q.Started = max(q.Started, l.Started)
		q.InFlight = AddSat(q.InFlight, l.InFlight)
		q.Tokens = AddSat(q.Tokens, l.PendingTokens)
		q.Requests = AddSat(q.Requests, l.PendingRequests)
		var listed int64
		for _, r := range l.Pending {
			listed = AddSat(listed, r.Tokens)
		}
		q.Pending = append(q.Pending, l.Pending...)
		q.Unlisted = AddSat(q.Unlisted, max(l.PendingTokens-listed, 0))
		if l.Rate > 0 && len(l.Pending) > 0 {
			q.Rates = append(q.Rates, l.Rate)
		}
	})
}

// PeerEnded counts the live peers' requests on inst that an engine-load
// sample asked for at asked and answered at got (Unix ns) may have
// counted and that have ended since (EndedIn); the same liveness rules as
// PeerLoad.
func (t *Table) PeerEnded(inst string, asked, got int64) (n int) {
	t.livePeerLoads(inst, func(l loadAt) { n += EndedIn(l.Ended, asked, got) })
	return n
}

// EndedIn counts the requests of ends that a sample asked for at asked and
// answered at got may have counted: routed before got, ended after asked.
func EndedIn(ends []Ended, asked, got int64) int {
	n := 0
	for _, e := range ends {
		if e.At < got && e.End > asked {
			n++
		}
	}
	return n
}

// PeerStatus is one peer as this replica sees it.
type PeerStatus struct {
	Replica     string    `json:"replica"`
	Incarnation uint64    `json:"incarnation"`
	LastSeen    time.Time `json:"last_seen"`
	Live        bool      `json:"live"`
	InFlight    int64     `json:"in_flight"`
	Pending     int64     `json:"pending_prefill_tokens"`
}

// Peers lists the peers known, live or not, by name.
func (t *Table) Peers() []PeerStatus {
	now := t.now()
	t.mu.RLock()
	out := make([]PeerStatus, 0, len(t.peers))
	for name, p := range t.peers {
		s := PeerStatus{Replica: name, Incarnation: p.incarnation, LastSeen: p.seen, Live: now.Sub(p.seen) <= t.timeout}
		for _, l := range p.loads {
			s.InFlight += l.InFlight
			s.Pending += l.PendingTokens
		}
		out = append(out, s)
	}
	t.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Replica < out[j].Replica })
	return out
}

// Forget drops peers silent for ten timeouts (their entries already count
// nothing), so that a fleet's churn of replica names does not grow the
// table without end. It returns how many live peers remain.
func (t *Table) Forget() (live int) {
	now := t.now()
	t.mu.Lock()
	defer t.mu.Unlock()
	for name, p := range t.peers {
		age := now.Sub(p.seen)
		if age > 10*t.timeout {
			delete(t.peers, name)
		} else if age <= t.timeout {
			live++
		}
	}
	return live
}

// ApplySpec records a peer's speculative blocks, each held until receipt
// + its TTL while the instance's cache epoch (epoch(inst), as this replica
// counts it) stays what it is now. It returns how many entries were
// dropped because the table was full (the oldest make way).
func (t *Table) ApplySpec(m *Message, epoch func(string) uint64) (evicted int) {
	now := t.now().UnixNano()
	for _, s := range m.Specs {
		var ep uint64
		if epoch != nil {
			ep = epoch(s.Instance)
		}
		keys := make([]kvindex.Key, len(s.Keys))
		for i, k := range s.Keys {
			keys[i] = kvindex.Key(k)
		}
		evicted += t.spec.Add(keys, s.Instance, now+int64(min(s.TTL, MaxTTL)), ep, now)
	}
	return evicted
}

// SpecLen is the number of speculative entries held (expired ones
// included until the next insertion sweeps them).
func (t *Table) SpecLen() int { return t.spec.Len() }

// PeerExtend returns how far the peers' speculative blocks continue keys
// on inst from block from: the largest k >= from with keys[from:k] all
// held, unexpired, in inst's cache epoch epoch.
func (t *Table) PeerExtend(keys []kvindex.Key, from int, inst string, epoch uint64) int {
	now := t.now().UnixNano()
	for {
		next := t.spec.Extend(keys, from, inst, epoch, now)
		next = t.overlayExtend(keys, next, inst)
		if next == from {
			return from
		}
		from = next
	}
}

// PeerHolders appends to dst the instances that peers hold key on,
// unexpired.
func (t *Table) PeerHolders(dst []string, key kvindex.Key) []string {
	return t.overlayHolders(t.spec.Holders(dst, key, t.now().UnixNano()), key)
}
