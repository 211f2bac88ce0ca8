package kvaware

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// Sequencing in the live router (events.replica_sync.sequence;
// docs/replicas.md "Sequencing a burst"). When the pool's replica sync
// sequences, Pick holds a request while a peer is live: it publishes the
// request's intent and waits for its turn, which the pool's epoch loop
// gives when the request's epoch is due, in the pool's order — the
// peers' intents before it decided dry onto the overlay (DecideIntent),
// its own earlier ones by their own Picks. With no live peer nothing is
// held. The loop runs only while an epoch is open: it starts with the
// first intent (own or a peer's) and ends when every open epoch is
// decided, so nothing outlives the requests it serves.

// IntentPeers is the part of the peer state that carries intents.
// *replicasync.Syncer implements it.
type IntentPeers interface {
	// Sequence is δ (0: off); Grace how long after an epoch's end the
	// peers' intents are waited for.
	Sequence() time.Duration
	Grace() time.Duration
	// Live is how many peers are live.
	Live() int
	Replica() string
	// AttachIntents sets where the peers' intents go.
	AttachIntents(func(replicasync.Intent))
	// PublishIntent sends an own held intent; false when refused.
	PublishIntent(replicasync.Intent) bool
	// BeginEpoch holds the peers' state messages back until the epoch's
	// overlay is cleared (EndEpoch).
	BeginEpoch()
	// Commit says an own intent was decided for real; Committed is the
	// highest intent seq a peer's incarnation has said it decided for real
	// in the messages applied here.
	Commit(seq uint64)
	Committed(replica string, incarnation uint64) uint64
	// NextIntentSeq numbers an own intent, from one counter for every
	// pool state over this peer state (a reload's new one and the old,
	// still holding requests resolved before the swap): the peers name
	// an intent by replica, incarnation and seq.
	NextIntentSeq() uint64
	// CountSequence adds counts (and a hold time, when >= 0) to the
	// metrics.
	CountSequence(d replicasync.SequencerStats, hold time.Duration)
}

var _ IntentPeers = (*replicasync.Syncer)(nil)

// seqWaiter is a held request waiting for its turn.
type seqWaiter struct {
	start time.Time     // when it was held, on the real clock (the hold metric)
	turn  chan struct{} // closed by the loop: pick now
	done  chan struct{} // closed by the owner when its pick returned
	// granted: the loop closed turn; left: the owner is gone before its
	// turn (cancelled, or its intent was refused): the loop decides it
	// dry, as its peers do. Both guarded by seqState.mu.
	granted, left bool
}

// seqState is a pool's sequencing.
type seqState struct {
	ip  IntentPeers
	now func() time.Time

	mu      sync.Mutex // guards the rest
	sq      *replicasync.Sequencer
	last    replicasync.SequencerStats // counted in the metrics so far
	waiters map[uint64]*seqWaiter      // own held intents by Seq
	running bool                       // the epoch loop runs
	// sleep is the due time the loop sleeps until (zero while it does
	// not sleep); wake (capacity 1) wakes it when an epoch due earlier
	// opens meanwhile.
	sleep time.Time
	wake  chan struct{}
	// deadline is, per open epoch, when it is decided on the monotonic
	// clock: its wall-clock due time as read when it opened, so that a
	// wall clock stepped back meanwhile does not hold its requests for
	// the step's length.
	deadline map[int64]time.Time
	// strat and cands are the newest held request's strategy and
	// candidates: what the loop decides its epoch's dry intents with.
	strat *KVAware
	cands []*router.Instance
	// wg counts the loop (tests wait for it).
	wg sync.WaitGroup
}

// attachSequencing turns sequencing on when the peer state sequences.
func (st *KVState) attachSequencing(ps PeerState) {
	ip, ok := ps.(IntentPeers)
	if !ok || ip.Sequence() <= 0 {
		return
	}
	q := &seqState{ip: ip, now: st.now, waiters: map[uint64]*seqWaiter{}, wake: make(chan struct{}, 1),
		deadline: map[int64]time.Time{}}
	q.sq = replicasync.NewSequencer(replicasync.SequencerConfig{
		Replica: ip.Replica(), Epoch: ip.Sequence(), Grace: ip.Grace(), Start: st.now(), NextSeq: ip.NextIntentSeq})
	st.seq = q
	ip.AttachIntents(q.receive)
}

// SequenceStats is what the pool's sequencer did (zero when off).
func (st *KVState) SequenceStats() replicasync.SequencerStats {
	if st.seq == nil {
		return replicasync.SequencerStats{}
	}
	st.seq.mu.Lock()
	defer st.seq.mu.Unlock()
	return st.seq.sq.Stats()
}

// countLocked adds what the sequencer counted since the last call to the
// metrics.
func (q *seqState) countLocked() {
	cur := q.sq.Stats()
	d := replicasync.SequencerStats{Held: cur.Held - q.last.Held, Alone: cur.Alone - q.last.Alone,
		Received: cur.Received - q.last.Received, Late: cur.Late - q.last.Late, Dropped: cur.Dropped - q.last.Dropped,
		Future: cur.Future - q.last.Future}
	q.last = cur
	if d != (replicasync.SequencerStats{}) {
		q.ip.CountSequence(d, -1)
	}
}

// receive takes a peer's intent (on the subscription's goroutine).
func (q *seqState) receive(in replicasync.Intent) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if now := q.now(); q.sq.Receive(now, in) {
		q.openedLocked(now, in.Arrival)
		q.startLocked(in.Arrival)
	}
	q.countLocked()
}

// openedLocked records when the epoch of an intent arriving at arrival,
// just sequenced at wall-clock now, is due on the monotonic clock (the
// real clock's: st.now may be another's), unless its epoch has a
// deadline already. Bounded by Hold (an own request is due within δ +
// grace) and Receive (a peer's within δ + 2 × grace).
func (q *seqState) openedLocked(now time.Time, arrival int64) {
	e := q.sq.EpochOf(arrival)
	if _, ok := q.deadline[e]; !ok {
		q.deadline[e] = time.Now().Add(q.sq.EpochDue(e).Sub(now))
	}
}

// startLocked starts the epoch loop unless it runs, or wakes it when it
// sleeps until an epoch due after that of an intent arriving at arrival
// (Unix ns), just opened.
func (q *seqState) startLocked(arrival int64) {
	if q.running {
		if !q.sleep.IsZero() && q.sq.EpochDue(q.sq.EpochOf(arrival)).Before(q.sleep) {
			select {
			case q.wake <- struct{}{}:
			default:
			}
		}
		return
	}
	q.running = true
	q.wg.Go(q.run)
}

// hold holds req for its epoch when a peer is live: it returns the
// waiter whose done the caller closes after its pick (nil: decide at
// once, alone), or ctx's error when the request left while held.
func (q *seqState) hold(ctx context.Context, s *KVAware, req *router.Request, cands []*router.Instance) (*seqWaiter, error) {
	if q.ip.Live() == 0 {
		q.mu.Lock()
		q.sq.Hold(q.now(), false, replicasync.Intent{}) // counted alone
		q.countLocked()
		q.mu.Unlock()
		return nil, nil
	}
	in := s.Intent(ctx, req)
	q.mu.Lock()
	start := q.now()
	in, held := q.sq.Hold(start, true, in)
	var w *seqWaiter
	if held {
		q.openedLocked(start, in.Arrival)
		w = &seqWaiter{start: time.Now(), turn: make(chan struct{}), done: make(chan struct{})}
		q.waiters[in.Seq] = w
		q.strat, q.cands = s, slices.Clone(cands)
		q.startLocked(in.Arrival)
	}
	q.countLocked()
	q.mu.Unlock()
	if !held {
		return nil, nil
	}
	if !q.ip.PublishIntent(in) {
		q.mu.Lock()
		if !w.granted { // decide alone, now
			w.left = true
			q.sq.Withdraw(in)
			delete(q.waiters, in.Seq)
			q.mu.Unlock()
			return nil, nil
		}
		q.mu.Unlock()
	}
	select {
	case <-w.turn:
		return w, nil
	case <-ctx.Done():
		q.mu.Lock()
		granted := w.granted
		w.left = !granted
		q.mu.Unlock()
		if granted {
			close(w.done) // the loop goes on without this pick
		}
		return nil, ctx.Err()
	}
}

// run is the epoch loop: it decides each epoch when it is due, until no
// epoch is open.
func (q *seqState) run() {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		q.mu.Lock()
		at, ok := q.sq.Next()
		if !ok {
			q.running = false
			clear(q.deadline)
			q.mu.Unlock()
			return
		}
		d := at.Sub(q.now())
		for _, dl := range q.deadline {
			d = min(d, time.Until(dl))
		}
		if d > 0 {
			q.sleep = at
		}
		q.mu.Unlock()
		if d > 0 {
			t.Reset(d)
			select {
			case <-t.C:
			case <-q.wake: // an earlier epoch opened: look again
			}
		}
		q.mu.Lock()
		q.sleep = time.Time{}
		// An epoch past its monotonic deadline is due whatever the wall
		// clock says (stepped back since it opened).
		now, mono := q.now(), time.Now()
		for e, dl := range q.deadline {
			if !mono.Before(dl) {
				now = maxTime(now, q.sq.EpochDue(e))
			}
		}
		due := q.sq.Due(now, nil)
		for e := range q.deadline {
			if !now.Before(q.sq.EpochDue(e)) {
				delete(q.deadline, e)
			}
		}
		s, cands := q.strat, q.cands
		q.mu.Unlock()
		for len(due) > 0 {
			e := q.sq.EpochOf(due[0].Arrival) // EpochOf reads only the config
			n := 1
			for n < len(due) && q.sq.EpochOf(due[n].Arrival) == e {
				n++
			}
			q.decide(due[:n], s, cands)
			due = due[n:]
		}
	}
}

// decide decides one epoch's intents in the pool's order: the own by
// giving each held request its turn and waiting for its pick, the peers'
// (and an own whose request left) dry onto the overlay, then forgets the
// overlay; an own withdrawn meanwhile (decided alone) is skipped. An
// epoch without an own intent changes nothing here: skipped.
func (q *seqState) decide(epoch []replicasync.Intent, s *KVAware, cands []*router.Instance) {
	own := q.ip.Replica()
	if s == nil || !slices.ContainsFunc(epoch, func(in replicasync.Intent) bool { return in.Replica == own }) {
		return
	}
	q.ip.BeginEpoch()
	for i := range epoch {
		in := &epoch[i]
		if in.Replica == own {
			q.mu.Lock()
			w := q.waiters[in.Seq]
			delete(q.waiters, in.Seq)
			turn := w != nil && !w.left
			if turn {
				w.granted = true
				close(w.turn)
			}
			q.mu.Unlock()
			if turn {
				q.ip.CountSequence(replicasync.SequencerStats{}, time.Since(w.start))
				<-w.done
				q.ip.Commit(in.Seq)
				continue
			}
			if w == nil {
				// Withdrawn after this epoch was taken (its publication
				// refused, hold): decided alone, for real, its effects in
				// this replica's own state, and no peer saw its intent.
				// Decided dry it would count twice here.
				continue
			}
		} else if q.ip.Committed(in.Replica, in.Incarnation) >= in.Seq {
			// Its owner's real decision reached this replica before the
			// epoch began here (this replica's clock behind, or a slow
			// decision): the peer state counts it already.
			continue
		}
		_, _ = s.DecideIntent(context.Background(), in, false, cands)
	}
	s.st.EndEpoch()
}

// maxTime is the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
