package httpapi_test

import (
	"log/slog"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
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

// TestReloadForgetsInstanceAfterItsRequests: a request in flight on an
// instance a reload removes writes the instance's series when it ends;
// they are deleted once it has (not only at the reload), so that instance
// names that come and go leave no series behind.
func TestReloadForgetsInstanceAfterItsRequests(t *testing.T) {
	h := servertest.New(t, 2, nil)
	h.Run()
	var release []func()
	for _, u := range h.Ups {
		release = append(release, u.Hold())
	}
	defer func() {
		for _, r := range release {
			r()
		}
	}()
	done := make(chan servertest.Result, 1)
	go func() {
		done <- servertest.Do(t, h.TS.URL, "POST", "/v1/chat/completions", servertest.ChatBody(servertest.Model, "in flight across the reload", false), nil)
	}()
	p, _ := h.Srv.Pool("llama")
	var gone *router.Instance
	servertest.WaitFor(t, "the request in flight", func() bool {
		for _, in := range p.Instances() {
			if in.InFlight() > 0 {
				gone = in
				return true
			}
		}
		return false
	})
	var stays config.InstanceConfig
	for _, ic := range h.Srv.Pools()[0].Config().Instances {
		if ic.ID != gone.ID() {
			stays = ic
		}
	}
	cfg := config.Config{Pools: []config.PoolConfig{h.Srv.Pools()[0].Config()}}
	cfg.Pools[0].Instances = []config.InstanceConfig{stays}
	if err := h.Srv.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if gone.Healthy() {
		t.Error("the removed instance is still healthy: a request resolved before the reload could pick it")
	}
	for _, r := range release {
		r()
	}
	if r := <-done; r.Status != http.StatusOK || r.Header.Get(router.HeaderInstance) != gone.ID() {
		t.Fatalf("request: %d from %q, want 200 from %s", r.Status, r.Header.Get(router.HeaderInstance), gone.ID())
	}
	series := func() float64 {
		return servertest.Metric(t, h.Srv.Registry(), "kvrouter_requests_total", map[string]string{"instance": gone.ID()})
	}
	servertest.WaitWithin(t, 10*time.Second, "the removed instance's series deleted after its request", func() bool { return series() == 0 })
	// A request to the instance that stays is counted as ever.
	if r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody(servertest.Model, "after", false), nil); r.Status != http.StatusOK {
		t.Fatalf("after the reload: %d", r.Status)
	}
	if n := servertest.Metric(t, h.Srv.Registry(), "kvrouter_requests_total", map[string]string{"instance": stays.ID}); n < 1 {
		t.Fatalf("requests_total for %s = %v", stays.ID, n)
	}
}
