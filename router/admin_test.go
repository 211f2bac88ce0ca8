package router_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
)

func TestAdminSwitchRouting(t *testing.T) {
	h := newHarness(t, 3, nil)
	body := chatBody(model, "switch", false)
	if s := h.do("POST", "/v1/chat/completions", body, nil).header.Get(router.HeaderStrategy); s != "prefix_aware" {
		t.Fatalf("strategy %q", s)
	}
	r := h.do("PUT", "/admin/pools/llama/routing", []byte(`{"strategy":"round_robin"}`), nil)
	if r.status != 200 {
		t.Fatalf("PUT routing: %d %s", r.status, r.body)
	}
	var rc config.RoutingConfig
	if err := json.Unmarshal(r.body, &rc); err != nil || rc.Strategy != "round_robin" || rc.PrefixLength != 8192 || rc.ConcurrencyThreshold != 64 {
		t.Fatalf("PUT answer %s (%v): want round_robin with the other fields kept", r.body, err)
	}
	seen := map[string]bool{}
	for range 3 {
		rr := h.do("POST", "/v1/chat/completions", body, nil)
		if rr.header.Get(router.HeaderStrategy) != "round_robin" || rr.header.Get(router.HeaderReason) != "round_robin" {
			t.Fatalf("after switch: strategy %q reason %q", rr.header.Get(router.HeaderStrategy), rr.header.Get(router.HeaderReason))
		}
		seen[rr.header.Get(router.HeaderInstance)] = true
	}
	if len(seen) != 3 {
		t.Fatalf("round robin used %d of 3 instances", len(seen))
	}

	bad := []struct{ body, field string }{
		{`{"prefix_length": 100}`, "routing.prefix_length 100 out of range 1024..65536"},
		{`{"prefix_length": 70000}`, "routing.prefix_length 70000 out of range 1024..65536"},
		{`{"concurrency_threshold": 2000}`, "routing.concurrency_threshold 2000 out of range 1..1024"},
		{`{"concurrency_threshold": -1}`, "routing.concurrency_threshold -1 out of range 1..1024"},
		{`{"strategy": "fastest"}`, `routing.strategy "fastest"`},
		{`{"stratgy": "random"}`, `unknown field "stratgy"`},
		{`{"strategy": `, "malformed JSON"},
	}
	for _, tc := range bad {
		r := h.do("PUT", "/admin/pools/llama/routing", []byte(tc.body), nil)
		msg, _ := errorOf(t, r)
		if r.status != 400 || !strings.Contains(msg, tc.field) {
			t.Errorf("PUT %s: %d %q, want 400 naming %q", tc.body, r.status, msg, tc.field)
		}
	}
	// Rejected updates left the routing alone.
	if r := h.do("GET", "/admin/pools/llama/routing", nil, nil); !strings.Contains(string(r.body), `"round_robin"`) {
		t.Fatalf("routing after rejected updates: %s", r.body)
	}
	if r := h.do("PUT", "/admin/pools/nope/routing", []byte(`{}`), nil); r.status != 404 {
		t.Fatalf("unknown pool: %d", r.status)
	}
}

func TestAdminToken(t *testing.T) {
	h := newHarness(t, 1, func(c *config.Config) { c.AdminToken = "s3cret" })
	tests := []struct {
		auth   string
		status int
	}{
		{"", 401},
		{"Bearer wrong", 401},
		{"Basic s3cret", 401},
		{"Bearer", 401},
		{"Bearer ", 401},
		{"Bearers3cret", 401},
		{"Bearer s3cret", 200},
		// RFC 7235: the scheme is case-insensitive.
		{"bearer s3cret", 200},
		{"BEARER s3cret", 200},
		{"Bearer   s3cret", 200},
	}
	for _, tc := range tests {
		hdr := map[string]string{}
		if tc.auth != "" {
			hdr["Authorization"] = tc.auth
		}
		for _, req := range []struct{ method, path, body string }{
			{"GET", "/admin/pools", ""},
			{"PUT", "/admin/pools/llama/routing", `{"strategy":"random"}`},
		} {
			r := h.do(req.method, req.path, []byte(req.body), hdr)
			if r.status != tc.status {
				t.Errorf("%s %s with %q: %d, want %d", req.method, req.path, tc.auth, r.status, tc.status)
			}
			if tc.status == 401 && r.header.Get("WWW-Authenticate") == "" {
				t.Errorf("401 without WWW-Authenticate")
			}
		}
	}
}

// Without an admin token the profiling endpoints are off (403), whatever
// the admin API does.
func TestPprofNeedsAToken(t *testing.T) {
	h := newHarness(t, 1, nil)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/cmdline"} {
		if r := h.do("GET", path, nil, nil); r.status != 403 {
			t.Errorf("GET %s without a token configured: %d, want 403", path, r.status)
		}
	}
	h = newHarness(t, 1, func(c *config.Config) { c.AdminToken = "s3cret" })
	if r := h.do("GET", "/debug/pprof/cmdline", nil, map[string]string{"Authorization": "Bearer s3cret"}); r.status != 200 {
		t.Errorf("pprof with the token: %d", r.status)
	}
}

func TestAdminListPoolsAndMetrics(t *testing.T) {
	h := newHarness(t, 2, nil)
	h.do("POST", "/v1/chat/completions", chatBody(model, "count me", false), nil)
	h.do("POST", "/v1/chat/completions", chatBody("nope", "count me", false), nil)
	r := h.do("GET", "/admin/pools", nil, nil)
	var pools []router.PoolStatus
	if err := json.Unmarshal(r.body, &pools); err != nil || len(pools) != 1 {
		t.Fatalf("pools %s: %v", r.body, err)
	}
	p := pools[0]
	if p.Name != "llama" || p.Model != model || len(p.Instances) != 2 || !p.Instances[0].Healthy || p.Routing.Strategy != "prefix_aware" {
		t.Fatalf("pool status %+v", p)
	}
	m := h.do("GET", "/metrics", nil, nil)
	for _, want := range []string{
		`kvrouter_requests_total{instance="vllm-`,
		`kvrouter_requests_total{instance="",pool="",reason="",status="404",strategy=""} 1`,
		`kvrouter_decision_seconds_bucket{pool="llama",strategy="prefix_aware"`,
		`kvrouter_upstream_ttfb_seconds_count{instance="vllm-`,
		`kvrouter_instance_in_flight{instance="vllm-0",pool="llama"} 0`,
		`kvrouter_instance_healthy{instance="vllm-1",pool="llama"} 1`,
		`kvrouter_pool_strategy{pool="llama",strategy="prefix_aware"} 1`,
	} {
		if !strings.Contains(string(m.body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestSeparateAdminHandler(t *testing.T) {
	h := newHarness(t, 1, func(c *config.Config) { c.AdminListen = "127.0.0.1:0" })
	if r := h.do("GET", "/admin/pools", nil, nil); r.status != 404 {
		t.Fatalf("admin API on the data listener with admin_listen set: %d", r.status)
	}
	if r := h.do("GET", "/metrics", nil, nil); r.status != 404 {
		t.Fatalf("/metrics on the data listener with admin_listen set: %d", r.status)
	}
	rec := newRecorder(t, h.srv.AdminHandler(), "GET", "/admin/pools")
	if rec.Code != 200 {
		t.Fatalf("admin handler: %d", rec.Code)
	}
}

func TestModelsUnion(t *testing.T) {
	h := newHarness(t, 1, func(c *config.Config) {
		c.Pools[0].Adapters = []string{"sql-lora"}
		qwen := routertest.New(t, "qwen-0", "Qwen/Qwen3-8B")
		c.Pools = append(c.Pools, config.PoolConfig{Name: "qwen", Model: "Qwen/Qwen3-8B", Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "qwen-0", URL: qwen.URL()}}})
	})
	r := h.do("GET", "/v1/models", nil, nil)
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.Unmarshal(r.body, &list); err != nil || list.Object != "list" {
		t.Fatalf("models %s: %v", r.body, err)
	}
	var ids []string
	for _, m := range list.Data {
		id := m.ID
		if m.Parent != nil {
			id += "<" + *m.Parent
		}
		ids = append(ids, id)
	}
	if got, want := strings.Join(ids, ","), model+",sql-lora<"+model+",Qwen/Qwen3-8B"; got != want {
		t.Fatalf("models %s, want %s", got, want)
	}
	// Requests pick their pool by model.
	if r := h.do("POST", "/v1/chat/completions", chatBody("Qwen/Qwen3-8B", "hi", false), nil); r.header.Get(router.HeaderInstance) != "qwen-0" {
		t.Fatalf("Qwen request went to %q", r.header.Get(router.HeaderInstance))
	}
}

func TestLoRAAdapters(t *testing.T) {
	mk := func(fallback string) *harness {
		h := newHarness(t, 0, func(c *config.Config) {
			c.Pools[0].AdapterFallback = fallback
			c.Pools[0].Discovery = config.DiscoveryConfig{Interval: time.Second}
			for i, ad := range [][]string{{"sql-lora"}, {}, {"sql-lora", "chat-lora"}, {}} {
				u := routertest.New(t, fmt.Sprintf("vllm-%d", i), model, ad...)
				c.Pools[0].Instances = append(c.Pools[0].Instances, config.InstanceConfig{ID: u.ID, URL: u.URL()})
			}
			// One adapter known only from config.
			c.Pools[0].Instances[3].Adapters = []string{"static-lora"}
		})
		h.run()
		p, _ := h.srv.Pool("llama")
		waitFor(t, "adapters discovered", func() bool {
			return p.Instances()[2].HasAdapter("chat-lora") && p.Instances()[0].HasAdapter("sql-lora")
		})
		return h
	}
	h := mk("none")
	tests := []struct {
		model string
		want  map[string]bool
	}{
		{"sql-lora", map[string]bool{"vllm-0": true, "vllm-2": true}},
		{"chat-lora", map[string]bool{"vllm-2": true}},
		{"static-lora", map[string]bool{"vllm-3": true}},
		{model, map[string]bool{"vllm-0": true, "vllm-1": true, "vllm-2": true, "vllm-3": true}},
	}
	for _, tc := range tests {
		seen := map[string]bool{}
		for i := range 40 {
			r := h.do("POST", "/v1/chat/completions", chatBody(tc.model, fmt.Sprintf("q%d", i), false), nil)
			if r.status != 200 {
				t.Fatalf("%s: %d %s", tc.model, r.status, r.body)
			}
			seen[r.header.Get(router.HeaderInstance)] = true
		}
		if fmt.Sprint(seen) != fmt.Sprint(tc.want) {
			t.Errorf("%s routed to %v, want %v", tc.model, seen, tc.want)
		}
	}
	// The only holder of chat-lora goes down: 503 without fallback ...
	p, _ := h.srv.Pool("llama")
	p.Instances()[2].SetHealthy(false)
	if r := h.do("POST", "/v1/chat/completions", chatBody("chat-lora", "x", false), nil); r.status != 503 || !strings.Contains(string(r.body), "chat-lora") {
		t.Fatalf("no holder, no fallback: %d %s", r.status, r.body)
	}
	// ... and any healthy instance with fallback "all".
	h2 := mk("all")
	p2, _ := h2.srv.Pool("llama")
	p2.Instances()[2].SetHealthy(false)
	if r := h2.do("POST", "/v1/chat/completions", chatBody("chat-lora", "x", false), nil); r.status != 200 {
		t.Fatalf("fallback all: %d %s", r.status, r.body)
	}
	// The raw path names the adapter in a header.
	if r := h.do("POST", "/invocations", []byte(`{}`), map[string]string{router.HeaderAdapter: "sql-lora"}); r.status != 200 || !map[string]bool{"vllm-0": true, "vllm-2": true}[r.header.Get(router.HeaderInstance)] {
		t.Fatalf("raw adapter: %d on %s", r.status, r.header.Get(router.HeaderInstance))
	}
	if r := h.do("POST", "/invocations", []byte(`{}`), map[string]string{router.HeaderAdapter: "nope-lora"}); r.status != 404 {
		t.Fatalf("raw unknown adapter: %d", r.status)
	}
}

func TestHealthChecksEjectAndReadmit(t *testing.T) {
	h := newHarness(t, 2, func(c *config.Config) {
		c.Pools[0].Health = config.HealthConfig{Interval: 100 * time.Millisecond, Timeout: 500 * time.Millisecond, UnhealthyThreshold: 2, HealthyThreshold: 3}
	})
	h.run()
	p, _ := h.srv.Pool("llama")
	in := p.Instances()[1]
	h.ups[1].SetHealthy(false)
	waitFor(t, "instance ejected", func() bool { return !in.Healthy() })
	probesAtEject := h.ups[1].Probes.Load()
	if probesAtEject < 2 {
		t.Fatalf("ejected after %d probes, want >= 2", probesAtEject)
	}
	for i := range 20 {
		if r := h.do("POST", "/v1/chat/completions", chatBody(model, fmt.Sprint(i), false), nil); r.header.Get(router.HeaderInstance) != "vllm-0" {
			t.Fatalf("request went to ejected instance %s", r.header.Get(router.HeaderInstance))
		}
	}
	h.ups[1].SetHealthy(true)
	okFrom := h.ups[1].Probes.Load()
	waitFor(t, "instance re-admitted", func() bool { return in.Healthy() })
	if n := h.ups[1].Probes.Load() - okFrom; n < 3 {
		t.Fatalf("re-admitted after %d good probes, want >= 3", n)
	}
	// A dead instance (connection refused) is ejected too.
	h.ups[0].Server.Close()
	waitFor(t, "closed instance ejected", func() bool { return !p.Instances()[0].Healthy() })
}

func TestReloadKeepsInstanceState(t *testing.T) {
	h := newHarness(t, 2, nil)
	p, _ := h.srv.Pool("llama")
	kept := p.Instances()[0]
	kept.Acquire()
	defer kept.Release()
	cfg := config.Config{Pools: []config.PoolConfig{{Name: "llama", Model: model, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Routing:   config.RoutingConfig{Strategy: "least_outstanding"},
		Instances: []config.InstanceConfig{{ID: "vllm-0", URL: h.ups[0].URL()}, {ID: "vllm-9", URL: h.ups[1].URL()}}}}}
	if err := h.srv.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	np, _ := h.srv.Pool("llama")
	if np.Instances()[0] != kept || kept.InFlight() != 1 {
		t.Fatal("reload lost the instance and its in-flight count")
	}
	if rc, _ := np.Routing(); rc.Strategy != "least_outstanding" {
		t.Fatalf("strategy after reload %q", rc.Strategy)
	}
	// least_outstanding avoids the busy one.
	if r := h.do("POST", "/v1/chat/completions", chatBody(model, "x", false), nil); r.header.Get(router.HeaderInstance) != "vllm-9" {
		t.Fatalf("went to %s", r.header.Get(router.HeaderInstance))
	}
	bad := cfg
	bad.Pools = []config.PoolConfig{cfg.Pools[0]}
	bad.Pools[0].Routing.ConcurrencyThreshold = 5000
	if err := h.srv.Reload(bad); err == nil || !strings.Contains(err.Error(), "pools[0].routing.concurrency_threshold") {
		t.Fatalf("bad reload: %v", err)
	}
	if rc, _ := np.Routing(); rc.ConcurrencyThreshold != 64 {
		t.Fatal("a rejected reload changed the routing")
	}
}

func TestHealthzReadyz(t *testing.T) {
	h := newHarness(t, 1, nil)
	for _, path := range []string{"/healthz", "/readyz", "/ping"} {
		if r := h.do("GET", path, nil, nil); r.status != http.StatusOK {
			t.Errorf("%s: %d", path, r.status)
		}
	}
}

func TestPoolLevelAdapterOnEveryInstance(t *testing.T) {
	h := newHarness(t, 3, func(c *config.Config) { c.Pools[0].Adapters = []string{"shared-lora"} })
	seen := map[string]bool{}
	for i := range 30 {
		r := h.do("POST", "/v1/chat/completions", chatBody("shared-lora", fmt.Sprintf("q%d", i), false), nil)
		if r.status != 200 {
			t.Fatalf("%d %s", r.status, r.body)
		}
		seen[r.header.Get(router.HeaderInstance)] = true
	}
	if len(seen) != 3 {
		t.Fatalf("pool-level adapter routed to %v, want all 3 instances", seen)
	}
}
