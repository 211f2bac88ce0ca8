package httpapi_test

import (
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// TestReloadFailedKeepsQueue: a reload that fails at a later pool (pool
// b's tokenizer path does not exist) leaves pool a's kept flow-control
// queue on the running configuration: its budget is still 2 healthy
// instances × concurrency_threshold 8, not the rejected file's threshold
// 1 over its 3 instances, and the instance health checks ejected stays
// ejected though the rejected file turns health checks off (which admits
// every instance). A reload that succeeds then moves the queue over.
func TestReloadFailedKeepsQueue(t *testing.T) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
	if err != nil {
		t.Fatal(err)
	}
	ups := []*routertest.Upstream{routertest.New(t, "a-0", "ma"), routertest.New(t, "a-1", "ma"), routertest.New(t, "a-2", "ma"), routertest.New(t, "b-0", kvModel)}
	inst := func(u *routertest.Upstream) config.InstanceConfig {
		return config.InstanceConfig{ID: u.ID, URL: u.URL()}
	}
	off := func(pc *config.PoolConfig) {
		pc.Health, pc.Discovery = config.HealthConfig{Disable: true}, config.DiscoveryConfig{Disable: true}
	}
	a := config.PoolConfig{Name: "a", Model: "ma", Routing: config.RoutingConfig{ConcurrencyThreshold: 8},
		FlowControl: &config.FlowControlConfig{Enabled: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{inst(ups[0]), inst(ups[1]), inst(ups[2])}}
	b := config.PoolConfig{Name: "b", Model: kvModel, Instances: []config.InstanceConfig{inst(ups[3])}}
	off(&b)
	cfg := config.Config{Pools: []config.PoolConfig{a, b}}
	srv, _ := servertest.Serve(t, cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(p config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
			if p.Name == "b" {
				return idx, nil
			}
			return nil, nil
		})})
	pa, _ := srv.Pool("a")
	pa.Instances()[2].SetHealthy(false) // as health checks would
	budget := func() int {
		gate, _ := pa.Queue()
		return gate.Stats().MaxConcurrency
	}
	if got := budget(); got != 16 {
		t.Fatalf("max_concurrency %d before the reload, want 2 × 8", got)
	}

	bad := cfg
	bad.Pools = []config.PoolConfig{a, b}
	bad.Pools[0].Routing.ConcurrencyThreshold = 1
	bad.Pools[0].Health.Disable = true // flow_control unchanged: the queue is kept
	bad.Pools[1].Tokenizer = &config.TokenizerConfig{Source: "files", Path: filepath.Join(t.TempDir(), "missing")}
	if err := srv.Reload(bad); err == nil {
		t.Fatal("a reload with a missing tokenizer succeeded")
	}
	if now, _ := srv.Pool("a"); now != pa {
		t.Fatal("the failed reload replaced pool a")
	}
	if got := budget(); got != 16 {
		t.Errorf("max_concurrency %d after a failed reload, want 16 as before", got)
	}
	if pa.Instances()[2].Healthy() {
		t.Error("a failed reload re-admitted an ejected instance")
	}

	good := bad
	good.Pools = []config.PoolConfig{bad.Pools[0], b}
	if err := srv.Reload(good); err != nil {
		t.Fatal(err)
	}
	na, _ := srv.Pool("a")
	if gate, _ := na.Queue(); gate.Stats().MaxConcurrency != 3 {
		t.Errorf("max_concurrency %d after the reload, want 3 instances × 1", gate.Stats().MaxConcurrency)
	}
}
