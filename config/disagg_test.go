package config

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestDisaggregationConfig(t *testing.T) {
	base := func(mod func(*PoolConfig)) Config {
		p := PoolConfig{Name: "p", Model: "m", Instances: []InstanceConfig{{ID: "a", URL: "http://127.0.0.1:1", Role: RolePrefill}, {ID: "b", URL: "http://127.0.0.1:2"}}}
		if mod != nil {
			mod(&p)
		}
		return Config{Pools: []PoolConfig{p}}.WithDefaults()
	}
	c := base(func(p *PoolConfig) { p.Disaggregation = &DisaggregationConfig{Mode: DisaggConditional} })
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	d := c.Pools[0].Disaggregation
	if d.MinPrefillTokens != DefaultMinPrefillTokens || d.PrefillTimeout != time.Minute || !d.Enabled() {
		t.Fatalf("defaults: %+v", d)
	}
	var off *DisaggregationConfig
	if off.Enabled() || (&DisaggregationConfig{Mode: DisaggOff}).Enabled() {
		t.Fatal("nil or off reported enabled")
	}
	for _, tc := range []struct {
		mod  func(*PoolConfig)
		want string
	}{
		{func(p *PoolConfig) { p.Disaggregation = &DisaggregationConfig{Mode: "sometimes"} }, "disaggregation.mode"},
		{func(p *PoolConfig) {
			p.Disaggregation = &DisaggregationConfig{Mode: DisaggAlways, MinPrefillTokens: -1}
		}, "min_prefill_tokens"},
		{func(p *PoolConfig) {
			p.Disaggregation = &DisaggregationConfig{Mode: DisaggAlways, PrefillTimeout: time.Millisecond}
		}, "prefill_timeout"},
		{func(p *PoolConfig) { p.Instances[1].Role = "decoder" }, "instances[1].role"},
		{func(p *PoolConfig) {
			p.Disaggregation, p.PassKVTransferParams = &DisaggregationConfig{Mode: DisaggConditional}, true
		}, "pass_kv_transfer_params"},
	} {
		err := base(tc.mod).Validate()
		if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error naming %s, got %v", tc.want, err)
		}
	}
}
