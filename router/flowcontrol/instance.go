package flowcontrol

import (
	"slices"
	"strings"
	"time"
)

// Per-instance budgets. A pool-wide budget lets the strategy pile the
// pool's whole allowance of pending prefill onto one engine (the cache
// holder of a hot prefix, the least loaded by a stale count), where it
// waits in vLLM's first-come-first-served queue behind work the router can
// no longer reorder. With InstanceConcurrency or InstancePrefill set, a
// request is admitted only while some instance has room for it, the caller
// routes it among the instances with room (Room) and tells the queue where
// it went (Bind); every engine then holds at most its budget and the rest
// waits in the router, where priority and fair queuing order it.

// instLoad is what one instance holds of the admitted requests.
type instLoad struct {
	name     string
	inflight int
	pending  int64     // prompt tokens before their first token
	work     int64     // of those, the tokens it does not hold (workOn)
	big      int       // oversized prompts before their first token (reserve.go)
	bigEnd   time.Time // when the last bound of them is predicted to reach it (reserve.go)
	long     int       // oversized requests bound there, until they end (reserve.go)
	live     bool
}

func (s *Sched) perInstance() bool { return s.cfg.InstanceConcurrency > 0 || s.cfg.InstancePrefill > 0 }

// SetInstances sets the instances admitted requests may be routed to.
// Budgets are per instance only when Config.InstanceConcurrency or
// InstancePrefill is set; an instance that leaves keeps counting the
// requests it holds until they end.
func (s *Sched) SetInstances(names []string) {
	if s.insts == nil {
		s.insts = map[string]*instLoad{}
	}
	for _, l := range s.insts {
		l.live = false
	}
	for _, n := range names {
		if l := s.insts[n]; l != nil {
			l.live = true
		} else {
			s.insts[n] = &instLoad{name: n, live: true}
		}
	}
	for name, l := range s.insts {
		if !l.live && l.inflight == 0 && l.pending == 0 {
			delete(s.insts, name)
		}
	}
	s.liveN = len(names)
}

// roomIn reports whether an instance holding l can take it (v: it's
// keepView, s.keep(it)).
func (s *Sched) roomIn(v *keepView, l *instLoad, it *Item) bool {
	return v.mayTake(l) && s.budgetRoom(l, it)
}

// budgetRoom reports whether the budgets of an instance holding l leave
// room for it.
func (s *Sched) budgetRoom(l *instLoad, it *Item) bool {
	if c := s.cfg.InstanceConcurrency; c > 0 && l.inflight >= c {
		return false
	}
	p := s.cfg.InstancePrefill
	if p <= 0 || l.pending == 0 {
		return true
	}
	c := s.charge(it, l.name)
	return l.pending+c <= p && !s.pastDeadline(workOn(it, l.name), l.work, it)
}

// pastDeadline reports whether a request with a deadline, sent now to an
// instance with ahead tokens of prefill work before it there (the
// uncached tokens of the requests bound there and not yet at their first
// token) and own of its own, would risk its first token after the
// deadline: more than one request in ten (missShare, the percentile the
// light tenants' objective is stated in) by the service fit's prediction
// and the spread of its samples about it (service.go). Admitting where
// the fit's mean just meets the deadline fills the engines to the edge of
// the short requests' objectives, where half of them miss (kv_aware,
// kvbench flow: 2× goodput −7.5 % at 8 instances, light p90 58 → 86 ms
// against 86; with the tail, 186.3 req/s and 76 ms). A budget in tokens
// bounds the engine's wait for everyone alike; a request whose objective
// is shorter than that wait (8,192 tokens are 320 ms on an 8×H100 Llama
// 70B) goes only to an instance with little enough ahead, and waits in the
// router otherwise, where priority, fairness and its deadline order it.
// An idle instance always takes it (roomIn).
func (s *Sched) pastDeadline(own, ahead int64, it *Item) bool {
	if it.Deadline.IsZero() || !s.svcFit.mature() {
		return false
	}
	return s.last.Add(s.svcFit.late(float64(own), float64(ahead))).After(it.Deadline)
}

// Room reports whether instance can take it under the per-instance
// budgets (always true without them, and for an instance the queue does
// not know yet: it holds nothing the queue admitted). To ask of many
// instances, RoomFor.
func (s *Sched) Room(instance string, it *Item) bool {
	c := s.RoomFor(it)
	return c.Has(instance)
}

// RoomCheck answers Room for one request, with what the answer needs of
// the whole pool gathered once (RoomFor): asking it of every candidate is
// one pass over the pool, not one per candidate. Valid until the queue
// next changes.
type RoomCheck struct {
	s  *Sched
	it *Item
	v  keepView
}

// RoomFor is the RoomCheck of it.
func (s *Sched) RoomFor(it *Item) RoomCheck {
	return RoomCheck{s: s, it: it, v: s.keep(it)}
}

// Has reports whether instance can take the request (Room).
func (c *RoomCheck) Has(instance string) bool {
	l := c.s.insts[instance]
	return l == nil || c.s.roomIn(&c.v, l, c.it)
}

// instancesFit reports whether some instance it may go to (Item.Eligible)
// has room for it beyond the admitted requests not yet bound to one (each
// is assumed to take one of the instances with room).
func (s *Sched) instancesFit(it *Item) bool {
	if !s.perInstance() || s.liveN == 0 {
		return true
	}
	free, eligible := 0, 0
	v := s.keep(it)
	for _, l := range s.insts {
		if !l.live || (it.Eligible != nil && !it.Eligible(l.name)) {
			continue
		}
		eligible++
		if s.roomIn(&v, l, it) {
			free++
			if free > s.unbound {
				return true
			}
		}
	}
	// With no live instance it may go to, holding it would help nobody:
	// it goes through, to be answered by the router (no eligible
	// instance) rather than wait out max_wait.
	return eligible == 0
}

// Companion admits it, outside the queue, as a warm-up copy of the
// admitted request of (its exported fields are set from of's): the same prompt (Tenant, Priority, Cost, Prefill, Cached)
// sent to instance for one output token beside it (router.Warm). It
// counts like a request bound there — in flight, its prefill pending on
// instance until FirstToken, its place until Done — so that the budgets
// see the prefill the copy puts on that engine; it is not charged to fair
// queuing (the router chose to send it, not the tenant) nor counted among
// admissions. It rides on of's admission rather than waiting: the
// strategy chose instance among those with room for of, and a copy held
// back would be a purchase not made. It reports false, and counts
// nothing, when of is not admitted or in flight, or it is not new.
func (s *Sched) Companion(of, it *Item, instance string, now time.Time) bool {
	if (of.state != stAdmitted && of.state != stPrefilled) || it.state != stNew {
		return false
	}
	s.tick(now)
	*it = Item{Tenant: of.Tenant, Priority: of.Priority, Cost: of.Cost, Prefill: of.Prefill, Cached: of.Cached, Value: it.Value, arrived: now}
	s.admit(it, now)
	s.Bind(it, instance)
	s.counts.Companions++
	return true
}

// Bind records the instance an admitted request was routed to: it counts
// against that instance's budgets until FirstToken (prefill) and Done. An
// item not admitted, or already bound, is left alone.
func (s *Sched) Bind(it *Item, instance string) {
	if it.inst != nil || (it.state != stAdmitted && it.state != stPrefilled) {
		return
	}
	if s.insts == nil {
		s.insts = map[string]*instLoad{}
	}
	l := s.insts[instance]
	if l == nil {
		l = &instLoad{name: instance}
		s.insts[instance] = l
	}
	it.inst, it.charge, it.ahead, it.work = l, s.charge(it, instance), l.work, workOn(it, instance)
	s.unbound--
	l.inflight++
	if it.state == stAdmitted {
		l.pending += it.charge
		l.work += it.work
		s.bigBound(it)
	}
	if s.oversized(it) {
		it.long = true
		l.long++
	}
}

// unbindPrefill releases it's pending prefill on its instance.
func (s *Sched) unbindPrefill(it *Item) {
	if it.inst != nil {
		it.inst.pending -= it.charge
		it.inst.work -= it.work
	}
}

// release frees it's place on its instance (or among the unbound).
func (s *Sched) release(it *Item) {
	l := it.inst
	if l == nil {
		s.unbound--
		return
	}
	l.inflight--
	if it.long {
		it.long = false
		l.long--
	}
	if !l.live && l.inflight == 0 && l.pending == 0 {
		for name, x := range s.insts {
			if x == l {
				delete(s.insts, name)
			}
		}
	}
}

// InstanceLoad is one instance's share of the admitted requests.
type InstanceLoad struct {
	Instance       string `json:"instance"`
	InFlight       int    `json:"in_flight"`
	PendingPrefill int64  `json:"pending_prefill_tokens"`
}

// instanceStats lists the instances' loads, by name.
func (s *Sched) instanceStats() []InstanceLoad {
	if !s.perInstance() {
		return nil
	}
	out := make([]InstanceLoad, 0, len(s.insts))
	for name, l := range s.insts {
		out = append(out, InstanceLoad{Instance: name, InFlight: l.inflight, PendingPrefill: l.pending})
	}
	slices.SortFunc(out, func(a, b InstanceLoad) int { return strings.Compare(a.Instance, b.Instance) })
	return out
}

// Hold is how many of a request's leading prompt tokens one instance
// holds in cache (Item.Cached).
type Hold struct {
	Instance string
	Tokens   int64
}

// charge is what the per-instance budget charges instance for it: its
// whole prompt, or with Config.ChargeUncached the tokens instance does not
// hold (Item.Cached).
func (s *Sched) charge(it *Item, instance string) int64 {
	if !s.cfg.ChargeUncached {
		return it.Prefill
	}
	return workOn(it, instance)
}

// workOn is the prompt tokens of it that instance does not hold
// (Item.Cached): what that instance's engine prefills for it.
func workOn(it *Item, instance string) int64 {
	for _, h := range it.Cached {
		if h.Instance == instance {
			return it.Prefill - min(max(h.Tokens, 0), it.Prefill)
		}
	}
	return it.Prefill
}

// compute is the prompt tokens the reservation counts for it (oversized
// prompts, the demand while requests wait): its whole prompt, or with
// Config.ChargeUncached what its instance was charged once bound, else
// what the instance holding most of it would prefill (where a cache-aware
// pick sends it).
func (s *Sched) compute(it *Item) int64 {
	if !s.cfg.ChargeUncached {
		return it.Prefill
	}
	if it.inst != nil {
		return it.charge
	}
	held := int64(0)
	for _, h := range it.Cached {
		held = max(held, h.Tokens)
	}
	return it.Prefill - min(held, it.Prefill)
}
