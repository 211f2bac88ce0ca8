package flowcontrol

import (
	"container/heap"
	"container/list"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("flowcontrol: invalid config")

// Defaults. Each is a bound chosen from what it protects, not fitted to a
// trace; docs/flow-control.md gives the reasoning at more length.
const (
	// DefaultMaxQueue bounds waiting requests per pool. Each holds its
	// body (already bounded by the router's body budget) and a goroutine;
	// 1,024 waiting requests is several times the in-flight capacity of a
	// large pool, so under a burst the time bound (MaxWait) or the
	// deadline sheds before the length does.
	DefaultMaxQueue = 1024
	// DefaultMaxWait bounds the time a request waits: past it the client
	// is better served by a 429 it can retry (or send elsewhere) than by a
	// connection held open; interactive TTFT objectives are seconds, and
	// batch clients set their own deadline or resubmit.
	DefaultMaxWait = 30 * time.Second
	// agingBands is how many priority bands a request can climb within
	// MaxWait: the default aging step is MaxWait/agingBands, so aging acts
	// well before the time bound sheds the request.
	agingBands = 10
	// estimatorWindow is the number of dispatches (or first tokens) the
	// drain-rate and service-time averages span: enough to average out
	// request-size variance (relative error ~1/sqrt(64) = 12%), few enough
	// to follow a change of load within a few turnovers of a pool's slots.
	estimatorWindow = 64
)

// Reason says why a request left the queue without being admitted.
type Reason string

// Reasons.
const (
	// ShedQueueFull: the queue was at MaxQueue and held nothing of lower
	// priority to displace.
	ShedQueueFull Reason = "queue_full"
	// ShedDisplaced: a more urgent arrival took its place in a full queue.
	ShedDisplaced Reason = "displaced"
	// ShedDeadline: its TTFT objective could not be met (predicted at
	// arrival, or reached while waiting).
	ShedDeadline Reason = "deadline"
	// ShedTimeout: it waited MaxWait.
	ShedTimeout Reason = "timeout"
	// Canceled: the client went away while it waited.
	Canceled Reason = "canceled"
)

// Reasons lists every Reason, for metrics.
func Reasons() []Reason {
	return []Reason{ShedQueueFull, ShedDisplaced, ShedDeadline, ShedTimeout, Canceled}
}

// Verdict is the outcome of Offer.
type Verdict uint8

// Verdicts.
const (
	// Admitted: the request may be sent now; call Done when it ends.
	Admitted Verdict = iota + 1
	// Queued: the request waits; Next admits it, Expire or Remove ends it.
	Queued
	// Shed: the request is refused now (Outcome.Reason says why).
	Shed
)

// Config of one pool's queue. The zero value is a queue with no budget:
// everything is admitted at once.
type Config struct {
	// MaxConcurrency is the number of admitted, unfinished requests the
	// pool takes; 0 = no limit. SetLimits changes it at runtime (the router
	// derives it from the instances' concurrency threshold).
	MaxConcurrency int
	// MaxPendingPrefill bounds the prompt tokens of admitted requests that
	// have not produced their first token; 0 = no limit. A request larger
	// than the whole budget is admitted when nothing else is prefilling.
	MaxPendingPrefill int64
	// MaxQueue bounds waiting requests (default DefaultMaxQueue).
	MaxQueue int
	// MaxWait bounds the time a request waits (default DefaultMaxWait).
	MaxWait time.Duration
	// AgingStep is the wait that moves a request up one priority band —
	// past the next more urgent band waiting, whatever its value (default
	// MaxWait/10).
	AgingStep time.Duration
	// Weights are tenants' shares of a band under contention (default 1
	// each): a tenant of weight 2 is admitted twice the tokens of one of
	// weight 1 while both wait.
	Weights map[string]float64
	// InstanceConcurrency and InstancePrefill are the same budgets per
	// instance (0 = none; instance.go): with either set a request is
	// admitted only while an instance (SetInstances) has room for it, and
	// the caller routes it to one that has (Room, Bind).
	InstanceConcurrency int
	InstancePrefill     int64
	// PreferCached: among the waiting requests fair queuing considers due
	// together (affinity.go), the one with the most prompt tokens cached
	// (Item.Cached) on an instance with room goes first, so a freed slot
	// goes to the request that gains most from that instance's cache.
	PreferCached bool
	// ChargeUncached makes the per-instance budget charge an instance only
	// the prompt tokens it does not hold (Item.Cached), and the
	// reservation's demand counts those tokens in both regimes (the
	// service fit counts them whether or not this is set: service.go).
	// Off by default: measured (docs/BENCHMARKS.md §12) it fixes kv_aware's
	// tail at half load but lowers goodput under 2× overload: the
	// reservation then keeps the short requests only their bare offered
	// load of instances, which runs them at utilisation ~1.
	ChargeUncached bool
	// ReserveInstance keeps live instances free of prompts larger than
	// InstancePrefill, as many as the requests that fit a step need for
	// their measured demand (reserve.go).
	ReserveInstance bool
}

// WithDefaults fills zero fields with their defaults.
func (c Config) WithDefaults() Config {
	zero.Default(&c.MaxQueue, DefaultMaxQueue)
	zero.Default(&c.MaxWait, DefaultMaxWait)
	zero.Default(&c.AgingStep, max(c.MaxWait/agingBands, time.Millisecond))
	return c
}

// Validate reports a config that cannot work.
func (c Config) Validate() error {
	switch {
	case c.MaxConcurrency < 0:
		return fmt.Errorf("%w: max_concurrency %d < 0", ErrConfig, c.MaxConcurrency)
	case c.MaxPendingPrefill < 0:
		return fmt.Errorf("%w: max_pending_prefill_tokens %d < 0", ErrConfig, c.MaxPendingPrefill)
	case c.MaxQueue < 0:
		return fmt.Errorf("%w: max_queue %d < 0", ErrConfig, c.MaxQueue)
	case c.MaxWait < 0:
		return fmt.Errorf("%w: max_wait %v < 0", ErrConfig, c.MaxWait)
	case c.AgingStep < 0:
		return fmt.Errorf("%w: aging_step %v < 0", ErrConfig, c.AgingStep)
	case c.InstanceConcurrency < 0 || c.InstancePrefill < 0:
		return fmt.Errorf("%w: per-instance budgets %d, %d < 0", ErrConfig, c.InstanceConcurrency, c.InstancePrefill)
	}
	for t, w := range c.Weights {
		if !(w > 0) || math.IsInf(w, 0) {
			return fmt.Errorf("%w: weight of tenant %q is %v, want > 0", ErrConfig, t, w)
		}
	}
	return nil
}

// Item is one request as the queue sees it. The caller fills the exported
// fields before Offer and must not change them afterwards.
type Item struct {
	// Tenant shares a band fairly with other tenants ("" is a tenant too).
	Tenant string
	// Priority: lower is more urgent (vLLM's convention); 0 is the default.
	Priority int64
	// Cost is what fair queuing charges the tenant: the request's prompt
	// tokens plus the output tokens it may generate (at least 1).
	Cost int64
	// Prefill is the prompt tokens counted against MaxPendingPrefill until
	// FirstToken (per instance with Config.ChargeUncached: only the tokens
	// the instance does not hold, Cached).
	Prefill int64
	// Cached is, per instance, how many of the prompt's leading tokens it
	// holds in cache, as the router's index saw them when the request
	// arrived (instances not listed hold none). The caller computes it
	// before Offer, outside the queue's lock (with a shared index it is a
	// round trip).
	Cached []Hold
	// Eligible reports whether the request may be sent to instance (a
	// LoRA adapter only some instances hold); nil = any. The per-instance
	// budgets admit it only while an instance it may go to has room: an
	// idle instance it cannot use must not let it in, to be bound over
	// budget on one it can. Called under the queue's lock, at each
	// decision, once per live instance.
	Eligible func(instance string) bool
	// Deadline is the time by which its first token is due; zero = none.
	Deadline time.Time
	// Value is the caller's own (the Gate keeps its waiter here).
	Value any

	arrived, admitted time.Time
	seq               uint64
	start             float64 // start tag (start-time fair queuing)
	lvl               *level
	tagIdx, expIdx    int
	expires           time.Time
	expReason         Reason
	fifo              *list.Element
	tfifo             *list.Element // in its tenant's items
	state             itemState
	inst              *instLoad // the instance it was bound to (Bind)
	charge            int64     // the prefill tokens charged to inst (Bind)
	work              int64     // its prefill: the prompt tokens inst (Bind; until then the best holder) lacks
	ahead             int64     // inst's prefill work before it, when bound
	big               bool      // an oversized prompt before its first token (reserve.go)
	long              bool      // an oversized request bound to inst, until it ends (reserve.go)
}

type itemState uint8

const (
	stNew itemState = iota
	stQueued
	stAdmitted  // counted in flight and in pending prefill
	stPrefilled // counted in flight only
	stDone      // finished, shed or removed
)

// Arrived is when the item was offered.
func (it *Item) Arrived() time.Time { return it.arrived }

// Waited is the time from offer to admission (0 when admitted at once, or
// not admitted).
func (it *Item) Waited() time.Duration {
	if it.admitted.IsZero() {
		return 0
	}
	return it.admitted.Sub(it.arrived)
}

// Outcome is what Offer decided.
type Outcome struct {
	Verdict Verdict
	// Reason is set for Shed.
	Reason Reason
	// RetryAfter is when a shed request is worth retrying: the predicted
	// time for the queue ahead of it to drain, at least one second.
	RetryAfter time.Duration
	// PredictedWait is the wait predicted for a queued request (0 when the
	// drain rate is not known yet).
	PredictedWait time.Duration
	// Displaced is a queued item of lower priority shed to make room (its
	// reason is ShedDisplaced); the caller tells its owner.
	Displaced *Item
}

// level is one priority band: its items ordered by start tag (fair
// queuing) and by arrival (aging), and its tenants' fair-queuing state.
type level struct {
	prio    int64
	tags    tagHeap
	fifo    list.List
	tenants map[string]*tenantState
	vtime   float64 // virtual time: the start tag of the last admitted item
	cost    int64   // queued tokens
}

type tenantState struct {
	finish float64 // finish tag of its last queued item
	queued int
	cost   int64
	// items are its queued requests, oldest first; lifo: newest first
	// (lifo.go) since one of them was shed for its deadline or wait bound
	// while others of it waited, until none waits.
	items list.List
	lifo  bool
}

// Sched is one pool's queue. It is not safe for concurrent use (Gate adds
// the lock); every method that depends on time takes now, so a simulator
// can run it on a virtual clock.
type Sched struct {
	cfg      Config
	conc     int
	prefill  int64
	inflight int
	pending  int64

	levels map[int64]*level
	order  []*level // active levels, by priority
	queued int
	cost   int64
	exp    expHeap
	seq    uint64

	// Drain-rate estimate: tokens admitted from the queue per second of
	// time the queue was non-empty, both averaged over estimatorWindow
	// admissions.
	last       time.Time
	busySec    float64
	busyTokens float64
	// svc is the average time from admission to first token; svcFit
	// predicts it from a request's prompt tokens (service.go).
	svc    time.Duration
	svcN   int
	svcFit svcFit

	counts Counts

	// Per-instance budgets (instance.go): the instances' loads, how many
	// are live, and admitted requests not yet bound to an instance.
	insts map[string]*instLoad
	// keepFree and keepBusy are keep's scratch (reserve.go).
	keepFree, keepBusy []*instLoad
	liveN              int
	unbound            int
	affBuf             []*Item // scratch for preferred
	// unboundBig counts oversized prompts admitted and not yet bound
	// (reserve.go).
	unboundBig int
	// Step-sized demand (reserve.go): arrivals counted, seconds between
	// them (averaged over estimatorWindow arrivals), and the step-sized
	// requests' tokens among them by priority.
	arrN    uint64
	lastArr time.Time
	arrSec  float64
	smallBy map[int64]*smallDemand
	// longBy is the oversized prompts' demand by priority, as smallBy
	// the step-sized requests' (offeredK's bound, longRoom).
	longBy map[int64]*smallDemand
	// arrTok is every arrival's uncached prompt tokens, decayed like
	// arrSec: the offered work of all prompts; queuedSmall the waiting
	// requests that fit a step (reserve.go).
	arrTok      float64
	queuedSmall int
	endsBuf     []float64
}

// Counts are the queue's totals since it was made.
type Counts struct {
	AdmittedAtOnce uint64 `json:"admitted_at_once"` // admitted at Offer, without waiting
	AdmittedQueued uint64 `json:"admitted_queued"`  // admitted by Next after waiting
	// Shed counts requests that left without admission, by reason
	// (Canceled included).
	Shed map[Reason]uint64 `json:"shed"`
	// Companions counts warm-up copies counted beside admitted requests
	// (Companion), not among admissions.
	Companions uint64 `json:"companions"`
}

// New returns an empty queue; cfg is completed with WithDefaults.
func New(cfg Config) (*Sched, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Sched{cfg: cfg, conc: cfg.MaxConcurrency, prefill: cfg.MaxPendingPrefill,
		levels: map[int64]*level{}, counts: Counts{Shed: map[Reason]uint64{}}}, nil
}

// Config is the queue's configuration, defaults applied.
func (s *Sched) Config() Config { return s.cfg }

// SetLimits changes the budgets (0 = no limit). Lowering them admits
// nothing new until the pool is back under them; raising them does not by
// itself admit anyone: call Next.
func (s *Sched) SetLimits(maxConcurrency int, maxPendingPrefill int64) {
	s.conc, s.prefill = max(maxConcurrency, 0), max(maxPendingPrefill, 0)
}

// tick accounts the time since the last event as backlog time when
// requests were waiting.
func (s *Sched) tick(now time.Time) {
	if s.queued > 0 && now.After(s.last) {
		s.busySec += now.Sub(s.last).Seconds()
	}
	if now.After(s.last) {
		s.last = now
	}
}

func (s *Sched) fits(it *Item) bool {
	if s.conc > 0 && s.inflight >= s.conc {
		return false
	}
	if !(s.prefill <= 0 || s.pending == 0 || s.pending+it.Prefill <= s.prefill) {
		return false
	}
	return s.instancesFit(it) && !s.reserveBlocks(it)
}

func (s *Sched) weight(tenant string) float64 {
	if w, ok := s.cfg.Weights[tenant]; ok {
		return w
	}
	return 1
}

// Offer decides on an arriving request: admit it now (when nothing waits
// and the budgets allow), shed it (queue full of more urgent work, or its
// deadline out of reach), or queue it.
func (s *Sched) Offer(it *Item, now time.Time) Outcome {
	if it.state != stNew {
		panic("flowcontrol: item offered twice")
	}
	s.tick(now)
	it.arrived = now
	it.Cost = max(it.Cost, 1)
	it.Prefill = max(it.Prefill, 0)
	s.noteArrival(it, now)
	if (s.queued == 0 || s.passesHeld(it, now)) && s.fits(it) {
		s.admit(it, now)
		s.counts.AdmittedAtOnce++
		return Outcome{Verdict: Admitted}
	}
	lvl := s.levels[it.Priority]
	start := 0.0
	var ts *tenantState
	if lvl != nil {
		start = lvl.vtime
		if ts = lvl.tenants[it.Tenant]; ts != nil {
			start = max(start, s.arrivalTag(ts, it.Tenant))
		}
	}
	wait := s.predictWait(it, start)
	if !it.Deadline.IsZero() && now.Add(wait+s.service(it)).After(it.Deadline) {
		s.overrun(ts)
		return s.shed(it, ShedDeadline, wait)
	}
	var displaced *Item
	if s.queued >= s.cfg.MaxQueue {
		if s.cfg.MaxQueue == 0 {
			return s.shed(it, ShedQueueFull, wait)
		}
		worst := s.order[len(s.order)-1]
		if worst.prio <= it.Priority {
			return s.shed(it, ShedQueueFull, wait)
		}
		displaced = worst.fifo.Back().Value.(*Item)
		s.leave(displaced)
		s.counts.Shed[ShedDisplaced]++
		if lvl != nil && lvl.prio == displaced.Priority && s.levels[lvl.prio] == nil {
			lvl, start = nil, 0 // its level emptied: fair queuing starts afresh
		}
	}
	s.enqueue(it, start)
	return Outcome{Verdict: Queued, PredictedWait: wait, Displaced: displaced}
}

func (s *Sched) shed(it *Item, r Reason, wait time.Duration) Outcome {
	it.state = stDone
	s.counts.Shed[r]++
	return Outcome{Verdict: Shed, Reason: r, RetryAfter: s.retryAfter(wait)}
}

// retryAfter turns a predicted wait into a Retry-After: at least a second
// (the header's unit), at most MaxWait.
func (s *Sched) retryAfter(wait time.Duration) time.Duration {
	return min(max(wait.Round(time.Second), time.Second), max(s.cfg.MaxWait, time.Second))
}

// rate is the drain rate in tokens per second, 0 while unknown.
func (s *Sched) rate() float64 {
	if s.busySec <= 0 || s.busyTokens <= 0 {
		return 0
	}
	return s.busyTokens / s.busySec
}

// drainTime is the predicted time for the whole queue to be admitted.
func (s *Sched) drainTime() time.Duration {
	r := s.rate()
	if r == 0 {
		return 0
	}
	return time.Duration(float64(s.cost) / r * float64(time.Second))
}

// predictWait estimates how long it would wait: the tokens that would be
// admitted before it — everything queued in more urgent bands, its own
// tenant's backlog, and from each other tenant of its band the share fair
// queuing serves before start — over the drain rate. Requests of worse
// bands that aging may promote are not counted.
func (s *Sched) predictWait(it *Item, start float64) time.Duration {
	r := s.rate()
	if r == 0 {
		return 0
	}
	// Integer tokens: the sum must not depend on the map's order, so that
	// a simulation is repeatable.
	var ahead int64
	for _, l := range s.order {
		if l.prio > it.Priority {
			break
		}
		if l.prio < it.Priority {
			ahead += l.cost
			continue
		}
		span := start - l.vtime
		for name, t := range l.tenants {
			switch {
			case t.queued == 0:
			case name == it.Tenant:
				if !t.lifo { // newest first: its own backlog goes after it
					ahead += t.cost
				}
			default:
				ahead += min(t.cost, int64(span*s.weight(name)))
			}
		}
	}
	return time.Duration(float64(ahead) / r * float64(time.Second))
}

func (s *Sched) enqueue(it *Item, start float64) {
	lvl := s.levels[it.Priority]
	if lvl == nil {
		lvl = &level{prio: it.Priority, tenants: map[string]*tenantState{}}
		s.levels[it.Priority] = lvl
		i, _ := slices.BinarySearchFunc(s.order, it.Priority, func(l *level, p int64) int {
			switch {
			case l.prio < p:
				return -1
			case l.prio > p:
				return 1
			}
			return 0
		})
		s.order = slices.Insert(s.order, i, lvl)
		start = 0
	}
	t := lvl.tenants[it.Tenant]
	if t == nil {
		t = &tenantState{finish: lvl.vtime}
		lvl.tenants[it.Tenant] = t
	}
	s.seq++
	it.seq, it.lvl, it.state = s.seq, lvl, stQueued
	it.start = max(start, lvl.vtime, t.finish)
	t.finish = it.start + float64(it.Cost)/s.weight(it.Tenant)
	t.queued++
	t.cost += it.Cost
	lvl.cost += it.Cost
	heap.Push(&lvl.tags, it)
	it.fifo = lvl.fifo.PushBack(it)
	it.tfifo = t.items.PushBack(it)
	s.queued++
	s.queuedSmall += btoi(!s.oversized(it))
	s.cost += it.Cost
	it.expires, it.expReason = it.arrived.Add(s.cfg.MaxWait), ShedTimeout
	if !it.Deadline.IsZero() {
		// Past this point it cannot meet its deadline even if admitted.
		if d := it.Deadline.Add(-s.service(it)); d.Before(it.expires) {
			it.expires, it.expReason = d, ShedDeadline
		}
	}
	heap.Push(&s.exp, it)
}

// leave takes a queued item out of the queue unserved (canceled, expired,
// displaced): its tenant is not charged for it. Enqueue advanced the
// tenant's finish tag by its cost over the tenant's weight, and each of the
// tenant's requests after it starts that much later; left there, a tenant
// whose burst was canceled would be tagged a burst ahead of the others and
// get nothing while any of them stays backlogged, though it was served
// nothing ("no credit saved up, no penalty"). So the charge is taken back
// from the start tags after its own and from the finish tag, never below
// the band's virtual time (where an idle tenant starts). It walks the
// tenant's waiting requests: at most MaxQueue, each a heap fix.
func (s *Sched) leave(it *Item) {
	lvl := it.lvl
	t := lvl.tenants[it.Tenant]
	c := float64(it.Cost) / s.weight(it.Tenant)
	for e := t.items.Front(); e != nil; e = e.Next() {
		// Newest first exchanges tags (lifo.go): later by tag, not by arrival.
		if x := e.Value.(*Item); x.start > it.start {
			x.start = max(x.start-c, lvl.vtime)
			heap.Fix(&lvl.tags, x.tagIdx)
		}
	}
	t.finish = max(t.finish-c, lvl.vtime)
	s.unqueue(it)
}

// unqueue takes a queued item out of every structure.
func (s *Sched) unqueue(it *Item) {
	lvl := it.lvl
	heap.Remove(&lvl.tags, it.tagIdx)
	lvl.fifo.Remove(it.fifo)
	heap.Remove(&s.exp, it.expIdx)
	t := lvl.tenants[it.Tenant]
	t.items.Remove(it.tfifo)
	t.queued--
	t.lifo = t.lifo && t.queued > 0
	t.cost -= it.Cost
	lvl.cost -= it.Cost
	s.queued--
	s.queuedSmall -= btoi(!s.oversized(it))
	s.cost -= it.Cost
	it.fifo, it.tfifo, it.lvl, it.state = nil, nil, nil, stDone
	if lvl.fifo.Len() == 0 {
		// An empty band forgets its tenants: fair queuing starts afresh
		// with the next busy period, and memory stays bounded by the
		// queue's length.
		delete(s.levels, lvl.prio)
		i := slices.Index(s.order, lvl)
		s.order = slices.Delete(s.order, i, i+1)
		return
	}
	if t.queued == 0 && len(lvl.tenants) > 2*lvl.fifo.Len()+16 {
		// Idle tenants keep their finish tags (so a tenant cannot reset its
		// charge by pausing) until they outnumber the waiting requests.
		for name, ts := range lvl.tenants {
			if ts.queued == 0 {
				delete(lvl.tenants, name)
			}
		}
	}
}

func (s *Sched) admit(it *Item, now time.Time) {
	it.admitted, it.state = now, stAdmitted
	it.work = uncached(it) // until Bind says where
	s.inflight++
	s.pending += it.Prefill
	s.unbound++
	s.bigAdmitted(it)
}

// head is the waiting request Next considers first, and its band (the
// queue is not empty).
//
// Aging climbs bands, not priority values: a band's rank (its place among
// the bands with requests waiting, 0 the most urgent) less the aging steps
// its oldest has waited. Priorities are ordinal — vLLM's "lower means
// earlier handling" gives them no scale — and any int64 is accepted, so
// with their numeric distance a client sending -20 beside priority 0 held
// it back 21 aging steps, past max_wait (ten steps by default): starved.
// By rank, a request with k more urgent bands waiting goes after at most
// k + 1 steps, whatever their values.
func (s *Sched) head(now time.Time) (*Item, *level, bool) {
	var best *level
	bestEff := int64(0)
	for rank, l := range s.order {
		oldest := l.fifo.Front().Value.(*Item)
		eff := int64(rank) - int64(now.Sub(oldest.arrived)/s.cfg.AgingStep)
		if best == nil || eff < bestEff {
			best, bestEff = l, eff
		}
	}
	// Aged only when aging overtook a more urgent band: a band that wins
	// by its own priority keeps fair queuing between its tenants, however
	// long its oldest has waited — fair queuing starves no tenant, and
	// arrival order there would hand the band to whichever tenant sent
	// most (any overload with waits past an aging step did). Within a
	// tenant that goes newest first, its aged oldest still goes first
	// (newest).
	aged := best != s.order[0]
	switch {
	case aged:
		return best.fifo.Front().Value.(*Item), best, true
	case s.cfg.PreferCached:
		return s.preferred(best), best, false
	}
	return best.tags[0], best, false
}

// Next admits the next waiting request if the budgets allow, else returns
// nil. The band is the most urgent after aging (a request's band improves
// by one band, not one priority value, per AgingStep waited: head; ties go
// to the band that is there by its own priority); within a band the
// oldest request goes first once aging has lifted the band over a more
// urgent one, else the one fair queuing puts first. The request chosen
// that does not fit the budgets blocks the queue, so that a large prompt
// is not overtaken by smaller ones of its own tenant or of tenants fair
// queuing puts behind it; only an arrival ranked ahead of it goes first.
func (s *Sched) Next(now time.Time) *Item {
	s.tick(now)
	if s.queued == 0 {
		return nil
	}
	it, best, aged := s.head(now)
	if !s.fits(it) {
		if !s.reserveBlocks(it) {
			return nil
		}
		// Held back only by the reservation: the first request that fits
		// a step goes onto the room it keeps.
		if it = s.stepSized(best); it == nil {
			return nil
		}
	}
	if !aged {
		it = s.newest(it, now)
	}
	it.lvl.vtime = max(it.lvl.vtime, it.start) // best's, or another band's (stepSized)
	s.unqueue(it)
	s.busyTokens += float64(it.Cost)
	s.busyTokens *= 1 - 1.0/estimatorWindow
	s.busySec *= 1 - 1.0/estimatorWindow
	s.admit(it, now)
	s.counts.AdmittedQueued++
	return it
}

// FirstToken releases an admitted request's pending prefill and learns the
// service time (admission to first token) deadlines are predicted with.
func (s *Sched) FirstToken(it *Item, now time.Time) {
	if !s.prefilled(it) {
		return
	}
	d := max(now.Sub(it.admitted), 0)
	if s.svcN < estimatorWindow {
		s.svcN++
	}
	s.svc += (d - s.svc) / time.Duration(s.svcN)
	// Its engine prefilled the work ahead of it there, then its own
	// (service.go).
	s.svcFit.add(float64(it.work), float64(it.ahead), d.Seconds())
}

// Prefilled releases an admitted request's pending prefill as FirstToken
// does, without learning a service time from now: for a request whose
// first token is not observed (a non-streamed response comes whole, after
// the generation; Ticket.Unstreamed).
func (s *Sched) Prefilled(it *Item, now time.Time) {
	s.tick(now)
	s.prefilled(it)
}

// prefilled moves an admitted request past its prefill; false when it was
// not admitted or is past it already.
func (s *Sched) prefilled(it *Item) bool {
	if it.state != stAdmitted {
		return false
	}
	it.state = stPrefilled
	s.pending -= it.Prefill
	s.unbindPrefill(it)
	s.bigPrefilled(it)
	return true
}

// PredictedFirstToken is when the service fit predicts an admitted
// request's first token: its admission plus the fit's mean for its work
// and the work ahead of it on its instance (bound, else as at arrival:
// service); ok is false before the fit has a sample or when it is not
// admitted.
func (s *Sched) PredictedFirstToken(it *Item) (t time.Time, ok bool) {
	if s.svcN == 0 || it.state != stAdmitted {
		return time.Time{}, false
	}
	d := s.serviceFit(it)
	if it.inst != nil {
		d = s.svcFit.at(float64(it.work), float64(it.ahead))
	}
	return it.admitted.Add(d), true
}

// Done ends an admitted request (finished, failed or abandoned), freeing
// its budget; call Next afterwards. It is a no-op for an item that was not
// admitted or is already done.
func (s *Sched) Done(it *Item, now time.Time) {
	s.tick(now)
	switch it.state {
	case stAdmitted:
		s.pending -= it.Prefill
		s.unbindPrefill(it)
		s.bigPrefilled(it)
	case stPrefilled:
	default:
		return
	}
	it.state = stDone
	s.inflight--
	s.release(it)
}

// Remove takes a waiting request out of the queue (its client went away:
// reason Canceled), counting it under reason; it reports whether the item
// was waiting.
func (s *Sched) Remove(it *Item, reason Reason, now time.Time) bool {
	s.tick(now)
	if it.state != stQueued {
		return false
	}
	s.leave(it)
	s.counts.Shed[reason]++
	return true
}

// Expire sheds the waiting requests whose wait bound or deadline has
// passed at now, appending them to dst; ExpiredReason says why each went.
func (s *Sched) Expire(now time.Time, dst []*Item) []*Item {
	s.tick(now)
	for len(s.exp) > 0 && !s.exp[0].expires.After(now) {
		it := s.exp[0]
		r := it.expReason
		t := it.lvl.tenants[it.Tenant]
		s.leave(it)
		s.overrun(t)
		it.expReason = r
		s.counts.Shed[r]++
		dst = append(dst, it)
	}
	return dst
}

// ExpiredReason is why Expire shed it (ShedTimeout or ShedDeadline).
func (it *Item) ExpiredReason() Reason { return it.expReason }

// NextExpiry is the earliest time a waiting request expires; ok is false
// when nothing waits.
func (s *Sched) NextExpiry() (t time.Time, ok bool) {
	if len(s.exp) == 0 {
		return time.Time{}, false
	}
	return s.exp[0].expires, true
}

// Len is the number of waiting requests.
func (s *Sched) Len() int { return s.queued }

// InFlight is the number of admitted, unfinished requests.
func (s *Sched) InFlight() int { return s.inflight }

// Counts returns the totals since the queue was made.
func (s *Sched) Counts() Counts {
	c := s.counts
	c.Shed = make(map[Reason]uint64, len(s.counts.Shed))
	for r, n := range s.counts.Shed {
		c.Shed[r] = n
	}
	return c
}

// tagHeap orders a band's items by start tag, then arrival.
type tagHeap []*Item

func (h tagHeap) Len() int { return len(h) }
func (h tagHeap) Less(i, j int) bool {
	if h[i].start != h[j].start {
		return h[i].start < h[j].start
	}
	return h[i].seq < h[j].seq
}
func (h tagHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].tagIdx, h[j].tagIdx = i, j
}
func (h *tagHeap) Push(x any) { it := x.(*Item); it.tagIdx = len(*h); *h = append(*h, it) }
func (h *tagHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return it
}

// expHeap orders waiting items by expiry.
type expHeap []*Item

func (h expHeap) Len() int { return len(h) }
func (h expHeap) Less(i, j int) bool {
	if !h[i].expires.Equal(h[j].expires) {
		return h[i].expires.Before(h[j].expires)
	}
	return h[i].seq < h[j].seq
}
func (h expHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].expIdx, h[j].expIdx = i, j
}
func (h *expHeap) Push(x any) { it := x.(*Item); it.expIdx = len(*h); *h = append(*h, it) }
func (h *expHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return it
}
