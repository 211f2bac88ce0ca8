package kvaware

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
)

// refusingPeers refuses the second intent's publication, once the epoch
// loop has begun deciding its epoch (the refusal of a publish that took
// past its epoch's due time), and counts the effects put on the overlay.
type refusingPeers struct {
	peerFreshness
	publishes atomic.Int32
	refuse    chan struct{} // closed by BeginEpoch: the second publish fails
	returned  chan struct{} // closed by the test when the refused request's pick returned
	overlays  atomic.Int32
}

func (r *refusingPeers) PublishIntent(in replicasync.Intent) bool {
	if r.publishes.Add(1) != 2 {
		return r.peerFreshness.PublishIntent(in)
	}
	<-r.refuse
	return false
}

func (r *refusingPeers) BeginEpoch() {
	r.peerFreshness.BeginEpoch()
	select {
	case <-r.refuse:
	default:
		close(r.refuse)
	}
	select { // the refused request has withdrawn and been decided alone
	case <-r.returned:
	case <-time.After(10 * time.Second):
	}
}

func (r *refusingPeers) Overlay(e replicasync.Effect) {
	r.overlays.Add(1)
	r.peerFreshness.Overlay(e)
}

// An own held request whose intent's publication is refused after the
// epoch loop took its epoch is decided alone, for real, at once; the loop
// must not then decide it dry onto the overlay as well (the request would
// count twice on this replica while its epoch is decided, and on no
// peer's overlay: they never saw the intent).
func TestWithdrawnIntentNotDecidedDry(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	const seq = replicasync.MaxSequence // the second request held in the first's epoch on a loaded machine
	var rp *refusingPeers
	a := newPeerWorldNow(t, url, pool, "a", 4, true, seq, nil, func(pf peerFreshness) kvindex.Freshness {
		rp = &refusingPeers{peerFreshness: pf, refuse: make(chan struct{}), returned: make(chan struct{})}
		return rp
	})
	b := newPeerWorldRun(t, url, pool, "b", 4, true, seq)
	waitUntil(t, "peers live", func() bool { return a.sync.Live() == 1 && b.sync.Live() == 1 })
	time.Sleep(3 * seq) // past the partial epoch
	now := time.Now()
	time.Sleep(now.Truncate(seq).Add(seq + 2*time.Millisecond).Sub(now)) // 2 ms into an epoch

	s := a.strategy(config.RoutingConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	first := make(chan error, 1)
	go func() {
		_, err := s.Pick(ctx, kvRequest("q1", promptTokens(71, 8*kvTestBS)), a.insts)
		first <- err
	}()
	waitUntil(t, "the first request is held", func() bool { return a.st.SequenceStats().Held == 1 })
	_, err := s.Pick(ctx, kvRequest("q2", promptTokens(72, 8*kvTestBS)), a.insts)
	close(rp.returned)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	a.st.seq.wg.Wait() // the epoch loop has decided the epoch and ended
	if st := a.st.SequenceStats(); st.Held != 2 {
		t.Fatalf("held %d requests, want both in one epoch (%+v)", st.Held, st)
	}
	if n := rp.overlays.Load(); n != 0 {
		t.Fatalf("a put %d effects on its overlay; its requests were decided for real, and no peer's intent was sequenced", n)
	}
}

// A reload that rebuilds a pool's KVState (its model or tokenizer
// changed) keeps the pool's Syncer, and so its incarnation: the new
// state's sequencer must continue the intent seqs, not number them from 1
// again. Restarted, its commits fell below what the Syncer had already
// said (a commit only rises), so the peers read every new intent up to the
// old state's count as decided for real already and skipped its dry
// decision; and an open intent of the old state shared its id with a new
// one.
func TestRebuiltStateContinuesIntentSeqs(t *testing.T) {
	const seq = 20 * time.Millisecond
	_, a, b := sequencingPair(t, seq)
	pick := func(s *KVAware, i int) { t.Helper(); a.seqPick(s, i) }
	incarnation := func() uint64 {
		for _, p := range b.sync.Peers() {
			if p.Replica == "a" {
				return p.Incarnation
			}
		}
		return 0
	}
	s := a.strategy(config.RoutingConfig{})
	pick(s, 0)
	pick(s, 1)
	waitUntil(t, "b hears a's two commits", func() bool { return b.sync.Committed("a", incarnation()) == 2 })

	// The reload's new state over the same pool's Syncer.
	st2, s2 := a.rebuilt()
	time.Sleep(3 * seq) // past the new state's partial epoch
	pick(s2, 2)
	if st := st2.SequenceStats(); st.Held != 1 {
		t.Fatalf("the new state held %d requests (%+v), want 1", st.Held, st)
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.sync.Committed("a", incarnation()) != 3 {
		if time.Now().After(deadline) {
			t.Fatalf("b reads a's commit %d after the new state's first decision, want 3: the new intent's seq restarted below the old state's",
				b.sync.Committed("a", incarnation()))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
