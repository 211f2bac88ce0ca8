package replicasync

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/internal/zero"
	"github.com/kvrouter/kvrouter/kvindex"
)

// SubjectRoot is the subject root: a pool's replicas publish on
// kv.replicas.<pool>.
const SubjectRoot = "kv.replicas"

// Defaults (Config's zero values).
const (
	// DefaultInterval is how often changes are sent. The speculative
	// blocks exist for the requests that follow a new prompt within its
	// prefill (~0.3 s for 8,000 tokens at 25,000 tokens/s): a peer learns
	// of a decision within one interval plus a NATS hop (well under a
	// millisecond on a LAN), so 50 ms covers most of that window, and a
	// busy replica sends at most 20 load and 20 speculative messages a
	// second per pool.
	DefaultInterval = 50 * time.Millisecond
	// DefaultMinGap is how long after a change (Changed: a routing
	// decision, a request's end, a peer's hello) an early send goes out,
	// and the least time between two early sends. A NATS hop on a LAN is
	// ~100 µs, so a peer hears of a decision ~1.1 ms after it instead of
	// up to an interval later; one replica's decisions come milliseconds
	// apart (1,000 requests/s is one a millisecond), so a gap of 1 ms
	// still sends about once per decision at that rate and coalesces
	// more at higher ones: at most 1,000 early sends a second on top of
	// the interval's, each a delta of the few instances that changed, and
	// never beyond the byte budget (an early send goes only when the
	// budget holds a whole message). The gap also covers the proxy's
	// in-flight increment, made just after the strategy returns.
	DefaultMinGap = time.Millisecond
	// DefaultHeartbeat is how often the whole load table is sent even
	// when nothing changed: it refreshes every entry, so a lost update
	// lasts at most this long, and it tells peers the replica is alive.
	DefaultHeartbeat = time.Second
	// DefaultPeerTimeout: a peer silent this long (three missed
	// heartbeats, as a bridge's stale_after is three of its heartbeats)
	// counts nothing until it is heard again, so a killed replica's
	// requests in flight stop weighing on the instances it used.
	DefaultPeerTimeout = 3 * time.Second
	// DefaultMaxMessageBytes bounds one message: far under NATS's default
	// max_payload (1 MiB); 64 KiB holds ~8,000 block keys (30 long
	// prompts' new blocks) or ~3,000 instances' counters.
	DefaultMaxMessageBytes = 64 << 10
	// DefaultMaxBytesPerSecond bounds what one replica sends per pool.
	// A replica routing 1,000 requests/s whose prompts each bring 500 new
	// blocks (8,000 uncached tokens) announces 4 MB/s of keys; real
	// traffic, mostly cached, sends a small fraction. Over the bound,
	// speculative blocks are dropped (counted) before load counters,
	// and routing degrades to each replica's own view, never worse.
	DefaultMaxBytesPerSecond = 4 << 20
	// DefaultSpecCapacity bounds the peers' speculative (block, instance)
	// entries held, as the router's own overlay is bounded
	// (kvaware.DefaultSpeculativeCapacity).
	DefaultSpecCapacity = 1 << 18
)

// Config configures a Syncer. Zero values mean the defaults above.
type Config struct {
	// Conn is the NATS connection; required. Core NATS only: nothing is
	// stored, a message lost is replaced by the next one.
	Conn *nats.Conn
	// Pool names the pool; required.
	Pool string
	// Replica names this replica among the pool's (unique per process:
	// the default, hostname-pid, is).
	Replica  string
	Interval time.Duration
	// MinGap: an early send follows a change (Changed) this much later,
	// and early sends are at least this far apart; 100µs..Interval.
	MinGap time.Duration
	// NoEarlySend turns early sends off: changes wait for the next
	// interval (as before early sends; for comparisons).
	NoEarlySend       bool
	Heartbeat         time.Duration
	PeerTimeout       time.Duration
	MaxMessageBytes   int
	MaxBytesPerSecond int
	SpecCapacity      int
	// Epoch is the instance's cache epoch as this replica counts it
	// (router.CacheEpochs): a peer's speculative blocks count only while
	// it stays what it was when they arrived. nil = always 0.
	Epoch func(inst string) uint64
	// Metrics, nil = kept but registered nowhere.
	Metrics *Metrics
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Now is the clock; nil = time.Now.
	Now func() time.Time
	// Sequence is δ, the epoch of same-instant burst sequencing
	// (sequence.go; docs/replicas.md "Sequencing a burst"): 0 = off.
	// When on, the Syncer also carries intents on IntentSubject.
	Sequence time.Duration
	// SequenceGrace: see SequenceGrace (0: the default).
	SequenceGrace time.Duration
}

// SequenceGrace is how long after an epoch's end its peers' intents are
// waited for: one delivery, a NATS hop on a LAN (~100 µs) plus the
// replicas' clock skew (NTP keeps hosts of one network within a few
// hundred µs): 500 µs.
const SequenceGrace = 500 * time.Microsecond

// MaxSequence bounds δ: every request of a replica with live peers waits
// up to δ + SequenceGrace; beyond 100 ms the wait outweighs any placement
// it buys (a long prompt's prefill is ~0.3 s).
const MaxSequence = 100 * time.Millisecond

// MinMinGap is the least MinGap: about one NATS hop on a LAN; a shorter
// gap would send more often than a peer can hear the difference.
const MinMinGap = 100 * time.Microsecond

// ErrConfig marks an invalid Config.
var ErrConfig = errors.New("replicasync: invalid config")

// DefaultReplica is hostname-pid, unique among the processes of a fleet.
func DefaultReplica() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "router"
	}
	h = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' {
			return r
		}
		return '_'
	}, h)
	s := fmt.Sprintf("%s-%d", h, os.Getpid())
	if len(s) > MaxNameLen {
		s = s[len(s)-MaxNameLen:]
	}
	return s
}

// WithDefaults fills zero fields with the defaults.
func (c Config) WithDefaults() Config {
	if c.Replica == "" { // DefaultReplica asks the OS: only when needed
		c.Replica = DefaultReplica()
	}
	zero.Default(&c.Interval, DefaultInterval)
	zero.Default(&c.MinGap, min(DefaultMinGap, c.Interval))
	zero.Default(&c.Heartbeat, DefaultHeartbeat)
	zero.Default(&c.PeerTimeout, DefaultPeerTimeout)
	zero.Default(&c.MaxMessageBytes, DefaultMaxMessageBytes)
	zero.Default(&c.MaxBytesPerSecond, DefaultMaxBytesPerSecond)
	zero.Default(&c.SpecCapacity, DefaultSpecCapacity)
	zero.Default(&c.SequenceGrace, SequenceGrace)
	return c
}

// Validate checks a Config with defaults applied.
func (c Config) Validate() error {
	bad := func(f string, a ...any) error { return fmt.Errorf("%w: "+f, append([]any{ErrConfig}, a...)...) }
	switch {
	case checkName("pool", c.Pool) != nil:
		return bad("pool %q", c.Pool)
	case checkName("replica", c.Replica) != nil:
		return bad("replica %q: 1..%d of [A-Za-z0-9_-]", c.Replica, MaxNameLen)
	case c.Interval < time.Millisecond || c.Interval > 10*time.Second:
		return bad("interval %v out of 1ms..10s", c.Interval)
	case c.MinGap < MinMinGap || c.MinGap > c.Interval:
		return bad("min_gap %v out of %v..interval (%v)", c.MinGap, MinMinGap, c.Interval)
	case c.Heartbeat < c.Interval || c.Heartbeat > time.Minute:
		return bad("heartbeat %v out of interval..1m", c.Heartbeat)
	case c.PeerTimeout < 2*c.Heartbeat:
		return bad("peer_timeout %v under two heartbeats (%v): one lost message would drop a live peer", c.PeerTimeout, 2*c.Heartbeat)
	case c.MaxMessageBytes < MinMessageBytes || c.MaxMessageBytes > 1<<20:
		return bad("max_message_bytes %d out of %d..1 MiB (the largest load entry: %d pending and %d ended requests)", c.MaxMessageBytes, MinMessageBytes, MaxPending, MaxEnded)
	case c.MaxBytesPerSecond < c.MaxMessageBytes:
		return bad("max_bytes_per_second %d under max_message_bytes %d", c.MaxBytesPerSecond, c.MaxMessageBytes)
	case c.SpecCapacity < 0 || c.SpecCapacity > 1<<26:
		return bad("spec_capacity %d out of 0..%d", c.SpecCapacity, 1<<26)
	case c.Sequence != 0 && (c.Sequence < c.MinGap+MinMinGap || c.Sequence > MaxSequence):
		// An epoch's real effects reach the peers min_gap plus a hop after
		// it is decided: a shorter δ decides the next epoch without them.
		return bad("sequence %v out of min_gap + %v (%v)..%v", c.Sequence, MinMinGap, c.MinGap+MinMinGap, MaxSequence)
	}
	return nil
}

// Syncer is one replica's side of a pool's replica sync: it publishes the
// replica's counters and speculative blocks and holds its peers' (Table).
// Its methods are safe for concurrent use; Run owns the subscription and
// the sending loop.
type Syncer struct {
	cfg         Config
	subject     string
	incarnation uint64
	table       *Table
	log         *slog.Logger
	m           *Metrics

	local atomic.Pointer[func(dst []Load) []Load]
	place atomic.Pointer[func(dst []Queued) ([]Queued, float64)]
	rent  atomic.Pointer[func(dst []Rent, full bool) []Rent]
	hello atomic.Bool // a peer asked for our whole state
	// changed holds a pending early-send request (Changed); Run's
	// goroutine takes it and sends MinGap later.
	changed chan struct{}
	// intents receives the peers' intents (AttachIntents).
	intents atomic.Pointer[func(Intent)]
	// committed is the highest own intent seq decided for real (Commit).
	committed atomic.Uint64
	// intentSeq is the highest own intent seq published (IntentSeq).
	intentSeq atomic.Uint64
	// assigned is the highest own intent seq handed out (NextIntentSeq).
	assigned atomic.Uint64
	// While an epoch is decided (BeginEpoch..ClearOverlay) the peers'
	// load and speculative messages wait in deferred (intents.go).
	epochMu  sync.Mutex
	deciding bool
	deferred []Message

	qMu    sync.Mutex // guards queue and queued
	queue  []Spec
	queued int // keys in queue

	// Owned by Run's goroutine:
	seq      uint64
	lastSent map[string]Load
	// lastPlace is the placement message last sent (Computed, Queues).
	lastPlace Message
	placeSent bool
	lastFull  time.Time
	recent    []sentSpec // our unexpired announcements, for hellos
	// recentSpare is the slice flushSpecs compacts recent into.
	recentSpare []sentSpec
	commitSent  uint64     // the last commit message's Committed
	budgetMu    sync.Mutex // guards budget and refilled (intents are sent from the request path)
	budget      float64    // rate limiter: bytes that may be sent now
	refilled    time.Time
	buf         []byte
	loadBuf     []Load

	dupWarned atomic.Int64 // unix nanos of the last duplicate-name warning
}

type sentSpec struct {
	Spec
	exp time.Time
}

// New builds a Syncer; Run starts it.
func New(cfg Config) (*Syncer, error) {
	cfg = cfg.WithDefaults()
	if cfg.Conn == nil {
		return nil, fmt.Errorf("%w: no NATS connection", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics, _ = NewMetrics(nil)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	s := &Syncer{cfg: cfg, subject: SubjectRoot + "." + cfg.Pool, incarnation: binary.LittleEndian.Uint64(b[:]),
		table: NewTable(cfg.PeerTimeout, cfg.SpecCapacity, cfg.Now), log: cfg.Logger.With("pool", cfg.Pool, "replica", cfg.Replica),
		m: cfg.Metrics, lastSent: map[string]Load{}, changed: make(chan struct{}, 1), budget: float64(cfg.MaxBytesPerSecond), refilled: cfg.Now()}
	return s, nil
}

// Replica is this replica's name.
func (s *Syncer) Replica() string { return s.cfg.Replica }

// Table is what the peers have published.
func (s *Syncer) Table() *Table { return s.table }

// AttachLocal sets where this replica's own counters come from: f appends
// one Load per instance with anything in flight or pending (the router's
// KVState attaches itself; a later call replaces an earlier one).
func (s *Syncer) AttachLocal(f func(dst []Load) []Load) { s.local.Store(&f) }

// AttachPlacement sets where this replica's placement averages come from
// (kv_aware's mean tokens computed per pick and averaged queue per
// instance): f appends the queues to dst and returns them with the mean.
// They go out every Interval when they changed (not in early sends: they
// move slowly), and whole with every heartbeat and after a hello.
func (s *Syncer) AttachPlacement(f func(dst []Queued) ([]Queued, float64)) { s.place.Store(&f) }

// AttachRent sets where this replica's rent accounts come from (kv_aware's
// hot-prefix rent or buy): f appends every account it holds when full,
// else those that changed since its previous call (a dropped one as
// Removed), and forgets the changes. They go out with every send, early
// ones included, and whole with every heartbeat and after a hello, while
// a peer is live (a purchase or the rent of a decision is news to the
// peers' next decision).
func (s *Syncer) AttachRent(f func(dst []Rent, full bool) []Rent) { s.rent.Store(&f) }

// RentAccount: see Table.RentAccount.
func (s *Syncer) RentAccount(key, gen uint64, rent float64) (uint64, float64) {
	return s.table.RentAccount(key, gen, rent)
}

// PeerComputed: see Table.PeerComputed.
func (s *Syncer) PeerComputed(dst []float64) ([]float64, int) { return s.table.PeerComputed(dst) }

// PeerQueued: see Table.PeerQueued.
func (s *Syncer) PeerQueued(inst string, dst []float64) []float64 {
	return s.table.PeerQueued(inst, dst)
}

// PeerLoad sums the live peers' counters for inst.
func (s *Syncer) PeerLoad(inst string) (inflight, pendingTokens, pendingRequests int64) {
	return s.table.PeerLoad(inst)
}

// PeerQueue: see Table.PeerQueue.
func (s *Syncer) PeerQueue(inst string, q *PeerQueue) { s.table.PeerQueue(inst, q) }

// PeerEnded: see Table.PeerEnded.
func (s *Syncer) PeerEnded(inst string, asked, got int64) int {
	return s.table.PeerEnded(inst, asked, got)
}

// PeerExtend implements kvaware.PeerState.
func (s *Syncer) PeerExtend(keys []kvindex.Key, from int, inst string, epoch uint64) int {
	return s.table.PeerExtend(keys, from, inst, epoch)
}

// Overlay and ClearOverlay are the table's (sequencing, overlay.go).
func (s *Syncer) Overlay(e Effect) { s.table.Overlay(e) }

// ClearOverlay forgets the epoch's overlay and applies the peers'
// messages deferred while it was decided (BeginEpoch).
func (s *Syncer) ClearOverlay() {
	s.table.ClearOverlay()
	s.endEpoch()
}

// PeerHolders: see Table.PeerHolders.
func (s *Syncer) PeerHolders(dst []string, key kvindex.Key) []string {
	return s.table.PeerHolders(dst, key)
}

// Speculate queues a routing decision's speculative blocks for the next
// send; it never blocks. Beyond what the rate bound lets one interval
// carry, blocks are dropped (counted).
func (s *Syncer) Speculate(inst string, keys []kvindex.Key, ttl time.Duration) {
	if len(keys) == 0 || ttl <= 0 {
		return
	}
	limit := max(s.cfg.MaxBytesPerSecond/8*int(s.cfg.Interval)/int(time.Second), s.cfg.MaxMessageBytes/8)
	s.qMu.Lock()
	if s.queued+len(keys) > limit {
		s.qMu.Unlock()
		s.m.dropped.WithLabelValues(s.cfg.Pool, "queue").Add(float64(len(keys)))
		return
	}
	ks := make([]uint64, len(keys))
	for i, k := range keys {
		ks[i] = uint64(k)
	}
	s.queue = append(s.queue, Spec{Instance: inst, TTL: ttl, Keys: ks})
	s.queued += len(keys)
	s.qMu.Unlock()
}

// Changed tells the syncer that this replica's state changed (a routing
// decision, a request's end): it sends what changed MinGap later, ahead of
// the next interval, if the byte budget holds a whole message then (else
// the interval's send carries it). Call it after the change (the sent
// state is read when the send goes out); it never blocks, and calls
// within one gap share one send.
func (s *Syncer) Changed() {
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// Peers lists the peers heard from.
func (s *Syncer) Peers() []PeerStatus { return s.table.Peers() }

// Run subscribes to the pool's subject, asks the peers for their state
// (hello) and sends this replica's every Interval until ctx is done; it
// returns ctx.Err(), or an error when it cannot subscribe.
func (s *Syncer) Run(ctx context.Context) error {
	sub, err := s.cfg.Conn.Subscribe(s.subject, s.receive)
	if err != nil {
		return fmt.Errorf("replicasync: subscribe %s: %w", s.subject, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if s.cfg.Sequence > 0 {
		isub, err := s.cfg.Conn.Subscribe(s.IntentSubject(), s.receiveIntents)
		if err != nil {
			return fmt.Errorf("replicasync: subscribe %s: %w", s.IntentSubject(), err)
		}
		defer func() { _ = isub.Unsubscribe() }()
	}
	// A reconnect (the server restarted, or another in the cluster took
	// the connection) is a join again: what the peers sent while this
	// replica was away (deltas, speculative blocks) reached no one, so it
	// says hello, and they answer with their whole tables and unexpired
	// announcements, as to a newcomer, instead of it waiting for their
	// next heartbeat. Registered once connected: only reconnects signal.
	reconnected := s.cfg.Conn.StatusChanged(nats.CONNECTED)
	defer s.cfg.Conn.RemoveStatusListener(reconnected)
	s.send(&Message{Kind: KindHello})
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	gap := time.NewTimer(s.cfg.MinGap)
	gap.Stop()
	armed := false
	for {
		select {
		case <-ctx.Done():
			s.leave()
			return ctx.Err()
		case <-t.C:
			s.flush(true)
		case <-reconnected:
			s.send(&Message{Kind: KindHello})
		case <-s.changed:
			// One early send per gap: a change signalled while armed is
			// read by the send already due (it reads the state then).
			if !armed && !s.cfg.NoEarlySend {
				gap.Reset(s.cfg.MinGap)
				armed = true
			}
		case <-gap.C:
			armed = false
			s.early()
		}
	}
}

// leave is Run's last send, when its context ends (the router is
// exiting): the load table whole with nothing in flight or pending, so
// that the peers stop counting this replica's requests now instead of for
// the peer timeout after its last message. A router whose drain timed out
// exits with requests still counted; they end with its process (found on
// the binaries, session 19: 8 requests cut at a 3 s drain were counted by
// a peer for ~2 s more). Recent ends stay listed (peers take them out of
// their engine samples). Every instance this replica holds or last sent
// is listed, zero ones as zero (the receiver drops those), so that a table
// split over several messages zeroes them too. A message refused by the
// byte budget or lost leaves them to the peer timeout, as before.
func (s *Syncer) leave() {
	cur := s.localLoads()
	out := make([]Load, 0, len(cur)+len(s.lastSent))
	for _, l := range cur {
		l.InFlight, l.PendingTokens, l.PendingRequests, l.Pending = 0, 0, 0, nil
		out = append(out, l)
	}
	for id := range s.lastSent {
		if _, ok := cur[id]; !ok {
			out = append(out, Load{Instance: id})
		}
	}
	if s.sendLoads(out, true) && s.cfg.Conn.IsConnected() {
		_ = s.cfg.Conn.FlushTimeout(time.Second) // out before the connection is closed
	}
}

// early is Changed's send: what changed, unless no peer is live (a lone
// replica would send one message per decision to no one; a newcomer's
// hello makes it live, and the interval's sends keep going out for a peer
// that joins without one) or the byte budget cannot hold a whole message
// now (the next interval's send then carries it, as without early sends).
func (s *Syncer) early() {
	if s.table.Live() == 0 {
		s.m.early.WithLabelValues(s.cfg.Pool, "no_peer").Inc()
		return
	}
	if s.refill(s.cfg.Now()) < float64(s.cfg.MaxMessageBytes) {
		s.m.early.WithLabelValues(s.cfg.Pool, "deferred").Inc()
		return
	}
	s.m.early.WithLabelValues(s.cfg.Pool, "sent").Inc()
	s.flush(false)
}

// receive handles one message (on the subscription's goroutine).
func (s *Syncer) receive(msg *nats.Msg) {
	pool := s.cfg.Pool
	m, err := Decode(msg.Data)
	if err != nil {
		reason := "malformed"
		if errors.Is(err, ErrVersion) {
			reason = "version"
		}
		s.m.dropped.WithLabelValues(pool, reason).Inc()
		s.log.Debug("replica sync: message dropped", "err", err)
		return
	}
	if m.Replica == s.cfg.Replica {
		if m.Incarnation != s.incarnation {
			s.m.dropped.WithLabelValues(pool, "duplicate_replica").Inc()
			now := time.Now().UnixNano()
			if last := s.dupWarned.Load(); now-last > int64(time.Minute) && s.dupWarned.CompareAndSwap(last, now) {
				s.log.Warn("replica sync: another process publishes under this replica's name; give each replica its own events.replica_sync.replica")
			}
		}
		return // our own
	}
	s.m.messages.WithLabelValues(pool, "received", m.Kind.String()).Inc()
	s.m.bytes.WithLabelValues(pool, "received").Add(float64(len(msg.Data)))
	if s.deferEpoch(&m) {
		return
	}
	s.apply(&m)
}

// apply applies a peer's message to the table.
func (s *Syncer) apply(m *Message) {
	pool := s.cfg.Pool
	switch m.Kind {
	case KindHello:
		s.table.Hello(m.Replica, m.Incarnation)
		s.hello.Store(true)
		s.Changed() // the newcomer catches up within a gap, not an interval
	case KindLoad:
		switch s.table.ApplyLoad(m) {
		case Stale:
			s.m.dropped.WithLabelValues(pool, "stale").Inc()
		case Restarted:
			s.log.Info("replica sync: peer restarted; its old counters are dropped", "peer", m.Replica)
		}
	case KindPlacement:
		s.table.ApplyPlacement(m)
	case KindRent:
		s.table.ApplyRent(m)
	case KindCommit:
		s.table.ApplyCommit(m)
	case KindSpec:
		s.table.Touch(m.Replica, m.Incarnation)
		if n := s.table.ApplySpec(m, s.cfg.Epoch); n > 0 {
			s.m.dropped.WithLabelValues(pool, "capacity").Add(float64(n))
		}
	}
}

// allow takes n bytes from the rate budget (refilled at MaxBytesPerSecond,
// holding at most one second's worth).
func (s *Syncer) allow(n int, now time.Time) bool {
	s.budgetMu.Lock()
	defer s.budgetMu.Unlock()
	if float64(n) > s.refillLocked(now) {
		return false
	}
	s.budget -= float64(n)
	return true
}

// refill brings the rate budget up to now and returns it.
func (s *Syncer) refill(now time.Time) float64 {
	s.budgetMu.Lock()
	defer s.budgetMu.Unlock()
	return s.refillLocked(now)
}

func (s *Syncer) refillLocked(now time.Time) float64 {
	rate := float64(s.cfg.MaxBytesPerSecond)
	s.budget = min(rate, s.budget+rate*now.Sub(s.refilled).Seconds())
	s.refilled = now
	return s.budget
}

// send encodes and publishes m within the rate bound; false when it was
// not sent.
func (s *Syncer) send(m *Message) bool {
	pool := s.cfg.Pool
	m.Replica, m.Incarnation = s.cfg.Replica, s.incarnation
	if m.Kind == KindLoad {
		s.seq++
		m.Seq = s.seq
	}
	var err error
	if s.buf, err = m.AppendBinary(s.buf[:0]); err != nil {
		s.log.Error("replica sync: cannot encode", "err", err) // a bug: names are checked where they enter
		return false
	}
	if !s.allow(len(s.buf), s.cfg.Now()) {
		s.m.dropped.WithLabelValues(pool, "rate").Inc()
		return false
	}
	if err := s.cfg.Conn.Publish(s.subject, s.buf); err != nil {
		s.m.dropped.WithLabelValues(pool, "publish").Inc()
		s.log.Debug("replica sync: publish failed", "err", err)
		return false
	}
	s.m.messages.WithLabelValues(pool, "sent", m.Kind.String()).Inc()
	s.m.bytes.WithLabelValues(pool, "sent").Add(float64(len(s.buf)))
	return true
}

// flush sends what changed: the load table (whole every Heartbeat or
// when a peer said hello, else the instances that changed), the placement
// averages (on the interval, tick), then the queued speculative blocks.
func (s *Syncer) flush(tick bool) {
	now := s.cfg.Now()
	hello := s.hello.Swap(false)
	// Read before the loads: they hold at least these decisions' effects.
	committed := s.committed.Load()
	cur := s.localLoads()
	full := hello || now.Sub(s.lastFull) >= s.cfg.Heartbeat
	var out []Load
	if full {
		for _, l := range cur {
			out = append(out, l)
		}
	} else {
		out = Delta(out, s.lastSent, cur)
	}
	loadsSent := true
	if full || len(out) > 0 {
		if loadsSent = s.sendLoads(out, full); loadsSent {
			s.lastSent = cur
			if full {
				s.lastFull = now
			}
		}
	}
	// Placement averages on the interval, while a peer may hear them (a
	// newcomer's hello brings them whole).
	live := s.table.Live() > 0
	if full || tick && live {
		s.flushPlacement(full)
	}
	s.flushRents(full, live)
	s.flushSpecs(now, hello)
	// The intents decided for real, after the messages with their effects
	// (whole again with the table, for a newcomer).
	if loadsSent && (committed > s.commitSent || full && committed > 0) &&
		s.send(&Message{Kind: KindCommit, Committed: committed}) {
		s.commitSent = committed
	}
	s.m.peers.WithLabelValues(s.cfg.Pool).Set(float64(s.table.Forget()))
}

// localLoads reads the router's load table (Config.Local): its valid,
// non-empty entries by instance.
func (s *Syncer) localLoads() map[string]Load {
	s.loadBuf = s.loadBuf[:0]
	if f := s.local.Load(); f != nil {
		s.loadBuf = (*f)(s.loadBuf)
	}
	cur := make(map[string]Load, len(s.loadBuf))
	for _, l := range s.loadBuf {
		if l.InFlight < 0 || l.PendingTokens < 0 || l.PendingRequests < 0 || checkName("instance", l.Instance) != nil {
			continue
		}
		if !l.Empty() {
			cur[l.Instance] = l
		}
	}
	return cur
}

// Delta appends to dst the load entries a delta message carries from the
// table last sent to cur (both by instance, without empty entries): the
// instances whose counters changed, each with only the ends added since,
// and those back to zero, sent as zero.
func Delta(dst []Load, last, cur map[string]Load) []Load {
	for id, l := range cur {
		if prev := last[id]; !prev.Equal(l) {
			dst = append(dst, l.sinceSent(prev.Ended))
		}
	}
	for id := range last {
		if _, ok := cur[id]; !ok {
			dst = append(dst, Load{Instance: id}) // now zero
		}
	}
	return dst
}

// MinMessageBytes is the least max_message_bytes: one message holds the
// largest load entry (an instance name of MaxNameLen, MaxPending pending
// and MaxEnded ended requests) from a replica of the longest name, as
// loadSize and headerSize count them (~3.1 KiB). Under it, a replica whose
// busiest instance's entry did not fit sent nothing else (found in review:
// with 1 KiB, 64 recent ends per instance — 21 requests/s over the 3 s
// they are kept — made sendLoads spin on empty messages).
var MinMessageBytes = headerSize(strings.Repeat("r", MaxNameLen)) +
	loadSize(Load{Instance: strings.Repeat("i", MaxNameLen), Pending: make([]Pending, MaxPending), Ended: make([]Ended, MaxEnded)})

// sendLoads sends loads in messages of at most MaxMessageBytes; a full
// table that fits in one message is marked Complete.
func (s *Syncer) sendLoads(loads []Load, full bool) bool {
	room := s.cfg.MaxMessageBytes - headerSize(s.cfg.Replica)
	size := 0
	for _, l := range loads {
		size += loadSize(l)
	}
	if size <= room {
		return s.send(&Message{Kind: KindLoad, Complete: full, Loads: loads})
	}
	ok := true
	for start := 0; start < len(loads); {
		n, end := 0, start
		for end < len(loads) && n+loadSize(loads[end]) <= room {
			n += loadSize(loads[end])
			end++
		}
		if end == start {
			// Validate keeps room for the largest entry (MinMessageBytes),
			// and loadSize over-counts: never loop on one that claims not
			// to fit.
			end++
		}
		ok = s.send(&Message{Kind: KindLoad, Loads: loads[start:end]}) && ok
		start = end
	}
	return ok
}

// flushPlacement sends the placement averages when they changed since
// the last sent (always when full), in messages of at most
// MaxMessageBytes, the first Complete.
func (s *Syncer) flushPlacement(full bool) {
	f := s.place.Load()
	if f == nil {
		return
	}
	qs, computed := (*f)(nil)
	kept := qs[:0]
	for _, q := range qs {
		if checkName("instance", q.Instance) == nil && placementValue(q.Wait) {
			kept = append(kept, q)
		}
	}
	qs = kept
	if !placementValue(computed) {
		computed = 0
	}
	if !full && s.placeSent && computed == s.lastPlace.Computed && slices.Equal(qs, s.lastPlace.Queues) {
		return
	}
	room := s.cfg.MaxMessageBytes - headerSize(s.cfg.Replica) - 8
	ok := true
	for start := 0; start == 0 || start < len(qs); {
		n, end := 0, start
		for end < len(qs) && n+queuedSize(qs[end]) <= room {
			n += queuedSize(qs[end])
			end++
		}
		end = max(end, min(start+1, len(qs))) // a name fits: MinMessageBytes
		ok = s.send(&Message{Kind: KindPlacement, Complete: start == 0, Computed: computed, Queues: qs[start:end]}) && ok
		if end == start {
			break
		}
		start = end
	}
	if ok {
		s.lastPlace, s.placeSent = Message{Computed: computed, Queues: qs}, true
	}
}

// flushRents sends the rent accounts that changed since the last send
// (while a peer is live) or, when full, all of them (whatever live says,
// as the load table and the placement averages: a peer may hear this
// replica, and count it live by its load messages, while this replica
// hears no one, and it must not keep summing frozen accounts), in
// messages of at most MaxMessageBytes, the first of a whole table
// Complete. The changes are taken from kv_aware every flush, so that they
// do not pile up while no peer listens (a lone replica sends no deltas: a
// newcomer's hello makes it live and brings the whole table); a change
// lost with a refused send is repaired by the next heartbeat's whole
// table.
func (s *Syncer) flushRents(full, live bool) {
	f := s.rent.Load()
	if f == nil {
		return
	}
	rs := (*f)(nil, full)
	if !full && (!live || len(rs) == 0) {
		return
	}
	kept := rs[:0]
	for _, r := range rs {
		if rentValue(r) {
			kept = append(kept, r)
		}
	}
	rs = kept
	per := max((s.cfg.MaxMessageBytes-headerSize(s.cfg.Replica))/rentSize, 1)
	for start := 0; start == 0 || start < len(rs); start += per {
		end := min(start+per, len(rs))
		s.send(&Message{Kind: KindRent, Complete: full && start == 0, Rents: rs[start:end]})
		if end == start {
			break
		}
	}
}

// flushSpecs sends the queued speculative blocks (and, after a hello, our
// unexpired earlier ones with their remaining TTL), packed into messages
// of at most MaxMessageBytes.
func (s *Syncer) flushSpecs(now time.Time, hello bool) {
	s.qMu.Lock()
	q := s.queue
	s.queue, s.queued = nil, 0
	s.qMu.Unlock()
	// Forget expired announcements; bound what is kept for hellos, the
	// newest first. kept is the spare slice, not s.recent's: compacting
	// s.recent in place while reading it from the back overwrote entries
	// not yet read.
	kept := s.recentSpare[:0]
	keys := 0
	for i := len(s.recent) - 1; i >= 0; i-- {
		if r := s.recent[i]; r.exp.After(now) && keys+len(r.Keys) <= s.cfg.SpecCapacity {
			keys += len(r.Keys)
			kept = append(kept, r)
		}
	}
	slices.Reverse(kept) // oldest first
	clear(s.recent)
	s.recent, s.recentSpare = kept, s.recent[:0]
	var out []Spec
	if hello {
		for _, r := range s.recent {
			out = append(out, Spec{Instance: r.Instance, TTL: r.exp.Sub(now), Keys: r.Keys})
		}
	}
	out = append(out, q...)
	if len(out) == 0 {
		return
	}
	room := s.cfg.MaxMessageBytes - headerSize(s.cfg.Replica)
	for start := 0; start < len(out); {
		n, end := 0, start
		for end < len(out) {
			sz := specSize(out[end])
			if sz > room { // one decision larger than a message: its leading blocks matter most
				out[end].Keys = out[end].Keys[:(room-specSize(Spec{Instance: out[end].Instance}))/8]
				sz = specSize(out[end])
			}
			if n+sz > room {
				break
			}
			n += sz
			end++
		}
		s.send(&Message{Kind: KindSpec, Specs: out[start:end]}) // a refusal is counted by send
		start = end
	}
	for _, sp := range q {
		s.recent = append(s.recent, sentSpec{Spec: sp, exp: now.Add(sp.TTL)})
	}
}
