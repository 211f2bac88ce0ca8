package kvaware

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
)

// A burst that reaches three replicas at one instant — eight requests
// sharing a long new system prompt, dealt round robin — is decided by the
// sequenced replicas exactly as one router decides it in the pool's
// order: each replica decides its peers' intents dry onto its overlay and
// its own for real, and every replica's dry pick of a peer's request is
// the owner's real one. Without the overlay (each replica deciding its own
// alone at that instant, as before) the burst scatters. No sync message
// flows in this test (the syncers do not run): the peers' state is the
// epoch's overlay alone.
func TestSequencedBurstAsOneRouter(t *testing.T) {
	system := promptTokens(11, 64*kvTestBS)
	type reqSpec struct {
		text   string
		tokens []uint32
	}
	var reqs []reqSpec
	for i := range 8 {
		reqs = append(reqs, reqSpec{fmt.Sprintf("system prompt + question %d", i), append(slices.Clone(system), promptTokens(uint32(200+i), 40)...)})
	}
	newReq := func(i int) *router.Request { return kvRequest(reqs[i].text, reqs[i].tokens) }

	for _, overlay := range []bool{true, false} {
		t.Run(fmt.Sprintf("overlay_%v", overlay), func(t *testing.T) {
			url := testenv.NATSURL(t)
			pool := testenv.UniqueName(t)
			names := []string{"a", "b", "c"}
			var reps []*peerWorld
			var kvs []*KVAware
			var seqs []*replicasync.Sequencer
			t0 := time.Now().Truncate(2 * time.Millisecond).Add(-10 * time.Millisecond)
			for _, n := range names {
				w := newIdlePeerWorld(t, url, pool, n, 8)
				reps = append(reps, w)
				kvs = append(kvs, w.strategy(config.RoutingConfig{}))
				seqs = append(seqs, replicasync.NewSequencer(replicasync.SequencerConfig{Replica: n, Epoch: 2 * time.Millisecond, Start: t0.Add(-time.Second)}))
			}
			// The burst: request i reaches replica i%3 at one instant.
			arrive := t0.Add(100 * time.Microsecond)
			owner := map[string]int{}
			for i := range reqs {
				o := i % len(reps)
				in, held := seqs[o].Hold(arrive, true, kvs[o].Intent(context.Background(), newReq(i)))
				if !held {
					t.Fatal("not held")
				}
				owner[fmt.Sprintf("%s/%d", in.Replica, in.Seq)] = i
				for j := range seqs {
					if j != o {
						seqs[j].Receive(arrive, in)
					}
				}
			}
			due, _ := seqs[0].Next()
			// Each replica decides the epoch in the pool's order.
			real := make([]string, len(reqs))
			dry := map[int][]string{}
			var order []int
			for j, s := range seqs {
				for _, in := range s.Due(due, nil) {
					i := owner[fmt.Sprintf("%s/%d", in.Replica, in.Seq)]
					if j == 0 {
						order = append(order, i)
					}
					if in.Replica != s.Name() {
						if !overlay {
							continue
						}
						d, err := kvs[j].DecideIntent(context.Background(), &in, false, reps[j].insts)
						if err != nil {
							t.Fatal(err)
						}
						dry[i] = append(dry[i], d.Instance.ID())
						continue
					}
					d, err := kvs[j].Pick(context.Background(), newReq(i), reps[j].insts)
					if err != nil {
						t.Fatal(err)
					}
					d.Instance.Acquire() // as the proxy does
					real[i] = d.Instance.ID()
				}
				reps[j].st.EndEpoch()
			}
			// One router deciding the same requests in the pool's order.
			one := newKVWorld(t, 8)
			s1 := one.strategy(config.RoutingConfig{})
			want := make([]string, len(reqs))
			for _, i := range order {
				d, err := s1.Pick(context.Background(), newReq(i), one.insts)
				if err != nil {
					t.Fatal(err)
				}
				d.Instance.Acquire()
				want[i] = d.Instance.ID()
			}
			if !overlay {
				if slices.Equal(real, want) {
					t.Fatalf("without the overlay the replicas decided as one router (%v): the test cannot tell", real)
				}
				return
			}
			if !slices.Equal(real, want) {
				t.Fatalf("sequenced replicas picked %v, one router %v", real, want)
			}
			for i, ds := range dry {
				for _, d := range ds {
					if d != real[i] {
						t.Errorf("request %d: a peer's dry pick %s, the owner's %s", i, d, real[i])
					}
				}
			}
			for _, w := range reps {
				for _, in := range w.insts {
					if f, tok, _ := w.st.PeerLoad(in.ID()); f != 0 || tok != 0 {
						t.Errorf("after EndEpoch %s still counts %d in flight, %d tokens from the overlay", in.ID(), f, tok)
					}
				}
			}
		})
	}
}
