package config

import (
	"math"
	"time"
)

// ValidateKV checks the fields the kv_aware strategy added to
// KVScoringConfig (the throughputs and block size are checked by
// RoutingConfig.validate). f is the YAML path of the section.
func (k *KVScoringConfig) ValidateKV(f string) error {
	if k == nil {
		return nil
	}
	bad := invalidf(f + ".")
	for _, v := range []struct {
		name string
		v    float64
	}{
		{"prefill_tokens_per_second", k.PrefillTokensPerSecond},
		{"cpu_load_tokens_per_second", k.CPULoadTokensPerSecond},
		{"disk_load_tokens_per_second", k.DiskLoadTokensPerSecond},
		{"shared_load_tokens_per_second", k.SharedLoadTokensPerSecond},
		{"running_request_seconds", k.RunningRequestSeconds},
	} {
		if v.v < 0 || math.IsNaN(v.v) || math.IsInf(v.v, 0) {
			return bad("%s %v: want a finite number >= 0 (0 = default)", v.name, v.v)
		}
	}
	switch k.Engine {
	case "", EngineVLLM, EngineSGLang, EngineTRTLLM:
	default:
		return bad("engine %q: want vllm, sglang or trtllm", k.Engine)
	}
	if math.IsNaN(k.PrefillCostWeight) || k.PrefillCostWeight > 100 {
		return bad("prefill_cost_weight %v out of range (negative = 0, 0 = adaptive, at most 100)", k.PrefillCostWeight)
	}
	if k.RunningRequestSeconds > 60 {
		return bad("running_request_seconds %v out of range 0..60", k.RunningRequestSeconds)
	}
	if math.IsNaN(k.DecodeStepSeconds) || math.IsInf(k.DecodeStepSeconds, 0) || k.DecodeStepSeconds > 60 {
		return bad("decode_step_seconds %v out of range (negative = no step time, 0 = default, at most 60)", k.DecodeStepSeconds)
	}
	if k.MaxNumBatchedTokens > 1<<24 {
		return bad("max_num_batched_tokens %d out of range (negative = off, 0 = default, at most %d)", k.MaxNumBatchedTokens, 1<<24)
	}
	if k.WaitingRequestTokens < 0 || k.WaitingRequestTokens > 1<<22 {
		return bad("waiting_request_tokens %d out of range 0..%d", k.WaitingRequestTokens, 1<<22)
	}
	if math.IsNaN(k.LoadBound) || k.LoadBound > 100 {
		return bad("load_bound %v out of range (negative = off, 0 = default, at most 100)", k.LoadBound)
	}
	if k.TieTolerance < 0 || k.TieTolerance > time.Minute {
		return bad("tie_tolerance %v out of range 0..1m", k.TieTolerance)
	}
	if k.SpeculativeTTL > 10*time.Minute {
		return bad("speculative_ttl %v out of range (negative = off, 0 = default, at most 10m)", k.SpeculativeTTL)
	}
	if k.SpeculativeCapacity < 0 || k.SpeculativeCapacity > 1<<26 {
		return bad("speculative_capacity %d out of range 0..%d", k.SpeculativeCapacity, 1<<26)
	}
	if k.ScrapeInterval > 0 && k.ScrapeInterval < 50*time.Millisecond || k.ScrapeInterval > time.Hour {
		return bad("scrape_interval %v out of range (negative = off, 0 = default, 50ms..1h)", k.ScrapeInterval)
	}
	if k.ScrapeTimeout < 0 || k.ScrapeTimeout > time.Minute {
		return bad("scrape_timeout %v out of range 0..1m", k.ScrapeTimeout)
	}
	if k.TokenizeTimeout < 0 || k.TokenizeTimeout > time.Minute {
		return bad("tokenize_timeout %v out of range 0..1m", k.TokenizeTimeout)
	}
	if k.ScrapePath != "" && k.ScrapePath[0] != '/' {
		return bad("scrape_path %q: must start with /", k.ScrapePath)
	}
	return nil
}
