package router

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/tiers"
	"github.com/kvrouter/kvrouter/tiers/tiermetrics"
)

func kvevHashes(from, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(from + i)
	}
	return out
}

func kvevTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(3*i + 1)
	}
	return out
}

// TestAccountingApplier: the tier accounting follows what the index did,
// batch by batch, with clears and purges.
func TestAccountingApplier(t *testing.T) {
	ctx := context.Background()
	type held = [tiers.Count]int64
	tests := []struct {
		name    string
		batches [][]events.Event
		purge   bool
		want    held
	}{
		{"gpu store", [][]events.Event{{{Kind: events.BlockStored, BlockHashes: kvevHashes(1, 4), TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"}}},
			false, held{4, 0, 0, 0}},
		{"duplicate store counted once (index totals)", [][]events.Event{
			{{Kind: events.BlockStored, BlockHashes: kvevHashes(1, 4), TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"}},
			{{Kind: events.BlockStored, BlockHashes: kvevHashes(1, 4), TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"}},
		}, false, held{4, 0, 0, 0}},
		{"offload then evict from gpu, one batch of two tiers", [][]events.Event{
			{{Kind: events.BlockStored, BlockHashes: kvevHashes(1, 4), TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"}},
			{{Kind: events.BlockStored, BlockHashes: kvevHashes(3, 2), Medium: "CPU"}, {Kind: events.BlockRemoved, BlockHashes: kvevHashes(3, 2), Medium: "GPU"}},
		}, false, held{2, 2, 0, 0}},
		{"clear in the middle of a batch", [][]events.Event{
			{{Kind: events.BlockStored, BlockHashes: kvevHashes(1, 4), TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"},
				{Kind: events.AllBlocksCleared},
				{Kind: events.BlockStored, BlockHashes: kvevHashes(10, 1), TokenIDs: kvevTokens(16), BlockSize: 16, Medium: "GPU"}},
		}, false, held{1, 0, 0, 0}},
		{"purge forgets", [][]events.Event{{{Kind: events.BlockStored, BlockHashes: kvevHashes(1, 4), TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"}}},
			true, held{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m"})
			if err != nil {
				t.Fatal(err)
			}
			acct, err := tiermetrics.NewAccounting(nil)
			if err != nil {
				t.Fatal(err)
			}
			a := &accountingApplier{Index: idx, acct: acct}
			for _, b := range tc.batches {
				if _, err := a.Apply(ctx, "i", b); err != nil {
					t.Fatal(err)
				}
			}
			if tc.purge {
				if err := a.Purge(ctx, "i"); err != nil {
					t.Fatal(err)
				}
			}
			if got := acct.Held("i"); got != tc.want {
				t.Fatalf("held %v, want %v", got, tc.want)
			}
			// The index agrees with the accounting.
			st, _ := idx.Instances(ctx)
			var fromIndex held
			for _, s := range st {
				for tr := range tiers.Count {
					fromIndex[tr] = int64(s.Blocks[tr])
				}
			}
			if fromIndex != tc.want {
				t.Fatalf("index holds %v, accounting %v", fromIndex, tc.want)
			}
		})
	}
}

func TestKVEventsWantedAndConfig(t *testing.T) {
	no, yes := false, true
	pool := func(r config.RoutingConfig) config.PoolConfig {
		return config.PoolConfig{Name: "p", Model: "m", Routing: r, Instances: []config.InstanceConfig{{ID: "a", URL: "http://127.0.0.1:1"}}}
	}
	wanted := []struct {
		name string
		cfg  config.Config
		want bool
	}{
		{"heuristic only", config.Config{Pools: []config.PoolConfig{pool(config.RoutingConfig{})}}, false},
		{"kv_aware pool", config.Config{Pools: []config.PoolConfig{pool(config.RoutingConfig{Strategy: config.StrategyKVAware})}}, true},
		{"shadow pool", config.Config{Pools: []config.PoolConfig{pool(config.RoutingConfig{Shadow: true})}}, true},
		{"index section", config.Config{Index: &config.IndexConfig{}, Pools: []config.PoolConfig{pool(config.RoutingConfig{})}}, true},
		{"explicitly enabled", config.Config{Events: &config.EventsConfig{Enabled: &yes}, Index: &config.IndexConfig{}, Pools: []config.PoolConfig{pool(config.RoutingConfig{})}}, true},
		{"disabled", config.Config{Events: &config.EventsConfig{Enabled: &no}, Pools: []config.PoolConfig{pool(config.RoutingConfig{Strategy: config.StrategyKVAware})}}, false},
	}
	for _, tc := range wanted {
		if got := config.KVEventsWanted(tc.cfg); got != tc.want {
			t.Errorf("%s: KVEventsWanted %v, want %v", tc.name, got, tc.want)
		}
	}

	kvPool := pool(config.RoutingConfig{Strategy: config.StrategyKVAware})
	empty := config.PoolConfig{Name: "p", Model: "m", Routing: config.RoutingConfig{Strategy: config.StrategyKVAware}}
	invalid := []struct {
		name string
		cfg  config.Config
		want string // "" = valid
	}{
		{"defaults", config.Config{Events: &config.EventsConfig{}, Pools: []config.PoolConfig{kvPool}}, ""},
		{"url and embedded", config.Config{Events: &config.EventsConfig{NATS: config.NATSConfig{URL: "nats://x:4222", Embedded: true}}, Pools: []config.PoolConfig{kvPool}}, "exclude"},
		{"bad listen", config.Config{Events: &config.EventsConfig{NATS: config.NATSConfig{Listen: "4222"}}, Pools: []config.PoolConfig{kvPool}}, "events.nats.listen"},
		{"stream replicas over the limit", config.Config{Events: &config.EventsConfig{NATS: config.NATSConfig{URL: "nats://x:4222", StreamReplicas: 6}}, Pools: []config.PoolConfig{kvPool}}, "stream_replicas 6 out of range"},
		{"stream replicas on the embedded server", config.Config{Events: &config.EventsConfig{NATS: config.NATSConfig{StreamReplicas: 3}}, Pools: []config.PoolConfig{kvPool}}, "needs events.nats.url"},
		{"cert without key", config.Config{Events: &config.EventsConfig{NATS: config.NATSConfig{TLS: &config.TLSConfig{CertFile: "c"}}}, Pools: []config.PoolConfig{kvPool}}, "cert_file and key_file"},
		{"negative stale", config.Config{Events: &config.EventsConfig{StaleAfter: -1}, Pools: []config.PoolConfig{kvPool}}, ">= 0"},
		{"purge before stale", config.Config{Events: &config.EventsConfig{StaleAfter: 60e9, PurgeAfter: 30e9}, Pools: []config.PoolConfig{kvPool}}, "purge_after"},
		{"no instances, discovery on", config.Config{Pools: []config.PoolConfig{empty}}, ""},
		{"no instances, discovery off", config.Config{Events: &config.EventsConfig{DiscoverInstances: &no}, Pools: []config.PoolConfig{empty}}, "at least one instance"},
		{"no instances, events off", config.Config{Events: &config.EventsConfig{Enabled: &no}, Pools: []config.PoolConfig{{Name: "p", Model: "m"}}}, "at least one instance"},
	}
	for _, tc := range invalid {
		err := tc.cfg.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (err == nil || !errors.Is(err, config.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: error %v, want one naming %q", tc.name, err, tc.want)
		}
	}
}

// BenchmarkAccountingApply is the cost the accounting adds to every event
// batch the consumer applies (a typical batch: 4 stored GPU blocks, 4
// removed), beside the bare index.
func BenchmarkAccountingApply(b *testing.B) {
	ctx := context.Background()
	for _, withAcct := range []bool{false, true} {
		name := "index"
		if withAcct {
			name = "index+accounting"
		}
		b.Run(name, func(b *testing.B) {
			idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m"})
			if err != nil {
				b.Fatal(err)
			}
			acct, _ := tiermetrics.NewAccounting(nil)
			var ap interface {
				Apply(context.Context, string, []events.Event) (kvindex.ApplyResult, error)
			} = idx
			if withAcct {
				ap = &accountingApplier{Index: idx, acct: acct}
			}
			toks := kvevTokens(64)
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				base := i * 4
				evs := []events.Event{
					{Kind: events.BlockStored, BlockHashes: kvevHashes(base, 4), TokenIDs: toks, BlockSize: 16, Medium: "GPU"},
					{Kind: events.BlockRemoved, BlockHashes: kvevHashes(base, 4), Medium: "GPU"},
				}
				if _, err := ap.Apply(ctx, "i", evs); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestDefaultEmbeddedStoreDir: the default store is keyed by port and by the
// fleet's pools, so another fleet never loads this one's snapshots.
func TestDefaultEmbeddedStoreDir(t *testing.T) {
	a := []config.PoolConfig{{Name: "llama", Model: "m1"}, {Name: "qwen", Model: "m2"}}
	b := []config.PoolConfig{{Name: "qwen", Model: "m2"}, {Name: "llama", Model: "m1"}}
	c := []config.PoolConfig{{Name: "llama", Model: "m1"}}
	if DefaultEmbeddedStoreDir(4222, a) != DefaultEmbeddedStoreDir(4222, b) {
		t.Fatal("pool order changed the store")
	}
	if DefaultEmbeddedStoreDir(4222, a) == DefaultEmbeddedStoreDir(4222, c) {
		t.Fatal("another fleet shares the store")
	}
	if DefaultEmbeddedStoreDir(4222, a) == DefaultEmbeddedStoreDir(4223, a) {
		t.Fatal("another port shares the store")
	}
}
