package flowcontrol

import (
	"math"
	"slices"
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
//   - While nothing but long prompts waits, the short requests are placed
//     by the strategy among all instances with room, a cache-aware one onto
//     the instance holding their prefix, so their work is their uncached
//     tokens (Item.Cached), and a long prompt is held back when, admitted,
//     it would leave them instances on which more than one request in ten
//     waits longer than its objective leaves (the mean objective less the
//     service fit's prediction for a short prompt's uncached tokens with
//     nothing ahead): Erlang C on what remains, one instance more as each
//     long prompt holding one reaches its predicted first token, averaged
//     over the new prompt's hold (shortTail). At least one instance stays
//     theirs, and one the long prompts'.
//     Without objectives, the fewest that carry the load, ⌊a·b⌋ + 1
//     (staff). The rule before took the short requests to be confined to
//     k instances for good; at half load they are so only while long
//     prompts hold every other instance, until those prompts' first
//     tokens, and it held long prompts back on its one-in-ten boundary
//     (kvbench flow --seed 2). Counting whole prompts here kept two of four
//     instances for light requests whose prefill needs half of one.
//   - While step-sized requests wait, or every arrival's offered work is
//     at least the pool's instances (overloaded), k is at least ⌈a·b⌉ on
//     whole prompts, the short requests' offered load (a waiting short
//     request goes to whichever instance frees, holding its prefix or
//     not), and up to the fewest instances on which at most one in ten of
//     them waits at all, as far as the long prompts at least as urgent
//     keep their own offered load (offeredK). The offered load,
//     not a share of the queue's drain rate: that rate is measured only
//     while requests wait, and at light load those short spells put it far
//     below the pool's capacity (the heavy tenant's p99 at half load 1,229
//     ms with a drain-rate k, 685 ms with this one, 1,210 ms without the
//     queue). In this regime the k instances are kept free of oversized
//     requests for their whole life, decode included, not only until
//     their first tokens (mayTake): a long context decoding on an
//     instance makes each step there ~12–14 ms at 25–35 such requests,
//     and a short prompt waits for the step in progress, so a short
//     request there has a p90 at 1.5 times its unloaded one whatever
//     its prefix hit (docs/BENCHMARKS.md §12, session 13). The kept
//     instances are those serving the short requests most (a long
//     prompt takes the free instance they use least), and while fewer
//     than k are free, the instances running fewest long requests take
//     no more until theirs end. A short request is told which they are
//     (KeptFree): a copy of its prefix bought by a cache-aware strategy
//     goes there (router.Request.KeptFree), where it is neither behind
//     long decodes nor evicted by long contexts.
//
// Nothing is reserved with a single instance, nor while no step-sized
// request at least as urgent has arrived within the time an oversized
// prompt would hold the instance (its predicted admission-to-first-token
// time): a pool serving only long prompts keeps all its instances, and
// reserves again as soon as short requests come. When the head of the
// queue is an oversized prompt held back only by the reservation, the
// first request in fair-queuing order that fits a step goes ahead of it,
// onto the room the reservation keeps (stepSized), and such a request
// arriving then is admitted at once (passesHeld); the oversized prompt
// is admitted as soon as one of the others' long prefills ends. The cost:
// while short requests keep arriving, long prompts get at most N−k
// instances even when the short ones leave some of theirs idle.

// oversized reports whether it is a prompt the reservation keeps off the
// reserved instances.
func (s *Sched) oversized(it *Item) bool {
	return s.cfg.ReserveInstance && s.cfg.InstancePrefill > 0 && s.compute(it) > s.cfg.InstancePrefill
}

// reserveBlocks reports whether admitting it would leave the step-sized
// requests too few instances free of oversized prompts.
func (s *Sched) reserveBlocks(it *Item) bool {
	if !s.oversized(it) || s.liveN < 2 {
		return false
	}
	if s.keptOut(it) {
		return true
	}
	held := s.unboundBig
	for _, l := range s.insts {
		if l.live && l.big > 0 {
			held++
		}
	}
	left := s.liveN - held - 1 // the instances it would leave them
	if held == 0 {
		// One instance always stays for the long prompts (k ≤ N−1): with
		// none held, a pool whose short requests' objectives no number
		// of instances meets would otherwise starve them.
		return false
	}
	d, ok := s.smallDemandFor(it)
	if !ok {
		return false
	}
	b := s.svcFit.slope()
	if b <= 0 || s.arrSec <= 0 || d.reqs <= 0 {
		return left < 1
	}
	if s.overloaded(b) {
		return left < s.offeredK(it, d, b)
	}
	load := d.tokens / s.arrSec * b // offered load, in instances
	work := d.tokens / d.reqs * b   // one request's prefill, in seconds of an instance
	if d.objN <= 0 {
		// No objectives: the fewest that carry the load.
		return left < staff(load, work, -1, s.liveN-1)
	}
	if left < 1 {
		return true
	}
	target := max(d.obj/d.objN-s.svcFit.at(d.tokens/d.reqs, 0).Seconds(), 0)
	hold := s.serviceFit(it).Seconds()
	return shortTail(load, work, target, left, hold, s.bigEnds(hold)) > missShare
}

// keepK is how many instances free of oversized requests (prefill and
// decode alike) the oversized prompt it leaves the step-sized requests:
// ok is false where none is kept that way (not overloaded, the demand or
// the slope not known yet).
func (s *Sched) keepK(it *Item) (k int, ok bool) {
	d, ok := s.smallDemandFor(it)
	if !ok {
		return 0, false
	}
	b := s.svcFit.slope()
	if b <= 0 || s.arrSec <= 0 || d.reqs <= 0 || !s.overloaded(b) {
		return 0, false
	}
	return s.offeredK(it, d, b), true
}

// keepView is what mayTake needs of the whole pool for one oversized
// prompt, gathered once (keep) so that a walk over the instances asking
// each (instancesFit, keptOut, FilterRoom) is one pass and a sort, not one
// pass per instance: on is false where the reservation keeps nothing free
// of oversized requests (keepK), and every instance may take it.
type keepView struct {
	on bool
	// top is the keepK-th of the instances free of oversized requests by
	// servesMore (nil with fewer than keepK free): the kept set is it and
	// those before it.
	top *instLoad
	// spare: the free instances beyond keepK, less the admitted unbound
	// oversized prompts that will each take one.
	spare int
	// last is, when fewer than keepK are free, the need-th of the
	// instances running oversized requests by fewest (need: the free
	// instances missing; nil with fewer such instances): it and those
	// before it take no more until theirs end.
	last *instLoad
	need int
}

// keep gathers the keepView of the oversized prompt it (off for any other
// request, or where nothing is kept).
func (s *Sched) keep(it *Item) keepView {
	if !s.oversized(it) || s.liveN < 2 {
		return keepView{}
	}
	k, ok := s.keepK(it)
	if !ok {
		return keepView{}
	}
	free, busy := s.splitLong()
	// it itself, admitted and not yet bound, is among the unbound.
	others := max(s.unboundBig-btoi(it.big && it.inst == nil), 0)
	v := keepView{on: true, spare: len(free) - others - k, need: k - (len(free) - others)}
	if len(free) >= k {
		sortServing(free)
		v.top = free[k-1]
	}
	if v.need > 0 && len(busy) >= v.need {
		slices.SortFunc(busy, func(a, b *instLoad) int { return order(fewerLong(a, b), a == b) })
		v.last = busy[v.need-1]
	}
	return v
}

// splitLong sorts the live instances into those with no oversized request
// in flight and those running some (in the Sched's scratch: valid until
// the next call).
func (s *Sched) splitLong() (free, busy []*instLoad) {
	free, busy = s.keepFree[:0], s.keepBusy[:0]
	for _, l := range s.insts {
		switch {
		case !l.live:
		case l.long == 0:
			free = append(free, l)
		default:
			busy = append(busy, l)
		}
	}
	s.keepFree, s.keepBusy = free, busy
	return free, busy
}

// sortServing orders instances by servesMore: those the step-sized
// requests use most first.
func sortServing(ls []*instLoad) {
	slices.SortFunc(ls, func(a, b *instLoad) int { return order(servesMore(a, b), a == b) })
}

// order is a comparison's result from "a goes before b" and "a is b".
func order(before, same bool) int {
	switch {
	case same:
		return 0
	case before:
		return -1
	}
	return 1
}

// fewerLong orders instances running oversized requests by how many, then
// by name.
func fewerLong(a, b *instLoad) bool {
	return a.long < b.long || (a.long == b.long && a.name < b.name)
}

// mayTake reports whether the oversized prompt of the view may go to l:
// always for a request that fits a step, and while the reservation keeps
// no instances free of oversized requests (keepK). To an instance with
// none in flight, when that leaves keepK such instances (the oversized
// prompts admitted and not yet bound each taking one) and the ones left
// are those serving the step-sized requests most (servesMore): the kept
// set stays where their copies of hot prefixes are, and the long prompt
// takes the free instance they use least. To one running oversized
// requests, unless fewer than keepK are free and it is among the ones
// running fewest, one for each instance missing: those take no more until
// their long requests end, and the kept set grows to what the short
// requests need.
func (v *keepView) mayTake(l *instLoad) bool {
	if !v.on {
		return true
	}
	if l.long == 0 {
		// The free instances other than l leave keepK (l itself is one of
		// the free counted, when live), and l is not among the keepK
		// serving most.
		return v.spare >= btoi(l.live) && v.top != nil && servesMore(v.top, l)
	}
	return v.need <= 0 || (v.last != nil && fewerLong(v.last, l))
}

// servesMore orders instances free of oversized requests by the requests
// in flight there (all step-sized), then by name.
func servesMore(a, b *instLoad) bool {
	return a.inflight > b.inflight || (a.inflight == b.inflight && a.name < b.name)
}

// keptOut reports whether the oversized prompt it is held back by the
// instances kept free of oversized requests alone: some instance has room
// for it under the budgets, and each of them is one it may not take.
func (s *Sched) keptOut(it *Item) bool {
	if !s.oversized(it) {
		return false
	}
	v := s.keep(it)
	if !v.on {
		return false
	}
	kept := false
	for _, l := range s.insts {
		if !l.live || !s.budgetRoom(l, it) {
			continue
		}
		if v.mayTake(l) {
			return false
		}
		kept = true
	}
	return kept
}

// KeptFree appends to dst the instances kept free of oversized requests
// for a request it that fits a step (none for an oversized one, or
// without the reservation): under overload the keepK instances with no
// oversized request in flight that serve the step-sized requests most,
// which long prompts may not take (mayTake); otherwise every one
// with none in flight. A copy of its prefix there serves it away from the
// long prompts' decodes (router.Request.KeptFree).
func (s *Sched) KeptFree(it *Item, dst []string) []string {
	if !s.cfg.ReserveInstance || s.cfg.InstancePrefill <= 0 || s.oversized(it) {
		return dst
	}
	free, _ := s.splitLong()
	probe := Item{Priority: it.Priority, Prefill: s.cfg.InstancePrefill + 1, Cost: s.cfg.InstancePrefill + 1}
	if k, ok := s.keepK(&probe); ok && len(free) > k {
		sortServing(free)
		free = free[:k]
	}
	for _, l := range free {
		dst = append(dst, l.name)
	}
	return dst
}

// smallDemandFor is the demand of the step-sized requests at least as
// urgent as the oversized prompt it; ok is false when none of them has
// arrived within its predicted service time (service.go): then nothing is
// reserved.
func (s *Sched) smallDemandFor(it *Item) (d smallDemand, ok bool) {
	d, last := s.demandAtLeast(s.smallBy, it.Priority)
	return d, !last.IsZero() && s.last.Before(last.Add(s.serviceFit(it)))
}

// demandAtLeast sums by's demand of the priorities at least as urgent as
// prio, with the latest arrival among them.
func (s *Sched) demandAtLeast(by map[int64]*smallDemand, prio int64) (d smallDemand, last time.Time) {
	for p, e := range by {
		if p <= prio {
			d.add(e, s.arrN)
			if e.last.After(last) {
				last = e.last
			}
		}
	}
	return d, last
}

// overloaded reports whether the reservation is sized by the short
// requests' bare offered load (⌈a·b⌉ on whole prompts) rather than by
// staffing: while step-sized requests wait (a waiting short request goes
// to whichever instance frees, holding its prefix or not), or while the
// offered work of every arrival, long prompts included, is at least the
// pool's instances (b seconds per token): the queue then cannot stay empty
// for long, whatever it holds at the moment. A long prompt waiting alone
// at light load is not overload: the staffing rule sizes its reservation.
func (s *Sched) overloaded(b float64) bool {
	return s.queuedSmall > 0 || s.arrTok/s.arrSec*b >= float64(s.liveN)
}

// offeredK is the instances kept under overload for the step-sized
// requests at least as urgent as the oversized prompt it, between 1 and
// N−1: the fewest on which at most one short request in ten (missShare)
// waits for an instance at all, staff(a_u·b, target 0) on their uncached
// load, as far as the oversized prompts at least as urgent as it keep
// what their own offered load needs (longRoom), and never fewer than the
// short requests' offered load on whole prompts, ⌈a·b⌉.
//
// The short requests are those the reservation isolates from the long
// prompts; isolation is their tail as if the long ones were not there. A
// short request that waits behind another short one's prefill waits about
// a whole short prefill, which alone is its unloaded TTFT again: the one
// in ten allowed to miss (the percentile issue 17 states their objective
// in) is the only share that may wait at all. ⌈a·b⌉ alone bounds nothing
// of that wait: its instances run at utilisation up to 1 (×90, 8
// instances, seed 2, 4×: three kept, light p90 1.61× unloaded). What
// the long prompts lose is the instances beyond ⌈a·b⌉; those at least as
// urgent as the short ones are owed the same as them, their offered load,
// so the instances beyond ⌈a·b⌉ go to the short ones' wait only out of
// what the long ones' load leaves (docs/BENCHMARKS.md §12, "Session 15
// (second)").
func (s *Sched) offeredK(it *Item, d smallDemand, b float64) int {
	k := int(math.Ceil(d.computed / s.arrSec * b))
	if d.reqs > 0 {
		if w := staff(d.tokens/s.arrSec*b, d.tokens/d.reqs*b, 0, s.liveN-1); w > k {
			k = max(k, min(w, s.longRoom(it, k, b)))
		}
	}
	return min(max(k, 1), s.liveN-1)
}

// longRoom is the most instances the short requests may keep beyond their
// bare need k0 (⌈a·b⌉) without taking from the oversized prompts at least
// as urgent as it what their own offered load needs, N − ⌈a_L·b⌉ on
// their uncached tokens. When that load does not fit beside k0 (⌈a_L·b⌉
// > N − k0) the long prompts' queue grows whatever is kept for the short
// ones: no k bounds their wait, and what they lose to the short ones'
// wait is goodput alone, of a class already asking past what the pool
// leaves it (×90: a heavy tenant at 1.8–3.6× the fleet); then the bound is
// the pool's, N − 1.
func (s *Sched) longRoom(it *Item, k0 int, b float64) int {
	d, _ := s.demandAtLeast(s.longBy, it.Priority)
	need := int(math.Ceil(d.tokens / s.arrSec * b))
	if need > s.liveN-k0 {
		return s.liveN - 1
	}
	return s.liveN - need
}

// bigEnds is, in seconds from now and sorted, when each oversized prompt
// holding an instance is predicted to reach its first token (0 for one
// predicted already there; hold for one admitted and not yet bound, as
// for the prompt it, admitted now, whose end is among them).
func (s *Sched) bigEnds(hold float64) []float64 {
	ends := append(s.endsBuf[:0], hold)
	for _, l := range s.insts {
		if l.live && l.big > 0 {
			ends = append(ends, max(l.bigEnd.Sub(s.last).Seconds(), 0))
		}
	}
	for range s.unboundBig {
		ends = append(ends, hold)
	}
	slices.Sort(ends)
	s.endsBuf = ends
	return ends
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

// tailSamples is how many arrival times across a long prompt's hold
// shortTail averages over: its error is below a sixteenth of the hold's
// span of the tail probability, well inside the 1/√64 the estimators
// carry.
const tailSamples = 16

// shortTail is the share of the step-sized requests arriving while an
// oversized prompt admitted now holds its instance (hold seconds) that
// wait longer than target for an instance: the short requests are an
// M/M/c queue of offered load a (in instances) and work seconds per
// request on the c instances the long prompts leave them — left now, one
// more as each long prompt holding one reaches its first token (ends,
// seconds from now, sorted; the new one's at hold). An arrival at u waits
// with Erlang's probability C(c(u), a) (1 when c(u) ≤ a), and the wait
// exceeds target with P = C · exp(−∫ (c(s) − a)⁺ ds / work) over [u, u +
// target]: the queue drains at (c − a)/work while c servers serve it. The
// share is P averaged over u uniform in [0, hold) (Poisson arrivals).
// With every long prompt held for good (ends beyond the horizon) this is
// staff's criterion on left instances; counting them as they end is what
// the confinement to k instances missed: at half load the short requests
// are confined only while long prompts hold every other instance, for
// the rest of those prompts' prefill.
func shortTail(a, work, target float64, left int, hold float64, ends []float64) float64 {
	if a <= 0 || work <= 0 {
		return 0
	}
	servers := func(t float64) int { // instances free of long prompts at t
		c := left
		for _, e := range ends {
			if e > t {
				break
			}
			c++
		}
		return c
	}
	n := tailSamples
	if hold <= 0 {
		n = 1
	}
	sum := 0.0
	for i := range n {
		u := hold * (float64(i) + 0.5) / float64(n)
		c := servers(u)
		p := 1.0
		if float64(c) > a {
			p = erlangC(c, a)
		}
		// ∫ (c(s) − a)⁺ ds over [u, u+target], piecewise between the ends.
		integral, from, to := 0.0, u, u+target
		for _, e := range ends {
			if e <= from {
				continue
			}
			if e >= to {
				break
			}
			integral += max(float64(servers(from))-a, 0) * (e - from)
			from = e
		}
		integral += max(float64(servers(from))-a, 0) * (to - from)
		sum += p * math.Exp(-integral/work)
	}
	return sum / float64(n)
}

// smallDemand is the step-sized requests of one priority (in longBy, the
// oversized prompts of one), among the arrivals, decayed like arrSec (by
// 1−1/estimatorWindow per arrival, applied lazily: the sums are their
// values after arrival n): their tokens of
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

// passesHeld reports whether the arriving request it, one that fits a
// step, finds only oversized prompts waiting with the one Next would
// admit first held back by the reservation alone: Next would then let the
// first step-sized request in fair-queuing order go onto the room the
// reservation keeps (stepSized), so it goes at once if it fits (Offer),
// instead of being queued and predicted behind prompts it would pass at
// the next dispatch anyway — and shed on arrival for their tokens, the
// half-load sheds. One reservation check, as Next makes.
func (s *Sched) passesHeld(it *Item, now time.Time) bool {
	if s.queuedSmall > 0 || s.oversized(it) {
		return false
	}
	h, _, _ := s.head(now)
	return !s.fits(h) && s.reserveBlocks(h)
}

// noteArrival accounts an arrival: the time since the previous one, and
// its demand under its priority, a step-sized request's in smallBy, an
// oversized prompt's in longBy. Priorities whose arrivals have decayed
// below one are forgotten (every estimatorWindow arrivals), so the maps
// hold the priorities of recent arrivals only (by count, not tokens: a
// fully cached prompt is an arrival with no work).
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
	s.arrTok = s.arrTok*arrivalKeep + float64(uncached(it))
	by := &s.smallBy
	if s.oversized(it) {
		by = &s.longBy
	}
	if *by == nil {
		*by = map[int64]*smallDemand{}
	}
	d := (*by)[it.Priority]
	if d == nil {
		d = &smallDemand{n: s.arrN}
		(*by)[it.Priority] = d
	}
	d.note(s, it, now)
	if s.arrN%estimatorWindow == 0 {
		forget(s.smallBy, s.arrN)
		forget(s.longBy, s.arrN)
	}
}

// forget drops the priorities whose arrivals have decayed below one.
func forget(by map[int64]*smallDemand, n uint64) {
	for p, d := range by {
		if d.count(n) < 1 {
			delete(by, p)
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
		it.inst.bigEnd = it.admitted.Add(s.svcFit.at(float64(it.work), float64(it.ahead)))
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
