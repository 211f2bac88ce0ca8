package httpapi_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/servertest"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
)

// disaggFleet is a router in front of kvsim prefill and decode instances
// (real HTTP servers speaking vLLM's disaggregated-serving protocol).
type disaggFleet struct {
	t    *testing.T
	ts   *httptest.Server
	sims map[string]*simserver.Instance
}

// mod, when set, edits the pool's configuration before the router starts.
func newDisaggFleet(t *testing.T, dc config.DisaggregationConfig, prefill, decode int, mod ...func(*config.PoolConfig)) *disaggFleet {
	t.Helper()
	f := &disaggFleet{t: t, sims: map[string]*simserver.Instance{}}
	pc := config.PoolConfig{Name: "pd", Model: sim.DefaultModel, Disaggregation: &dc,
		Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
		Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	add := func(id, role string) {
		in, err := simserver.Start(context.Background(), simserver.Config{Role: role, TimeScale: 50,
			Engine: sim.Config{GPUBlocks: 8192}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { in.Close() })
		f.sims[id] = in
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: id, URL: in.URL(), Role: role})
	}
	for i := range prefill {
		add(fmt.Sprintf("p%d", i), config.RolePrefill)
	}
	for i := range decode {
		add(fmt.Sprintf("d%d", i), config.RoleDecode)
	}
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: sim.DefaultModel, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mod {
		m(&pc)
	}
	cfg := config.Config{Pools: []config.PoolConfig{pc}}.WithDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	_, f.ts = servertest.Serve(t, cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })})
	return f
}

func (f *disaggFleet) post(path string, body map[string]any) (servertest.Result, string) {
	f.t.Helper()
	resp := testenv.PostJSON(f.t, f.ts.URL+path, body)
	if resp.Status != http.StatusOK {
		f.t.Fatalf("%s: %d %s", path, resp.Status, resp.Body)
	}
	return resp, string(resp.Body)
}

func tokenPrompt(seed, n int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = 1000 + (seed*7919+i*31)%20000
	}
	return p
}

// TestDisaggregatedServing: through the router, plain and streamed
// completions and chat requests are prefilled on a prefill instance and
// generated on a decode instance that received the prefill's transfer
// parameters; the headers name both; conditional mode keeps short prompts
// aggregated; a failed prefill falls back to aggregated serving on a decode
// instance and a prefill instance never sees a plain request.
func TestDisaggregatedServing(t *testing.T) {
	f := newDisaggFleet(t, config.DisaggregationConfig{Mode: config.DisaggAlways}, 2, 2)
	long := strings.Repeat("a story about routing requests to the right engine, ", 40)
	cases := []struct {
		path string
		body map[string]any
	}{
		{"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": long, "max_tokens": 5}},
		{"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(1, 900), "max_tokens": 5, "stream": true, "stream_options": map[string]any{"include_usage": true}}},
		{"/v1/chat/completions", map[string]any{"model": sim.DefaultModel, "messages": []map[string]string{{"role": "user", "content": long}}, "max_tokens": 5}},
		{"/v1/chat/completions", map[string]any{"model": sim.DefaultModel, "messages": []map[string]string{{"role": "user", "content": long + "!"}}, "max_completion_tokens": 5, "stream": true}},
	}
	for i, c := range cases {
		resp, out := f.post(c.path, c.body)
		h := resp.Header
		pre, dec := h.Get(httpapi.HeaderPrefillInstance), h.Get(router.HeaderInstance)
		if h.Get(httpapi.HeaderDisagg) != "disaggregated" || !strings.HasPrefix(pre, "p") || !strings.HasPrefix(dec, "d") {
			t.Fatalf("case %d: disagg %q, prefill %q, decode %q", i, h.Get(httpapi.HeaderDisagg), pre, dec)
		}
		if stream, _ := c.body["stream"].(bool); stream != strings.Contains(out, "data: [DONE]") {
			t.Fatalf("case %d: stream %v, body %.200s", i, stream, out)
		}
		got := f.sims[dec].RemotePrefills()
		if len(got) == 0 || got[len(got)-1].EngineID != f.sims[pre].EngineID() || got[len(got)-1].Blocks == 0 {
			t.Fatalf("case %d: decode instance %s received %+v, want the parameters of %s", i, dec, got, pre)
		}
	}
	var prefills uint64
	for id, in := range f.sims {
		if strings.HasPrefix(id, "p") {
			prefills += in.Prefills()
		}
	}
	if prefills != uint64(len(cases)) {
		t.Fatalf("prefill instances answered %d prefills, want %d", prefills, len(cases))
	}

	// Conditional: a short uncached part stays aggregated (on a decode
	// instance), a long one is disaggregated.
	c := newDisaggFleet(t, config.DisaggregationConfig{Mode: config.DisaggConditional, MinPrefillTokens: 256}, 1, 1)
	resp, _ := c.post("/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(2, 100), "max_tokens": 3})
	if got := resp.Header.Get(httpapi.HeaderDisagg); got != "aggregated; short" || resp.Header.Get(router.HeaderInstance) != "d0" {
		t.Fatalf("100-token prompt: disagg %q on %s", got, resp.Header.Get(router.HeaderInstance))
	}
	resp, _ = c.post("/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(3, 2000), "max_tokens": 3})
	if got := resp.Header.Get(httpapi.HeaderDisagg); got != "disaggregated" {
		t.Fatalf("2000-token prompt: disagg %q", got)
	}

	// The decode instance gone after the prefill: one clear error, the
	// prefill done once, nothing generated twice.
	e := newDisaggFleet(t, config.DisaggregationConfig{Mode: config.DisaggAlways}, 1, 1)
	e.sims["d0"].Close()
	dresp := testenv.PostJSON(t, e.ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": long, "max_tokens": 3})
	if dresp.Status != http.StatusBadGateway || !strings.Contains(string(dresp.Body), "d0") || dresp.Header.Get(httpapi.HeaderPrefillInstance) != "p0" {
		t.Fatalf("decode instance down: %d %s (prefill %q)", dresp.Status, dresp.Body, dresp.Header.Get(httpapi.HeaderPrefillInstance))
	}
	if n := e.sims["p0"].Prefills(); n != 1 {
		t.Fatalf("prefill instance answered %d prefills for one request, want 1", n)
	}

	// Every prefill instance gone: the request is served aggregated by a
	// decode instance (which refuses nothing plain), not failed.
	for id, in := range f.sims {
		if strings.HasPrefix(id, "p") {
			in.Close()
		}
	}
	resp, _ = f.post("/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": long, "max_tokens": 3, "stream": true})
	if got := resp.Header.Get(httpapi.HeaderDisagg); got != "aggregated; prefill_failed" || !strings.HasPrefix(resp.Header.Get(router.HeaderInstance), "d") {
		t.Fatalf("prefill instances down: disagg %q on %s", got, resp.Header.Get(router.HeaderInstance))
	}
}
