package kvaware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
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

// Three live replicas (real syncers on the test NATS server, sequencing
// in 20 ms epochs) receive one same-instant burst — nine requests sharing
// a long new system prompt, three at each — and, each request held for
// its epoch and its intent published, place it as one router placing the
// nine in turn does (the same number of requests on each instance used).
// Unsequenced (δ = 0), the same burst is decided blind at each replica
// and scattered.
func TestSequencedLiveBurst(t *testing.T) {
	system := promptTokens(11, 64*kvTestBS)
	const n = 9
	newReq := func(i int) *router.Request {
		return kvRequest(fmt.Sprintf("system prompt + question %d", i), append(slices.Clone(system), promptTokens(uint32(200+i), 40)...))
	}
	// One router deciding the burst in turn.
	one := newKVWorld(t, 8)
	s1 := one.strategy(config.RoutingConfig{})
	var want []string
	for i := range n {
		d, err := s1.Pick(context.Background(), newReq(i), one.insts)
		if err != nil {
			t.Fatal(err)
		}
		d.Instance.Acquire()
		want = append(want, d.Instance.ID())
	}
	// The placement's shape: how many requests each instance took, most
	// first. One router's depends on which request it decides first (its
	// hash-home), the replicas' on the pool's order of the burst: the
	// shapes are compared, not the names.
	shape := func(ids []string) []int {
		c := map[string]int{}
		for _, id := range ids {
			c[id]++
		}
		var out []int
		for _, k := range c {
			out = append(out, k)
		}
		slices.Sort(out)
		slices.Reverse(out)
		return out
	}
	wantShape := shape(want)

	burst := func(t *testing.T, seq time.Duration, shadowed bool) ([]string, []*peerWorld) {
		url := testenv.NATSURL(t)
		pool := testenv.UniqueName(t)
		var reps []*peerWorld
		var kvs []*KVAware
		for _, name := range []string{"a", "b", "c"} {
			w := newPeerWorldRun(t, url, pool, name, 8, true, seq)
			reps = append(reps, w)
			kvs = append(kvs, w.strategy(config.RoutingConfig{}))
		}
		waitUntil(t, "every replica hears both peers", func() bool {
			for _, w := range reps {
				if w.sync.Live() != 2 {
					return false
				}
			}
			return true
		})
		time.Sleep(2 * seq) // past the partial epoch the replicas started in
		if seq > 0 {
			// The burst's arrivals (spread by the intents' keying, a few
			// ms under -race) start just after an epoch's start, so that
			// they share one epoch: a burst split across two is decided
			// as two bursts (the second after the first's real effects
			// arrived by the sync), which this test does not assert on.
			now := time.Now()
			time.Sleep(now.Truncate(seq).Add(seq + seq/20).Sub(now))
		}
		got := make([]string, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				o := i % len(reps)
				<-start
				var pick router.Strategy = kvs[o]
				if shadowed {
					// shadow: true, kv_aware in use (the example config's)
					pick = NewShadow(kvs[o], kvs[o])
				}
				d, err := pick.Pick(context.Background(), newReq(i), reps[o].insts)
				if err != nil {
					t.Error(err)
					return
				}
				d.Instance.Acquire() // as the proxy does
				got[i] = d.Instance.ID()
			})
		}
		close(start)
		wg.Wait()
		return got, reps
	}

	sequenced := func(t *testing.T, shadowed bool) {
		// δ at its bound and a grace of 4δ (newPeerWorldRun): the burst's
		// arrivals must share one epoch and every intent must reach the
		// peers before it is due, on a shared 2-core VM under -race where
		// a goroutine can wait tens of milliseconds for a core (at 20 ms
		// this failed 5 of 6 runs at load average 35, late intents and a
		// burst split over two epochs).
		//
		// Still, a core can be away longer than that grace on a loaded
		// machine (seen 1 in 16 runs at load average ~20 with -race):
		// the burst is then decided as two, an outcome of the schedule,
		// not of the rule. So a burst placed unlike one router's is tried
		// again on new replicas, and the test fails only if three in a
		// row are: a broken sequencing places every burst wrong.
		var got []string
		for try := range 3 {
			var reps []*peerWorld
			got, reps = burst(t, replicasync.MaxSequence, shadowed)
			var held int64
			for _, w := range reps {
				st := w.st.SequenceStats()
				held += st.Held
				w.st.seq.wg.Wait() // the epoch loop ends with its last epoch
				if l := w.st.seq.sq.Stats(); l.Late > 0 {
					t.Logf("%d late intents", l.Late)
				}
			}
			if held != n {
				t.Fatalf("%d of %d requests held", held, n)
			}
			if slices.Equal(shape(got), wantShape) {
				return
			}
			t.Logf("burst %d: sequenced replicas placed it on %v, one router on %v", try+1, got, want)
		}
		t.Fatalf("three sequenced bursts in a row placed unlike one router: the last on %v, one router on %v", got, want)
	}
	for _, shadowed := range []bool{false, true} {
		name := "sequenced"
		if shadowed {
			name = "sequenced_shadowed"
		}
		t.Run(name, func(t *testing.T) { sequenced(t, shadowed) })
	}
	t.Run("unsequenced", func(t *testing.T) {
		// Blind replicas scatter the burst unless the sync happens to
		// catch up within it (the arrivals spread by a few ms under
		// -race): one burst of three scattered is enough to tell.
		var got []string
		for range 3 {
			if got, _ = burst(t, 0, false); !slices.Equal(shape(got), wantShape) {
				return
			}
		}
		t.Fatalf("unsequenced replicas placed three bursts as one router (%v): the test cannot tell", got)
	})
}

// With sequencing on and no live peer, nothing is held: the request is
// decided at once, counted alone.
func TestSequenceNoPeerHoldsNothing(t *testing.T) {
	url := testenv.NATSURL(t)
	w := newPeerWorldRun(t, url, testenv.UniqueName(t), "a", 4, true, 5*time.Millisecond)
	s := w.strategy(config.RoutingConfig{})
	t0 := time.Now()
	for i := range 3 {
		if _, err := s.Pick(context.Background(), kvRequest(fmt.Sprint(i), promptTokens(uint32(i), 4*kvTestBS)), w.insts); err != nil {
			t.Fatal(err)
		}
	}
	if st := w.st.SequenceStats(); st.Held != 0 || st.Alone != 3 {
		t.Fatalf("stats %+v, want 3 alone and none held", st)
	}
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("three lone picks took %v", d)
	}
}

// A held request whose context ends leaves at once with its error; its
// epoch is still decided (the request dry, as its peers decide it) and
// the epoch loop then ends.
func TestSequenceHeldRequestLeaves(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	a := newPeerWorldRun(t, url, pool, "a", 4, true, 20*time.Millisecond)
	b := newPeerWorldRun(t, url, pool, "b", 4, true, 20*time.Millisecond)
	waitUntil(t, "peers live", func() bool { return a.sync.Live() == 1 && b.sync.Live() == 1 })
	time.Sleep(40 * time.Millisecond) // past the partial epoch
	s := a.strategy(config.RoutingConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	_, err := s.Pick(ctx, kvRequest("q", promptTokens(1, 4*kvTestBS)), a.insts)
	if err == nil || time.Since(t0) > 50*time.Millisecond {
		t.Fatalf("a cancelled held request returned %v after %v", err, time.Since(t0))
	}
	if st := a.st.SequenceStats(); st.Held != 1 {
		t.Fatalf("stats %+v: the request was not held", st)
	}
	a.st.seq.wg.Wait() // the loop ends with the epoch
	a.st.seq.mu.Lock()
	n := len(a.st.seq.waiters)
	a.st.seq.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d waiters left", n)
	}
}

// A held request picks among its candidates still healthy at its turn:
// one a reload ejected (or a health check failed) during the hold is not
// picked, and with none left the pick is ErrNoCandidates; the caller's
// candidate slice is left as it was.
func TestSequenceHeldPickSkipsEjected(t *testing.T) {
	const seq = 50 * time.Millisecond // grace 4·seq: time to eject during the hold
	_, a, _ := sequencingPair(t, seq)
	s := a.strategy(config.RoutingConfig{})
	cands := slices.Clone(a.insts)
	for i, eject := range [][]*router.Instance{a.insts[:3], a.insts[3:]} {
		type picked struct {
			dec router.Decision
			err error
		}
		pc := make(chan picked, 1)
		go func() {
			dec, err := s.Pick(context.Background(), kvRequest(fmt.Sprint(i), promptTokens(uint32(i), 4*kvTestBS)), cands)
			pc <- picked{dec, err}
		}()
		waitUntil(t, "the request held", func() bool { return a.st.SequenceStats().Held == int64(i+1) })
		for _, in := range eject {
			in.SetHealthy(false)
		}
		got := <-pc
		name := "no instance"
		if got.dec.Instance != nil {
			name = got.dec.Instance.ID()
		}
		if i == 0 && (got.err != nil || got.dec.Instance != a.insts[3]) {
			t.Fatalf("with three ejected during the hold: %s %v, want %s", name, got.err, a.insts[3].ID())
		}
		if i == 1 && !errors.Is(got.err, router.ErrNoCandidates) {
			t.Fatalf("with every candidate ejected during the hold: %s %v, want ErrNoCandidates", name, got.err)
		}
	}
	if !slices.Equal(cands, a.insts) {
		t.Fatal("the caller's candidates were changed")
	}
}

// A peer's intent that buys a hot prefix's warm-up copy (warmable) is
// overlaid as the peer's commit makes the copy: the prefix the holder has
// stored (Warm.Tokens) pending on the copy's instance and only its blocks
// about to be computed there, not the buyer's whole prompt. Before, the
// overlay counted the whole prompt's recompute and its tail's blocks on
// the copy's instance, which the peer's copy never computes.
func TestDecideIntentWarmCopyOverlay(t *testing.T) {
	system := promptTokens(61, 64*kvTestBS)
	req := func(i int) *router.Request {
		r := kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
		r.Warmable = true
		return r
	}
	w, p := newTableWorld(t, 4)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}})
	w.store(w.insts[1].ID(), system, 0, 64)
	for range 20 { // as TestHotPrefixWarmCopy: a congested holder
		w.insts[1].Acquire()
	}
	for i := range 200 {
		in := s.Intent(context.Background(), req(i))
		d, err := s.DecideIntent(context.Background(), &in, true, w.insts)
		if err != nil {
			t.Fatal(err)
		}
		if p.OverlayLen() == 2 { // the pick's effect and a copy's
			if d.Instance != w.insts[1] {
				t.Fatalf("purchase at request %d: %s, want the holder", i, d.Instance.ID())
			}
			for _, alt := range w.insts {
				if alt == w.insts[1] {
					continue
				}
				if f, tok, _ := p.PeerLoad(alt.ID()); f == 0 {
					continue
				} else if tok != int64(64*kvTestBS) {
					t.Errorf("the copy's instance %s: %d pending tokens overlaid, want the holder's prefix, %d", alt.ID(), tok, 64*kvTestBS)
				}
				if h := p.PeerHolders(nil, kvindex.Key(in.Keys[64])); slices.Contains(h, alt.ID()) {
					t.Errorf("the buyer's own block 64 overlaid on the copy's instance %s (holders %v)", alt.ID(), h)
				}
				if h := p.PeerHolders(nil, kvindex.Key(in.Keys[63])); !slices.Contains(h, alt.ID()) {
					t.Errorf("the prefix's last block not overlaid on the copy's instance %s (holders %v)", alt.ID(), h)
				}
				return
			}
			t.Fatal("no copy's instance in the overlay")
		}
		w.st.EndEpoch()
		kvPick(t, s, req(i), w.insts)
	}
	t.Fatal("no purchase in 200 intents")
}
