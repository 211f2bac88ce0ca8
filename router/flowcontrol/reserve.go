package flowcontrol

import (
	"math"
	"time"
)

// Reserving an instance for step-sized prompts.
//
// A prompt larger than InstancePrefill (one engine step's worth of
// tokens, as the router configures it) cannot share a step: its engine
// spends whole steps on it until its first token, and the per-instance
// budget admits it only to an instance with nothing else prefilling. When
// such prompts hold every instance, a short request that arrives waits in
// the router for the first of them to finish: the residual of a long
// prefill (a 10,000-token prompt is about 0.4 s on an 8×H100 Llama 70B),
// however little its tenant sends and however far ahead fair queuing puts
// it. Start-time fair queuing orders the queue; it cannot shorten a
// non-preemptive job already running on every server.
//
// With Config.ReserveInstance, oversized prompts leave k of the live
// instances free of them (counting those admitted and not yet bound to
// one), so a request that fits a step always has an instance whose
// pending prefill is bounded by the budget — its wait for room is about
// one step at most, not one long prefill. k is how many instances the
// step-sized requests at least as urgent as the long prompt need, from
// their demand over the last estimatorWindow arrivals: a, their prompt
// tokens arriving per second, and b, the seconds of admission-to-first-
// token each prompt token adds (the own-work slope of the service fit,
// service.go: an instance's prefill time per token of work). This is
// size-based task assignment (SITA: Harchol-Balter, Crovella and Murta,
// "On choosing a task assignment policy for a distributed server system",
// 1999): short jobs get servers of their own, so they do not queue behind
// long ones. k is at least 1 and at most N−1 (one instance stays for the
// long prompts; fair queuing decides their share of it), and 1 until the
// slope is known (first tokens after more than one amount of work).
//
//   - While nothing else waits, the short requests are placed by the
//     strategy among all instances with room, a cache-aware one onto the
//     instance holding their prefix, so their work is their uncached
//     tokens (Item.Cached), and k is a staffing question: the fewest
//     instances on which, as an M/M/k queue (offered load a·b in
//     instances, a request's work its uncached tokens × b), at most one
//     request in ten waits longer than its objective leaves (the mean
//     objective less the service fit's prediction for a short prompt's
//     uncached tokens with nothing ahead); without objectives, the fewest
//     that carry the load, ⌊a·b⌋ + 1 (staff). Counting whole prompts here
//     kept two of four instances for light requests whose prefill needs
//     half of one (kv_aware, kvbench flow at half load: a·b median 1.02
//     on whole prompts, 0.43–0.84 uncached), and the heavy tenant's
//     10,000-token prompts waited: p99 of all requests 529 ms against 420
//     ms without the queue; 401 ms with this rule.
//   - While other requests wait, k = ⌈a·b⌉ on whole prompts, the short
//     requests' offered load: a waiting short request goes to whichever
//     instance frees, holding its prefix or not, and the staffing rule
//     applied there reserved more than this and cost goodput under
//     overload (kv_aware, 4 instances, 4×: 82.1 → 78.1 req/s; counting
//     uncached tokens there: 91.5 → 83.7 at 2×). The offered load, not a
//     share of the queue's drain rate: that rate is measured only while
//     requests wait, and at light load those short spells put it far
//     below the pool's capacity (the heavy tenant's p99 at half load
//     1,229 ms with a drain-rate k, 685 ms with this one, 1,210 ms without
//     the queue).
//
// Nothing is reserved with a single instance, nor while no step-sized
// request at least as urgent has arrived within the time an oversized
// prompt would hold the instance (its predicted admission-to-first-token
// time): a pool serving only long prompts keeps all its instances, and
// reserves again as soon as short requests come. When the head of the
// queue is an oversized prompt held back only by the reservation, the
// first request in fair-queuing order that fits a step goes ahead of it,
// onto the room the reservation keeps (stepSized); the oversized prompt
// is admitted as soon as one of the others' long prefills ends. The cost:
// while short requests keep arriving, long prompts get at most N−k
// instances even when the short ones leave some of theirs idle.

// oversized reports whether it is a prompt the reservation keeps off the
// reserved instances.
func (s *Sched) oversized(it *Item) bool {
	return s.cfg.ReserveInstance && s.cfg.InstancePrefill > 0 && s.compute(it) > s.cfg.InstancePrefill
}

// reserveBlocks reports whether admitting it would leave fewer than
// reserved instances free of oversized prompts.
func (s *Sched) reserveBlocks(it *Item) bool {
	if !s.oversized(it) || s.liveN < 2 {
		return false
	}
	k := s.reserved(it)
	if k == 0 {
		return false
	}
	held := s.unboundBig
	for _, l := range s.insts {
		if l.live && l.big > 0 {
			held++
		}
	}
	return held >= s.liveN-k
}

// reserved is k for the oversized prompt it: the instances kept free of
// oversized prompts for the step-sized requests at least as urgent as it,
// between 1 and N−1 (staff); 0 when none of those has arrived within its
// predicted service time (service.go).
func (s *Sched) reserved(it *Item) int {
	var d smallDemand
	var last time.Time
	for p, e := range s.smallBy {
		if p <= it.Priority {
			d.add(e, s.arrN)
			if e.last.After(last) {
				last = e.last
			}
		}
	}
	if last.IsZero() || !s.last.Before(last.Add(s.service(it))) {
		return 0
	}
	b := s.svcFit.slope()
	if b <= 0 || s.arrSec <= 0 || d.reqs <= 0 {
		return min(1, s.liveN-1)
	}
	if others := s.queued - btoi(it.state == stQueued); others > 0 {
		return min(max(int(math.Ceil(d.computed/s.arrSec*b)), 1), s.liveN-1)
	}
	load := d.tokens / s.arrSec * b // offered load, in instances
	work := d.tokens / d.reqs * b   // one request's prefill, in seconds of an instance
	target := -1.0                  // the wait their objectives leave (< 0: none)
	if d.objN > 0 {
		target = max(d.obj/d.objN-s.svcFit.at(d.tokens/d.reqs, 0).Seconds(), 0)
	}
	return staff(load, work, target, s.liveN-1)
}

// missShare is the share of a class's requests allowed to wait longer than
// their objectives leave: one in ten, the 90th percentile, the percentile
// issue 17 states the light tenants' objective in.
const missShare = 0.1

// staff is the fewest servers, between 1 and most, that carry a class of
// offered load a (in servers) whose requests need work seconds of one
// server each, so that at most missShare of them wait longer than target
// seconds for a server: the smallest k > a with P(wait > target) =
// C(k, a) · exp(−(k − a) · target / work) ≤ missShare (an M/M/k queue:
// Poisson arrivals, exponential work; C is Erlang's C formula, the
// probability of waiting at all). A class with no load needs one (none
// wait). With no target (target < 0: no objectives) the fewest that are
// stable, ⌊a⌋ + 1; when no k up to most meets the target, most.
func staff(a, work, target float64, most int) int {
	if most < 1 {
		return 0
	}
	if a <= 0 || work <= 0 {
		return 1
	}
	if target < 0 {
		return min(int(math.Floor(a))+1, most)
	}
	for k := 1; k < most; k++ {
		if float64(k) > a && erlangC(k, a)*math.Exp(-(float64(k)-a)*target/work) <= missShare {
			return k
		}
	}
	return most
}

// erlangC is the probability that an arrival waits in an M/M/k queue of
// offered load a < k: from the Erlang-B recursion B(i) = a·B(i−1) / (i +
// a·B(i−1)), C = k·B / (k − a·(1 − B)).
func erlangC(k int, a float64) float64 {
	bl := 1.0
	for i := 1; i <= k; i++ {
		bl = a * bl / (float64(i) + a*bl)
	}
	return float64(k) * bl / (float64(k) - a*(1-bl))
}

// smallDemand is the step-sized requests of one priority, among the
// arrivals, decayed like arrSec (by 1−1/estimatorWindow per arrival, applied
// lazily: the sums are their values after arrival n): their tokens of
// prefill work (uncached: what an instance holding most of the prompt
// would prefill), the tokens the service line counts for them (compute),
// their number, the sum and number of their TTFT objectives (deadline −
// arrival), and when the last arrived.
type smallDemand struct {
	tokens, computed, reqs, obj, objN float64
	n                                 uint64
	last                              time.Time
}

const arrivalKeep = 1 - 1.0/estimatorWindow

// count is the arrivals d holds, decayed to arrival n.
func (d *smallDemand) count(n uint64) float64 {
	return d.reqs * math.Pow(arrivalKeep, float64(n-d.n))
}

// add adds e, decayed to arrival n, to d.
func (d *smallDemand) add(e *smallDemand, n uint64) {
	f := math.Pow(arrivalKeep, float64(n-e.n))
	d.tokens += e.tokens * f
	d.computed += e.computed * f
	d.reqs += e.reqs * f
	d.obj += e.obj * f
	d.objN += e.objN * f
}

// note decays d to the current arrival and adds it, arrived at now.
func (d *smallDemand) note(s *Sched, it *Item, now time.Time) {
	n := s.arrN
	f := math.Pow(arrivalKeep, float64(n-d.n))
	d.tokens = d.tokens*f + float64(uncached(it))
	d.computed = d.computed*f + float64(s.compute(it))
	d.reqs = d.reqs*f + 1
	d.obj, d.objN = d.obj*f, d.objN*f
	if !it.Deadline.IsZero() {
		d.obj += max(it.Deadline.Sub(now).Seconds(), 0)
		d.objN++
	}
	d.n, d.last = n, now
}

// stepSized is the request that goes onto the reserved room when the head
// of band first is an oversized prompt held back by the reservation: the
// one fair queuing puts first among those of band first that are not
// oversized and fit the budgets now, else the same in the other bands by
// priority (nil if none). A less urgent request may take it: the held-back
// head cannot use that room, so it is not delayed by it; were only its own
// band considered, a band whose head is a long prompt would stop the whole
// queue while the room reserved for short requests stood idle.
func (s *Sched) stepSized(first *level) *Item {
	if it := s.stepSizedIn(first); it != nil {
		return it
	}
	for _, l := range s.order {
		if l == first {
			continue
		}
		if it := s.stepSizedIn(l); it != nil {
			return it
		}
	}
	return nil
}

func (s *Sched) stepSizedIn(l *level) *Item {
	var best *Item
	for _, it := range l.tags {
		if s.oversized(it) || !s.fits(it) {
			continue
		}
		if best == nil || it.start < best.start || (it.start == best.start && it.seq < best.seq) {
			best = it
		}
	}
	return best
}

// noteArrival accounts an arrival: the time since the previous one, and
// a step-sized request's demand under its priority. Priorities whose
// arrivals have decayed below one are forgotten (every estimatorWindow
// arrivals), so the map holds the priorities of recent arrivals only (by
// count, not tokens: a fully cached prompt is an arrival with no work).
func (s *Sched) noteArrival(it *Item, now time.Time) {
	if !s.cfg.ReserveInstance || s.cfg.InstancePrefill <= 0 {
		return
	}
	s.arrN++
	if !s.lastArr.IsZero() && now.After(s.lastArr) {
		s.arrSec = s.arrSec*arrivalKeep + now.Sub(s.lastArr).Seconds()
	} else {
		s.arrSec *= arrivalKeep
	}
	if now.After(s.lastArr) {
		s.lastArr = now
	}
	if !s.oversized(it) {
		if s.smallBy == nil {
			s.smallBy = map[int64]*smallDemand{}
		}
		d := s.smallBy[it.Priority]
		if d == nil {
			d = &smallDemand{n: s.arrN}
			s.smallBy[it.Priority] = d
		}
		d.note(s, it, now)
	}
	if s.arrN%estimatorWindow == 0 {
		for p, d := range s.smallBy {
			if d.count(s.arrN) < 1 {
				delete(s.smallBy, p)
			}
		}
	}
}

// bigAdmitted counts an oversized prompt from admission until its first
// token (or end): against the unbound until Bind, then against its
// instance.
func (s *Sched) bigAdmitted(it *Item) {
	if s.oversized(it) {
		it.big = true
		s.unboundBig++
	}
}

func (s *Sched) bigBound(it *Item) {
	if it.big {
		s.unboundBig--
		it.inst.big++
	}
}

func (s *Sched) bigPrefilled(it *Item) {
	if !it.big {
		return
	}
	it.big = false
	if it.inst != nil {
		it.inst.big--
	} else {
		s.unboundBig--
	}
}

// uncached is the prompt tokens of it that the instance holding most of
// it does not hold: its prefill work where a cache-aware pick sends it.
func uncached(it *Item) int64 {
	held := int64(0)
	for _, h := range it.Cached {
		held = max(held, h.Tokens)
	}
	return it.Prefill - min(held, it.Prefill)
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
