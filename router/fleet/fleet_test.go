package fleet_test

import (
	"encoding/json"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/fleet"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
)

// The router's pool table is what fleet applies configurations to.
var _ fleet.Pools = (*httpapi.Server)(nil)

// TestReconciler runs a real pipeline (its own NATS server, stream and
// bucket) and a real router: a heartbeat-announced instance joins its pool
// through Run; a SIGHUP-style Apply keeps it; a configuration the router
// refuses changes nothing, neither the pool table nor what the pipeline
// reports as discovered; and the instance leaves once discovery is off.
func TestReconciler(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	name := testenv.UniqueName(t)
	pool, model := "p_"+name, "m-"+name
	ns := testenv.StartNATS(t)
	cfg := config.Config{
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: "EV_" + name}, Bucket: "SN_" + name},
		Pools: []config.PoolConfig{{Name: pool, Model: model, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "file-0", URL: "http://127.0.0.1:1"}}}},
	}
	log := slog.New(slog.DiscardHandler)
	kve, err := kvstate.Start(ctx, cfg, kvstate.Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kve.Close)
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: log, KV: kvaware.NewSource(kve.KV), KVEvents: kve, Admin: admin.Routes(kve)})
	if err != nil {
		t.Fatal(err)
	}
	fl := fleet.New(srv, kve, cfg, 20*time.Millisecond, log)
	go func() { _ = fl.Run(ctx) }() // ends with ctx, at the test's cleanup

	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	subj, err := kvstream.InstancesSubject(pool, "disc-1")
	if err != nil {
		t.Fatal(err)
	}
	ids := func() []string {
		p, ok := srv.Pool(pool)
		if !ok {
			return nil
		}
		var out []string
		for _, in := range p.Instances() {
			out = append(out, in.ID())
		}
		return out
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: instances %v", what, ids())
			}
			// Heartbeats keep coming, as a bridge sends them.
			data, _ := json.Marshal(kvstream.Heartbeat{Pool: pool, Instance: "disc-1", URL: "http://127.0.0.2:8000", Model: model, Time: time.Now(), IntervalMS: 1000, Role: config.RolePrefill})
			if err := nc.Publish(subj, data); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor("heartbeat instance joins", func() bool { return slices.Contains(ids(), "disc-1") && kve.IsDiscovered(pool, "disc-1") })
	// Its heartbeat's role places it: a prefill instance, never a candidate
	// for a plain request.
	if p, _ := srv.Pool(pool); p != nil {
		for _, in := range p.Instances() {
			if in.ID() == "disc-1" && in.Role() != config.RolePrefill {
				t.Fatalf("discovered instance's role %q, want prefill", in.Role())
			}
		}
		if c, _ := p.Candidates(nil, "", nil); slices.ContainsFunc(c, func(in *router.Instance) bool { return in.ID() == "disc-1" }) {
			t.Fatal("a discovered prefill instance is a candidate for plain requests")
		}
	}

	// A reload from the file keeps the discovered instance and applies the
	// file's change.
	next := cfg
	next.Pools = slices.Clone(cfg.Pools)
	next.Pools[0].Routing.Strategy = config.StrategyPrefixAware
	if err := fl.Apply(next); err != nil {
		t.Fatal(err)
	}
	if p, _ := srv.Pool(pool); !slices.Contains(ids(), "disc-1") || !kve.IsDiscovered(pool, "disc-1") {
		t.Fatalf("after Apply: %v", ids())
	} else if rc, _ := p.Routing(); rc.Strategy != config.StrategyPrefixAware {
		t.Fatalf("after Apply: strategy %s", rc.Strategy)
	}

	// A configuration the router refuses leaves everything as it was.
	bad := next
	bad.Pools = slices.Clone(next.Pools)
	bad.Pools[0].Routing.ConcurrencyThreshold = -5
	if err := fl.Apply(bad); err == nil {
		t.Fatal("a bad configuration applied")
	}
	if p, _ := srv.Pool(pool); !slices.Contains(ids(), "disc-1") || !kve.IsDiscovered(pool, "disc-1") {
		t.Fatalf("after a refused Apply: %v", ids())
	} else if rc, _ := p.Routing(); rc.Strategy != config.StrategyPrefixAware {
		t.Fatalf("after a refused Apply: strategy %s", rc.Strategy)
	}

	// Discovery off in the file: the instance leaves at the next apply.
	off := false
	quiet := next
	ev := *next.Events
	ev.DiscoverInstances = &off
	quiet.Events = &ev
	if err := fl.Apply(quiet); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(ids(), "disc-1") || kve.IsDiscovered(pool, "disc-1") {
		t.Fatalf("discovery off, still there: %v", ids())
	}
	if !slices.Contains(ids(), "file-0") {
		t.Fatalf("the file's instance left: %v", ids())
	}
}
