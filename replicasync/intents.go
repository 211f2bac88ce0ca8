package replicasync

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// Intents on the wire (docs/replicas.md, "Sequencing a burst"): a replica
// that holds a request for its epoch publishes its Intent at once on the
// pool's intent subject, kv.replicas.<pool>.intents, beside the replica
// sync's (a version 5 replica, which subscribes to kv.replicas.<pool>
// only, never sees one), within the Syncer's byte budget; its peers hand
// each to their pool's sequencer (AttachIntents).

// IntentSubject is the pool's intent subject.
func (s *Syncer) IntentSubject() string { return s.subject + ".intents" }

// Sequence is δ, the sequencing epoch (0: off).
func (s *Syncer) Sequence() time.Duration { return s.cfg.Sequence }

// Grace is how long after an epoch's end its peers' intents are waited
// for.
func (s *Syncer) Grace() time.Duration { return s.cfg.SequenceGrace }

// Live is how many peers are live now.
func (s *Syncer) Live() int { return s.table.Live() }

// AttachIntents sets where the peers' intents go (on the subscription's
// goroutine: f must not block).
func (s *Syncer) AttachIntents(f func(Intent)) { s.intents.Store(&f) }

// PublishIntent sends a held request's intent to the peers now, within
// the byte budget; false when it was not sent (refused by the budget or by
// NATS, counted): the caller decides the request alone. An intent with
// more keys than max_message_bytes holds goes with its leading keys, as a
// speculative announcement does; one that cannot fit even so (a keyless
// intent larger than a message: never, at the least max_message_bytes) is
// counted as reason="size". Safe for concurrent use.
func (s *Syncer) PublishIntent(in Intent) bool {
	pool := s.cfg.Pool
	m := Message{Kind: KindIntent, Replica: s.cfg.Replica, Incarnation: s.incarnation, Intents: []Intent{in}}
	buf, err := m.AppendBinary(nil)
	if err == nil && len(buf) > s.cfg.MaxMessageBytes {
		// The key count's uvarint only shrinks with the keys: n keys fit.
		if n := len(in.Keys) - (len(buf)-s.cfg.MaxMessageBytes+7)/8; n >= 0 {
			m.Intents[0].Keys = in.Keys[:n]
			buf, err = m.AppendBinary(buf[:0])
		}
	}
	if err != nil {
		s.m.dropped.WithLabelValues(pool, "malformed").Inc()
		s.log.Error("replica sync: cannot encode an intent", "err", err)
		return false
	}
	if len(buf) > s.cfg.MaxMessageBytes {
		s.m.dropped.WithLabelValues(pool, "size").Inc()
		return false
	}
	if !s.allow(len(buf), s.cfg.Now()) {
		s.m.dropped.WithLabelValues(pool, "rate").Inc()
		return false
	}
	if err := s.cfg.Conn.Publish(s.IntentSubject(), buf); err != nil {
		s.m.dropped.WithLabelValues(pool, "publish").Inc()
		return false
	}
	atLeast(&s.intentSeq, in.Seq)
	s.m.messages.WithLabelValues(pool, "sent", KindIntent.String()).Inc()
	s.m.bytes.WithLabelValues(pool, "sent").Add(float64(len(buf)))
	return true
}

// receiveIntents handles one message on the intent subject: a peer's
// intents go to the attached sequencer; anything else is dropped and
// counted (never a crash).
func (s *Syncer) receiveIntents(msg *nats.Msg) {
	pool := s.cfg.Pool
	m, err := Decode(msg.Data)
	if err == nil && m.Kind != KindIntent {
		err = ErrMalformed
	}
	if err != nil {
		reason := "malformed"
		if errors.Is(err, ErrVersion) {
			reason = "version"
		}
		s.m.dropped.WithLabelValues(pool, reason).Inc()
		return
	}
	if m.Replica == s.cfg.Replica {
		return // our own (a duplicate name is reported by the sync's subject)
	}
	s.m.messages.WithLabelValues(pool, "received", m.Kind.String()).Inc()
	s.m.bytes.WithLabelValues(pool, "received").Add(float64(len(msg.Data)))
	f := s.intents.Load()
	if f == nil {
		return
	}
	for _, in := range m.Intents {
		(*f)(in)
	}
}

// CountSequence adds a sequencer's counts (a delta of SequencerStats) and
// a held request's hold time (hold >= 0) to the metrics.
func (s *Syncer) CountSequence(d SequencerStats, hold time.Duration) {
	pool := s.cfg.Pool
	for _, c := range [...]struct {
		outcome string
		n       int64
	}{{"held", d.Held}, {"alone", d.Alone}, {"received", d.Received}, {"late", d.Late}, {"dropped", d.Dropped}, {"future", d.Future}} {
		if c.n > 0 {
			s.m.sequenced.WithLabelValues(pool, c.outcome).Add(float64(c.n))
		}
	}
	if hold >= 0 {
		s.m.hold.WithLabelValues(pool).Observe(hold.Seconds())
	}
}

// MaxDeferred bounds the peers' messages held while an epoch is decided
// (an epoch's decisions take microseconds to a few milliseconds; a peer
// sends at most one early message per min_gap and one per interval): past
// it they are applied at once.
const MaxDeferred = 1024

// Commit records that this replica has decided its intent seq (and every
// earlier one) for real: the next send carries it after the load and spec
// messages that hold the decision's effects (KindCommit). Safe for
// concurrent use.
func (s *Syncer) Commit(seq uint64) {
	if atLeast(&s.committed, seq) {
		s.Changed() // an early send carries it (or the one due does)
	}
}

// IntentSeq is the highest own intent seq this Syncer has published or
// committed: a sequencer that replaces the pool's previous one (a
// reload's new pool state) numbers its intents after it
// (SequencerConfig.After), since the incarnation, which names them with
// the seq, stays the Syncer's.
func (s *Syncer) IntentSeq() uint64 {
	return max(s.intentSeq.Load(), s.committed.Load(), s.assigned.Load())
}

// NextIntentSeq numbers an own intent: the counter every sequencer over
// this Syncer takes its seqs from (SequencerConfig.NextSeq), since its
// peers name an intent by this Syncer's replica, incarnation and seq.
func (s *Syncer) NextIntentSeq() uint64 { return s.assigned.Add(1) }

// atLeast raises v to seq; false when it was there already.
func atLeast(v *atomic.Uint64, seq uint64) bool {
	for {
		cur := v.Load()
		if seq <= cur {
			return false
		}
		if v.CompareAndSwap(cur, seq) {
			return true
		}
	}
}

// Committed is the highest intent seq a peer's incarnation has said it
// decided for real (0: none heard): the peer's load and spec messages
// applied here already count those intents' requests.
func (s *Syncer) Committed(replica string, incarnation uint64) uint64 {
	return s.table.Committed(replica, incarnation)
}

// BeginEpoch tells the syncer an epoch is being decided: until
// ClearOverlay, the peers' load and speculative messages are held back.
// Their decisions of the same epoch reach this replica min_gap plus a hop
// after they are made, while it may still be deciding it; the overlay
// already counts them, and applied at once they would count twice.
func (s *Syncer) BeginEpoch() {
	s.epochMu.Lock()
	s.deciding = true
	s.epochMu.Unlock()
}

// deferEpoch holds m back while an epoch is decided; false: apply it now.
// A commit message is held with the load and spec messages it follows: a
// peer's intent it covers is not decided dry, so it must not count before
// they do.
func (s *Syncer) deferEpoch(m *Message) bool {
	if m.Kind != KindLoad && m.Kind != KindSpec && m.Kind != KindCommit {
		return false
	}
	s.epochMu.Lock()
	defer s.epochMu.Unlock()
	if !s.deciding || len(s.deferred) >= MaxDeferred {
		return false
	}
	s.deferred = append(s.deferred, *m)
	return true
}

// endEpoch applies the messages held back, in their order.
func (s *Syncer) endEpoch() {
	s.epochMu.Lock()
	defer s.epochMu.Unlock()
	s.deciding = false
	for i := range s.deferred {
		s.apply(&s.deferred[i])
	}
	clear(s.deferred)
	s.deferred = s.deferred[:0]
}
