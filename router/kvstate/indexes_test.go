package kvstate

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// TestNewPoolIndexes builds both backends from configuration (Redis for
// real) and checks that each pool's index is its own and keys like the
// strategy does.
func TestNewPoolIndexes(t *testing.T) {
	pools := []config.PoolConfig{
		{Name: "a", Model: "model-a", Routing: config.RoutingConfig{KV: &config.KVScoringConfig{BlockSize: testBS}}},
		{Name: "b", Model: "model-b", Routing: config.RoutingConfig{KV: &config.KVScoringConfig{BlockSize: testBS}}},
	}
	tests := []struct {
		name string
		idx  func(t *testing.T) *config.IndexConfig
	}{
		{"memory", func(*testing.T) *config.IndexConfig { return &config.IndexConfig{Backend: "memory", Capacity: 1000} }},
		{"redis", func(t *testing.T) *config.IndexConfig {
			return &config.IndexConfig{Backend: "redis", Redis: &config.RedisConfig{Addrs: []string{testenv.Redis(t)}, KeyPrefix: testenv.UniqueName(t)}}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pi, err := NewPoolIndexes(config.Config{Index: tc.idx(t), Pools: pools})
			if err != nil {
				t.Fatal(err)
			}
			defer pi.Close()
			ctx := context.Background()
			tokens := seqTokens(4 * testBS)
			for _, p := range pools {
				root := kvindex.Root(p.Model, "", "")
				keys := kvindex.Keys(root, tokens, testBS)
				ev := events.Event{Kind: events.BlockStored, BlockSize: testBS, Medium: "GPU", TokenIDs: tokens, BlockHashes: []uint64{1, 2, 3, 4}}
				if _, err := pi.ByPool[p.Name].Apply(ctx, "inst-"+p.Name, []events.Event{ev}); err != nil {
					t.Fatal(err)
				}
				ms, err := pi.ByPool[p.Name].Lookup(ctx, keys)
				if err != nil {
					t.Fatal(err)
				}
				if len(ms) != 1 || ms[0].Instance != "inst-"+p.Name || ms[0].Blocks[0] != 4 {
					t.Fatalf("pool %s: lookup %+v, want only its own instance with 4 blocks", p.Name, ms)
				}
				if bs := pi.ByPool[p.Name].BlockSize(); bs != testBS {
					t.Errorf("pool %s: block size %d", p.Name, bs)
				}
			}
		})
	}
	if pi, err := NewPoolIndexes(config.Config{Pools: pools}); err != nil || len(pi.ByPool) != 0 {
		t.Errorf("no index section: %v %v", pi, err)
	}
	for i, ic := range []*config.IndexConfig{{Backend: "redis"}, {Backend: "etcd"}, {Backend: "memory", Capacity: -1}} {
		if _, err := NewPoolIndexes(config.Config{Index: ic, Pools: pools}); err == nil {
			t.Errorf("%d: %+v accepted", i, ic)
		} else if i < 2 && !errors.Is(err, config.ErrInvalidConfig) {
			t.Errorf("%d: %v", i, fmt.Sprint(err))
		}
	}
}

// testBS is the block size of the indexes built here.
const testBS = 16

// seqTokens is a prompt of n distinct token ids.
func seqTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(1000 + i)
	}
	return out
}

// TestRedisClusterSlotMapReload: a Redis Cluster index (cluster: true, or
// several seeds, which always mean a cluster) reloads its slot map every
// ClusterStateReload, not go-redis's 60 s; one address without cluster is
// a plain client. Nothing is dialled to build them.
func TestRedisClusterSlotMapReload(t *testing.T) {
	for _, c := range []struct {
		name    string
		rc      config.RedisConfig
		cluster bool
	}{
		{"cluster flag", config.RedisConfig{Addrs: []string{"127.0.0.1:1"}, Cluster: true}, true},
		{"several seeds", config.RedisConfig{Addrs: []string{"127.0.0.1:1", "127.0.0.1:2"}}, true},
		{"one node", config.RedisConfig{Addrs: []string{"127.0.0.1:1"}}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			rc := c.rc
			idx, err := NewPoolIndexes(config.Config{Index: &config.IndexConfig{Backend: "redis", Redis: &rc},
				Pools: []config.PoolConfig{{Name: "p", Model: "m"}}})
			if err != nil {
				t.Fatal(err)
			}
			defer idx.Close()
			cc, ok := idx.rdb.(*redis.ClusterClient)
			if ok != c.cluster {
				t.Fatalf("cluster client %v, want %v (%T)", ok, c.cluster, idx.rdb)
			}
			if ok && cc.Options().ClusterStateReloadInterval != ClusterStateReload {
				t.Errorf("slot map reloaded every %v, want %v", cc.Options().ClusterStateReloadInterval, ClusterStateReload)
			}
		})
	}
}

// TestRedisLookupBoundedWhenHung: a request's lookup in the shared index
// must not wait on a hung Redis (stopped: connections held, nothing
// answered). The consumer flags the index within seconds and kv_aware then
// skips the lookup, but a lookup already sent waited for go-redis's read
// timeout times its retries (35 s for this pipeline, context deadlines ignored):
// on the binaries every request in flight when Redis was stopped for 8 s
// took 8 s. The lookup now gives up after DefaultRedisLookupTimeout (kvindex)
// and the request routes on the heuristic.
func TestRedisLookupBoundedWhenHung(t *testing.T) {
	srv := testenv.StartRedis(t)
	lookupBoundedWhenHung(t, config.RedisConfig{Addrs: []string{srv.Addr}}, srv.Pause, srv.Resume)
}

// The same on a Redis Cluster, every node stopped (none fails over): the
// cluster client honours the lookup's deadline alike (its per-node
// pipelines read under the same context).
func TestRedisClusterLookupBoundedWhenHung(t *testing.T) {
	c := testenv.StartRedisCluster(t)
	each := func(f func(*testenv.RedisServer)) func() {
		return func() {
			for _, n := range c.Nodes {
				f(n)
			}
		}
	}
	lookupBoundedWhenHung(t, config.RedisConfig{Addrs: c.Addrs(), Cluster: true},
		each((*testenv.RedisServer).Pause), each((*testenv.RedisServer).Resume))
}

// lookupBoundedWhenHung: a lookup through the router's index on rc,
// answered, then cut at its bound while pause holds Redis stopped, then
// answered again once resume lets it run.
func lookupBoundedWhenHung(t *testing.T, rc config.RedisConfig, pause, resume func()) {
	pools := []config.PoolConfig{{Name: "a", Model: "model-a", Routing: config.RoutingConfig{KV: &config.KVScoringConfig{BlockSize: testBS}}}}
	rc.KeyPrefix = testenv.UniqueName(t)
	pi, err := NewPoolIndexes(config.Config{Index: &config.IndexConfig{Backend: "redis", Redis: &rc}, Pools: pools})
	if err != nil {
		t.Fatal(err)
	}
	defer pi.Close()
	ctx := context.Background()
	tokens := seqTokens(4 * testBS)
	keys := kvindex.Keys(kvindex.Root("model-a", "", ""), tokens, testBS)
	ev := events.Event{Kind: events.BlockStored, BlockSize: testBS, Medium: "GPU", TokenIDs: tokens, BlockHashes: []uint64{1, 2, 3, 4}}
	idx := pi.ByPool["a"]
	if _, err := idx.Apply(ctx, "i0", []events.Event{ev}); err != nil {
		t.Fatal(err)
	}
	if ms, err := idx.Lookup(ctx, keys); err != nil || len(ms) != 1 {
		t.Fatalf("lookup before the pause: %+v, %v", ms, err)
	}
	pause()
	resumed := false
	defer func() {
		if !resumed {
			resume()
		}
	}()
	start := time.Now()
	ms, err := idx.Lookup(ctx, keys)
	took := time.Since(start)
	resume()
	resumed = true
	if err == nil {
		t.Fatalf("lookup on a stopped Redis answered %+v", ms)
	}
	// The bound is 250 ms; 2 s leaves room for a loaded machine and is
	// less than one read of go-redis alone waits (3 s; 35 s with its
	// retries, the deadline then cutting only between them).
	if took > 2*time.Second {
		t.Fatalf("lookup on a stopped Redis took %v (err %v): want it cut at the lookup timeout", took, err)
	}
	if r := kvindex.LookupFailure(err); r != "timeout" {
		t.Fatalf("lookup on a stopped Redis failed as %q (%v), want timeout", r, err)
	}
	t.Logf("lookup on a stopped Redis cut after %v: %v", took, err)
	// Redis answering again: the next lookup finds the instance.
	deadline := time.Now().Add(10 * time.Second)
	for {
		ms, err = idx.Lookup(ctx, keys)
		if err == nil && len(ms) == 1 && ms[0].Blocks[0] == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("lookup after the resume: %+v, %v", ms, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
