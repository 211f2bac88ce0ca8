package kvaware

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

// instanceSeries counts the per-instance series of kv_aware on g.
func instanceSeries(t *testing.T, g prometheus.Gatherer) int {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		switch mf.GetName() {
		case "kvrouter_kv_pending_prefill_tokens", "kvrouter_kv_load_scrapes_total":
			n += len(mf.GetMetric())
		}
	}
	return n
}

// stateSizes is the number of per-instance entries st keeps.
func stateSizes(st *KVState) (pend, loads, live, published int) {
	st.pendMu.RLock()
	pend = len(st.pend)
	st.pendMu.RUnlock()
	st.loads.mu.RLock()
	loads, live = len(st.loads.samples), st.loads.live
	st.loads.mu.RUnlock()
	st.peers.snap.mu.RLock()
	published = len(st.peers.snap.queues)
	st.peers.snap.mu.RUnlock()
	return
}

// newForgetState is a pool's state with its metrics on reg, and kv_aware
// over it.
func newForgetState(t *testing.T, reg *prometheus.Registry) (*KVState, *KVAware) {
	t.Helper()
	st := newPendingState(t, reg)
	s, err := newKVAware(config.RoutingConfig{}, st, func(uint64) uint64 { return 0 })
	if err != nil {
		t.Fatal(err)
	}
	return st, s
}

// untilClosed runs f until stop is closed.
func untilClosed(stop <-chan struct{}, f func()) {
	for {
		select {
		case <-stop:
			return
		default:
			f()
		}
	}
}

// TestForgetInstanceChurn: instances that join, take requests, report
// load, are scraped and published, and leave, leave nothing behind: the
// per-instance maps and series return to what the one instance that stays
// has, round after round.
func TestForgetInstanceChurn(t *testing.T) {
	reg := prometheus.NewRegistry()
	st, s := newForgetState(t, reg)
	stay, _ := router.NewInstance("stay", "http://127.0.0.1:9")
	touch := func(id string) {
		observe(st, id, 100).Done(200, -1)
		st.SetLoad(id, 1, 2)
		st.m.scrapes.WithLabelValues(st.pool, id, "ok").Inc()
	}
	touch("stay")
	st.publishPlacement(nil)
	basePend, baseLoads, baseLive, basePub := stateSizes(st)
	baseSeries := instanceSeries(t, reg)
	if basePend != 1 || baseLoads != 1 || baseLive != 1 || basePub != 1 || baseSeries != 2 {
		t.Fatalf("baseline: pend %d loads %d live %d published %d series %d, want 1 1 1 1 2", basePend, baseLoads, baseLive, basePub, baseSeries)
	}
	const rounds, n = 5, 12
	for r := range rounds {
		cands := []*router.Instance{stay}
		for k := range n {
			id := fmt.Sprintf("r%d-%d", r, k)
			in, _ := router.NewInstance(id, "http://127.0.0.1:9")
			cands = append(cands, in)
			touch(id)
		}
		// Decisions over the round's fleet (a candidate index: over
		// candIndexMin candidates), committed and finished.
		for q := range 4 {
			kvPick(t, s, kvRequest("", promptTokens(uint32(100*r+q), 8*kvTestBS)), cands)
		}
		st.publishPlacement(nil)
		if p, _, _, _ := stateSizes(st); p != 1+n {
			t.Fatalf("round %d: %d pending counters before the leave, want %d", r, p, 1+n)
		}
		for _, in := range cands[1:] {
			st.ForgetInstance(in.ID())
		}
		pend, loads, live, pub := stateSizes(st)
		series := instanceSeries(t, reg)
		if pend != basePend || loads != baseLoads || live != baseLive || pub != basePub || series != baseSeries {
			t.Fatalf("round %d after the leave: pend %d loads %d live %d published %d series %d, want %d %d %d %d %d",
				r, pend, loads, live, pub, series, basePend, baseLoads, baseLive, basePub, baseSeries)
		}
		st.publishPlacement(nil)
		if _, _, _, pub := stateSizes(st); pub != basePub {
			t.Fatalf("round %d: the next publication lists %d instances, want %d", r, pub, basePub)
		}
	}
	if tok, reqs := st.PendingPrefill("stay"); tok != 0 || reqs != 0 {
		t.Errorf("the staying instance's pending: %d/%d, want 0/0", tok, reqs)
	}
}

// TestForgetInstanceInFlight: requests routed to an instance before it
// left release their pending prefill after it: nothing is made again for
// it, and when it returns under the same id it starts from nothing, the
// old requests' releases leaving its new counter alone.
func TestForgetInstanceInFlight(t *testing.T) {
	reg := prometheus.NewRegistry()
	st := newPendingState(t, reg)
	streamed := observe(st, "a", 100)
	timed := observe(st, "a", 30)
	late := observe(st, "a", 7)
	st.SetLoad("a", 3, 4)
	st.ForgetInstance("a")

	streamed.FirstByte()
	streamed.Done(200, -1)
	timed.ReleasePrefillAfter(0)
	timed.Done(499, -1)
	if p, l, _, _ := stateSizes(st); p != 0 || l != 0 {
		t.Fatalf("after in-flight releases: %d pending counters, %d load slots, want 0 0", p, l)
	}
	if n := instanceSeries(t, reg); n != 0 {
		t.Fatalf("%d series after the releases, want 0", n)
	}
	if _, ok := st.loads.get("a", st.now(), DefaultScrapeInterval); ok {
		t.Fatal("the departed instance's load sample is still read")
	}

	// It returns: a new instance under the old id.
	fresh := observe(st, "a", 50)
	if tok, reqs := st.PendingPrefill("a"); tok != 50 || reqs != 1 {
		t.Fatalf("returned instance's pending: %d/%d, want 50/1", tok, reqs)
	}
	late.Done(200, -1) // the last request of its previous life
	if tok, reqs := st.PendingPrefill("a"); tok != 50 || reqs != 1 {
		t.Fatalf("after an old request's release: %d/%d, want 50/1 (not the old counter's)", tok, reqs)
	}
	if v, ok := scrapePending(t, reg, "p", "a"); !ok || v != 50 {
		t.Fatalf("pending series: %v (present %v), want 50", v, ok)
	}
	if n := fresh.pc.ends.inSample(0, st.now().UnixNano()+1); n != 0 {
		t.Errorf("the returned instance inherited %d ended requests", n)
	}
	fresh.Done(200, -1)
	if tok, reqs := st.PendingPrefill("a"); tok != 0 || reqs != 0 {
		t.Errorf("after all: %d/%d, want 0/0", tok, reqs)
	}
}

// TestForgetInstanceCandIndexMiss: a candidate index's cached miss stands
// only while no counter or load slot was made since; a leave followed by
// a new instance's first request keeps the map's size but makes one,
// which a decision must see.
func TestForgetInstanceCandIndexMiss(t *testing.T) {
	w := newKVWorld(t, candIndexMin)
	st := w.st
	s := w.strategy(config.RoutingConfig{})
	ev := st.getEval()
	defer st.putEval(ev)
	ev.ci = s.cands.get(w.insts)
	ev.cands = make([]candEval, len(w.insts))
	for i, in := range w.insts {
		ev.cands[i].inst = in
	}
	observe(st, "gone", 10)
	st.SetLoad("gone", 1, 1)
	lookup := func() (*pendingCounter, *loadSlot) {
		st.pendMu.RLock()
		st.loads.mu.RLock()
		defer st.loads.mu.RUnlock()
		defer st.pendMu.RUnlock()
		return ev.pending(st, 0), ev.loadSlot(st, 0)
	}
	if pc, sl := lookup(); pc != nil || sl != nil {
		t.Fatal("a counter or slot for an instance that had none")
	}
	st.ForgetInstance("gone")
	first := w.insts[0].ID()
	o := observe(st, first, 20)
	defer o.Done(200, -1)
	st.SetLoad(first, 2, 2)
	pc, sl := lookup()
	if pc != o.pc {
		t.Error("the candidate index kept its miss: the new counter is not read")
	}
	if sl == nil || !sl.ok {
		t.Error("the candidate index kept its miss: the new load sample is not read")
	}
}

// TestForgetInstanceThroughServer: the reload that removes an instance
// from its pool (here a configured one taken out of the file; a purged
// discovered one goes the same way, through the fleet reconciler's
// reload) drops the pool's kv_aware state for it and its series; one that
// comes back starts from zero.
func TestForgetInstanceThroughServer(t *testing.T) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
	if err != nil {
		t.Fatal(err)
	}
	pool := func(ids ...string) config.Config {
		pc := config.PoolConfig{Name: "p", Model: kvTestModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
		for _, id := range ids {
			pc.Instances = append(pc.Instances, config.InstanceConfig{ID: id, URL: "http://127.0.0.1:9"})
		}
		return config.Config{Pools: []config.PoolConfig{pc}}
	}
	srv, err := httpapi.NewServer(pool("a", "b"), httpapi.Options{
		Logger: slog.New(slog.DiscardHandler),
		KV:     NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := srv.Pool("p")
	st := Of(p)
	for _, id := range []string{"a", "b"} {
		observe(st, id, 10).Done(200, -1)
		st.SetLoad(id, 1, 1)
		st.m.scrapes.WithLabelValues("p", id, "ok").Inc()
	}
	before := instanceSeries(t, srv.Registry())
	if err := srv.Reload(pool("a")); err != nil {
		t.Fatal(err)
	}
	p, _ = srv.Pool("p")
	if Of(p) != st {
		t.Fatal("the reload replaced the pool's state")
	}
	if p, l, _, _ := stateSizes(st); p != 1 || l != 1 {
		t.Errorf("after b left: %d pending counters, %d load slots, want 1 1 (a's)", p, l)
	}
	if after := instanceSeries(t, srv.Registry()); after != before-2 {
		t.Errorf("series after b left: %d, want %d", after, before-2)
	}
	if err := srv.Reload(pool("a", "b")); err != nil {
		t.Fatal(err)
	}
	if tok, reqs := st.PendingPrefill("b"); tok != 0 || reqs != 0 {
		t.Errorf("b back: pending %d/%d, want 0/0", tok, reqs)
	}
	if p, l, _, _ := stateSizes(st); p != 1 || l != 1 {
		t.Errorf("b back, before any request: %d pending counters, %d load slots, want 1 1", p, l)
	}
}

// TestForgetInstanceConcurrent: leaves racing decisions, releases, load
// samples and publications (run with -race) leave counters that never go
// negative, and once the last request has ended and the instance has
// left, nothing of it.
func TestForgetInstanceConcurrent(t *testing.T) {
	reg := prometheus.NewRegistry()
	st, s := newForgetState(t, reg)
	var cands []*router.Instance
	for k := range candIndexMin {
		in, _ := router.NewInstance(fmt.Sprintf("x%d", k), "http://127.0.0.1:9")
		cands = append(cands, in)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 4 {
		wg.Go(func() {
			q := 0
			untilClosed(stop, func() {
				q++
				d, err := s.Pick(context.Background(), kvRequest("", promptTokens(uint32(g*1000+q%50), 4*kvTestBS)), cands)
				if err != nil {
					t.Error(err)
					return
				}
				st.SetLoad(d.Instance.ID(), 1, 1)
				if d.Observer != nil {
					d.Observer.FirstByte()
					d.Observer.Done(200, -1)
				}
			})
		})
	}
	wg.Go(func() {
		untilClosed(stop, func() {
			for _, in := range cands {
				st.ForgetInstance(in.ID())
			}
			st.publishPlacement(nil)
			for _, in := range cands {
				if tok, reqs := st.PendingPrefill(in.ID()); tok < 0 || reqs < 0 {
					t.Errorf("%s pending %d/%d", in.ID(), tok, reqs)
				}
			}
		})
	})
	time.Sleep(200 * time.Millisecond)
	close(stop)
	wg.Wait()
	for _, in := range cands {
		st.ForgetInstance(in.ID())
	}
	if p, l, live, pub := stateSizes(st); p != 0 || l != 0 || live != 0 || pub != 0 {
		t.Errorf("after all left: pend %d loads %d live %d published %d, want 0", p, l, live, pub)
	}
	if n := instanceSeries(t, reg); n != 0 {
		t.Errorf("%d series after all left", n)
	}
}

// observe is a request's observer on inst, tokens of prefill pending.
func observe(st *KVState, inst string, tokens int) *kvObserver {
	o, _ := st.newObserver(inst, tokens, 0)
	return o
}
