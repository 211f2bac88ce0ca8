package flowcontrol

import (
	"container/heap"
	"time"
)

// Newest first within a tenant once it overruns (adaptive LIFO).
//
// A tenant whose requests arrive faster than its share of the pool is
// served keeps a standing backlog. Served oldest first, with objectives,
// that backlog grows until the oldest request is about to miss its
// deadline: every request admitted has then waited nearly its whole
// objective, and the rest are shed. The share the tenant is served is
// fixed by fair queuing, not by the order within its own requests, so
// the same number of its requests are admitted either way; served newest
// first, the admitted ones are those that have waited least and the
// backlog's oldest expire instead. So a tenant's requests go newest first
// from the moment one of them is shed for its deadline or wait bound —
// on arrival, predicted behind its own backlog, or while waiting — while
// others of it wait (the evidence that its backlog, not a passing burst,
// is what the oldest waited for), until none of it waits. No threshold:
// the request's own objective (or max_wait) says when the backlog is
// standing. This is the adaptive LIFO of Maurer, "Fail at Scale"
// (ACM Queue 13(8), 2015), with the switch taken from the objectives
// the queue already has rather than from a fixed queueing time. A
// tenant's order changes, never how much of the band it gets: the
// request admitted takes the start tag of the one fair queuing chose
// (their tags are exchanged), and a request aged into a better band still
// goes oldest first, as does the tenant's oldest once it has waited an
// aging step (newest).

// overrun marks t newest first when one of its requests was shed for its
// deadline or wait bound and others of it still wait.
func (s *Sched) overrun(t *tenantState) {
	if t != nil && t.queued > 0 {
		t.lifo = true
	}
}

// arrivalTag is the start tag from which an arrival of tenant name is
// predicted: after its tenant's backlog, or, newest first, at the tag of
// the backlog's first request (its tags are contiguous from there).
func (s *Sched) arrivalTag(t *tenantState, name string) float64 {
	if !t.lifo {
		return t.finish
	}
	return t.finish - float64(t.cost)/s.weight(name)
}

// newest is the request to admit in place of it, which fair queuing (or
// the reservation's step-sized pass) chose: when its tenant goes newest
// first, that tenant's newest request — or its oldest once that has waited
// an aging step (newest first would starve it: aging bounds a request's
// wait within its tenant as across bands) — if that request fits, else it.
func (s *Sched) newest(it *Item, now time.Time) *Item {
	t := it.lvl.tenants[it.Tenant]
	if !t.lifo {
		return it
	}
	nw := t.items.Back().Value.(*Item)
	if old := t.items.Front().Value.(*Item); now.Sub(old.arrived) >= s.cfg.AgingStep {
		nw = old
	}
	if nw == it || !s.fits(nw) {
		return it
	}
	it.start, nw.start = nw.start, it.start
	heap.Fix(&it.lvl.tags, it.tagIdx)
	heap.Fix(&nw.lvl.tags, nw.tagIdx)
	return nw
}
