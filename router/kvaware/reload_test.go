package kvaware

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
)

// A reload builds every pool's strategy before its table is published
// (router.NewTable, over the server's Source.For): one that fails on a
// later pool must leave kv_aware's kept speculative overlay — its ttl,
// capacity and entries — as it was, for the strategy in use and for the
// next routing switch, which reuses it. Before, building the reload's
// kv_aware with another ttl replaced the kept overlay: the failed reload
// changed nothing in use, but the next switch, finding the reload's ttl
// kept, started an empty overlay and forgot the bursts in flight. A
// reload that succeeds keeps its new overlay once committed.
func TestFailedReloadKeepsOverlay(t *testing.T) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
	if err != nil {
		t.Fatal(err)
	}
	src := NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })
	kvFor := func(pc config.PoolConfig, prev *router.Pool) (router.Exact, error) { // as httpapi's
		if prev == nil {
			return src.For(pc, nil, config.PoolConfig{})
		}
		return src.For(pc, prev.Exact(), prev.Config())
	}
	routing := func(ttl time.Duration, capacity int) config.RoutingConfig {
		return config.RoutingConfig{Strategy: config.StrategyKVAware,
			KV: &config.KVScoringConfig{SpeculativeTTL: ttl, SpeculativeCapacity: capacity}}
	}
	p := config.PoolConfig{Name: "p", Model: kvTestModel, Routing: routing(time.Minute, 4096),
		Instances: []config.InstanceConfig{{ID: "vllm-0", URL: "http://vllm-0"}, {ID: "vllm-1", URL: "http://vllm-1"}}}
	t1, commit, err := router.NewTable(config.Config{Pools: []config.PoolConfig{p}}, nil, kvFor)
	if err != nil {
		t.Fatal(err)
	}
	commit()
	pool, _ := t1.Pool("p")
	st := Of(pool)
	_, strat := pool.Routing()
	if _, err := strat.Pick(context.Background(), kvRequest("q", promptTokens(1, 8*kvTestBS)), pool.Instances()); err != nil {
		t.Fatal(err)
	}
	kept := st.spec
	n := kept.Len()
	if n == 0 {
		t.Fatal("the pick left no speculative entries")
	}
	unchanged := func(when string) {
		t.Helper()
		if sp := st.spec; sp != kept || sp.ttl != time.Minute || sp.set.Cap() != 4096 || sp.Len() != n {
			t.Fatalf("%s: the kept overlay is %p (ttl %v, capacity %d, %d entries), want %p (1m, 4096, %d)",
				when, sp, sp.ttl, sp.set.Cap(), sp.Len(), kept, n)
		}
	}

	// A reload that changes p's overlay and adds a pool whose tokenizer
	// cannot be loaded.
	next := p
	next.Routing = routing(2*time.Minute, 8192)
	q := config.PoolConfig{Name: "q", Model: "other", Tokenizer: &config.TokenizerConfig{Source: TokenSourceFiles, Path: t.TempDir()},
		Instances: []config.InstanceConfig{{ID: "q-0", URL: "http://q-0"}}}
	if _, c, err := router.NewTable(config.Config{Pools: []config.PoolConfig{next, q}}, t1, kvFor); !errors.Is(err, router.ErrTokenSource) || c != nil {
		t.Fatalf("the reload: err %v, commit %v", err, c != nil)
	}
	unchanged("after a failed reload")

	// A runtime switch that keeps the overlay's ttl and capacity keeps its
	// entries.
	if err := pool.SetRouting(routing(time.Minute, 4096)); err != nil {
		t.Fatal(err)
	}
	unchanged("after a routing switch")
	if _, s := pool.Routing(); s.(*KVAware).spec != kept {
		t.Fatal("the switched-to kv_aware does not write the kept overlay")
	}

	t2, commit, err := router.NewTable(config.Config{Pools: []config.PoolConfig{next}}, t1, kvFor)
	if err != nil {
		t.Fatal(err)
	}
	unchanged("built, not committed")
	commit()
	p2, _ := t2.Pool("p")
	_, s2 := p2.Routing()
	if sp := st.spec; sp != s2.(*KVAware).spec || sp.ttl != 2*time.Minute || sp.set.Cap() != 8192 {
		t.Fatalf("committed: the kept overlay is %p (ttl %v, capacity %d), want the reload's", sp, sp.ttl, sp.set.Cap())
	}
}
