package tiers

import (
	"errors"
	"fmt"
	"math"
)

// ErrInvalidCostModel is returned by CostModel.Validate.
var ErrInvalidCostModel = errors.New("tiers: invalid cost model")

// CostModel prices a prompt token by where its KV comes from: recomputed by
// prefill, or loaded from a tier. Scoring uses it as
//
//	ttft = queue + recompute/P + Σ_tier tokens_tier / X_tier
//
// with P = PrefillTokensPerSec and X_tier = LoadTokensPerSec(tier).
//
// The zero value is the documented default: Llama 3.1 70B in fp16 on one
// 8×H100 node with tensor parallelism 8. Each zero field takes its default
// separately, so a model can override only what it knows.
//
// The arithmetic behind the defaults (figures from
// `docs/reference/workload-facts.md`, with their sources):
//
//   - KV bytes per token: 2 (K and V) · 80 layers · 8 KV heads · 128 head
//     dim · 2 bytes (fp16) = 327,680 bytes (the model's shape; Mooncake
//     FAST'25 §5.3.1 gives the same 320 KB).
//   - Tensor parallelism spreads each token's KV over the GPUs, and each GPU
//     copies its share over its own host link at the same time, so a tier
//     restores GPUs · link / KVBytesPerToken tokens per second.
//   - CPU: ~50 GB/s per GPU each way over PCIe (vLLM blog "KV offloading
//     connector", 2026-01-08, H100) → 8 · 50e9 / 327,680 ≈ 1.22 M tokens/s.
//   - Disk: llm-d measured loads from a file system up to 16.8× faster than
//     prefill for Llama 3.1 70B (llm-d blog "native KV-cache offloading to
//     any file system"); 16.8 · 25,000 tokens/s = 420,000 tokens/s, i.e.
//     ~17.2 GB/s per GPU.
//   - Shared: Mooncake's cost model gives one 800 Gbps NIC per 8-GPU node
//     (paper, Table 1) = 12.5 GB/s per GPU → ≈ 305,000 tokens/s.
//   - Prefill: ~25,000 tokens/s for 70B in BF16 on 8×H100 TP8, derived in
//     docs/reference/workload-facts.md §1 from NVIDIA NIM's TP2 FP8 TTFT at the same utilisation.
//
// So a CPU hit costs ≈ 2% of recomputing the token, a disk hit ≈ 6%, a
// shared-tier hit ≈ 8%; a GPU hit costs nothing.
type CostModel struct {
	// KVBytesPerToken is the KV size of one token over the whole model
	// (all layers, all GPUs). Default 327,680.
	KVBytesPerToken float64
	// GPUs is the number of GPUs an instance's KV is spread over (the
	// tensor-parallel size), each with its own link. Default 8.
	GPUs int
	// PrefillTokensPerSec is one instance's recompute throughput. Default 25,000.
	PrefillTokensPerSec float64
	// LinkBytesPerSec is each tier's load bandwidth per GPU, indexed by
	// Tier. The GPU entry is ignored (a GPU hit is free). Defaults: CPU
	// 50e9, Disk 17.2e9, Shared 12.5e9.
	LinkBytesPerSec [Count]float64
}

// Defaults of CostModel, with the reasoning in its doc comment.
const (
	DefaultKVBytesPerToken       = 2 * 80 * 8 * 128 * 2 // 327,680
	DefaultGPUs                  = 8
	DefaultPrefillTokensPerSec   = 25_000
	DefaultCPULinkBytesPerSec    = 50e9
	DefaultDiskLinkBytesPerSec   = 16.8 * DefaultPrefillTokensPerSec * DefaultKVBytesPerToken / DefaultGPUs
	DefaultSharedLinkBytesPerSec = 800e9 / 8 / 8
)

var defaultLinks = [Count]float64{0, DefaultCPULinkBytesPerSec, DefaultDiskLinkBytesPerSec, DefaultSharedLinkBytesPerSec}

// Validate reports negative, NaN or infinite settings. Zero means default.
func (m CostModel) Validate() error {
	bad := func(name string, v float64) error {
		if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%w: %s = %v (want a positive number, or 0 for the default)", ErrInvalidCostModel, name, v)
		}
		return nil
	}
	if err := bad("KVBytesPerToken", m.KVBytesPerToken); err != nil {
		return err
	}
	if m.GPUs < 0 {
		return fmt.Errorf("%w: GPUs = %d", ErrInvalidCostModel, m.GPUs)
	}
	if err := bad("PrefillTokensPerSec", m.PrefillTokensPerSec); err != nil {
		return err
	}
	for _, t := range All[1:] {
		if err := bad("LinkBytesPerSec["+t.String()+"]", m.LinkBytesPerSec[t]); err != nil {
			return err
		}
	}
	return nil
}

func orDefault(v, def float64) float64 {
	if v > 0 && !math.IsInf(v, 0) {
		return v
	}
	return def
}

// PrefillRate is P, the recompute throughput in tokens/s.
func (m CostModel) PrefillRate() float64 {
	return orDefault(m.PrefillTokensPerSec, DefaultPrefillTokensPerSec)
}

// LoadTokensPerSec is X for a tier: how many tokens of KV per second the
// tier restores into GPU memory. It is +Inf for GPU (nothing to load) and
// for unknown tiers falls back to the UnknownMediumTier's rate.
func (m CostModel) LoadTokensPerSec(t Tier) float64 {
	if t == GPU {
		return math.Inf(1)
	}
	if int(t) >= Count {
		t = UnknownMediumTier
	}
	gpus := float64(m.GPUs)
	if m.GPUs <= 0 {
		gpus = DefaultGPUs
	}
	link := orDefault(m.LinkBytesPerSec[t], defaultLinks[t])
	return gpus * link / orDefault(m.KVBytesPerToken, DefaultKVBytesPerToken)
}

// CostRatio is the cost of a token found in tier t relative to recomputing
// it: 0 for GPU, P/X for the others (≈ 0.02 for CPU with the defaults).
func (m CostModel) CostRatio(t Tier) float64 {
	return m.PrefillRate() / m.LoadTokensPerSec(t)
}

// RecomputeSeconds is the prefill time of n tokens.
func (m CostModel) RecomputeSeconds(n int) float64 { return float64(n) / m.PrefillRate() }

// LoadSeconds is the time to restore n tokens of KV from tier t (0 for GPU).
func (m CostModel) LoadSeconds(t Tier, n int) float64 { return float64(n) / m.LoadTokensPerSec(t) }
