package router

import (
	"context"
	"errors"
	"fmt"
	"testing"

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
		{Name: "a", Model: "model-a", Routing: config.RoutingConfig{KV: &config.KVScoringConfig{BlockSize: kvTestBS}}},
		{Name: "b", Model: "model-b", Routing: config.RoutingConfig{KV: &config.KVScoringConfig{BlockSize: kvTestBS}}},
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
			tokens := promptTokens(3, 4*kvTestBS)
			for _, p := range pools {
				root := kvindex.Root(p.Model, "", "")
				keys := kvindex.Keys(root, tokens, kvTestBS)
				ev := events.Event{Kind: events.BlockStored, BlockSize: kvTestBS, Medium: "GPU", TokenIDs: tokens, BlockHashes: []uint64{1, 2, 3, 4}}
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
				if bs := pi.ByPool[p.Name].BlockSize(); bs != kvTestBS {
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
