package kvaware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/tiers"
)

const (
	kvTestModel = "llama-kv"
	kvTestBS    = 16
)

// testClock is a settable clock for speculative TTLs and load ages.
type testClock struct {
	mu sync.Mutex // guards t
	t  time.Time
}

func newTestClock() *testClock { return &testClock{t: time.Unix(1_800_000_000, 0)} }

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// testFreshness is a settable Freshness.
type testFreshness struct {
	down   atomic.Bool
	mu     sync.Mutex // guards stale and epochs
	stale  map[string]bool
	epochs map[string]uint64
}

func (f *testFreshness) LostEpoch(id string) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.epochs[id]
}

// lose bumps id's cache epoch, as the consumer does when the instance is
// cleared, restarted or reported down.
func (f *testFreshness) lose(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.epochs == nil {
		f.epochs = map[string]uint64{}
	}
	f.epochs[id]++
}

func (f *testFreshness) StreamHealthy() bool { return !f.down.Load() }

func (f *testFreshness) Stale(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stale[id]
}

func (f *testFreshness) setStale(id string, v bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stale == nil {
		f.stale = map[string]bool{}
	}
	f.stale[id] = v
}

// kvWorld is a pool of instances over a real memory index fed with
// engine-like events: each instance reports its own engine hashes (as vLLM
// does, unrelated to router keys), GPU stores carry tokens and parents,
// offloads are tokenless stores of another medium.
type kvWorld struct {
	t     testing.TB
	idx   *kvindex.Memory
	st    *KVState
	clock *testClock
	fresh *testFreshness
	insts []*router.Instance
}

func newKVWorld(t testing.TB, n int) *kvWorld {
	t.Helper()
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
	if err != nil {
		t.Fatal(err)
	}
	w := &kvWorld{t: t, idx: idx, clock: newTestClock(), fresh: &testFreshness{}}
	w.st, err = NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: idx, Freshness: w.fresh, Now: w.clock.Now, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		w.add(fmt.Sprintf("vllm-%d", i))
	}
	return w
}

func (w *kvWorld) add(id string) *router.Instance {
	in, err := router.NewInstance(id, "http://127.0.0.1:9")
	if err != nil {
		w.t.Fatal(err)
	}
	w.insts = append(w.insts, in)
	return in
}

func (w *kvWorld) strategy(rc config.RoutingConfig) *KVAware {
	w.t.Helper()
	s, err := newKVAware(rc, w.st, func(n uint64) uint64 { return 0 })
	if err != nil {
		w.t.Fatal(err)
	}
	w.st.keepOverlay(s) // in use at once, as NewKVAware's
	return s
}

// engineHash is an instance's engine hash for a block: arbitrary to the
// router, different per instance (PYTHONHASHSEED differs per process).
func engineHash(inst string, k kvindex.Key) uint64 {
	return uint64(k)*0x9e3779b97f4a7c15 ^ xxhash.Sum64String(inst)
}

func (w *kvWorld) apply(inst string, evs ...events.Event) {
	w.t.Helper()
	res, err := w.idx.Apply(context.Background(), inst, evs)
	if err != nil || res.Invalid+res.Orphans+res.Unmapped > 0 {
		w.t.Fatalf("apply %s: %+v %v", inst, res, err)
	}
}

// store makes inst store blocks [from, to) of tokens on GPU, as vLLM's
// BlockStored does after a prefill.
func (w *kvWorld) store(inst string, tokens []uint32, from, to int) {
	keys := kvindex.Keys(kvindex.Root(kvTestModel, "", ""), tokens, kvTestBS)
	ev := events.Event{Kind: events.BlockStored, BlockSize: kvTestBS, Medium: "GPU", TokenIDs: slices.Clone(tokens[from*kvTestBS : to*kvTestBS])}
	for _, k := range keys[from:to] {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(inst, k))
	}
	if from > 0 {
		ev.ParentHash, ev.HasParent = engineHash(inst, keys[from-1]), true
	}
	w.apply(inst, ev)
}

// tierEvent makes inst store (or remove) blocks [from, to) in medium.
func (w *kvWorld) tierEvent(kind events.Kind, inst, medium string, tokens []uint32, from, to int) {
	keys := kvindex.Keys(kvindex.Root(kvTestModel, "", ""), tokens, kvTestBS)
	ev := events.Event{Kind: kind, Medium: medium}
	for _, k := range keys[from:to] {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(inst, k))
	}
	w.apply(inst, ev)
}

func (w *kvWorld) byID(id string) *router.Instance {
	for _, in := range w.insts {
		if in.ID() == id {
			return in
		}
	}
	w.t.Fatalf("no instance %s", id)
	return nil
}

// promptTokens is a deterministic prompt of n tokens for a seed.
func promptTokens(seed uint32, n int) []uint32 { return routertest.Prompt(seed, n) }

func kvRequest(text string, tokens []uint32) *router.Request {
	return &router.Request{Endpoint: router.EndpointCompletions, Pool: "p", Model: kvTestModel, RoutingText: text, PromptTokens: tokens}
}

func kvPick(t testing.TB, s router.Strategy, req *router.Request, cands []*router.Instance) router.Decision {
	t.Helper()
	d, err := s.Pick(context.Background(), req, cands)
	if err != nil {
		t.Fatal(err)
	}
	if d.Observer != nil {
		d.Observer.Done(200, -1) // release pending prefill: each test decides alone
	}
	return d
}

func matchedSum(d router.Decision) int {
	if d.Explain == nil {
		return 0
	}
	n := 0
	for _, v := range d.Explain.MatchedTokens {
		n += v
	}
	return n
}

// TestExactBeatsHeuristic covers the three situations where knowing the
// cache state beats guessing it from a hash.
func TestExactBeatsHeuristic(t *testing.T) {
	const blocks = 64 // a 1,024-token shared prefix
	tests := []struct {
		name string
		// setup places the prefix; it gets the prefix's rendezvous order
		// over the world's instances and returns the instance that holds
		// the prefix and the one prefix_aware will pick.
		setup      func(w *kvWorld, tokens []uint32, order []*router.Instance) (holder, heuristic *router.Instance)
		wantTier   tiers.Tier
		extraInsts int
	}{
		{
			name: "evicted from hash-home, held by overflow instance",
			setup: func(w *kvWorld, tokens []uint32, order []*router.Instance) (*router.Instance, *router.Instance) {
				home, overflow := order[0], order[1]
				// The hash-home computed the prefix, then a hot burst overflowed
				// to the next instance in rendezvous order, which computed it
				// too; later the home evicted it under memory pressure.
				w.store(home.ID(), tokens, 0, blocks)
				w.store(overflow.ID(), tokens, 0, blocks)
				w.tierEvent(events.BlockRemoved, home.ID(), "GPU", tokens, 0, blocks)
				return overflow, home
			},
			wantTier: tiers.GPU,
		},
		{
			name: "held only in CPU tier on one instance",
			setup: func(w *kvWorld, tokens []uint32, order []*router.Instance) (*router.Instance, *router.Instance) {
				holder := order[2]
				// Computed on GPU, offloaded to CPU, then dropped from GPU.
				w.store(holder.ID(), tokens, 0, blocks)
				w.tierEvent(events.BlockStored, holder.ID(), "CPU", tokens, 0, blocks)
				w.tierEvent(events.BlockRemoved, holder.ID(), "GPU", tokens, 0, blocks)
				return holder, order[0]
			},
			wantTier: tiers.CPU,
		},
		{
			name: "scale-out moves the hash-home to a cold instance",
			setup: func(w *kvWorld, tokens []uint32, order []*router.Instance) (*router.Instance, *router.Instance) {
				oldHome := order[0]
				w.store(oldHome.ID(), tokens, 0, blocks)
				// Scale out until a new instance wins the prefix's rendezvous.
				req := kvRequest("scale-out prefix", tokens)
				for i := 0; ; i++ {
					w.add(fmt.Sprintf("vllm-new-%d", i))
					if router.RendezvousOrder(req, w.insts)[0] != oldHome {
						break
					}
				}
				return oldHome, router.RendezvousOrder(req, w.insts)[0]
			},
			wantTier: tiers.GPU,
		},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newKVWorld(t, 4)
			tokens := promptTokens(uint32(100+i), blocks*kvTestBS+5)
			text := "scale-out prefix"
			if i != 2 {
				text = fmt.Sprintf("prefix %d", i)
			}
			req := kvRequest(text, tokens)
			holder, heur := tc.setup(w, tokens, router.RendezvousOrder(req, w.insts))
			if holder == heur {
				t.Fatal("test setup: the heuristic would already pick the holder")
			}
			kv := w.strategy(config.RoutingConfig{})
			prefix := &router.PrefixAware{Threshold: config.DefaultConcurrencyThresh}

			hd := kvPick(t, prefix, kvRequest(text, tokens), w.insts)
			kd := kvPick(t, kv, kvRequest(text, tokens), w.insts)
			if hd.Instance != heur {
				t.Fatalf("prefix_aware picked %s, want %s", hd.Instance.ID(), heur.ID())
			}
			if kd.Instance != holder || kd.Reason != router.ReasonKVMatch {
				t.Fatalf("kv_aware picked %s (%s), want %s (kv_match)", kd.Instance.ID(), kd.Reason, holder.ID())
			}
			if got := kd.Explain.MatchedTokens[tc.wantTier]; got != blocks*kvTestBS {
				t.Errorf("matched %v, want %d tokens in %s", kd.Explain.MatchedTokens, blocks*kvTestBS, tc.wantTier)
			}
			if kd.Explain.PromptTokens != len(tokens) {
				t.Errorf("prompt tokens %d, want %d", kd.Explain.PromptTokens, len(tokens))
			}
			// The heuristic's pick holds nothing: exact routing predicts a
			// faster first token, by the whole prefix's prefill.
			coldTTFT := time.Duration(float64(len(tokens)) / tiers.DefaultPrefillTokensPerSec * 1e9)
			if kd.Explain.PredictedTTFT >= coldTTFT/2 {
				t.Errorf("predicted TTFT %v, want well under the cold %v", kd.Explain.PredictedTTFT, coldTTFT)
			}
		})
	}
}

func TestKVAwareScoring(t *testing.T) {
	tokens := promptTokens(7, 64*kvTestBS)
	const text = "scoring prefix"
	type world = func(w *kvWorld, order []*router.Instance)
	tests := []struct {
		name       string
		rc         config.RoutingConfig
		setup      world
		want       func(order []*router.Instance) *router.Instance
		wantReason router.Reason
	}{
		{
			name: "nothing held: heuristic picks the hash-home",
			setup: func(w *kvWorld, order []*router.Instance) {
				other := promptTokens(8, 64*kvTestBS)
				w.store(order[1].ID(), other, 0, 64) // an unrelated prefix
			},
			want:       func(o []*router.Instance) *router.Instance { return o[0] },
			wantReason: router.ReasonHeuristic,
		},
		{
			name: "longer GPU match wins",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[0].ID(), tokens, 0, 16)
				w.store(o[2].ID(), tokens, 0, 48)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[2] },
			wantReason: router.ReasonKVMatch,
		},
		{
			name: "full CPU match beats half GPU match",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[0].ID(), tokens, 0, 32)
				w.store(o[3].ID(), tokens, 0, 64)
				w.tierEvent(events.BlockStored, o[3].ID(), "CPU", tokens, 0, 64)
				w.tierEvent(events.BlockRemoved, o[3].ID(), "GPU", tokens, 0, 64)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[3] },
			wantReason: router.ReasonKVMatch,
		},
		{
			name: "equal matches tie: rendezvous order decides",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[3].ID(), tokens, 0, 64)
				w.store(o[1].ID(), tokens, 0, 64)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[1] },
			wantReason: router.ReasonKVMatch,
		},
		{
			name: "holder at threshold: overflow to next best",
			rc:   config.RoutingConfig{ConcurrencyThreshold: 2},
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[1].ID(), tokens, 0, 64)
				w.store(o[2].ID(), tokens, 0, 40)
				o[1].Acquire()
				o[1].Acquire()
			},
			want:       func(o []*router.Instance) *router.Instance { return o[2] },
			wantReason: router.ReasonOverflow,
		},
		{
			name: "all full: best score anyway",
			rc:   config.RoutingConfig{ConcurrencyThreshold: 1},
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[2].ID(), tokens, 0, 64)
				for _, in := range o {
					in.Acquire()
				}
			},
			want:       func(o []*router.Instance) *router.Instance { return o[2] },
			wantReason: router.ReasonSaturated,
		},
		{
			name: "stale holder's blocks do not count",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[1].ID(), tokens, 0, 64)
				w.store(o[2].ID(), tokens, 0, 20)
				w.fresh.setStale(o[1].ID(), true)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[2] },
			wantReason: router.ReasonStaleFallback,
		},
		{
			name: "only holder stale: heuristic, reason stale_fallback",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[1].ID(), tokens, 0, 64)
				w.fresh.setStale(o[1].ID(), true)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[0] },
			wantReason: router.ReasonStaleFallback,
		},
		{
			name: "stale instance that would not have won: plain kv_match",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[1].ID(), tokens, 0, 10)
				w.store(o[2].ID(), tokens, 0, 64)
				w.fresh.setStale(o[1].ID(), true)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[2] },
			wantReason: router.ReasonKVMatch,
		},
		{
			name: "stream down: prefix_aware for the pool",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[2].ID(), tokens, 0, 64)
				w.fresh.down.Store(true)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[0] },
			wantReason: router.ReasonStreamDown,
		},
		{
			name: "engine queue outweighs a partial hit",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[1].ID(), tokens, 0, 64)
				w.store(o[2].ID(), tokens, 0, 32)
				w.st.SetLoad(o[1].ID(), 40, 10) // 40 waiting ≈ 1.6 s of prefill
				w.st.SetLoad(o[2].ID(), 0, 10)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[2] },
			wantReason: router.ReasonKVMatch,
		},
		{
			name: "stale load samples are ignored",
			setup: func(w *kvWorld, o []*router.Instance) {
				w.store(o[1].ID(), tokens, 0, 64)
				w.store(o[2].ID(), tokens, 0, 32)
				w.st.SetLoad(o[1].ID(), 40, 10)
				w.clock.Advance(time.Minute)
			},
			want:       func(o []*router.Instance) *router.Instance { return o[1] },
			wantReason: router.ReasonKVMatch,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newKVWorld(t, 5)
			order := router.RendezvousOrder(kvRequest(text, tokens), w.insts)
			tc.setup(w, order)
			d := kvPick(t, w.strategy(tc.rc), kvRequest(text, tokens), w.insts)
			if want := tc.want(order); d.Instance != want || d.Reason != tc.wantReason {
				t.Fatalf("picked %s (%s), want %s (%s)", d.Instance.ID(), d.Reason, want.ID(), tc.wantReason)
			}
			if d.Strategy != config.StrategyKVAware {
				t.Errorf("strategy %q", d.Strategy)
			}
		})
	}
}

func TestKVAwareStreamTransitions(t *testing.T) {
	w := newKVWorld(t, 3)
	tokens := promptTokens(3, 32*kvTestBS)
	order := router.RendezvousOrder(kvRequest("x", tokens), w.insts)
	w.store(order[2].ID(), tokens, 0, 32)
	s := w.strategy(config.RoutingConfig{})
	steps := []struct {
		down       bool
		wantReason router.Reason
	}{{false, router.ReasonKVMatch}, {true, router.ReasonStreamDown}, {true, router.ReasonStreamDown}, {false, router.ReasonKVMatch}}
	for i, step := range steps {
		w.fresh.down.Store(step.down)
		if d := kvPick(t, s, kvRequest("x", tokens), w.insts); d.Reason != step.wantReason {
			t.Fatalf("step %d: reason %s, want %s", i, d.Reason, step.wantReason)
		}
	}
	if got := counterValue(t, w.st.m.streamTransitions.WithLabelValues("p", "down")); got != 1 {
		t.Errorf("down transitions %v, want 1", got)
	}
	if got := counterValue(t, w.st.m.streamTransitions.WithLabelValues("p", "up")); got != 1 {
		t.Errorf("up transitions %v, want 1 (the recovery; the first healthy decision is not a transition)", got)
	}
	if got := gaugeValue(t, w.st.m.streamUp.WithLabelValues("p")); got != 1 {
		t.Errorf("stream gauge %v, want 1", got)
	}
}

// TestSpeculativeBurst: requests sharing a new 1,024-token system prompt
// but differing after it (so their routing texts, hence hash-homes,
// differ) land together with speculative entries, and scatter without.
func TestSpeculativeBurst(t *testing.T) {
	system := promptTokens(11, 64*kvTestBS)
	burst := func(w *kvWorld, s router.Strategy) map[string]int {
		got := map[string]int{}
		for i := range 8 {
			q := promptTokens(uint32(200+i), 40)
			req := kvRequest(fmt.Sprintf("system prompt + question %d", i), append(slices.Clone(system), q...))
			d, err := s.Pick(context.Background(), req, w.insts)
			if err != nil {
				t.Fatal(err)
			}
			got[d.Instance.ID()]++ // observers stay open: the burst is in flight
		}
		return got
	}
	t.Run("with speculative entries", func(t *testing.T) {
		w := newKVWorld(t, 8)
		got := burst(w, w.strategy(config.RoutingConfig{}))
		if len(got) != 1 {
			t.Fatalf("burst spread over %v, want one instance", got)
		}
		// Expired entries are forgotten: a later request is heuristic again.
		w.clock.Advance(DefaultSpeculativeTTL + time.Millisecond)
		req := kvRequest("late", append(slices.Clone(system), 1, 2, 3))
		if d := kvPick(t, w.strategy(config.RoutingConfig{}), req, w.insts); d.Reason != router.ReasonHeuristic {
			t.Errorf("after TTL: reason %s, want heuristic", d.Reason)
		}
	})
	// An instance that lost its cache (restarted, cleared, reported down)
	// does not hold what was routed to it before: its entries are void at
	// once, not at their TTL; and a stale instance is not followed on
	// guesses either.
	t.Run("void once the cache is lost", func(t *testing.T) {
		w := newKVWorld(t, 8)
		s := w.strategy(config.RoutingConfig{})
		got := burst(w, s)
		var home string
		for id := range got {
			home = id
		}
		req := func(name string) *router.Request { return kvRequest(name, append(slices.Clone(system), 7, 8, 9)) }
		if d := kvPick(t, s, req("before"), w.insts); d.Instance.ID() != home || d.Reason != router.ReasonKVMatch {
			t.Fatalf("before the loss: %s %s, want %s kv_match", d.Instance.ID(), d.Reason, home)
		}
		w.fresh.lose(home)
		d := kvPick(t, s, req("after"), w.insts)
		if d.Reason == router.ReasonKVMatch && d.Instance.ID() == home {
			t.Fatalf("after %s lost its cache: still kv_match on it from entries made before", home)
		}
		if m := matchedSum(d); d.Instance.ID() == home && m != 0 {
			t.Fatalf("after the loss: %d tokens predicted on %s", m, home)
		}
		// A stale instance (no heartbeat, engine reported down) is not
		// followed on its entries either.
		w2 := newKVWorld(t, 8)
		s2 := w2.strategy(config.RoutingConfig{})
		first := kvPick(t, s2, req("x"), w2.insts)
		w2.fresh.setStale(first.Instance.ID(), true)
		if d := kvPick(t, s2, req("y"), w2.insts); d.Instance.ID() == first.Instance.ID() && d.Reason == router.ReasonKVMatch {
			t.Fatalf("a stale instance was followed on speculative entries: %s %s", d.Instance.ID(), d.Reason)
		}
	})
	t.Run("without", func(t *testing.T) {
		w := newKVWorld(t, 8)
		got := burst(w, w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{SpeculativeTTL: -1}}))
		if len(got) < 3 {
			t.Fatalf("burst landed on %v: want it scattered by the hash", got)
		}
	})
}

// TestPendingPrefill: the router counts routed prefill work until the
// first response byte, and a long queue moves requests elsewhere.
func TestPendingPrefill(t *testing.T) {
	w := newKVWorld(t, 2)
	tokens := promptTokens(5, 64*kvTestBS)
	s := w.strategy(config.RoutingConfig{})
	d, err := s.Pick(context.Background(), kvRequest("a", tokens), w.insts)
	if err != nil {
		t.Fatal(err)
	}
	if tok, n := w.st.PendingPrefill(d.Instance.ID()); tok != int64(len(tokens)) || n != 1 {
		t.Fatalf("pending %d tokens / %d requests, want %d / 1", tok, n, len(tokens))
	}
	d.Observer.FirstByte()
	if tok, n := w.st.PendingPrefill(d.Instance.ID()); tok != 0 || n != 0 {
		t.Fatalf("after first byte: pending %d / %d, want 0 / 0", tok, n)
	}
	d.Observer.Done(200, -1)
	d.Observer.Done(200, -1) // idempotent
	if tok, _ := w.st.PendingPrefill(d.Instance.ID()); tok != 0 {
		t.Fatalf("after finish: pending %d", tok)
	}
}

func TestKVAwareNoTokensAndErrors(t *testing.T) {
	w := newKVWorld(t, 3)
	s := w.strategy(config.RoutingConfig{})
	req := &router.Request{Endpoint: router.EndpointChatCompletions, RoutingText: "hello"}
	d := kvPick(t, s, req, w.insts)
	if d.Reason != router.ReasonHeuristic || d.Explain != nil {
		t.Fatalf("no tokens: %s explain %v", d.Reason, d.Explain)
	}
	if want := router.RendezvousOrder(req, w.insts)[0]; d.Instance != want {
		t.Fatalf("no tokens: picked %s, want hash-home %s", d.Instance.ID(), want.ID())
	}
	req = &router.Request{Endpoint: router.EndpointChatCompletions, RoutingText: "hello", Tokenizer: failingSource{}}
	if d := kvPick(t, s, req, w.insts); d.Reason != router.ReasonHeuristic {
		t.Fatalf("tokenizer error: reason %s", d.Reason)
	}
	if got := counterValue(t, w.st.m.tokenErrs.WithLabelValues("p")); got != 1 {
		t.Errorf("token errors %v, want 1", got)
	}
	if _, err := s.Pick(context.Background(), req, nil); !errors.Is(err, router.ErrNoCandidates) {
		t.Errorf("no candidates: %v", err)
	}
	if _, err := router.NewStrategy(config.StrategyKVAware, config.RoutingConfig{}); !errors.Is(err, router.ErrNoKVState) {
		t.Errorf("kv_aware without state: %v", err)
	}
	if _, err := router.NewStrategy(config.StrategyPrefixAware, config.RoutingConfig{Shadow: true}); !errors.Is(err, router.ErrNoKVState) {
		t.Errorf("shadow without state: %v", err)
	}
	// A prompt shorter than a block: nothing can be cached.
	if d := kvPick(t, s, kvRequest("short", []uint32{1, 2, 3}), w.insts); d.Reason != router.ReasonHeuristic {
		t.Errorf("short prompt: %s", d.Reason)
	}
}

type failingSource struct{}

func (failingSource) Tokens(context.Context, *router.Request) ([]uint32, error) {
	return nil, errors.New("tokenizer exploded")
}

// TestKVAwareAdapterAndSalt: adapters and cache salts get their own chains.
func TestKVAwareAdapterAndSalt(t *testing.T) {
	w := newKVWorld(t, 4)
	tokens := promptTokens(9, 32*kvTestBS)
	order := router.RendezvousOrder(kvRequest("x", tokens), w.insts)
	w.store(order[3].ID(), tokens, 0, 32) // base model, no salt
	s := w.strategy(config.RoutingConfig{})
	if d := kvPick(t, s, kvRequest("x", tokens), w.insts); d.Instance != order[3] {
		t.Fatalf("base: picked %s", d.Instance.ID())
	}
	req := kvRequest("x", tokens)
	req.Adapter = "sql-lora"
	if d := kvPick(t, s, req, w.insts); d.Reason != router.ReasonHeuristic {
		t.Errorf("adapter request matched the base model's blocks: %s", d.Reason)
	}
	req = kvRequest("x", tokens)
	req.Body = []byte(`{"prompt":[1,2],"cache_salt":"tenant-a"}`)
	if d := kvPick(t, s, req, w.insts); d.Reason != router.ReasonHeuristic {
		t.Errorf("salted request matched unsalted blocks: %s", d.Reason)
	}
}

func TestExplanationHeader(t *testing.T) {
	e := &router.Explanation{MatchedTokens: [tiers.Count]int{128, 32, 0, 0}}
	if got, want := e.MatchedTokensHeader(), "gpu=128,cpu=32,disk=0,shared=0"; got != want {
		t.Fatalf("header %q, want %q", got, want)
	}
}

func TestTierTokensAndTTFT(t *testing.T) {
	sc := resolveScoring(&config.KVScoringConfig{PrefillTokensPerSecond: 1000, CPULoadTokensPerSecond: 10000, DiskLoadTokensPerSecond: 5000, SharedLoadTokensPerSecond: 2000})
	tests := []struct {
		blocks      [tiers.Count]int
		prompt      int
		wantMatched [tiers.Count]int
		wantTTFT    float64
	}{
		{[tiers.Count]int{0, 0, 0, 0}, 1000, [tiers.Count]int{}, 1.0},
		{[tiers.Count]int{10, 10, 10, 10}, 1000, [tiers.Count]int{160, 0, 0, 0}, 0.84},
		{[tiers.Count]int{10, 20, 30, 40}, 1000, [tiers.Count]int{160, 160, 160, 160}, 0.36 + 0.016 + 0.032 + 0.08},
		// At most (T − 1)/B whole blocks are reused (reusable): 62 of
		// 16 tokens, 992, and the last 8 tokens are prefilled.
		{[tiers.Count]int{100, 100, 100, 100}, 1000, [tiers.Count]int{992, 0, 0, 0}, 0.008},
		{[tiers.Count]int{0, 100, 100, 100}, 1000, [tiers.Count]int{0, 992, 0, 0}, 0.008 + 0.0992},
		// A prompt of whole blocks recomputes its last one.
		{[tiers.Count]int{64, 64, 64, 64}, 1024, [tiers.Count]int{1008, 0, 0, 0}, 0.016},
	}
	for i, tc := range tests {
		m := tierTokens(tc.blocks, 16, tc.prompt)
		if m != tc.wantMatched {
			t.Errorf("%d: matched %v, want %v", i, m, tc.wantMatched)
		}
		if got := sc.ttft(0, tc.prompt, m); got < tc.wantTTFT-1e-9 || got > tc.wantTTFT+1e-9 {
			t.Errorf("%d: ttft %v, want %v", i, got, tc.wantTTFT)
		}
	}
	// Queue: the router's pending work, or the engine's waiting count
	// when it says more, plus running requests.
	q, _ := sc.queue(2000, 2, 2, loadSample{}, false)
	if q != 2.0 {
		t.Errorf("local queue %v, want 2", q)
	}
	q, _ = sc.queue(2000, 2, 2, loadSample{waiting: 4, running: 3}, true)
	if want := (2000+2*1024)/1000.0 + 3*DefaultRunningRequestSeconds; q != want {
		t.Errorf("blended queue %v, want %v", q, want)
	}
	// An engine that only decodes still makes a new request wait for the
	// step in progress: half of a step of S plus the running sequences'
	// share, beside that share of the request's own step; an idle engine
	// none; prefill work ahead longer than that step covers it.
	// The load (what the bounded-load rule compares) leaves the residual
	// out: the work queued, prefill ahead and the running share.
	S, R := DefaultDecodeStepSeconds, DefaultRunningRequestSeconds
	if q, l := sc.queue(0, 0, 4, loadSample{}, false); math.Abs(q-((S+4*R)/2+4*R)) > 1e-12 || math.Abs(l-4*R) > 1e-12 {
		t.Errorf("decoding engine's queue, load %v, %v, want %v, %v", q, l, (S+4*R)/2+4*R, 4*R)
	}
	if q, l := sc.queue(0, 0, 0, loadSample{}, false); q != 0 || l != 0 {
		t.Errorf("idle engine's queue, load %v, %v, want 0", q, l)
	}
	if q, l := sc.queue(1, 1, 4, loadSample{}, false); math.Abs(q-((S+3*R)/2+3*R)) > 1e-12 || math.Abs(l-(0.001+3*R)) > 1e-12 {
		t.Errorf("short prefill ahead: queue, load %v, %v, want the step's residual %v, the work %v", q, l, (S+3*R)/2+3*R, 0.001+3*R)
	}
	// An engine decoding nothing with a request routed there and not yet
	// answered is running that request's step, however few tokens it has
	// to prefill (a prompt all cached takes a whole step): a new request
	// waits for the step's end, S/2 on average, as on a decoding engine.
	if q, l := sc.queue(1, 1, 1, loadSample{}, false); math.Abs(q-S/2) > 1e-12 || math.Abs(l-0.001) > 1e-12 {
		t.Errorf("a cache-served request ahead on an idle engine: queue, load %v, %v, want the step's residual %v, the work %v", q, l, S/2, 0.001)
	}
}

func TestKVScoringConfigValidate(t *testing.T) {
	tests := []struct {
		k  config.KVScoringConfig
		ok bool
	}{
		{config.KVScoringConfig{}, true},
		{config.KVScoringConfig{SpeculativeTTL: -1, ScrapeInterval: -1}, true},
		{config.KVScoringConfig{DiskLoadTokensPerSecond: -1}, false},
		{config.KVScoringConfig{WaitingRequestTokens: -5}, false},
		{config.KVScoringConfig{TieTolerance: -time.Second}, false},
		{config.KVScoringConfig{ScrapeInterval: time.Millisecond}, false},
		{config.KVScoringConfig{ScrapePath: "metrics"}, false},
		{config.KVScoringConfig{SpeculativeCapacity: -1}, false},
		{config.KVScoringConfig{RunningRequestSeconds: 100}, false},
		{config.KVScoringConfig{DecodeStepSeconds: 100}, false},
		{config.KVScoringConfig{DecodeStepSeconds: -1}, true}, // no step time
		{config.KVScoringConfig{DecodeStepSeconds: math.NaN()}, false},
		{config.KVScoringConfig{DecodeStepSeconds: 0.02}, true},
		{config.KVScoringConfig{MaxNumBatchedTokens: 2048}, true},
		{config.KVScoringConfig{MaxNumBatchedTokens: -1}, true}, // no step-sharing term
		{config.KVScoringConfig{MaxNumBatchedTokens: 1<<24 + 1}, false},
	}
	for i, tc := range tests {
		k := tc.k
		err := config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &k}.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("%d: %+v: err %v", i, tc.k, err)
		}
		if err != nil && !errors.Is(err, config.ErrInvalidConfig) {
			t.Errorf("%d: err %v does not wrap ErrInvalidConfig", i, err)
		}
	}
}

func TestSpeculativeOverlayBound(t *testing.T) {
	clock := newTestClock()
	s := newSpeculative(time.Second, 100, clock.Now)
	var sc specScan
	keys := kvindex.Keys(kvindex.Root("m", "", ""), promptTokens(1, 16*150), 16)
	s.add(keys, "a", 0)
	if s.Len() != 100 {
		t.Fatalf("len %d, want the bound 100", s.Len())
	}
	if got := s.extend(&sc, keys, 0, "a", 0); got != 100 {
		t.Fatalf("extend %d, want the first 100 blocks kept", got)
	}
	if got := s.extend(&sc, keys, 0, "a", 1); got != 0 {
		t.Fatalf("holds of an earlier cache epoch count: extend %d", got)
	}
	other := kvindex.Keys(kvindex.Root("m", "", ""), promptTokens(2, 16*60), 16)
	s.add(other, "b", 0) // evicts a's 60 oldest
	if got := s.extend(&sc, keys, 0, "a", 0); got != 0 {
		t.Fatalf("a's leading blocks should be evicted, extend %d", got)
	}
	if got := s.extend(&sc, other, 0, "b", 0); got != 60 {
		t.Fatalf("b extend %d, want 60", got)
	}
	clock.Advance(2 * time.Second)
	if got := s.extend(&sc, other, 0, "b", 0); got != 0 {
		t.Fatalf("expired entries still held: %d", got)
	}
	s.add(other[:1], "c", 0)
	if s.Len() != 1 {
		t.Fatalf("expired entries not swept: len %d", s.Len())
	}
}

func counterValue(t testing.TB, c prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func gaugeValue(t testing.TB, c prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// TestSpeculativeConfirmedThenEvicted: once events confirm a speculative
// guess, the index owns those blocks, so their eviction is seen at once
// rather than after the TTL.
func TestSpeculativeConfirmedThenEvicted(t *testing.T) {
	w := newKVWorld(t, 4)
	tokens := promptTokens(21, 32*kvTestBS)
	s := w.strategy(config.RoutingConfig{})
	first := kvPick(t, s, kvRequest("a", tokens), w.insts)
	if first.Reason != router.ReasonHeuristic {
		t.Fatalf("first: %s", first.Reason)
	}
	w.store(first.Instance.ID(), tokens, 0, 32) // the engine's events arrive
	if d := kvPick(t, s, kvRequest("b", tokens), w.insts); d.Instance != first.Instance || d.Reason != router.ReasonKVMatch {
		t.Fatalf("confirmed: picked %s (%s)", d.Instance.ID(), d.Reason)
	}
	w.tierEvent(events.BlockRemoved, first.Instance.ID(), "GPU", tokens, 0, 32)
	var other *router.Instance
	for _, in := range w.insts {
		if in != first.Instance {
			other = in
			break
		}
	}
	w.store(other.ID(), tokens, 0, 16)
	if d := kvPick(t, s, kvRequest("c", tokens), w.insts); d.Instance != other {
		t.Fatalf("after eviction: picked %s (%s), want the remaining holder %s", d.Instance.ID(), d.Reason, other.ID())
	}
}

// TestKVAwareHugePrompt: a prompt beyond maxKeyedTokens is keyed by its head.
func TestKVAwareHugePrompt(t *testing.T) {
	w := newKVWorld(t, 3)
	tokens := promptTokens(31, maxKeyedTokens+1000)
	order := router.RendezvousOrder(kvRequest("huge", tokens), w.insts)
	w.store(order[2].ID(), tokens[:4*kvTestBS], 0, 4)
	d := kvPick(t, w.strategy(config.RoutingConfig{}), kvRequest("huge", tokens), w.insts)
	if d.Instance != order[2] || d.Reason != router.ReasonKVMatch || d.Explain.PromptTokens != maxKeyedTokens {
		t.Fatalf("picked %s (%s), explain %+v", d.Instance.ID(), d.Reason, d.Explain)
	}
}

// TestReplicasAgree: two router replicas over one shared index (as with
// the Redis backend), each with its own instances and state, pick the same
// instance for every prompt, ties included.
func TestReplicasAgree(t *testing.T) {
	w := newKVWorld(t, 6)
	st2, err := NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: w.idx, Now: w.clock.Now, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var insts2 []*router.Instance
	for _, in := range w.insts {
		c, _ := router.NewInstance(in.ID(), "http://127.0.0.1:9")
		insts2 = append(insts2, c)
	}
	r1 := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{SpeculativeTTL: -1}})
	r2, err := NewKVAware(config.RoutingConfig{KV: &config.KVScoringConfig{SpeculativeTTL: -1}}, st2)
	if err != nil {
		t.Fatal(err)
	}
	kvMatches := 0
	for p := range 40 {
		tokens := promptTokens(uint32(500+p), 32*kvTestBS)
		// Two or three instances hold the same blocks: a tie.
		for k := range 2 + p%2 {
			w.store(w.insts[(p+k*2)%len(w.insts)].ID(), tokens, 0, 32)
		}
		text := fmt.Sprintf("prompt %d", p)
		d1 := kvPick(t, r1, kvRequest(text, tokens), w.insts)
		d2 := kvPick(t, r2, kvRequest(text, tokens), insts2)
		if d1.Instance.ID() != d2.Instance.ID() || d1.Reason != d2.Reason {
			t.Fatalf("prompt %d: replica 1 picked %s (%s), replica 2 %s (%s)", p, d1.Instance.ID(), d1.Reason, d2.Instance.ID(), d2.Reason)
		}
		if d1.Reason == router.ReasonKVMatch {
			kvMatches++
		}
	}
	if kvMatches != 40 {
		t.Errorf("%d of 40 decisions were kv_match", kvMatches)
	}
}

// slowSource is an engine /tokenize that does not answer in time.
type slowSource struct{}

func (slowSource) Tokens(ctx context.Context, _ *router.Request) ([]uint32, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestKVAwareTokenizeTimeout: a token source slower than tokenize_timeout
// costs the request its exact routing, not its latency.
func TestKVAwareTokenizeTimeout(t *testing.T) {
	w := newKVWorld(t, 3)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{TokenizeTimeout: 20 * time.Millisecond}})
	start := time.Now()
	d := kvPick(t, s, &router.Request{Endpoint: router.EndpointChatCompletions, RoutingText: "x", Tokenizer: slowSource{}}, w.insts)
	if el := time.Since(start); el > 2*time.Second || d.Reason != router.ReasonHeuristic {
		t.Fatalf("took %v, reason %s", el, d.Reason)
	}
	if got := counterValue(t, w.st.m.tokenErrs.WithLabelValues("p")); got != 1 {
		t.Errorf("token errors %v, want 1", got)
	}
}

// TestShadowHeuristicInUse: prefix_aware routes, kv_aware is scored dry
// beside it: no speculative entries, the heuristic's decision carries what
// the index predicted for it, and the comparison records both.
func TestShadowHeuristicInUse(t *testing.T) {
	w := newKVWorld(t, 4)
	tokens := promptTokens(41, 32*kvTestBS)
	order := router.RendezvousOrder(kvRequest("s", tokens), w.insts)
	w.store(order[3].ID(), tokens, 0, 32)
	s, err := router.NewStrategy(config.StrategyPrefixAware, config.RoutingConfig{Shadow: true}, router.WithKVState(w.st))
	if err != nil {
		t.Fatal(err)
	}
	if s.Name() != config.StrategyPrefixAware {
		t.Fatalf("name %q", s.Name())
	}
	d, err := s.Pick(context.Background(), kvRequest("s", tokens), w.insts)
	if err != nil {
		t.Fatal(err)
	}
	if d.Instance != order[0] || d.Strategy != config.StrategyPrefixAware || d.Reason != router.ReasonHash {
		t.Fatalf("in use: %s %s %s", d.Instance.ID(), d.Strategy, d.Reason)
	}
	if d.Explain == nil || matchedSum(d) != 0 || d.Observer == nil {
		t.Fatalf("explain %+v observer %v", d.Explain, d.Observer)
	}
	if tok, _ := w.st.PendingPrefill(order[0].ID()); tok != int64(len(tokens)) {
		t.Errorf("pending on the heuristic's pick: %d", tok)
	}
	d.Observer.FirstByte()
	d.Observer.Done(200, 1024) // usageJSON's cached_tokens
	if n := s.(*Shadow).kv.spec.Len(); n != 0 {
		t.Errorf("dry scoring left %d speculative entries", n)
	}
	sum := w.st.Compare(config.StrategyPrefixAware, true, w.insts, 0)
	if sum.Compared != 1 || sum.Agreed != 0 {
		t.Fatalf("compare %+v", sum)
	}
	// Every block but the last, which vLLM recomputes (reusable).
	if p, want := sum.Predicted[config.StrategyKVAware], int64(len(tokens)-kvTestBS); p.MatchedTokens != want {
		t.Errorf("kv_aware's pick predicted %d matched tokens, want %d", p.MatchedTokens, want)
	}
	if r := sum.Reported; r.WithUsage != 1 || r.CachedTokens != 1024 || r.MeanCachedWhenDiffer != 1024 {
		t.Errorf("reported %+v", r)
	}
	if len(sum.Recent) != 1 || sum.Recent[0].Other.Instance != order[3].ID() {
		t.Errorf("recent %+v", sum.Recent)
	}
}

// TestDryPickLeavesOverlay: shadow scoring (commit=false) must not hand
// speculative entries over to the index; the committed pick does.
func TestDryPickLeavesOverlay(t *testing.T) {
	w := newKVWorld(t, 4)
	tokens := promptTokens(43, 32*kvTestBS)
	keys := kvindex.Keys(kvindex.Root(kvTestModel, "", ""), tokens, kvTestBS)
	s := w.strategy(config.RoutingConfig{})
	first := kvPick(t, s, kvRequest("d", tokens), w.insts) // speculates all 32 blocks
	id := first.Instance.ID()
	w.store(id, tokens, 0, 16) // events confirm half
	held := func() bool { var sc specScan; return s.spec.heldBy(&sc, keys, 0, id) }
	if !held() {
		t.Fatal("the first pick left no speculative entry")
	}
	for range 3 {
		d, ev, err := s.pick(context.Background(), kvRequest("d", tokens), w.insts, false)
		if err != nil {
			t.Fatal(err)
		}
		s.st.putEval(ev)
		if d.Instance != first.Instance || d.Observer != nil {
			t.Fatalf("dry pick: %s observer %v", d.Instance.ID(), d.Observer)
		}
		if !held() {
			t.Fatal("a dry pick confirmed speculative entries")
		}
	}
	kvPick(t, s, kvRequest("d", tokens), w.insts)
	if held() {
		t.Error("the committed pick did not confirm the blocks the index now holds")
	}
}

func TestStrategiesNoCandidates(t *testing.T) {
	for _, name := range config.StrategyNames() {
		s := mustNewStrategy(t, name, config.RoutingConfig{}, router.WithKVState(newKVWorld(t, 1).st))
		if s.Name() != name {
			t.Errorf("Name() = %q, want %q", s.Name(), name)
		}
		if _, err := s.Pick(context.Background(), &router.Request{}, nil); !errors.Is(err, router.ErrNoCandidates) {
			t.Errorf("%s with no candidates: err %v, want router.ErrNoCandidates", name, err)
		}
	}
	if _, err := router.NewStrategy("kv_magic", config.RoutingConfig{}); !errors.Is(err, router.ErrUnknownStrategy) {
		t.Errorf("unknown strategy: err %v", err)
	}
	if _, err := router.NewStrategy(config.StrategyPrefixAware, config.RoutingConfig{PrefixLength: 10}); !errors.Is(err, config.ErrInvalidConfig) {
		t.Errorf("bad prefix length: err %v", err)
	}
}

func mustNewStrategy(t *testing.T, name string, rc config.RoutingConfig, opts ...router.StrategyOption) router.Strategy {
	t.Helper()
	s, err := router.NewStrategy(name, rc, opts...)
	if err != nil {
		t.Fatalf("NewStrategy(%q): %v", name, err)
	}
	return s
}

// TestShadowTellsHeld: with shadow scoring on, a pool routed by kv_aware
// still tells how much of a prompt its candidates hold without picking
// (Held, HeldBy: conditional disaggregation's short-prompt test, flow
// control's cached holds), as kv_aware alone does; a pool routed by a
// heuristic tells nothing, shadow on or off.
func TestShadowTellsHeld(t *testing.T) {
	type holder interface {
		Held(ctx context.Context, req *router.Request, cands []*router.Instance) (held, prompt int, ok bool)
		HeldBy(ctx context.Context, req *router.Request, cands []*router.Instance, dst []int) (per []int, prompt int, ok bool)
	}
	w := newKVWorld(t, 4)
	tokens := promptTokens(43, 8*kvTestBS)
	w.store(w.insts[2].ID(), tokens, 0, 4)
	for _, name := range []string{config.StrategyKVAware, config.StrategyPrefixAware} {
		s, err := router.NewStrategy(name, config.RoutingConfig{Shadow: true}, router.WithKVState(w.st))
		if err != nil {
			t.Fatal(err)
		}
		h, isHolder := s.(holder)
		if name != config.StrategyKVAware {
			if isHolder {
				if _, _, ok := h.Held(context.Background(), kvRequest("s", tokens), w.insts); ok {
					t.Fatalf("%s in use, shadow on: Held answered", name)
				}
			}
			continue
		}
		if !isHolder {
			t.Fatalf("kv_aware in use, shadow on: %T cannot tell what the candidates hold", s)
		}
		held, prompt, ok := h.Held(context.Background(), kvRequest("s", tokens), w.insts)
		per, prompt2, ok2 := h.HeldBy(context.Background(), kvRequest("s", tokens), w.insts, nil)
		if !ok || !ok2 || held != 4*kvTestBS || prompt != len(tokens) || prompt2 != len(tokens) || len(per) != 4 || per[2] != 4*kvTestBS {
			t.Fatalf("Held %d/%d %v, HeldBy %v/%d %v", held, prompt, ok, per, prompt2, ok2)
		}
	}
}
