package config

import (
	"math"
	"time"
)

// MaxTTFTObjective bounds a TTFT objective (router/flowcontrol's bound
// for the header, the same hour): beyond it there is no objective.
const MaxTTFTObjective = time.Hour

// FlowControlConfig is a pool's admission queue (router/flowcontrol; see
// docs/flow-control.md): when
// the pool is at its budget a request waits in priority bands, shared
// between tenants by tokens, instead of piling onto an engine; one that
// cannot meet its TTFT objective, or waits too long, is answered 429 with
// Retry-After. Off unless enabled.
type FlowControlConfig struct {
	Enabled bool `yaml:"enabled" json:"enabled"`
	// MaxConcurrency is the pool's in-flight budget; 0 (default) =
	// routing.concurrency_threshold × healthy instances, so the queue
	// holds a request exactly when every instance is full.
	MaxConcurrency int `yaml:"max_concurrency" json:"max_concurrency,omitempty"`
	// PrefillTokensPerInstance bounds the prompt tokens sent and not yet
	// answered with a first byte, per healthy instance; 0 (default) = no
	// bound. Two steps of the engines' --max-num-batched-tokens (vLLM's
	// default on H100-class GPUs: 8192) is the value to start from: one
	// step prefilling, one ready, the rest waiting in the router where
	// priority and fairness order it (docs/flow-control.md).
	PrefillTokensPerInstance int64 `yaml:"prefill_tokens_per_instance" json:"prefill_tokens_per_instance,omitempty"`
	// MaxQueue bounds waiting requests (default 1024).
	MaxQueue int `yaml:"max_queue" json:"max_queue,omitempty"`
	// MaxWait bounds a request's wait (default 30s).
	MaxWait time.Duration `yaml:"max_wait" json:"max_wait,omitempty"`
	// AgingStep is the wait that moves a request up one priority band
	// (default max_wait/10).
	AgingStep time.Duration `yaml:"aging_step" json:"aging_step,omitempty"`
	// TTFTObjective is the time-to-first-token objective of requests that
	// do not send X-Kvrouter-Ttft-Objective-Ms; 0 (default) = none.
	TTFTObjective time.Duration `yaml:"ttft_objective" json:"ttft_objective,omitempty"`
	// TenantWeights are tenants' shares under contention (default 1).
	TenantWeights map[string]float64 `yaml:"tenant_weights" json:"tenant_weights,omitempty"`
}

// On reports whether flow control is enabled.
func (c *FlowControlConfig) On() bool { return c != nil && c.Enabled }

func (c *FlowControlConfig) validate(field string) error {
	if !c.On() {
		return nil
	}
	bad := invalidf(field + ".")
	switch {
	case c.MaxConcurrency < 0 || c.MaxConcurrency > 1<<24:
		return bad("max_concurrency %d out of range 0..%d", c.MaxConcurrency, 1<<24)
	case c.PrefillTokensPerInstance < 0:
		return bad("prefill_tokens_per_instance %d must be >= 0", c.PrefillTokensPerInstance)
	case c.MaxQueue < 0 || c.MaxQueue > 1<<20:
		return bad("max_queue %d out of range 0..%d (0 = the default)", c.MaxQueue, 1<<20)
	case c.MaxWait < 0 || c.MaxWait > MaxTTFTObjective:
		return bad("max_wait %v out of range 0..%v", c.MaxWait, MaxTTFTObjective)
	case c.AgingStep < 0 || c.AgingStep > MaxTTFTObjective:
		return bad("aging_step %v out of range 0..%v", c.AgingStep, MaxTTFTObjective)
	case c.TTFTObjective < 0 || c.TTFTObjective > MaxTTFTObjective:
		return bad("ttft_objective %v out of range 0..%v", c.TTFTObjective, MaxTTFTObjective)
	}
	for t, w := range c.TenantWeights {
		if !(w > 0) || math.IsInf(w, 0) {
			return bad("tenant_weights[%q] %v: want a positive number", t, w)
		}
	}
	return nil
}
