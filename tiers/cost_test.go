package tiers

import (
	"errors"
	"math"
	"testing"
)

func near(a, b, rel float64) bool { return math.Abs(a-b) <= rel*math.Abs(b) }

func TestCostModelDefaults(t *testing.T) {
	var m CostModel // zero value = defaults
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		tier      Tier
		tokPerSec float64 // load throughput
		ratio     float64 // relative to recompute
	}{
		// 8 GPUs · 50e9 B/s / 327,680 B/token.
		{CPU, 1_220_703, 0.02048},
		// 16.8 × prefill (llm-d file-system offload measurement).
		{Disk, 420_000, 1 / 16.8},
		// 8 · 12.5e9 / 327,680.
		{Shared, 305_176, 0.08192},
	}
	for _, tc := range tests {
		if got := m.LoadTokensPerSec(tc.tier); !near(got, tc.tokPerSec, 1e-3) {
			t.Errorf("%v: load %v tokens/s, want %v", tc.tier, got, tc.tokPerSec)
		}
		if got := m.CostRatio(tc.tier); !near(got, tc.ratio, 1e-3) {
			t.Errorf("%v: ratio %v, want %v", tc.tier, got, tc.ratio)
		}
	}
	if !math.IsInf(m.LoadTokensPerSec(GPU), 1) || m.CostRatio(GPU) != 0 || m.LoadSeconds(GPU, 1000) != 0 {
		t.Error("a GPU hit must be free")
	}
	// docs/reference/workload-facts.md: a 10k-token prefix restores from CPU in ~8 ms, against
	// ~0.4 s to recompute.
	if got := m.LoadSeconds(CPU, 10_000); !near(got, 0.0082, 0.01) {
		t.Errorf("10k tokens from CPU: %v s", got)
	}
	if got := m.RecomputeSeconds(10_000); got != 0.4 {
		t.Errorf("10k tokens recompute: %v s", got)
	}
	// Tiers are ordered: each costs more than the one before.
	for i := 1; i < Count; i++ {
		if a, b := m.CostRatio(Tier(i-1)), m.CostRatio(Tier(i)); a >= b {
			t.Errorf("%v (%v) not cheaper than %v (%v)", Tier(i-1), a, Tier(i), b)
		}
	}
	if m.LoadTokensPerSec(Tier(9)) != m.LoadTokensPerSec(UnknownMediumTier) {
		t.Error("an out-of-range tier must be priced like the unknown-medium tier")
	}
}

func TestCostModelOverrides(t *testing.T) {
	// Llama 3.1 8B on one GPU: 32 layers → 131,072 B/token.
	m := CostModel{KVBytesPerToken: 2 * 32 * 8 * 128 * 2, GPUs: 1, PrefillTokensPerSec: 10_000}
	if got := m.LoadTokensPerSec(CPU); !near(got, 50e9/131072, 1e-9) {
		t.Errorf("cpu %v", got)
	}
	m.LinkBytesPerSec[CPU] = 25e9
	if got := m.CostRatio(CPU); !near(got, 10_000/(25e9/131072), 1e-9) {
		t.Errorf("ratio %v", got)
	}
}

func TestCostModelValidate(t *testing.T) {
	tests := []struct {
		name string
		m    CostModel
	}{
		{"negative bytes", CostModel{KVBytesPerToken: -1}},
		{"negative gpus", CostModel{GPUs: -2}},
		{"nan prefill", CostModel{PrefillTokensPerSec: math.NaN()}},
		{"inf link", CostModel{LinkBytesPerSec: [Count]float64{0, math.Inf(1)}}},
		{"negative shared link", CostModel{LinkBytesPerSec: [Count]float64{0, 0, 0, -5}}},
	}
	for _, tc := range tests {
		if err := tc.m.Validate(); !errors.Is(err, ErrInvalidCostModel) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}
