package sim

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// Config describes one simulated engine (one vLLM data-parallel rank). The
// zero value of every field means the documented default, which models
// Llama 3.1 70B (BF16) with tensor parallelism 8 on one 8×H100 node; the
// arithmetic behind each default is in docs/kvsim.md.
type Config struct {
	// Model is the served model name (default "meta-llama/Llama-3.1-70B-Instruct").
	Model string
	// BlockSize is the number of tokens per KV block (default 16, vLLM's default).
	BlockSize int
	// GPUBlocks is the device KV capacity in blocks (default 84,375 = 1.35M
	// tokens / 16: docs/reference/workload-facts.md §3 derives about 1.35M BF16 tokens for one 8×H100 node).
	GPUBlocks int
	// CPUBlocks is the capacity of the CPU offload tier in blocks; 0 disables it.
	CPUBlocks int
	// CPUWriteThrough copies blocks to the CPU tier as soon as they are
	// computed, as vLLM's OffloadingConnector does, instead of when they
	// are evicted from the GPU (the default, demote-on-evict).
	CPUWriteThrough bool
	// MaxNumBatchedTokens is the per-step token budget (default 8192, vLLM's
	// default for the OpenAI server on large GPUs).
	MaxNumBatchedTokens int
	// MaxNumSeqs caps the requests scheduled in one step (default 1024, vLLM's
	// default for the OpenAI server on large GPUs).
	MaxNumSeqs int
	// HashSeed seeds the engine's block hashes, as PYTHONHASHSEED seeds vLLM's
	// NONE_HASH: two engines with different seeds hash equal prefixes apart.
	HashSeed uint64
	// HashAlgo is the block hash function (default HashSHA256, vLLM's default).
	HashAlgo HashAlgo
	// DPRank is written into every event batch as data_parallel_rank.
	DPRank int
	// Epoch is the wall-clock time (Unix seconds) of virtual time 0; batch
	// timestamps are Epoch + virtual seconds. Zero is fine for simulations.
	Epoch float64
	// MaxModelLen caps prompt plus output tokens of one request (default
	// 131,072, Llama 3.1's context length).
	MaxModelLen int
	// TokenUpdates makes Advance report every generated token, not only the
	// first and the last (servers that stream need it; discrete-event
	// benchmarks do not, and save the work).
	TokenUpdates bool
	// PartialReuse makes the engine reuse its prefix cache as TensorRT-LLM
	// does (enable_partial_reuse, its default) instead of as vLLM does: up
	// to T − 1 tokens of the held blocks of a T-token prompt, so that a
	// prompt of exactly k blocks held whole recomputes its last token, not
	// its last block. The router's routing.kv.engine: trtllm rule
	// (router/kvaware/score.go, docs/kv-aware.md "What an engine reuses");
	// kvsim sets it with --engine trtllm.
	PartialReuse bool
	// Timing is the cost model of one engine step.
	Timing Timing
}

// Timing is the cost model of one continuous-batching step. A step costs
//
//	StepOverhead + max(compute, memory)
//	compute = (tokens·FLOPsPerToken + attention pairs·AttnFLOPsPerPair) / FLOPS
//	memory  = WeightReadTime + context tokens read · KVReadSecondsPerToken
//
// a roofline: prefill-heavy steps are compute bound, decode steps memory
// bound. Zero fields take the defaults documented on each field.
type Timing struct {
	// FLOPS is the effective compute rate of the whole tensor-parallel group
	// (default 8 GPUs × 989e12 dense BF16 × 0.50 utilisation = 3.956e15).
	FLOPS float64
	// FLOPsPerToken is the dense (non-attention) work per token, 2 × parameters
	// (default 2 × 70.6e9 = 141.2e9).
	FLOPsPerToken float64
	// AttnFLOPsPerPair is the attention work per (query token, context token)
	// pair: 4 × layers × hidden (QKᵀ and AV, 2 FLOPs per multiply-add);
	// default 4 × 80 × 8192 = 2,621,440.
	AttnFLOPsPerPair float64
	// WeightReadTime is the memory-bound floor of a step: each GPU reads its
	// share of the weights once (default 141.2 GB / 8 / 2.49 TB/s effective ≈ 7.09 ms).
	WeightReadTime time.Duration
	// KVReadSecondsPerToken is the time to read one context token's KV on
	// each GPU (default 40,960 B per GPU / 3.0e12 B/s effective ≈ 1.365e-8 s).
	KVReadSecondsPerToken float64
	// StepOverhead is the fixed cost of a step beyond the roofline: tensor-
	// parallel all-reduces, scheduling, sampling (default 1.5 ms, an estimate).
	StepOverhead time.Duration
	// CPULoadTokensPerSec is the rate at which CPU-tier blocks are promoted
	// to GPU (default 1.22M tokens/s: 50 GB/s per GPU over 40,960 B per GPU per token).
	CPULoadTokensPerSec float64
	// KVTransferTokensPerSec is the rate at which a disaggregated decode
	// engine receives a remote prefill's KV (default 305k tokens/s: an
	// 800 Gb/s NIC per 8-GPU node, Mooncake's figure, over 8 × 40,960 B
	// of Llama-3.1-70B KV per token; docs/reference/workload-facts.md §3–4).
	KVTransferTokensPerSec float64
}

// Default values; see Config and Timing for their sources.
const (
	DefaultModel               = "meta-llama/Llama-3.1-70B-Instruct"
	DefaultBlockSize           = 16
	DefaultGPUBlocks           = 1_350_000 / 16
	DefaultMaxNumBatchedTokens = 8192
	DefaultMaxNumSeqs          = 1024
	DefaultMaxModelLen         = 131072

	defaultFLOPS               = 8 * 989e12 * 0.50
	defaultFLOPsPerToken       = 2 * 70.6e9
	defaultAttnFLOPsPerPair    = 4 * 80 * 8192
	defaultWeightReadTime      = 7088 * time.Microsecond // 141.2e9 B / 8 GPUs / 2.49e12 B/s
	defaultKVReadSecondsPerTok = 40960 / 3.0e12
	defaultStepOverhead        = 1500 * time.Microsecond
	defaultCPULoadTokensPerSec = 50e9 / 40960
	defaultKVTransferTokPerSec = 800e9 / 8 / (8 * 40960)
)

// HashAlgo selects the engine's block hash, as vLLM's --prefix-caching-hash-algo.
type HashAlgo uint8

const (
	// HashSHA256: sha256 of the block, low 64 bits (vLLM's default).
	HashSHA256 HashAlgo = iota
	// HashXXH64: xxhash64 of the same bytes (vLLM's "xxhash"); cheaper.
	HashXXH64
)

// ParseHashAlgo accepts "sha256" and "xxhash".
func ParseHashAlgo(s string) (HashAlgo, error) {
	switch s {
	case "sha256", "":
		return HashSHA256, nil
	case "xxhash":
		return HashXXH64, nil
	}
	return 0, fmt.Errorf("%w: hash algorithm %q (want sha256 or xxhash)", ErrConfig, s)
}

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("sim: invalid config")

// withDefaults returns c with zero fields replaced by defaults, validated.
func (c Config) withDefaults() (Config, error) {
	zero.Default(&c.Model, DefaultModel)
	zero.Default(&c.BlockSize, DefaultBlockSize)
	zero.Default(&c.GPUBlocks, DefaultGPUBlocks)
	zero.Default(&c.MaxNumBatchedTokens, DefaultMaxNumBatchedTokens)
	zero.Default(&c.MaxModelLen, DefaultMaxModelLen)
	zero.Default(&c.MaxNumSeqs, DefaultMaxNumSeqs)
	t := &c.Timing
	zero.Default(&t.FLOPS, defaultFLOPS)
	zero.Default(&t.FLOPsPerToken, defaultFLOPsPerToken)
	zero.Default(&t.AttnFLOPsPerPair, defaultAttnFLOPsPerPair)
	zero.Default(&t.WeightReadTime, defaultWeightReadTime)
	zero.Default(&t.KVReadSecondsPerToken, defaultKVReadSecondsPerTok)
	zero.Default(&t.StepOverhead, defaultStepOverhead)
	zero.Default(&t.KVTransferTokensPerSec, defaultKVTransferTokPerSec)
	zero.Default(&t.CPULoadTokensPerSec, defaultCPULoadTokensPerSec)
	switch {
	case c.BlockSize < 1 || c.BlockSize > 1<<16:
		return c, fmt.Errorf("%w: block size %d out of range [1, 65536]", ErrConfig, c.BlockSize)
	case c.GPUBlocks < 1:
		return c, fmt.Errorf("%w: GPU blocks %d < 1", ErrConfig, c.GPUBlocks)
	case c.CPUBlocks < 0:
		return c, fmt.Errorf("%w: CPU blocks %d < 0", ErrConfig, c.CPUBlocks)
	case c.MaxNumBatchedTokens < 1:
		return c, fmt.Errorf("%w: max num batched tokens %d < 1", ErrConfig, c.MaxNumBatchedTokens)
	case c.MaxNumSeqs < 1:
		return c, fmt.Errorf("%w: max num seqs %d < 1", ErrConfig, c.MaxNumSeqs)
	case c.MaxModelLen < 2:
		return c, fmt.Errorf("%w: max model len %d < 2", ErrConfig, c.MaxModelLen)
	case c.HashAlgo > HashXXH64:
		return c, fmt.Errorf("%w: hash algorithm %d", ErrConfig, c.HashAlgo)
	case c.DPRank < 0:
		return c, fmt.Errorf("%w: data-parallel rank %d < 0", ErrConfig, c.DPRank)
	}
	for name, v := range map[string]float64{
		"FLOPS": t.FLOPS, "FLOPs per token": t.FLOPsPerToken, "attention FLOPs per pair": t.AttnFLOPsPerPair,
		"CPU load tokens/s": t.CPULoadTokensPerSec, "KV transfer tokens/s": t.KVTransferTokensPerSec, "KV read seconds per token": t.KVReadSecondsPerToken,
	} {
		if !(v > 0) || math.IsInf(v, 0) {
			return c, fmt.Errorf("%w: timing %s must be positive and finite, got %v", ErrConfig, name, v)
		}
	}
	if t.WeightReadTime < 0 || t.StepOverhead < 0 {
		return c, fmt.Errorf("%w: timing durations must not be negative", ErrConfig)
	}
	return c, nil
}

// MaxModelLenOrDefault is MaxModelLen, or its default when zero.
func (c Config) MaxModelLenOrDefault() int {
	if c.MaxModelLen == 0 {
		return DefaultMaxModelLen
	}
	return c.MaxModelLen
}

// BlockSizeOrDefault is BlockSize, or its default when zero.
func (c Config) BlockSizeOrDefault() int {
	if c.BlockSize == 0 {
		return DefaultBlockSize
	}
	return c.BlockSize
}
