package main

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/workload"
)

// boundRun builds wf's workload for ff's fleet, takes its pooled bound as
// des does, and runs one strategy against it.
func boundRun(t *testing.T, wf workloadFlags, ff fleetFlags, strategy string) report.Summary {
	t.Helper()
	scfg, gpuTokens, err := ff.simConfig()
	if err != nil {
		t.Fatal(err)
	}
	wf.fleetToks = gpuTokens * int64(ff.instances)
	b, err := wf.buildAll()
	if err != nil {
		t.Fatal(err)
	}
	_, hits, err := b.pooledBound(boundTokens(gpuTokens, scfg, ff.instances), ff.salt)
	if err != nil {
		t.Fatal(err)
	}
	s, err := runStrategy(context.Background(), strategy, &ff, scfg, &b, hits, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestBoundCountsCPUTier: with a CPU offload tier the engines' hits include
// CPU-tier promotions, so the pooled bound pools both tiers: no strategy
// goes above it.
func TestBoundCountsCPUTier(t *testing.T) {
	wf := workloadFlags{name: "mooncake", trace: workload.DefaultTracePath, speed: 1, replicate: 1, limit: 300}
	ff := fleetFlags{instances: 2, gpuTokens: "100k", cpuTokens: "2M", delay: 5 * time.Millisecond}
	s := boundRun(t, wf, ff, "prefix_aware")
	if s.HitRate == 0 || s.BoundFraction > 1 {
		t.Fatalf("hit rate %.3f is %.2f of the pooled bound %.3f: want a bound no strategy exceeds", s.HitRate, s.BoundFraction, s.Bound)
	}
}

// TestBoundKeepsCacheSalt: one instance is the pooled cache, so round-robin
// over it reaches the bound, salted prompts included (the engine folds the
// salt into its block hashes; the bound must too).
func TestBoundKeepsCacheSalt(t *testing.T) {
	wf := workloadFlags{name: "multi-tenant", seed: 1, replicate: 1, limit: 200}
	ff := fleetFlags{instances: 1, gpuTokens: "1.35M", cpuTokens: "0", salt: true, delay: 5 * time.Millisecond}
	s := boundRun(t, wf, ff, "round_robin")
	if s.BoundFraction < 0.99 {
		t.Fatalf("one instance reached %.3f of the pooled bound (hit %.3f, bound %.3f): want >= 0.99", s.BoundFraction, s.HitRate, s.Bound)
	}
}
