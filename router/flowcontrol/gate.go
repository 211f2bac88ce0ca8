package flowcontrol

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// ShedError is Acquire's refusal: the request was shed and should be
// answered at once (the HTTP edge answers 429 with Retry-After).
type ShedError struct {
	Reason     Reason
	RetryAfter time.Duration
	// Waited is how long it waited before it was shed (0 when shed on
	// arrival).
	Waited time.Duration
}

func (e *ShedError) Error() string {
	return fmt.Sprintf("flowcontrol: shed (%s), retry after %v", e.Reason, e.RetryAfter)
}

// Gate is a Sched shared by concurrent requests: Acquire blocks until the
// request is admitted, shed, or its context ends. Each waiter owns a timer
// for its own expiry, so the Gate starts no goroutine of its own.
type Gate struct {
	now       func() time.Time
	limits    func() (int, int64)
	instances func() []string

	// mu guards s and the tickets' state (admission, shed reason).
	mu      sync.Mutex
	s       *Sched
	expired []*Item // scratch for Expire
}

// GateOption adjusts a Gate.
type GateOption func(*Gate)

// WithClock replaces time.Now (tests).
func WithClock(now func() time.Time) GateOption { return func(g *Gate) { g.now = now } }

// WithLimits makes the Gate read its budgets (as SetLimits takes them) at
// every decision, so that they follow the pool: the router derives the
// concurrency budget from its healthy instances.
func WithLimits(f func() (maxConcurrency int, maxPendingPrefill int64)) GateOption {
	return func(g *Gate) { g.limits = f }
}

// WithInstances makes the Gate read the instances requests may go to at
// every decision (per-instance budgets: Config.InstanceConcurrency,
// InstancePrefill).
func WithInstances(f func() []string) GateOption {
	return func(g *Gate) { g.instances = f }
}

// NewGate returns a Gate over a new Sched.
func NewGate(cfg Config, opts ...GateOption) (*Gate, error) {
	s, err := New(cfg)
	if err != nil {
		return nil, err
	}
	g := &Gate{s: s, now: time.Now}
	for _, o := range opts {
		o(g)
	}
	return g, nil
}

// Ticket is an admitted request. Call FirstToken when its first byte
// arrives (it frees pending prefill) and Done when it ends, whichever way;
// both may be called more than once.
type Ticket struct {
	g     *Gate
	it    Item
	ready chan struct{} // closed when admitted or shed
	shed  Reason        // set, under g.mu, when shed while waiting
	retry time.Duration
	// unstreamed (under g.mu): its first byte is not its first token
	// (Unstreamed); prefill releases its prefill at the predicted one.
	unstreamed bool
	prefill    *time.Timer
}

// Waited is how long the request waited for admission.
func (t *Ticket) Waited() time.Duration { return t.it.Waited() }

// FirstToken frees the request's pending prefill and learns its service
// time (not for an Unstreamed request: its prefill ended earlier).
func (t *Ticket) FirstToken() {
	t.settle(func(s *Sched, it *Item, now time.Time) {
		if t.unstreamed {
			s.Prefilled(it, now)
		} else {
			s.FirstToken(it, now)
		}
	})
}

// Done ends the request and admits whoever its budget lets in.
func (t *Ticket) Done() {
	t.settle(func(s *Sched, it *Item, now time.Time) {
		if t.prefill != nil {
			t.prefill.Stop()
		}
		s.Done(it, now)
	})
}

// Unstreamed says that the request's first response byte will not mark
// its first token: vLLM sends a non-streamed response whole, after the
// generation. Held until that byte, its prefill would count against its
// instance's budget for the whole generation, and learnt as a service
// time, the generation would pass for a prefill and shed requests with
// objectives it does not concern. So its pending prefill is released when
// its first token is predicted — admission plus the queue's service fit
// for its work and the work ahead of it on its instance (call it after
// Bind), else, before the fit has a sample, after fallback (the
// strategy's own prediction, or 0) — or at its first byte or Done if
// sooner, and no sample is learnt from it. The fit's mean, not a
// percentile: the budget bounds the engine's pending tokens, whose time
// average is the tokens admitted per second times the mean time each is
// held (Little's law), so holding each for its predicted mean keeps the
// average right; a percentile would hold nine in ten too long and idle
// the budget. With nothing learnt yet the choice is between counting the
// generation as prefill (a 3,000-token prompt then held for its whole
// answer: two such per 8,192-token budget) and counting little; the
// concurrency budget still bounds the engine, so the queue errs on that
// side until a streamed request teaches it the engine's prefill rate.
// Only the first call counts.
func (t *Ticket) Unstreamed(fallback time.Duration) {
	g := t.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if t.unstreamed {
		return
	}
	t.unstreamed = true
	now := g.now()
	d := fallback
	if at, ok := g.s.PredictedFirstToken(&t.it); ok {
		d = at.Sub(now)
	}
	if d <= 0 {
		g.s.Prefilled(&t.it, now)
		g.dispatch(now)
		return
	}
	t.prefill = time.AfterFunc(d, func() {
		t.settle((*Sched).Prefilled) // a no-op once its first byte or Done came
	})
}

// settle applies step to the request under the gate's lock, at one clock
// reading, then admits whoever that lets in.
func (t *Ticket) settle(step func(*Sched, *Item, time.Time)) {
	g := t.g
	g.mu.Lock()
	now := g.now()
	step(g.s, &t.it, now)
	g.dispatch(now)
	g.mu.Unlock()
}

// Acquire offers the request described by it (its Value is the Gate's)
// and waits for the outcome: a Ticket when admitted, a *ShedError when
// shed, or ctx's error when ctx ends first — the request then leaves the
// queue at once and is counted Canceled.
func (g *Gate) Acquire(ctx context.Context, it Item) (*Ticket, error) {
	t := &Ticket{g: g, it: it, ready: make(chan struct{})}
	t.it.Value = t
	g.mu.Lock()
	now := g.now()
	g.refresh()
	g.expire(now)
	out := g.s.Offer(&t.it, now)
	if d := out.Displaced; d != nil {
		// out.RetryAfter is the arrival's, set only when it is shed.
		g.release(d, ShedDisplaced, g.retryAfter())
	}
	switch out.Verdict {
	case Admitted:
		g.mu.Unlock()
		return t, nil
	case Shed:
		g.dispatch(now) // the expiries above may have freed the queue's head
		g.mu.Unlock()
		return nil, &ShedError{Reason: out.Reason, RetryAfter: out.RetryAfter}
	}
	g.dispatch(now)
	wait := t.it.expires.Sub(now)
	g.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case <-t.ready:
			return t.outcome()
		case <-ctx.Done():
			g.mu.Lock()
			now := g.now()
			if !g.s.Remove(&t.it, Canceled, now) && t.shed == "" {
				// Admitted as the client left: give the slot back.
				g.s.Done(&t.it, now)
			}
			g.dispatch(now) // it may have been the head holding the others back
			g.mu.Unlock()
			return nil, ctx.Err()
		case <-timer.C:
			g.mu.Lock()
			now := g.now()
			// Admit first whoever has room: a budget raised or an
			// instance back since the last decision (nothing else calls
			// Next then, unless Poke does) would otherwise find this
			// request shed for its wait beside a free slot. Then shed what
			// expired and admit at once whoever that unblocks (the
			// expired request may have been the head holding the others
			// back), not at the next first token or end.
			g.refresh()
			g.admitReady(now)
			g.dispatch(now)
			if t.it.state == stQueued { // our clock and the timer's differ slightly
				timer.Reset(max(t.it.expires.Sub(now), time.Millisecond))
			}
			g.mu.Unlock()
		}
	}
}

func (t *Ticket) outcome() (*Ticket, error) {
	t.g.mu.Lock()
	defer t.g.mu.Unlock()
	if t.shed != "" {
		return nil, &ShedError{Reason: t.shed, RetryAfter: t.retry, Waited: t.g.now().Sub(t.it.arrived)}
	}
	return t, nil
}

// refresh reads the budgets when they follow the pool. Callers hold g.mu.
func (g *Gate) refresh() {
	if g.limits != nil {
		g.s.SetLimits(g.limits())
	}
	if g.instances != nil && g.s.perInstance() {
		g.s.SetInstances(g.instances())
	}
}

// FilterRoom keeps, in place, the candidates whose instance (named by id)
// has room for the ticket's request under the per-instance budgets; when
// none has (a budget lowered since admission) it returns cands unchanged,
// so the request is still routed.
func FilterRoom[T any](t *Ticket, cands []T, id func(T) string) []T {
	g := t.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.s.perInstance() {
		return cands
	}
	room := g.s.RoomFor(&t.it)
	n := 0
	for _, c := range cands {
		if room.Has(id(c)) {
			n++
		}
	}
	if n == 0 {
		return cands
	}
	out := cands[:0]
	for _, c := range cands {
		if room.Has(id(c)) {
			out = append(out, c)
		}
	}
	return out
}

// KeptFree appends to dst the instances the queue keeps free of prompts
// larger than a step, for the ticket's request (Sched.KeptFree;
// router.Request.KeptFree).
func (t *Ticket) KeptFree(dst []string) []string {
	g := t.g
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.s.KeptFree(&t.it, dst)
}

// Bind records the instance the request was routed to (the first call
// counts; it is charged there until FirstToken and Done).
func (t *Ticket) Bind(instance string) {
	g := t.g
	g.mu.Lock()
	g.s.Bind(&t.it, instance)
	g.mu.Unlock()
}

// Companion counts a warm-up copy of t's request sent to instance
// (Sched.Companion): call FirstToken and Done on the ticket it returns as
// for a request. It returns nil when t is no longer admitted (the copy is
// then not counted).
func (t *Ticket) Companion(instance string) *Ticket {
	g := t.g
	c := &Ticket{g: g, ready: make(chan struct{})}
	c.it.Value = c
	close(c.ready)
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.s.Companion(&t.it, &c.it, instance, g.now()) {
		return nil
	}
	return c
}

// Poke admits the waiters a change of the budgets or instances read
// through WithLimits and WithInstances has room for (a raised limit, an
// instance healthy again or added): the gate reads them at its decisions,
// and without one nothing would admit those waiters until the next
// arrival, first token or end, or their own expiry.
func (g *Gate) Poke() {
	g.mu.Lock()
	g.dispatch(g.now())
	g.mu.Unlock()
}

// dispatch sheds what has expired and admits what the budgets allow,
// waking each waiter. Callers hold g.mu.
func (g *Gate) dispatch(now time.Time) {
	g.refresh()
	g.expire(now)
	g.admitReady(now)
}

// admitReady admits what the budgets allow, waking each waiter. Callers
// hold g.mu.
func (g *Gate) admitReady(now time.Time) {
	for it := g.s.Next(now); it != nil; it = g.s.Next(now) {
		close(it.Value.(*Ticket).ready)
	}
}

// expire sheds the waiters whose time is up. Callers hold g.mu.
func (g *Gate) expire(now time.Time) {
	g.expired = g.s.Expire(now, g.expired[:0])
	for i, it := range g.expired {
		g.release(it, it.ExpiredReason(), g.retryAfter())
		g.expired[i] = nil
	}
}

// retryAfter is the Retry-After of a waiter shed now: the predicted time
// for the queue to drain, at least a second. Callers hold g.mu.
func (g *Gate) retryAfter() time.Duration { return g.s.retryAfter(g.s.drainTime()) }

func (g *Gate) release(it *Item, r Reason, retry time.Duration) {
	t := it.Value.(*Ticket)
	t.shed, t.retry = r, retry
	close(t.ready)
}

// Stats returns a snapshot of the queue.
func (g *Gate) Stats() Stats {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.refresh()
	return g.s.Stats(g.now())
}

// Config is the queue's configuration, defaults applied.
func (g *Gate) Config() Config { return g.s.Config() }
