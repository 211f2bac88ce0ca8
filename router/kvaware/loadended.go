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
	// ver counts changes to list (written with mu held); memo is
	// inSample's last answer, valid while ver and the sample's (asked,
	// got) are those it was counted for. A sample lives a scrape round and
	// the list changes once per end on the instance, while every decision
	// asks about every candidate: without the memo each decision scanned
	// each candidate's list (up to MaxEnded entries), the larger part of a
	// decision's per-candidate work at 128 instances (docs/BENCHMARKS.md
	// §10, "Session 17"). A hit is read without taking mu: a lock and
	// unlock per candidate and decision was, with the other two per
	// candidate, most of what a decision's pass over 128 candidates cost
	// ("Session 19"). They come first: what a decision reads.
	ver  atomic.Uint64
	memo endMemo
	mu   sync.Mutex
	list []replicasync.Ended
}

// endMemo is one inSample answer and what it was counted from, written
// with the list's mu held and read without it: seq is odd while a write is
// under way, so a reader that sees the same even seq before and after
// reading the fields read one answer whole.
type endMemo struct {
	seq        atomic.Uint64
	ver        atomic.Uint64 // the list's ver counted, plus one (0: none yet)
	asked, got atomic.Int64
	n          atomic.Int64
}

// get returns the memo's answer for a sample (asked, got) of the list at
// version ver; ok is false when the memo holds another one (or is being
// written).
func (m *endMemo) get(ver uint64, asked, got int64) (n int, ok bool) {
	s := m.seq.Load()
	if s&1 != 0 {
		return 0, false
	}
	mv, a, g, c := m.ver.Load(), m.asked.Load(), m.got.Load(), m.n.Load()
	if m.seq.Load() != s || mv != ver+1 || a != asked || g != got {
		return 0, false
	}
	return int(c), true
}

// set records an answer; called with the list's mu held.
func (m *endMemo) set(ver uint64, asked, got int64, n int) {
	m.seq.Add(1)
	m.ver.Store(ver + 1)
	m.asked.Store(asked)
	m.got.Store(got)
	m.n.Store(int64(n))
	m.seq.Add(1)
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
	l.ver.Add(1)
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
	// Each change of the list bumps ver after it: an answer for the
	// version read here is the answer for the list as it was when read.
	if n, ok := l.memo.get(l.ver.Load(), asked, got); ok {
		return n
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	ver := l.ver.Load()
	if n, ok := l.memo.get(ver, asked, got); ok {
		return n
	}
	n := replicasync.EndedIn(l.list, asked, got)
	l.memo.set(ver, asked, got, n)
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
