package router_test

import (
	"bytes"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/openai"
)

// TestResolveSaltsPromptCacheKey: an OpenAI request without the tenant
// header has its prompt_cache_key as the tenant key (Request.TenantKey),
// and a salting pool writes that tenant's cache_salt into the body an edge
// forwards, as docs/security.md says ("the X-Amzn-SageMaker-Prefix-Aware-Id
// header, else the body's prompt_cache_key"); kv_aware keys by it. Before,
// only the header's tenant was salted: the body went unsalted.
func TestResolveSaltsPromptCacheKey(t *testing.T) {
	secret := bytes.Repeat([]byte{3}, 32)
	cfg := config.Config{CacheSaltSecret: secret, Pools: []config.PoolConfig{{Name: "p", Model: "m",
		Routing:   config.RoutingConfig{Strategy: config.StrategyPrefixAware},
		CacheSalt: &config.CacheSaltConfig{Enabled: true},
		Instances: []config.InstanceConfig{{ID: "i-0", URL: "http://i-0"}}}}}
	tb, commit, err := router.NewTable(cfg, nil, func(config.PoolConfig, *router.Pool) (router.Exact, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	commit()
	for _, tc := range []struct {
		name   string
		header []string
		want   string
	}{
		{"prompt_cache_key", nil, router.DeriveCacheSalt(secret, "k")},
		{"the header wins", []string{"h"}, router.DeriveCacheSalt(secret, "h")},
	} {
		req, _, err := tb.Resolve(router.Inbound{Endpoint: router.EndpointCompletions, Forwards: true, Tenant: tc.header,
			Body: []byte(`{"model":"m","prompt":"hello","prompt_cache_key":"k"}`)})
		if err != nil {
			t.Fatal(err)
		}
		if got := openai.CacheSalt(req.Body); got != tc.want || req.CacheSalt() != tc.want {
			t.Errorf("%s: forwarded cache_salt %q, keyed by %q; want %q (body %s)", tc.name, got, req.CacheSalt(), tc.want, req.Body)
		}
	}
}
