package config

import (
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// Instance roles in disaggregated serving (vLLM's kv_role): a prefill
// instance computes prompts and hands their KV to a decode instance; a
// decode instance generates; "both" (the default) does either.
const (
	RoleBoth    = "both"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// Disaggregation modes.
const (
	DisaggOff         = "off"
	DisaggAlways      = "always"
	DisaggConditional = "conditional"
)

// DefaultMinPrefillTokens is conditional disaggregation's threshold: a
// request whose uncached part is shorter goes aggregated. 256 tokens of
// Llama-3.1-70B prefill on 8×H100 cost about 9 ms of compute (256 × 141
// GFLOP at 4 PFLOP/s), about one decode step: below that, the prefill
// slows the decode instance's batch by less than a step, while going
// disaggregated costs a second HTTP exchange and the KV handshake.
const DefaultMinPrefillTokens = 256

// DisaggregationConfig routes a pool's requests in two stages: a prefill
// instance (kv_aware over the prefill set's caches) computes the prompt,
// then a decode instance (the pool's strategy over the decode set)
// generates with the KV the prefill handed over — vLLM's disaggregated
// serving protocol (docs/disaggregation.md).
type DisaggregationConfig struct {
	// Mode: off (default), always (every OpenAI request with a prefill
	// instance available), or conditional (only when the uncached part is
	// at least MinPrefillTokens and the prefill set is not saturated).
	Mode string `yaml:"mode" json:"mode"`
	// MinPrefillTokens is conditional mode's threshold (default 256).
	MinPrefillTokens int `yaml:"min_prefill_tokens" json:"min_prefill_tokens,omitempty"`
	// PrefillTimeout bounds the prefill stage, every attempt together;
	// past it the request falls back to aggregated (default 60s).
	PrefillTimeout time.Duration `yaml:"prefill_timeout" json:"prefill_timeout,omitempty"`
}

// Enabled reports whether requests may be disaggregated.
func (d *DisaggregationConfig) Enabled() bool { return d != nil && d.Mode != "" && d.Mode != DisaggOff }

func (d *DisaggregationConfig) applyDefaults() {
	if d == nil {
		return
	}
	if d.Mode == "" {
		d.Mode = DisaggOff
	}
	zero.Default(&d.MinPrefillTokens, DefaultMinPrefillTokens)
	zero.Default(&d.PrefillTimeout, 60*time.Second)
}

func (d *DisaggregationConfig) validate(f string, instances []InstanceConfig) error {
	for j, in := range instances {
		switch in.Role {
		case "", RoleBoth, RolePrefill, RoleDecode:
		default:
			return fmt.Errorf("%w: %s.instances[%d].role %q: want both, prefill or decode", ErrInvalidConfig, f, j, in.Role)
		}
	}
	if d == nil {
		return nil
	}
	switch d.Mode {
	case DisaggOff, DisaggAlways, DisaggConditional:
	default:
		return fmt.Errorf("%w: %s.disaggregation.mode %q: want off, always or conditional", ErrInvalidConfig, f, d.Mode)
	}
	if d.MinPrefillTokens < 1 || d.MinPrefillTokens > 1<<20 {
		return fmt.Errorf("%w: %s.disaggregation.min_prefill_tokens %d out of range 1..1048576", ErrInvalidConfig, f, d.MinPrefillTokens)
	}
	if d.PrefillTimeout < 100*time.Millisecond || d.PrefillTimeout > time.Hour {
		return fmt.Errorf("%w: %s.disaggregation.prefill_timeout %v out of range 100ms..1h", ErrInvalidConfig, f, d.PrefillTimeout)
	}
	return nil
}
