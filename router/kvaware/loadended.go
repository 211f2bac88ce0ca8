package kvaware

import (
	"sync"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/replicasync"
)

// An engine-load sample (loadscrape.go) is a snapshot of the engine's
// waiting and running requests at the moment it was scraped, and a router
// scrapes every second at its own moment. Until its next scrape it used to
// count every request of the snapshot, although some have ended since:
// after a burst, a replica whose scrape caught the burst running saw the
// instance busy for up to a second, and a replica that scraped just before
// or after saw it idle, so the two routed the next request differently
// with nothing pending anywhere (docs/BENCHMARKS.md §11).
//
// A request routed before a sample was taken and ended after it was in
// that sample; once it has ended it is no longer on the engine. The
// engine takes a scraped sample at some moment between the scrape's
// request (asked) and its answer (got): a request routed before got and
// ended after asked may have been in it, and is taken out. That takes out
// too many rather than too few (a request routed or ended while the scrape
// was on its way, a few milliseconds), and too many errs towards what
// the router tier itself knows, on which every replica agrees; too few
// would leave what the next scrape alone removes. So each
// replica remembers the requests it saw end on each instance (routing and
// end time), publishes them (replica sync, replicasync.Ended), and a
// decision takes out of an instance's sample every request, its own or
// a peer's, routed before the sample and ended after it. With no traffic
// but the router tier's, every replica's sample then falls to what is
// still running, whenever each scraped: replicas converge on the same
// view once sync has delivered, without waiting for their next scrape.
// Requests of other routers, or beyond the lists' bound, count as before
// until the next scrape.
//
// Which of the sample's two counts a request leaves: the running one
// first — a request ends only after running, and those that end soonest
// after a snapshot are the ones being served then — then the waiting one.

// endList is an instance's requests that this replica saw end recently,
// oldest first, at most replicasync.MaxEnded.
type endList struct {
	mu   sync.Mutex
	list []replicasync.Ended
	// ver counts changes to list; memo is inSample's last answer, valid
	// while ver and the sample's (asked, got) are those it was counted
	// for. A sample lives a scrape round and the list changes once per
	// end on the instance, while every decision asks about every
	// candidate: without the memo each decision scanned each candidate's
	// list (up to MaxEnded entries), the larger part of a decision's
	// per-candidate work at 128 instances (docs/BENCHMARKS.md §10,
	// "Session 17").
	ver  uint64
	memo endMemo
}

// endMemo is one inSample answer and what it was counted from.
type endMemo struct {
	ok         bool
	ver        uint64
	asked, got int64
	n          int
}

// add records an end, forgetting ends older than keep before it (ns).
func (l *endList) add(e replicasync.Ended, keep int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	drop := 0
	for drop < len(l.list) && l.list[drop].End < e.End-keep {
		drop++
	}
	if n := len(l.list) - drop + 1 - replicasync.MaxEnded; n > 0 {
		drop += n
	}
	l.list = append(l.list[:0], l.list[drop:]...)
	l.list = append(l.list, e)
	l.ver++
}

// snapshot appends the ends within keep of now (Unix ns) to dst.
func (l *endList) snapshot(dst []replicasync.Ended, now, keep int64) []replicasync.Ended {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.list {
		if e.End >= now-keep {
			dst = append(dst, e)
		}
	}
	return dst
}

// inSample counts the ends of requests that a sample asked for at asked
// and answered at got (Unix ns) may have counted: routed before got,
// ended after asked.
func (l *endList) inSample(asked, got int64) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m := &l.memo; m.ok && m.ver == l.ver && m.asked == asked && m.got == got {
		return m.n
	}
	n := replicasync.EndedIn(l.list, asked, got)
	l.memo = endMemo{ok: true, ver: l.ver, asked: asked, got: got, n: n}
	return n
}

// less is the sample without n of its requests, which have ended.
func (ls loadSample) less(n int) loadSample {
	if n <= 0 {
		return ls
	}
	r := min(float64(n), ls.running)
	ls.running -= r
	ls.waiting = max(0, ls.waiting-(float64(n)-r))
	return ls
}

// endKeep is how long ends are remembered (ns): as long as a decision may
// use a sample asked for before them (KVAware.loadAge, 3 scrape intervals;
// the longest of the pool's configurations). A sample normally lives one
// scrape round (interval + timeout, 1.5 s by default), but keeping only
// that long measurably lost settled agreement in the simulation (99.91 →
// 99.77–99.80 % on cache-pressure at 8 instances), and since a delta
// carries each end once (replicasync.Load.sinceSent) the longer list costs
// only the heartbeats' bytes.
type endKeep struct{ ns atomic.Int64 }

func (k *endKeep) atLeast(ns int64) {
	for {
		old := k.ns.Load()
		if old >= ns || k.ns.CompareAndSwap(old, ns) {
			return
		}
	}
}

func (k *endKeep) get() int64 {
	if v := k.ns.Load(); v > 0 {
		return v
	}
	return int64(3 * DefaultScrapeInterval)
}

// ended records that o's request ended on its instance now, for the
// instance's load sample to leave it out: a 2xx, or a client that left
// (499, vLLM aborts the request then). Not one the engine refused or never
// got (429, 503, a failed connection: 502; status 0, never sent), which no
// sample counted (found in review).
func (o *kvObserver) ended(status int) {
	if !(status >= 200 && status < 300 || status == 499) || o.at == 0 {
		return
	}
	now := o.st.now().UnixNano()
	o.pc.ends.add(replicasync.Ended{At: o.at, End: max(now, o.at)}, o.st.endKeep.get())
}
