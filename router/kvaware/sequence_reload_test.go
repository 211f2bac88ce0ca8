package kvaware

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/internal/testenv"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// TestReloadOverlapIntentSeqsDistinct: a reload builds the pool's new
// state while requests resolved against the old one still pick through
// it; both states' sequencers number the intents of the one Syncer's
// incarnation, and peers name an intent by (replica, incarnation, seq):
// two intents with one seq are one to them (the second dropped as a
// duplicate, a commit of either taken for both). Every intent the replica
// publishes must carry a seq of its own.
func TestReloadOverlapIntentSeqsDistinct(t *testing.T) {
	const seq = 20 * time.Millisecond
	url, a, _ := sequencingPair(t, seq)
	nc := testenv.Connect(t, url)
	var mu sync.Mutex
	var seqs []uint64
	sub, err := nc.Subscribe(a.sync.IntentSubject(), func(m *nats.Msg) {
		msg, err := replicasync.Decode(m.Data)
		if err != nil || msg.Replica != "a" {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for _, in := range msg.Intents {
			seqs = append(seqs, in.Seq)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	pick := func(s *KVAware, i int) { t.Helper(); a.seqPick(s, i) }
	s := a.strategy(config.RoutingConfig{})
	pick(s, 0)

	// The reload's new state over the same Syncer; the old one still
	// serves a request resolved before the swap.
	_, s2 := a.rebuilt()
	time.Sleep(3 * seq) // past the new state's partial epoch
	pick(s, 1)
	pick(s2, 2)
	waitUntil(t, "the three intents published", func() bool { mu.Lock(); defer mu.Unlock(); return len(seqs) == 3 })
	mu.Lock()
	defer mu.Unlock()
	seen := map[uint64]bool{}
	for _, q := range seqs {
		if seen[q] {
			t.Fatalf("intent seqs %v: seq %d published twice in one incarnation (the old and the new state numbered apart)", seqs, q)
		}
		seen[q] = true
	}
}

// rebuilt is a reload's new kv_aware state of w's pool over the same peer
// state (its Syncer), and a strategy over it.
func (w *peerWorld) rebuilt() (*KVState, *KVAware) {
	w.t.Helper()
	st, err := NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: w.idx, Freshness: w.st.fresh,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		w.t.Fatal(err)
	}
	st.SetInstances(func() []*router.Instance { return w.insts })
	w2 := &kvWorld{t: w.t, idx: w.idx, clock: w.clock, fresh: w.fresh, st: st, insts: w.insts}
	return st, w2.strategy(config.RoutingConfig{})
}

// seqPick picks request i (its own prompt) through s among w's instances.
func (w *peerWorld) seqPick(s *KVAware, i int) {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := s.Pick(ctx, kvRequest(fmt.Sprint(i), promptTokens(uint32(80+i), 4*kvTestBS)), w.insts); err != nil {
		w.t.Fatal(err)
	}
}
