package replicasync

import (
	"cmp"
	"slices"
	"time"
)

// Sequencing a same-instant burst (docs/replicas.md, "Sequencing a
// burst"). Replica sync shares a decision a min_gap plus a hop after it,
// so requests that reach different replicas at one instant are each
// decided blind to the others. A Sequencer instead holds each request of
// a replica with live peers until the end of its epoch (wall-clock
// aligned, Epoch long, so every replica knows the epochs without a word)
// plus a Grace for the peers' intents to arrive; the replica publishes an
// Intent for it meanwhile. When an epoch is due, every replica has the
// same intents and decides them in one order (Order: arrival, replica,
// seq) as one router would in turn: its own for real, its peers' dry
// (their effects on a throwaway overlay, Table.Overlay), dispatching only
// its own. The peers' real effects then arrive by the sync, before the
// next epoch is due when Epoch >= min_gap + a hop.

// Intent is a request a replica holds for its epoch: what every replica
// needs to decide it in the pool's order.
type Intent struct {
	// Replica and Seq name it: Seq counts the replica's intents (per
	// Sequencer, i.e. per process).
	Replica string
	Seq     uint64
	// Incarnation is the owner's (its message's; not encoded per intent):
	// a restarted owner numbers its intents from 1 again.
	Incarnation uint64
	// Arrival is when the owner received it (Unix ns, its clock): it
	// places the intent in its epoch and in the epoch's order.
	Arrival  int64
	Priority int
	// Tokens is the prompt's length in tokens, Hash its routing hash
	// (rendezvous order among ties), Keys its leading block keys (at most
	// MaxIntentKeys) as the owner's kv_aware keys it: every replica
	// matches them against its own index.
	Tokens int
	Hash   uint64
	Keys   []uint64
	// RemotePrefill: the intent is a disaggregated request's decode pick
	// (router.Request.RemotePrefill): the instance picked receives the
	// prompt's KV from the prefill instance and computes none of it, so
	// its decision books no pending prefill there (version 8: the intent
	// message's flag bit 1; an older replica ignores the bit).
	RemotePrefill bool
}

// MaxIntentKeys bounds the block keys an intent carries (8 bytes each:
// 16 KiB, a quarter of a message at the default max_message_bytes; at 16
// tokens a block, 32,768 tokens of prompt). Beyond it the prompt matches
// by its leading blocks only, which decide almost every pick.
const MaxIntentKeys = 2048

// DefaultMaxPerEpoch bounds the intents one epoch holds, own and peers'.
// A fleet routing 100,000 requests/s puts 200 in a 2 ms epoch; a burst of
// the bundled Mooncake trace at 128 instances ~160. Beyond it, an own
// request is decided at once, alone (as without sequencing), and a peer's
// is left to its owner.
const DefaultMaxPerEpoch = 1024

// SequencerConfig configures a Sequencer.
type SequencerConfig struct {
	// Replica is this replica's name (Intent.Replica of its own).
	Replica string
	// Epoch is δ, the length of an epoch (> 0).
	Epoch time.Duration
	// Grace is how long after an epoch's end the peers' intents are waited
	// for: one delivery (a NATS hop plus the clocks' skew). An intent
	// received after its epoch was due is late: left to its owner; one
	// due more than Epoch + 2×Grace ahead (its owner's clock further ahead
	// than the skew a grace allows) is future: left to its owner too.
	Grace time.Duration
	// MaxPerEpoch bounds an epoch's intents (0: DefaultMaxPerEpoch).
	MaxPerEpoch int
	// Start is when the replica started: an epoch begun before it is
	// partial (the peers' intents sent before it listened are missing),
	// so the replica neither holds nor sequences in it.
	Start time.Time
	// After is the seq the first own intent follows (its seq is After+1):
	// a sequencer that replaces another of the same incarnation (a
	// reload's new pool state over the pool's Syncer, Syncer.IntentSeq)
	// continues its numbering, since the peers name an intent by replica,
	// incarnation and seq and read commits by seq.
	After uint64
	// NextSeq, when set, numbers the own intents instead (After is then
	// unused): the counter of the Syncer whose incarnation names them
	// (Syncer.NextIntentSeq), shared by every sequencer over it, so that
	// a reload's new pool state and the old one, still holding requests
	// resolved before the swap, never give two intents one seq.
	NextSeq func() uint64
}

// SequencerStats counts what a Sequencer did.
type SequencerStats struct {
	// Held: own requests held for their epoch. Alone: own requests decided
	// at once (no live peer, a partial epoch, the bound). Received: peers'
	// intents sequenced. Late: peers' intents received after their epoch
	// was due (or of a partial epoch), left to their owner. Dropped:
	// peers' intents beyond the bound. Future: peers' intents due more
	// than Epoch + 2×Grace ahead of this replica's clock, left to their
	// owner (an epoch opened for one would hold this replica's requests
	// until then).
	Held, Alone, Received, Late, Dropped, Future int64
}

// Sequencer orders one replica's and its peers' intents by epoch. It is
// deterministic and has no clock of its own: every call is given now. Not
// safe for concurrent use (the caller serialises it).
type Sequencer struct {
	cfg  SequencerConfig
	seq  uint64
	open map[int64][]Intent // by epoch
	// peers names the peers' intents open: one delivered twice is
	// sequenced once.
	peers   map[intentID]struct{}
	decided int64 // the newest epoch decided; older ones are late
	stats   SequencerStats
}

// NewSequencer returns a sequencer for cfg.
func NewSequencer(cfg SequencerConfig) *Sequencer {
	if cfg.Epoch <= 0 {
		cfg.Epoch = time.Millisecond
	}
	if cfg.MaxPerEpoch <= 0 {
		cfg.MaxPerEpoch = DefaultMaxPerEpoch
	}
	cfg.Grace = max(cfg.Grace, 0)
	s := &Sequencer{cfg: cfg, seq: cfg.After, open: map[int64][]Intent{}, peers: map[intentID]struct{}{}}
	s.decided = s.epochOf(cfg.Start.UnixNano()) - 1
	return s
}

// Name is the replica's name.
func (s *Sequencer) Name() string { return s.cfg.Replica }

// Stats returns the counts so far.
func (s *Sequencer) Stats() SequencerStats { return s.stats }

func (s *Sequencer) epochOf(ns int64) int64 {
	d := int64(s.cfg.Epoch)
	e := ns / d
	if ns < 0 && ns%d != 0 {
		e-- // floor
	}
	return e
}

// dueAt is when epoch e is decided: its end plus the grace.
func (s *Sequencer) dueAt(e int64) time.Time {
	return time.Unix(0, (e+1)*int64(s.cfg.Epoch)).Add(s.cfg.Grace)
}

// EpochDue is when epoch e is decided.
func (s *Sequencer) EpochDue(e int64) time.Time { return s.dueAt(e) }

// partial reports whether epoch e began before the replica started.
func (s *Sequencer) partial(e int64) bool {
	return e*int64(s.cfg.Epoch) < s.cfg.Start.UnixNano()
}

// Hold offers an own request arriving at now. It returns the request's
// intent, to publish to the peers, and true when it is held until its
// epoch is due (Due); false: decide it at once, alone — no peer is live
// (live is the caller's Table.Live() > 0), its epoch began before the
// replica started, or the epoch is full.
func (s *Sequencer) Hold(now time.Time, live bool, in Intent) (Intent, bool) {
	in.Replica, in.Arrival = s.cfg.Replica, now.UnixNano()
	if len(in.Keys) > MaxIntentKeys {
		in.Keys = in.Keys[:MaxIntentKeys]
	}
	e := s.epochOf(in.Arrival)
	if !live || s.partial(e) || e <= s.decided || len(s.open[e]) >= s.cfg.MaxPerEpoch {
		s.stats.Alone++
		return in, false
	}
	if s.cfg.NextSeq != nil {
		in.Seq = s.cfg.NextSeq()
	} else {
		s.seq++
		in.Seq = s.seq
	}
	s.open[e] = append(s.open[e], in)
	s.stats.Held++
	return in, true
}

// Withdraw takes back an own held intent that its peers will not see (its
// publication was refused): its owner decides it alone, at once. It stays
// counted as held.
func (s *Sequencer) Withdraw(in Intent) {
	e := s.epochOf(in.Arrival)
	list := s.open[e]
	for i, x := range list {
		if x.Replica == in.Replica && x.Seq == in.Seq {
			if list = slices.Delete(list, i, i+1); len(list) == 0 {
				delete(s.open, e)
			} else {
				s.open[e] = list
			}
			return
		}
	}
}

// EpochOf is the epoch an intent arriving at ns (Unix ns) belongs to.
func (s *Sequencer) EpochOf(ns int64) int64 { return s.epochOf(ns) }

// intentID names an intent: its owner's process (replica and
// incarnation: a restarted owner numbers its intents from 1 again) and seq.
type intentID struct {
	replica     string
	incarnation uint64
	seq         uint64
}

func idOf(in *Intent) intentID { return intentID{in.Replica, in.Incarnation, in.Seq} }

// Receive records a peer's intent at now. It returns false when the
// intent is not sequenced here: already held (the same incarnation's seq
// delivered twice; a restarted owner's new intents are its new
// incarnation's), late (its epoch was due by now or already
// decided), of a partial epoch, future (due more than Epoch + 2×Grace
// after now: an own request arriving now is due within Epoch + Grace, and
// a peer's clock may be a grace ahead), or beyond the bound — its owner
// decides it in its own order, and its effects arrive by the sync.
func (s *Sequencer) Receive(now time.Time, in Intent) bool {
	if in.Replica == s.cfg.Replica {
		return false
	}
	id := idOf(&in)
	if _, dup := s.peers[id]; dup {
		return false
	}
	e := s.epochOf(in.Arrival)
	switch {
	case e <= s.decided || !now.Before(s.dueAt(e)) || s.partial(e):
		s.stats.Late++
		return false
	case s.dueAt(e).Sub(now) > s.cfg.Epoch+2*s.cfg.Grace:
		s.stats.Future++
		return false
	case len(s.open[e]) >= s.cfg.MaxPerEpoch:
		s.stats.Dropped++
		return false
	}
	if len(in.Keys) > MaxIntentKeys {
		in.Keys = in.Keys[:MaxIntentKeys]
	}
	s.open[e] = append(s.open[e], in)
	s.peers[id] = struct{}{}
	s.stats.Received++
	return true
}

// Next is when the oldest open epoch is due; ok is false when none is open.
func (s *Sequencer) Next() (at time.Time, ok bool) {
	first, found := int64(0), false
	for e := range s.open {
		if !found || e < first {
			first, found = e, true
		}
	}
	if !found {
		return time.Time{}, false
	}
	return s.dueAt(first), true
}

// Due appends to dst the intents of every epoch due by now, epoch by
// epoch, each in the pool's order (Order), and forgets those epochs: the
// caller decides them in that order, its own for real and its peers' dry.
func (s *Sequencer) Due(now time.Time, dst []Intent) []Intent {
	var due []int64
	for e := range s.open {
		if !now.Before(s.dueAt(e)) {
			due = append(due, e)
		}
	}
	slices.Sort(due)
	for _, e := range due {
		n := len(dst)
		dst = append(dst, s.open[e]...)
		slices.SortFunc(dst[n:], Order)
		for i := range dst[n:] {
			delete(s.peers, idOf(&dst[n+i]))
		}
		delete(s.open, e)
		s.decided = max(s.decided, e)
	}
	return dst
}

// Order is the pool's order of one epoch's intents: arrival time, then
// replica name, then the replica's seq, then its incarnation (two
// processes of one name, a restart's, may share a seq) — one order every
// replica computes from the same intents.
func Order(a, b Intent) int {
	return cmp.Or(cmp.Compare(a.Arrival, b.Arrival), cmp.Compare(a.Replica, b.Replica), cmp.Compare(a.Seq, b.Seq),
		cmp.Compare(a.Incarnation, b.Incarnation))
}
