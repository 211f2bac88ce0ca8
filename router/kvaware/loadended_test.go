package kvaware

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// A request routed before an engine-load sample and ended after it leaves
// the sample: its instance's queue falls as each such request ends, not
// at the next scrape; requests routed after the sample, or never sent,
// leave it as it is; the running count goes first, then the waiting one.
func TestLoadSampleLessEnded(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
	x := w.insts[0]
	queueWith := func(waiting, running float64) float64 {
		wait, _ := s.sc.queue(0, 0, 0, loadSample{waiting: waiting, running: running}, true)
		return wait
	}
	var before []pickedOn
	for i := range 3 {
		d := kvPickOn(t, s, x, uint32(10+i))
		d.dec.Observer.FirstByte() // no pending prefill: the sample alone counts
		before = append(before, d)
	}
	w.clock.Advance(10 * time.Millisecond)
	w.st.SetLoad(x.ID(), 1, 2) // the three: two running, one waiting
	w.clock.Advance(10 * time.Millisecond)
	after := kvPickOn(t, s, x, 20) // routed after the sample: not in it
	after.dec.Observer.FirstByte()
	unsent := kvPickOn(t, s, w.insts[1], 21)
	if got, want := probeQueue(t, s, w, x), queueWith(1, 2); got != want {
		t.Fatalf("queue %v with the sample as scraped, want %v", got, want)
	}
	w.clock.Advance(10 * time.Millisecond)
	after.dec.Observer.Done(200, -1)
	unsent.dec.Observer.Done(0, -1)
	if got, want := probeQueue(t, s, w, x), queueWith(1, 2); got != want {
		t.Fatalf("a request routed after the sample ended: queue %v, want %v (unchanged)", got, want)
	}
	for i, want := range []float64{queueWith(1, 1), queueWith(1, 0), queueWith(0, 0)} {
		before[i].dec.Observer.Done(200, -1)
		if got := probeQueue(t, s, w, x); got != want {
			t.Fatalf("%d of the sample's requests ended: queue %v, want %v", i+1, got, want)
		}
	}
	if q := queueWith(0, 0); q != 0 {
		t.Fatalf("an empty sample's queue %v", q)
	}
}

// With replica sync, a replica takes out of its own sample the requests
// its peer saw end since: the replica that scraped an instance while the
// peer's request ran there sees it idle once that request has ended, as
// the peer does, without waiting for its next scrape.
func TestLoadSampleLessPeerEnded(t *testing.T) {
	a, b := newPeerPair(t, 2)
	// Samples usable for 3 minutes: only the peer's end can move b's.
	rc := config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{ScrapeInterval: time.Minute}}
	sa, sb := a.strategy(rc), b.strategy(rc)
	idle := probeQueue(t, sb, b.kvWorld, b.insts[0])
	r := kvPickOn(t, sa, a.insts[0], 1)
	r.dec.Observer.FirstByte()
	time.Sleep(time.Millisecond)        // the sample is taken after the routing, on the wall clock
	b.st.SetLoad(b.insts[0].ID(), 0, 1) // b's scrape catches a's request running
	if q := probeQueue(t, sb, b.kvWorld, b.insts[0]); !(q > idle) {
		t.Fatalf("b's queue on the scraped instance %v, want above idle %v", q, idle)
	}
	r.dec.Observer.Done(200, -1)
	waitUntil(t, "b sees a's request end", func() bool { return probeQueue(t, sb, b.kvWorld, b.insts[0]) == idle })
	if q := probeQueue(t, sa, a.kvWorld, a.insts[0]); q != idle {
		t.Fatalf("a (no sample) sees %v, want idle %v", q, idle)
	}
}

// The end list keeps the newest ends within its age bound, at most
// replicasync.MaxEnded, and counts those a sample held.
func TestEndList(t *testing.T) {
	var l endList
	const keep = int64(3 * time.Second)
	for i := range replicasync.MaxEnded + 10 {
		l.add(replicasync.Ended{At: int64(i) * 1e6, End: int64(i)*1e6 + 5e6}, keep)
	}
	if got := l.snapshot(nil, 0, keep); len(got) != replicasync.MaxEnded || got[0].At != 10e6 {
		t.Fatalf("kept %d, oldest routed at %d; want %d from 10 ms", len(got), got[0].At, replicasync.MaxEnded)
	}
	// A sample at 20.5 ms held requests routed at 16..20 ms (ended 21..25).
	if n := l.inSample(20.5e6, 20.5e6); n != 5 {
		t.Fatalf("%d in a sample at 20.5 ms, want 5", n)
	}
	// Asked at 20.5 ms, answered at 22.5: those routed before 22.5 and
	// ended after 20.5 may have been in it (16..22 ms).
	if n := l.inSample(20.5e6, 22.5e6); n != 7 {
		t.Fatalf("%d in a sample taken between 20.5 and 22.5 ms, want 7", n)
	}
	// The answer is remembered for the same sample and list (each
	// decision asks about every candidate), and counted again once
	// either changes.
	if n := l.inSample(20.5e6, 22.5e6); n != 7 {
		t.Fatalf("asked again: %d, want 7", n)
	}
	if n := l.inSample(20.5e6, 20.5e6); n != 5 {
		t.Fatalf("back to the first sample: %d, want 5", n)
	}
	l.add(replicasync.Ended{At: 20e6, End: 30e6}, keep) // routed before the sample, ended after it
	if n := l.inSample(20.5e6, 20.5e6); n != 6 {
		t.Fatalf("after an end the sample held: %d, want 6", n)
	}
	l.add(replicasync.Ended{At: 10e9, End: 10e9}, keep) // 10 s later: the old ones are past any sample
	if n := l.inSample(20.5e6, 20.5e6); n != 0 {
		t.Fatalf("after the list dropped them: %d, want 0", n)
	}
	if got := l.snapshot(nil, 10e9, keep); len(got) != 1 {
		t.Fatalf("after 10 s kept %v", got)
	}
}

// With ten candidates decisions read load samples through the candidate
// index's slot cache: a sample set, dropped or set again after the index
// was built, on an instance that had one or not, is what the next
// decision's queue reads.
func TestLoadSlotsThroughCandidateIndex(t *testing.T) {
	w := newKVWorld(t, 10)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
	a, b := w.insts[3], w.insts[5]
	queueWith := func(waiting, running float64) float64 {
		wait, _ := s.sc.queue(0, 0, 0, loadSample{waiting: waiting, running: running}, true)
		return wait
	}
	check := func(step string, in *router.Instance, want float64) {
		t.Helper()
		_, ev, err := s.pick(context.Background(), kvRequest("probe", promptTokens(99, 4*kvTestBS)), w.insts, false)
		if err != nil {
			t.Fatal(err)
		}
		defer w.st.putEval(ev)
		if ev.ci == nil {
			t.Fatalf("%s: no candidate index over %d candidates", step, len(w.insts))
		}
		if got := ev.find(in).queue; got != want {
			t.Fatalf("%s: %s's queue %v, want %v", step, in.ID(), got, want)
		}
	}
	idle := queueWith(0, 0)
	check("no samples", a, idle)
	w.st.SetLoad(b.ID(), 2, 0)
	check("b sampled", b, queueWith(2, 0))
	check("b sampled", a, idle) // a's miss is remembered...
	w.st.SetLoad(a.ID(), 3, 1)
	check("a sampled", a, queueWith(3, 1)) // ...until a slot is made
	w.st.loads.drop(a.ID())
	check("a dropped", a, idle)
	check("a dropped", b, queueWith(2, 0))
	w.st.SetLoad(a.ID(), 1, 4)
	check("a sampled again", a, queueWith(1, 4))
	w.st.loads.drop(a.ID())
	w.st.loads.drop(b.ID())
	check("both dropped", b, idle)
}

// TestEndListConcurrentAsks: decisions read the memo without the list's
// lock while ends are added. Each end added is in the sample asked about,
// so the answers any reader sees never go down, and once the writer is
// done every reader sees them all (two samples alternate, so the memo is
// rewritten all along). Run with -race.
func TestEndListConcurrentAsks(t *testing.T) {
	var l endList
	const keep = int64(time.Hour)
	const ends = replicasync.MaxEnded - 1
	samples := [2][2]int64{{100e6, 100e6}, {100e6, 101e6}}
	done := make(chan struct{})
	errs := make(chan error, 4)
	var wg sync.WaitGroup
	for r := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			last := [2]int{}
			for k := 0; ; k++ {
				s := (r + k) % 2
				n := l.inSample(samples[s][0], samples[s][1])
				if n < last[s] || n > ends {
					errs <- fmt.Errorf("reader %d, sample %d: %d after %d (of %d)", r, s, n, last[s], ends)
					return
				}
				last[s] = n
				select {
				case <-done:
					if n := l.inSample(samples[s][0], samples[s][1]); n != ends {
						errs <- fmt.Errorf("reader %d after the last end: %d, want %d", r, n, ends)
					}
					return
				default:
				}
			}
		}()
	}
	for i := range ends {
		l.add(replicasync.Ended{At: int64(i) * 1e6, End: 200e6 + int64(i)}, keep) // routed before, ended after both samples
	}
	close(done)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
