package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// TestLiveAgreesWithDES runs the same small long-context workload through
// a real router in front of real (simulated) vLLM servers over HTTP, and
// through the discrete-event driver, and checks they agree in direction:
// prefix_aware beats random on hit rate and median TTFT in both.
func TestLiveAgreesWithDES(t *testing.T) {
	ctx := context.Background()
	w, err := workload.LongContext{Groups: 12, RequestsPerGroup: 5, PrefixTokens: 2000, QuestionTokens: 50, OutputTokens: 8,
		Arrivals: workload.Arrivals{Rate: 6}}.Generate(3)
	if err != nil {
		t.Fatal(err)
	}
	fl, err := startLocalFleet(ctx, fleetSpec{Instances: 3, GPUTokens: 1_350_000, TimeScale: 4, Strategy: "random"})
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	var out, errb bytes.Buffer
	c := newLiveClient(liveConfig{RouterURL: fl.routerURL, TimeScale: 4, Reset: true})
	bound, boundHits, err := workload.RequestsBoundPerRequest(w.Requests, sim.DefaultBlockSize, 3*1_350_000, false)
	if err != nil {
		t.Fatal(err)
	}
	live, err := liveCompare(ctx, c, w, []string{"random", "prefix_aware"}, boundHits, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	// No routing beats one cache of the whole fleet: the hit rates are
	// fractions of the bound, at most 1 (kvbench live sends completions,
	// so the engine caches the very token ids the bound counts).
	if b := bound.TokenRatio(); b < 0.5 {
		t.Errorf("bound %.3f: 12 groups of 5 requests sharing a 2,000-token prefix should hit most", b)
	}
	for _, s := range live {
		if s.BoundFraction <= 0 || s.BoundFraction > 1.02 {
			t.Errorf("live %s: hit %.3f is %.3f of the bound %.3f", s.Strategy, s.HitRate, s.BoundFraction, s.Bound)
		}
	}
	for _, s := range live {
		if s.Failed != 0 || s.Requests != len(w.Requests) {
			t.Fatalf("live %s: %d of %d failed", s.Strategy, s.Failed, s.Requests)
		}
		if s.Instances != 3 || s.ShareMax == 0 {
			t.Errorf("live %s: instances %d, share max %v", s.Strategy, s.Instances, s.ShareMax)
		}
	}
	if live[1].HitRate <= live[0].HitRate+0.2 {
		t.Errorf("live: prefix_aware hit %.3f vs random %.3f", live[1].HitRate, live[0].HitRate)
	}
	// Same direction in the discrete-event mode, on the same workload.
	var dsum [2]float64
	for i, name := range []string{"random", "prefix_aware"} {
		rt, err := newStrategyRouter(name, routingDefaults(), 1, demoModel)
		if err != nil {
			t.Fatal(err)
		}
		res, err := runDESOnce(ctx, 3, 1_350_000, rt, w)
		if err != nil {
			t.Fatal(err)
		}
		dsum[i] = res.HitRate
	}
	if dsum[1] <= dsum[0]+0.2 {
		t.Errorf("des: prefix_aware hit %.3f vs random %.3f", dsum[1], dsum[0])
	}
	t.Logf("hit rate random/prefix_aware: live %.3f/%.3f, des %.3f/%.3f", live[0].HitRate, live[1].HitRate, dsum[0], dsum[1])
}

// TestLiveKVAwarePipeline drives the demo's whole pipeline — kvsim ZMQ
// events, kvbridges, embedded NATS, the router's consumer and memory index
// — with kv_aware, and checks that it routes on what the engines reported.
func TestLiveKVAwarePipeline(t *testing.T) {
	ctx := context.Background()
	w, err := workload.LongContext{Groups: 8, RequestsPerGroup: 5, PrefixTokens: 2000, QuestionTokens: 50, OutputTokens: 8,
		Arrivals: workload.Arrivals{Rate: 4}}.Generate(5)
	if err != nil {
		t.Fatal(err)
	}
	fl, err := startLocalFleet(ctx, fleetSpec{Instances: 3, GPUTokens: 1_350_000, TimeScale: 2, Strategy: "prefix_aware", Events: true})
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	var out, errb bytes.Buffer
	c := newLiveClient(liveConfig{RouterURL: fl.routerURL, TimeScale: 2, Reset: true})
	sums, err := liveCompare(ctx, c, w, []string{"kv_aware"}, nil, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	s := sums[0]
	if s.Failed != 0 || s.Strategy != "kv_aware" {
		t.Fatalf("%d of %d failed (%s)", s.Failed, s.Requests, s.Strategy)
	}
	if s.Reasons["kv_match"] == 0 || s.HitRate < 0.5 {
		t.Errorf("kv_aware: hit %.3f, reasons %v", s.HitRate, s.Reasons)
	}
	if n, _ := fl.index.Len(ctx); n == 0 {
		t.Error("the router's index holds no blocks")
	}
}
