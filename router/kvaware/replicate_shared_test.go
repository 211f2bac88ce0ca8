package kvaware

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// rentPeers is a tablePeers that also shares rent accounts.
type rentPeers struct {
	*tablePeers
	rent func(dst []replicasync.Rent, full bool) []replicasync.Rent
}

func (p *rentPeers) AttachRent(f func([]replicasync.Rent, bool) []replicasync.Rent) { p.rent = f }

// sendRents sends from's changed accounts (all when full) to each of to
// through the wire format, as a replica's flush does.
func sendRents(t *testing.T, name string, from *rentPeers, full bool, to ...*rentPeers) {
	t.Helper()
	got := throughWire(t, &replicasync.Message{Kind: replicasync.KindRent, Replica: name, Incarnation: 1, Complete: full, Rents: from.rent(nil, full)})
	for _, p := range to {
		p.Table.ApplyRent(&got)
	}
}

// Three replicas, each of which has routed a different share of a hot
// prefix's requests to its busy holder (each alone has paid too little
// rent to buy a copy, their sum enough), make the same buy decision for
// the prefix's next request once each holds the others' rent messages:
// all buy, on the same instance, from accounts equal to the bit. After
// one of them buys, its message resets the account on the others: none
// buys a second copy, and the rent starts again from nothing everywhere.
// Before any message, each buys on its own account alone, as one router.
func TestRentSharedSameDecisionOnEveryReplica(t *testing.T) {
	const running = 20
	system := promptTokens(61, 64*kvTestBS)
	req := func(i int) *router.Request {
		return kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
	}
	fixed := config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}}
	queue := (DefaultDecodeStepSeconds+running*DefaultRunningRequestSeconds)/2 + running*DefaultRunningRequestSeconds
	price := -queue + 2*float64(64*kvTestBS)/25000
	want := int(math.Ceil(price / queue)) // rent payments that cover the price
	if want < 3 {
		t.Fatalf("price %.1f ms over rent %.1f ms: too few payments (%d) to split over three replicas", price*1e3, queue*1e3, want)
	}
	// Shares: each under want, their sum want.
	shares := []int{want - 2, 1, 1}

	var worlds []*kvWorld
	var peers []*rentPeers
	var strats []*KVAware
	for range 3 {
		w, tp := newTableWorld(t, 4)
		p := &rentPeers{tablePeers: tp}
		// Re-attach with the rent-sharing peer state (newTableWorld built
		// the state on tp alone).
		w.st.fresh = p
		w.st.attachPeers()
		w.store(w.insts[1].ID(), system, 0, 64)
		for range running {
			w.insts[1].Acquire()
		}
		worlds, peers, strats = append(worlds, w), append(peers, p), append(strats, w.strategy(fixed))
	}
	n := 0
	for r, s := range strats {
		for range shares[r] {
			if d := kvPick(t, s, req(n), worlds[r].insts); d.Instance != worlds[r].insts[1] || d.Reason != router.ReasonKVMatch {
				t.Fatalf("replica %d, request %d: %s (%s), want the holder (kv_match)", r, n, d.Instance.ID(), d.Reason)
			}
			n++
		}
	}
	dry := func(r int, rq *router.Request) router.Decision {
		t.Helper()
		d, ev, err := strats[r].pick(context.Background(), rq, worlds[r].insts, false)
		if err != nil {
			t.Fatal(err)
		}
		worlds[r].st.putEval(ev)
		return d
	}
	key := func(r int) float64 { // the prefix's account on replica r
		var acc []float64
		for i := range worlds[r].st.rent.sets {
			for _, e := range worlds[r].st.rent.sets[i] {
				if e.used {
					acc = append(acc, worlds[r].st.rent.get(e.key))
				}
			}
		}
		if len(acc) != 1 {
			t.Fatalf("replica %d holds %d accounts, want the prefix's one", r, len(acc))
		}
		return acc[0]
	}
	// exchange: every replica sends the others its accounts (changed, or
	// all).
	exchange := func(full bool) {
		for i, p := range peers {
			var to []*rentPeers
			for j, q := range peers {
				if j != i {
					to = append(to, q)
				}
			}
			sendRents(t, fmt.Sprintf("r%d", i), p, full, to...)
		}
	}
	for r := range 3 {
		if d := dry(r, req(n)); d.Reason != router.ReasonKVMatch {
			t.Fatalf("replica %d buys on its own %d payments (%s)", r, shares[r], d.Reason)
		}
	}
	// Every replica sends the others its accounts (deltas: all changed).
	exchange(false)
	acc := []float64{key(0), key(1), key(2)}
	if acc[0] != acc[1] || acc[1] != acc[2] || acc[0] < price {
		t.Fatalf("pooled accounts %v, want equal and at least the price %v", acc, price)
	}
	var picks []string
	for r := range 3 {
		d := dry(r, req(n))
		if d.Reason != router.ReasonReplicate {
			t.Fatalf("replica %d with the pool's account %v ≥ price %v: %s, want replicate", r, acc[r], price, d.Reason)
		}
		picks = append(picks, d.Instance.ID())
	}
	if picks[0] != picks[1] || picks[1] != picks[2] {
		t.Fatalf("replicas buy on %v", picks)
	}
	// Replica 1 buys; its message resets the account everywhere.
	if d := kvPick(t, strats[1], req(n), worlds[1].insts); d.Reason != router.ReasonReplicate {
		t.Fatalf("commit: %s", d.Reason)
	}
	n++
	sendRents(t, "r1", peers[1], false, peers[0], peers[2])
	for r := range 3 {
		if a := key(r); a != 0 {
			t.Fatalf("replica %d: account %v after r1's purchase, want 0", r, a)
		}
		if d := dry(r, req(n)); d.Reason == router.ReasonReplicate {
			t.Fatalf("replica %d buys a second copy", r)
		}
	}
	// Rent paid after the purchase counts from nothing on every replica,
	// and a whole table carries the same accounts as the deltas did.
	kvPick(t, strats[0], req(n), worlds[0].insts)
	exchange(true)
	acc = []float64{key(0), key(1), key(2)}
	if acc[0] != acc[1] || acc[1] != acc[2] || !(acc[0] > 0) || acc[0] > queue*1.0001 {
		t.Fatalf("accounts after one more payment: %v, want equal, one payment (%v)", acc, queue)
	}
}

// The changes kept for the next send are bounded even if no send drains
// them (what a whole table repairs), and a drained delta lists a dropped
// account as removed.
func TestRentDirtyBounded(t *testing.T) {
	var rt rentTable
	p := &rentPeers{tablePeers: &tablePeers{Table: replicasync.NewTable(time.Hour, 16, nil)}}
	rt.share(p)
	for k := range 3 * replicasync.MaxPeerRents {
		rt.add(kvindex.Key(k), 0.5)
	}
	if n := len(rt.dirty); n == 0 || n > replicasync.MaxPeerRents {
		t.Fatalf("%d changes kept, want 1..%d", n, replicasync.MaxPeerRents)
	}
	// A fresh table. Keys of one set: the third evicts the poorer of the
	// first two.
	rt = rentTable{}
	rt.share(p)
	a, b, c := kvindex.Key(7), kvindex.Key(7+rentSets), kvindex.Key(7+2*rentSets)
	rt.add(a, 0.5)
	rt.add(b, 0.25)
	p.rent(nil, false)
	rt.add(c, 1)
	got := p.rent(nil, false)
	want := []replicasync.Rent{{Key: uint64(b)}, {Key: uint64(c), Rent: 1}}
	if !slices.Equal(got, want) {
		t.Fatalf("delta %v, want %v (b dropped, c added)", got, want)
	}
}

// A purchase seen once is never un-seen: A has paid rent on a prefix, B
// buys a copy and publishes it; A's account is then nothing, and stays
// nothing when B restarts (its new incarnation's first message replaces
// its old state) or dies past the peer timeout, until A pays rent again.
// Before, A relied on B to hold the new generation, and A's old rent
// counted again: A bought a second copy.
func TestRentPurchaseSurvivesBuyerRestartOrDeath(t *testing.T) {
	for _, fate := range []string{"restart", "death"} {
		t.Run(fate, func(t *testing.T) {
			now := time.Unix(1000, 0)
			clock := func() time.Time { return now }
			const timeout = 3 * time.Second
			pa := &rentPeers{tablePeers: &tablePeers{Table: replicasync.NewTable(timeout, 16, clock)}}
			pb := &rentPeers{tablePeers: &tablePeers{Table: replicasync.NewTable(timeout, 16, clock)}}
			var a, b rentTable
			a.share(pa)
			b.share(pb)
			k := kvindex.Key(42)
			a.add(k, 1)
			sendRents(t, "a", pa, true, pb)
			b.reset(k)
			sendRents(t, "b", pb, true, pa)
			if got := a.get(k); got != 0 {
				t.Fatalf("A's account after B bought: %v, want 0", got)
			}
			switch fate {
			case "restart": // B's new incarnation has no account of k yet
				m := &replicasync.Message{Kind: replicasync.KindRent, Replica: "b", Incarnation: 2, Complete: true}
				pa.Table.ApplyRent(m)
			case "death":
				now = now.Add(2 * timeout)
			}
			if got := a.get(k); got != 0 {
				t.Fatalf("A's account after B's %s: %v, want 0 (the purchase un-seen)", fate, got)
			}
			if g, r := a.own(k); g != 1 || r != 0 {
				t.Fatalf("A's own account: gen %d rent %v, want gen 1 rent 0", g, r)
			}
			a.add(k, 0.5)
			if got := a.get(k); got != 0.5 {
				t.Fatalf("A's account after one more payment: %v, want 0.5", got)
			}
		})
	}
}

// An account stays within what the wire carries: rent saturates at
// replicasync.MaxRent, and a purchase on a peer's last generation
// (replicasync.MaxRentGen) does not wrap to 0 (which would make every
// older rent count again) nor go beyond what a peer accepts.
func TestRentAccountBounded(t *testing.T) {
	p := &rentPeers{tablePeers: &tablePeers{Table: replicasync.NewTable(time.Hour, 16, nil)}}
	var rt rentTable
	rt.share(p)
	k := kvindex.Key(3)
	rt.add(k, 0.9*replicasync.MaxRent)
	rt.add(k, 0.9*replicasync.MaxRent)
	if got := rt.get(k); got != replicasync.MaxRent {
		t.Fatalf("account %v, want %v", got, replicasync.MaxRent)
	}
	p.Table.ApplyRent(&replicasync.Message{Kind: replicasync.KindRent, Replica: "b", Incarnation: 1, Complete: true,
		Rents: []replicasync.Rent{{Key: uint64(k), Gen: replicasync.MaxRentGen}}})
	rt.reset(k)
	if g, _ := rt.own(k); g != replicasync.MaxRentGen {
		t.Fatalf("generation after a purchase on the last: %d, want %d", g, uint64(replicasync.MaxRentGen))
	}
	for _, r := range p.rent(nil, true) {
		if _, err := (&replicasync.Message{Kind: replicasync.KindRent, Replica: "a", Rents: []replicasync.Rent{r}}).AppendBinary(nil); err != nil {
			t.Fatalf("published %+v does not encode: %v", r, err)
		}
	}
}
