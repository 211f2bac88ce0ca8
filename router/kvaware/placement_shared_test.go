package kvaware

import (
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// tablePeers is a PeerState and PlacementPeers over a replicasync.Table
// the test feeds by hand (as the simulator's replicas are fed).
type tablePeers struct {
	kvindex.FreshnessFuncs
	*replicasync.Table // the peers' state, as a Syncer's
	place              func(dst []replicasync.Queued) ([]replicasync.Queued, float64)
}

func (p *tablePeers) Speculate(string, []kvindex.Key, time.Duration)          {}
func (p *tablePeers) AttachLocal(func([]replicasync.Load) []replicasync.Load) {}
func (p *tablePeers) Changed()                                                {}
func (p *tablePeers) AttachPlacement(f func([]replicasync.Queued) ([]replicasync.Queued, float64)) {
	p.place = f
}

// newTableWorld is a replica of a pool of n instances whose peers are
// what the test applies to its table.
func newTableWorld(t *testing.T, n int) (*kvWorld, *tablePeers) {
	t.Helper()
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
	if err != nil {
		t.Fatal(err)
	}
	w := &kvWorld{t: t, idx: idx, clock: newTestClock(), fresh: &testFreshness{}}
	p := &tablePeers{Table: replicasync.NewTable(time.Hour, 1<<10, w.clock.Now)}
	w.st, err = NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: idx, Freshness: p, Now: w.clock.Now, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		w.add(fmt.Sprintf("vllm-%d", i))
	}
	w.st.SetInstances(func() []*router.Instance { return w.insts })
	return w, p
}

// publish sends from's placement averages to each of to, as a replica's
// interval flush does.
func publish(t *testing.T, name string, from *tablePeers, to ...*tablePeers) {
	t.Helper()
	qs, computed := from.place(nil)
	got := throughWire(t, &replicasync.Message{Kind: replicasync.KindPlacement, Replica: name, Incarnation: 1, Complete: true, Computed: computed, Queues: qs})
	for _, p := range to {
		p.Table.ApplyPlacement(&got)
	}
}

// throughWire is m as a peer receives it: encoded, then decoded.
func throughWire(t *testing.T, m *replicasync.Message) replicasync.Message {
	t.Helper()
	b, err := m.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := replicasync.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// Three replicas with different histories (each averaged ū and W̄ from its
// own decisions, so each alone would price a request's later requests
// differently) compute the same placement inputs, to the bit, once each
// has the others' published averages: the mean over the replicas of
// their published values. Before any peer publishes, each reads its own
// live averages, as one router does.
func TestPlacementInputsSameOnEveryReplica(t *testing.T) {
	const n = 4
	var worlds []*kvWorld
	var peers []*tablePeers
	for r := range 3 {
		w, p := newTableWorld(t, n)
		worlds, peers = append(worlds, w), append(peers, p)
		s := w.strategy(config.RoutingConfig{})
		// Different new context per pick (ū), different instances busy
		// while the decisions sample the queues (W̄).
		for i := range 2*drainMinSamples + r*5 {
			in := w.insts[(i+r)%n]
			in.Acquire()
			kvPick(t, s, kvRequest(fmt.Sprintf("r%d-%d", r, i), promptTokens(uint32(1000*r+i), (2+r+i%3)*kvTestBS)), w.insts)
			w.clock.Advance(time.Duration(50+20*r) * time.Millisecond)
		}
	}
	var own []float64
	for _, w := range worlds {
		if shared, _ := w.st.placementShared(new([]float64)); shared {
			t.Fatal("pooled averages with no peer publishing")
		}
		own = append(own, w.st.computed.mean())
	}
	if own[0] == own[1] || own[1] == own[2] {
		t.Fatalf("the replicas' own ū should differ for the test to mean anything: %v", own)
	}
	// Every replica publishes to the others.
	for i, p := range peers {
		var to []*tablePeers
		for j, q := range peers {
			if j != i {
				to = append(to, q)
			}
		}
		publish(t, fmt.Sprintf("r%d", i), p, to...)
	}
	var us []float64
	for _, w := range worlds {
		shared, u := w.st.placementShared(new([]float64))
		if !shared {
			t.Fatal("peers published, but the term reads own averages")
		}
		us = append(us, u)
	}
	want := sortedMean(slices.Clone(own))
	if us[0] != us[1] || us[1] != us[2] || us[0] != want {
		t.Fatalf("pooled ū %v on the three replicas, want %v each (the mean of %v)", us, want, own)
	}
	for i := range n {
		id := worlds[0].insts[i].ID()
		var ws, lives []float64
		for _, w := range worlds {
			ws = append(ws, w.st.sharedQueued(id, new([]float64)))
			pc := w.st.pendingFor(id)
			w.st.placeMu.Lock()
			lives = append(lives, pc.queued.value())
			w.st.placeMu.Unlock()
		}
		if ws[0] != ws[1] || ws[1] != ws[2] {
			t.Fatalf("%s: pooled W̄ %v differs between replicas (own %v)", id, ws, lives)
		}
		if m := sortedMean(slices.Clone(lives)); ws[0] != m {
			t.Fatalf("%s: pooled W̄ %v, want the mean of the replicas' %v (%v)", id, ws[0], lives, m)
		}
	}
	// A replica's later decisions move its live averages, not what it
	// published: the pool's inputs stay the same everywhere until it
	// publishes again.
	s0 := worlds[0].strategy(config.RoutingConfig{})
	worlds[0].clock.Advance(time.Second)
	kvPick(t, s0, kvRequest("late", promptTokens(99999, 40*kvTestBS)), worlds[0].insts)
	_, u0 := worlds[0].st.placementShared(new([]float64))
	_, u1 := worlds[1].st.placementShared(new([]float64))
	if u0 != u1 || worlds[0].st.computed.mean() == own[0] {
		t.Fatalf("after an unpublished decision: ū %v and %v (own live %v, was %v)", u0, u1, worlds[0].st.computed.mean(), own[0])
	}
}
