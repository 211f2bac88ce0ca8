package flowcontrol

import "slices"

// maxAffinityCandidates bounds the requests one admission compares: each
// costs a pass over its Cached list and the instances with room, under
// the queue's lock, and an admission happens at every first token and
// completion, so 16 keeps the choice within microseconds of CPU while
// covering one due request from each of 16 tenants (more tenants than
// that rarely have a request due in the same window of virtual time).
const maxAffinityCandidates = 16

// preferred is the request of band l to admit when Config.PreferCached is set:
// among the requests fair queuing considers due together — start tag
// before the head's finish tag, the head being the request start-time fair
// queuing would admit — the one that fits the budgets with the most cached
// tokens on an instance with room (ties: the earliest start tag). Reordering
// within the head's own service interval is the slack start-time fair
// queuing already has between requests due at once (Goyal, Vin and Cheng,
// "Start-time Fair Queuing", SIGCOMM 1996: its fairness bound is one
// maximum request per flow), so a tenant's lag grows by at most one
// request. No request there holds anything on an instance with room for
// it (requests without Item.Cached hold nothing): the head, which blocks
// the queue as usual when it does not fit — so a queue whose requests
// carry no cached tokens (a strategy other than kv_aware) orders exactly
// as without the preference.
func (s *Sched) preferred(l *level) *Item {
	head := l.tags[0]
	if len(l.tags) == 1 {
		return head
	}
	finish := head.start + float64(head.Cost)/s.weight(head.Tenant)
	cands := s.affBuf[:0]
	for _, it := range l.tags {
		if it.start < finish {
			cands = append(cands, it)
		}
	}
	slices.SortFunc(cands, func(a, b *Item) int {
		switch {
		case a.start < b.start:
			return -1
		case a.start > b.start:
			return 1
		case a.seq < b.seq:
			return -1
		case a.seq > b.seq:
			return 1
		}
		return 0
	})
	cands = cands[:min(len(cands), maxAffinityCandidates)]
	best, bestGain := head, int64(0)
	for _, it := range cands {
		// The cached count first: fits walks every instance, and under
		// overload nothing fits (measured at 256 instances, 1,024 queued:
		// 63–102 µs per blocked Next the other way round, 9–12 this way).
		if g := s.cachedRoom(it); g > bestGain && s.fits(it) {
			best, bestGain = it, g
		}
	}
	clear(cands)
	s.affBuf = cands[:0]
	return best
}

// cachedRoom is the most prompt tokens of it that an instance with room
// for it holds (any instance without per-instance budgets).
func (s *Sched) cachedRoom(it *Item) int64 {
	best := int64(0)
	var v keepView
	if s.perInstance() && len(it.Cached) > 0 {
		v = s.keep(it)
	}
	for _, h := range it.Cached {
		if h.Tokens <= best {
			continue
		}
		if s.perInstance() {
			// An instance the queue no longer knows (gone unhealthy or
			// removed since the request arrived) has no room.
			l := s.insts[h.Instance]
			if l == nil || !l.live || !s.roomIn(&v, l, it) {
				continue
			}
		}
		best = h.Tokens
	}
	return min(best, it.Prefill)
}
