package test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// An engine whose kvbridge reports it down is taken out of routing at once,
// not after the router's own health checks fail unhealthy_threshold times
// (here 100 probes, 50 s: far past the test's waits, so only the bridge's
// report can eject it), and the router's probes put it back when it
// answers again. Before, requests went on reaching the dead engine until
// the health checks ejected it (15 s with the defaults).
func TestEngineDownEjectsInstance(t *testing.T) {
	sc := newEngineScene(t, 2*time.Minute)
	ups := []*routertest.Upstream{routertest.New(t, "vllm-0", kvrModel), routertest.New(t, "vllm-1", kvrModel)}
	cfg := config.Config{
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: sc.ns.URL(), Stream: sc.stream.Name}, Bucket: sc.bucket.Name},
		Pools: []config.PoolConfig{{Name: sc.pool, Model: kvrModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health:    config.HealthConfig{Interval: 500 * time.Millisecond, UnhealthyThreshold: 100, HealthyThreshold: 1},
			Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: ups[0].URL()}, {ID: "vllm-1", URL: ups[1].URL()}}}},
	}
	kve, srv := newKVRouter(t, sc.ctx, cfg, kvstate.Options{Logger: quietLogger(), SnapshotTimeout: 300 * time.Millisecond}, prometheus.NewRegistry())
	testenv.Go(t, sc.ctx, srv.Run)
	r := serveKVR(t, kve, srv, sc.pool)
	startKVREngine(t, sc.ctx, sc.ns.URL(), sc.pool, "vllm-0", ups[0].URL(), sc.stream.Name, sc.bucket.Name)
	r.waitLive("vllm-0", 15*time.Second)

	healthy := func(id string) bool {
		p, _ := srv.Pool(sc.pool)
		in, _ := p.Instance(id)
		return in.Healthy()
	}
	ejections := func(reason string) string {
		for _, l := range strings.Split(r.metrics(), "\n") {
			if strings.HasPrefix(l, "kvrouter_instance_ejections_total{") && strings.Contains(l, `instance="vllm-0"`) && strings.Contains(l, `reason="`+reason+`"`) {
				return l[strings.LastIndexByte(l, ' ')+1:]
			}
		}
		return ""
	}
	if !healthy("vllm-0") || ejections("engine_down") != "" {
		t.Fatalf("before the engine went down: healthy %v, ejections %q", healthy("vllm-0"), ejections("engine_down"))
	}

	// The engine stops serving: /health answers 503 to the bridge's probes
	// and to the router's, and it publishes nothing.
	ups[0].SetHealthy(false)
	testenv.WaitFor(t, 30*time.Second, "vllm-0 ejected on its bridge's report", func() bool { return !healthy("vllm-0") })
	if got := ejections("engine_down"); got != "1" {
		t.Fatalf("ejections{reason=engine_down} = %q, want 1", got)
	}
	if got := ejections("health_checks"); got != "" {
		t.Fatalf("the health checks ejected it (%s), not the bridge's report", got)
	}
	for range 5 {
		if inst, _ := r.complete(kvrTokens(3, 64)); inst != "vllm-1" {
			t.Fatalf("a request went to %s while vllm-0's engine is down", inst)
		}
	}
	// A router started while the engine is down, whose consumer read the
	// report before its data plane existed (as cmd/kvrouter starts the
	// pipeline first): the data plane ejects it as it subscribes.
	kve2, err := kvstate.Start(sc.ctx, cfg, kvstate.Options{Logger: quietLogger(), SnapshotTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kve2.Close)
	testenv.WaitFor(t, 15*time.Second, "the second router's consumer to read the report", func() bool {
		st, _ := kve2.KVInstances(sc.pool)
		return len(st) == 1 && st[0].EngineDown
	})
	srv2, err := httpapi.NewServer(cfg, httpapi.Options{Logger: quietLogger(), KV: kvaware.NewSource(kve2.KV), KVEvents: kve2})
	if err != nil {
		t.Fatal(err)
	}
	if p, _ := srv2.Pool(sc.pool); p.Instances()[0].Healthy() {
		t.Fatal("a router started while vllm-0's engine is down routes to it")
	}

	// Back: the router's own probe re-admits it (healthy_threshold 1); the
	// bridge's report of it back up does not eject it again.
	ups[0].SetHealthy(true)
	testenv.WaitFor(t, 30*time.Second, "vllm-0 re-admitted by health checks", func() bool { return healthy("vllm-0") })
	r.waitLive("vllm-0", 15*time.Second)
	if !healthy("vllm-0") || ejections("engine_down") != "1" {
		t.Fatalf("after the engine came back: healthy %v, ejections %q", healthy("vllm-0"), ejections("engine_down"))
	}
}
