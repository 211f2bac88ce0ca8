package consumer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// repairGate holds router B's replay of one message (ApplyAt from the
// position given to the message given) until release: another writer
// takes the instance over meanwhile.
type repairGate struct {
	*gatedIndex
	from, seq atomic.Uint64 // the apply to hold (seq 0: none)
	entered   chan struct{}
	release   chan struct{}
}

func (g *repairGate) ApplyAt(ctx context.Context, instance string, from kvindex.Position, seq uint64, evs []events.Event) (kvindex.SeqResult, error) {
	if seq != 0 && seq == g.seq.Load() && from.Seq == g.from.Load() && g.seq.CompareAndSwap(seq, 0) {
		close(g.entered)
		<-g.release
	}
	return g.gatedIndex.ApplyAt(ctx, instance, from, seq, evs)
}

// A router's repair of an instance meets another router's writer lease
// taken while the repair ran (the router stalled past its lease): the
// repair stops, the instance is left to that writer, and the router must
// not count it live while the index is behind the messages it consumed
// before the one in hand — it found the index missing them, and the new
// writer has not applied them yet.
//
// T, the other writer, is a kvindex handle of the test's own, so that
// when it takes the lease and when it applies are the test's to choose.
// B leaves message m1 to T (T holds the lease), T's lease runs out, B's
// next message m2 finds the index behind m1 and B repairs it from the
// stream, taking the lease; its replay of m1 is held until B's lease has
// run out and T has taken it back without applying anything. B's replay
// then meets T's lease (errOwned after a repair). B's position checks are
// held meanwhile: they would find the index behind too, a lease after m1
// was left to T, and keep e0 not live whatever the repair's answer did.
// Without the wait for the index to hold m1 (inst.await) on that answer,
// B read e0 live at m0, without m1.
func TestSharedRepairMeetsTakeover(t *testing.T) {
	const leaseB, leaseT = time.Second, 4 * time.Second // T's: a margin for a loaded machine
	w := newSharedWorld(t, 61, "e0")
	g := &repairGate{entered: make(chan struct{}), release: make(chan struct{})}
	w.wrapIndex = func(idx *kvindex.Redis) SharedApplier {
		g.gatedIndex = &gatedIndex{Redis: idx}
		return g
	}
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	defer func() { close(stop); hb.Wait() }()
	b := w.startRouterWith(w.client(), leaseB)
	w.publish(3)
	w.converge("B alone", b)
	hold := make(chan struct{})
	g.holdPositions.Store(&hold)
	var released, unheld bool
	defer func() {
		if !released {
			close(g.release)
		}
		if !unheld {
			close(hold)
		}
	}()

	tc := w.client()
	t.Cleanup(func() { _ = tc.Close() })
	tIdx, err := kvindex.NewRedis(tc, kvindex.RedisConfig{Prefix: w.prefix, Model: sharedModel, BlockSize: sharedBS,
		WriterLease: leaseT, ExactLookup: true})
	if err != nil {
		t.Fatal(err)
	}
	last := func() uint64 {
		t.Helper()
		info, err := w.stream().Info(w.ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.LastSeq
	}
	m0 := last()
	if p, err := tIdx.Position(w.ctx, "e0"); err != nil || p != (kvindex.Position{Seq: m0, Seeded: true}) {
		t.Fatalf("index at %v, %v; the stream's last message %d", p, err, m0)
	}
	// takeLease takes e0's writer lease for T without applying anything
	// (a begin at a position the index is not at takes the lease and
	// answers "behind"), once the holder's lease has run out. It returns
	// when the call that took it returned: the lease runs out leaseT after
	// Redis ran it, so no later than leaseT after that.
	takeLease := func(what string) time.Time {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			r, err := tIdx.ApplyAt(w.ctx, "e0", kvindex.Position{Seq: 1 << 40, Seeded: true}, 1<<40+1, nil)
			if err != nil {
				t.Fatalf("%s: T taking the lease: %v", what, err)
			}
			if r.Status == kvindex.SeqBehind {
				return time.Now()
			}
			if r.Status != kvindex.SeqNotOwner || time.Now().After(deadline) {
				t.Fatalf("%s: T taking the lease: %+v", what, r)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	took := takeLease("before m1") // once B's, from its last message, has run out
	w.publish(1)                   // m1: B leaves it to T (SeqNotOwner: T's lease held)
	m1 := last()
	if m1 != m0+1 {
		t.Fatalf("m1 at stream seq %d, after %d", m1, m0)
	}
	testenv.WaitFor(t, 10*time.Second, "B leaving m1 to T", func() bool { return g.notOwner.Load() >= 1 })

	// T's lease runs out with m1 unapplied: B's next message finds the
	// index behind m1, takes the lease and replays m1 — held here.
	time.Sleep(time.Until(took.Add(leaseT + 200*time.Millisecond)))
	g.from.Store(m0)
	g.seq.Store(m1)
	w.publish(1) // m2
	if m2 := last(); m2 != m1+1 {
		t.Fatalf("m2 at stream seq %d, after %d", m2, m1)
	}
	select {
	case <-g.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("B did not replay m1")
	}
	takeLease("during B's repair") // once B's lease has run out
	released = true
	close(g.release)
	// A second SeqNotOwner is the replay meeting T's lease.
	testenv.WaitFor(t, 10*time.Second, "B's replay meeting T's lease", func() bool { return g.notOwner.Load() >= 2 })
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if b.c.Live("e0") {
			p, _ := tIdx.Position(w.ctx, "e0")
			t.Fatalf("B counts e0 live with the index at %v, without m1 (%d) it consumed", p, m1)
		}
	}

	// T applies m1 and m2: B counts e0 live again.
	for seq := m1; seq <= m1+1; seq++ {
		msg, err := w.stream().GetMsg(w.ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		batch, err := events.Decode(msg.Data)
		if err != nil {
			t.Fatal(err)
		}
		if r, err := tIdx.ApplyAt(w.ctx, "e0", kvindex.Position{Seq: seq - 1, Seeded: true}, seq, batch.Events); err != nil || r.Status != kvindex.SeqApplied {
			t.Fatalf("T applying %d: %+v, %v", seq, r, err)
		}
	}
	unheld = true
	close(hold)
	testenv.WaitFor(t, 10*time.Second, "B counting e0 live once T applied m1 and m2", func() bool { return b.c.Live("e0") })
	w.publish(2) // T gone: B takes e0 over once T's lease has run out
	w.converge("after", b)
}
