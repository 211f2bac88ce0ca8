package config

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestFlowControlConfig(t *testing.T) {
	base := "pools: [{name: p, model: m, flow_control: {%s}, instances: [{id: a, url: 'http://h:1'}]}]"
	doc := strings.Replace(base, "%s", "enabled: true, max_wait: 10s, aging_step: 500ms, ttft_objective: 2s, prefill_tokens_per_instance: 8192, tenant_weights: {gold: 3}", 1)
	cfg, err := ParseConfig(strings.NewReader(doc))
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		t.Fatal(err)
	}
	fc := cfg.Pools[0].FlowControl
	if !fc.On() || fc.MaxWait != 10*time.Second || fc.AgingStep != 500*time.Millisecond || fc.TTFTObjective != 2*time.Second ||
		fc.PrefillTokensPerInstance != 8192 || fc.TenantWeights["gold"] != 3 {
		t.Fatalf("%+v", fc)
	}
	var off *FlowControlConfig
	if off.On() || (&FlowControlConfig{MaxQueue: -1}).validate("x") != nil {
		t.Fatal("a disabled section is not checked")
	}
	for _, tc := range []struct{ set, want string }{
		{"enabled: true, max_queue: -1", "pools[0].flow_control.max_queue -1"},
		{"enabled: true, max_concurrency: -2", "pools[0].flow_control.max_concurrency -2"},
		{"enabled: true, prefill_tokens_per_instance: -1", "prefill_tokens_per_instance -1"},
		{"enabled: true, ttft_objective: 2h", "ttft_objective 2h0m0s out of range"},
		{"enabled: true, max_wait: -1s", "max_wait -1s"},
		{"enabled: true, tenant_weights: {a: 0}", `tenant_weights["a"] 0`},
		{"enabled: true, max_wiat: 1s", `max_wiat: unknown field (did you mean "max_wait"?)`},
	} {
		cfg, err := ParseConfig(strings.NewReader(strings.Replace(base, "%s", tc.set, 1)))
		if err == nil {
			err = cfg.Validate()
		}
		if err == nil || !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want %q", tc.set, err, tc.want)
		}
	}
}
