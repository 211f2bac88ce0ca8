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
// one step at most, not one long prefill. k is what the step-sized
// requests at least as urgent as the long prompt need to carry their own
// demand, their offered load in instances: k = ⌈a · b⌉, a the prompt
// tokens of those requests arriving per second (averaged over the last
// estimatorWindow arrivals), b the seconds of admission-to-first-token
// each prompt token adds (the slope of the service-time line, service.go:
// an instance's prefill time per token, cache hits included; the engine's
// wait ahead of a request is the intercept), at least 1 and at most N−1.
// This is size-based task assignment (SITA: Harchol-Balter, Crovella and
// Murta, "On choosing a task assignment policy for a distributed server
// system", 1999): short jobs get servers in proportion to their load, so
// they do not queue behind long ones. A single reserved instance is not
// enough once the short requests need more than one instance's prefill:
// they then wait behind the long prefills again. At most N−1 keeps an
// instance for the long prompts (fair queuing decides their share of it).
// Until the slope is known (first tokens of prompts of more than one
// length), k is 1. The offered load, not a share of the queue's drain
// rate: that rate is measured only while requests wait, and at light load
// those short spells put it far below the pool's capacity (kvbench flow
// at half load: the heavy tenant's p99 1,229 ms with a drain-rate k, 685
// ms with this one, 1,210 ms without the queue).
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
// ⌈a · b⌉ between 1 and N−1; 0 when none of those has arrived within its
// predicted service time (service.go).
func (s *Sched) reserved(it *Item) int {
	var a float64
	var last time.Time
	for p, d := range s.smallBy {
		if p > it.Priority {
			continue
		}
		a += d.at(s.arrN)
		if d.last.After(last) {
			last = d.last
		}
	}
	if last.IsZero() || !s.last.Before(last.Add(s.service(it))) {
		return 0
	}
	k := 1
	if b := s.svcFit.slope(); b > 0 && s.arrSec > 0 {
		k = int(math.Ceil(a / s.arrSec * b))
	}
	return min(max(k, 1), s.liveN-1)
}

// smallDemand is the step-sized requests of one priority: their prompt
// tokens among the arrivals, decayed like arrSec (by 1−1/estimatorWindow per
// arrival, applied lazily: tokens is the value after arrival n), and when
// the last arrived.
type smallDemand struct {
	tokens float64
	n      uint64
	last   time.Time
}

const arrivalKeep = 1 - 1.0/estimatorWindow

func (d *smallDemand) at(n uint64) float64 {
	return d.tokens * math.Pow(arrivalKeep, float64(n-d.n))
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
// a step-sized request's tokens under its priority. Priorities whose
// demand has decayed below one token are forgotten (every
// estimatorWindow arrivals), so the map holds the priorities of recent
// arrivals only.
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
			d = &smallDemand{}
			s.smallBy[it.Priority] = d
		}
		d.tokens, d.n, d.last = d.at(s.arrN)+float64(s.compute(it)), s.arrN, now
	}
	if s.arrN%estimatorWindow == 0 {
		for p, d := range s.smallBy {
			if d.at(s.arrN) < 1 {
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
