package admin_test

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
	"github.com/kvrouter/kvrouter/router/servertest"
)

func TestAdminSwitchRouting(t *testing.T) {
	h := servertest.New(t, 3, nil)
	body := servertest.ChatBody(servertest.Model, "switch", false)
	if s := h.Do("POST", "/v1/chat/completions", body, nil).Header.Get(router.HeaderStrategy); s != "prefix_aware" {
		t.Fatalf("strategy %q", s)
	}
	r := h.Do("PUT", "/admin/pools/llama/routing", []byte(`{"strategy":"round_robin"}`), nil)
	if r.Status != 200 {
		t.Fatalf("PUT routing: %d %s", r.Status, r.Body)
	}
	var rc config.RoutingConfig
	if err := json.Unmarshal(r.Body, &rc); err != nil || rc.Strategy != "round_robin" || rc.PrefixLength != 8192 || rc.ConcurrencyThreshold != 64 {
		t.Fatalf("PUT answer %s (%v): want round_robin with the other fields kept", r.Body, err)
	}
	seen := map[string]bool{}
	for range 3 {
		rr := h.Do("POST", "/v1/chat/completions", body, nil)
		if rr.Header.Get(router.HeaderStrategy) != "round_robin" || rr.Header.Get(router.HeaderReason) != "round_robin" {
			t.Fatalf("after switch: strategy %q reason %q", rr.Header.Get(router.HeaderStrategy), rr.Header.Get(router.HeaderReason))
		}
		seen[rr.Header.Get(router.HeaderInstance)] = true
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
		// A zero or empty value given is out of range too, not "the
		// default": an empty variable in a script must not switch a pool
		// back to the defaults (kv_aware to prefix_aware).
		{`{"concurrency_threshold": 0}`, "routing.concurrency_threshold 0 out of range 1..1024"},
		{`{"prefix_length": 0}`, "routing.prefix_length 0 out of range 1024..65536"},
		{`{"strategy": ""}`, `routing.strategy ""`},
		{`{"stratgy": "random"}`, `unknown field "stratgy"`},
		{`{"strategy": `, "malformed JSON"},
	}
	for _, tc := range bad {
		r := h.Do("PUT", "/admin/pools/llama/routing", []byte(tc.body), nil)
		msg, _ := servertest.ErrorOf(t, r)
		if r.Status != 400 || !strings.Contains(msg, tc.field) {
			t.Errorf("PUT %s: %d %q, want 400 naming %q", tc.body, r.Status, msg, tc.field)
		}
	}
	// Rejected updates left the routing alone.
	if r := h.Do("GET", "/admin/pools/llama/routing", nil, nil); !strings.Contains(string(r.Body), `"round_robin"`) {
		t.Fatalf("routing after rejected updates: %s", r.Body)
	}
	if r := h.Do("PUT", "/admin/pools/nope/routing", []byte(`{}`), nil); r.Status != 404 {
		t.Fatalf("unknown pool: %d", r.Status)
	}
}

func TestAdminToken(t *testing.T) {
	h := servertest.New(t, 1, func(c *config.Config) { c.AdminToken = "s3cret" })
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
			r := h.Do(req.method, req.path, []byte(req.body), hdr)
			if r.Status != tc.status {
				t.Errorf("%s %s with %q: %d, want %d", req.method, req.path, tc.auth, r.Status, tc.status)
			}
			if tc.status == 401 && r.Header.Get("WWW-Authenticate") == "" {
				t.Errorf("401 without WWW-Authenticate")
			}
		}
	}
}

// Without an admin token the profiling endpoints are off (403), whatever
// the admin API does.
func TestPprofNeedsAToken(t *testing.T) {
	h := servertest.New(t, 1, nil)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/cmdline"} {
		if r := h.Do("GET", path, nil, nil); r.Status != 403 {
			t.Errorf("GET %s without a token configured: %d, want 403", path, r.Status)
		}
	}
	h = servertest.New(t, 1, func(c *config.Config) { c.AdminToken = "s3cret" })
	if r := h.Do("GET", "/debug/pprof/cmdline", nil, map[string]string{"Authorization": "Bearer s3cret"}); r.Status != 200 {
		t.Errorf("pprof with the token: %d", r.Status)
	}
}

func TestAdminListPoolsAndMetrics(t *testing.T) {
	h := servertest.New(t, 2, nil)
	h.Do("POST", "/v1/chat/completions", servertest.ChatBody(servertest.Model, "count me", false), nil)
	h.Do("POST", "/v1/chat/completions", servertest.ChatBody("nope", "count me", false), nil)
	r := h.Do("GET", "/admin/pools", nil, nil)
	var pools []router.PoolStatus
	if err := json.Unmarshal(r.Body, &pools); err != nil || len(pools) != 1 {
		t.Fatalf("pools %s: %v", r.Body, err)
	}
	p := pools[0]
	if p.Name != "llama" || p.Model != servertest.Model || len(p.Instances) != 2 || !p.Instances[0].Healthy || p.Routing.Strategy != "prefix_aware" {
		t.Fatalf("pool status %+v", p)
	}
	m := h.Do("GET", "/metrics", nil, nil)
	for _, want := range []string{
		`kvrouter_requests_total{instance="vllm-`,
		`kvrouter_requests_total{instance="",pool="",reason="",status="404",strategy=""} 1`,
		`kvrouter_decision_seconds_bucket{pool="llama",strategy="prefix_aware"`,
		`kvrouter_upstream_ttfb_seconds_count{instance="vllm-`,
		`kvrouter_instance_in_flight{instance="vllm-0",pool="llama"} 0`,
		`kvrouter_instance_healthy{instance="vllm-1",pool="llama"} 1`,
		`kvrouter_pool_strategy{pool="llama",strategy="prefix_aware"} 1`,
	} {
		if !strings.Contains(string(m.Body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestSeparateAdminHandler(t *testing.T) {
	h := servertest.New(t, 1, func(c *config.Config) { c.AdminListen = "127.0.0.1:0" })
	if r := h.Do("GET", "/admin/pools", nil, nil); r.Status != 404 {
		t.Fatalf("admin API on the data listener with admin_listen set: %d", r.Status)
	}
	if r := h.Do("GET", "/metrics", nil, nil); r.Status != 404 {
		t.Fatalf("/metrics on the data listener with admin_listen set: %d", r.Status)
	}
	rec := servertest.Record(t, h.Srv.AdminHandler(), "GET", "/admin/pools")
	if rec.Code != 200 {
		t.Fatalf("admin handler: %d", rec.Code)
	}
}

func TestModelsUnion(t *testing.T) {
	h := servertest.New(t, 1, func(c *config.Config) {
		c.Pools[0].Adapters = []string{"sql-lora"}
		qwen := routertest.New(t, "qwen-0", "Qwen/Qwen3-8B")
		c.Pools = append(c.Pools, config.PoolConfig{Name: "qwen", Model: "Qwen/Qwen3-8B", Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "qwen-0", URL: qwen.URL()}}})
	})
	r := h.Do("GET", "/v1/models", nil, nil)
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.Unmarshal(r.Body, &list); err != nil || list.Object != "list" {
		t.Fatalf("models %s: %v", r.Body, err)
	}
	var ids []string
	for _, m := range list.Data {
		id := m.ID
		if m.Parent != nil {
			id += "<" + *m.Parent
		}
		ids = append(ids, id)
	}
	if got, want := strings.Join(ids, ","), servertest.Model+",sql-lora<"+servertest.Model+",Qwen/Qwen3-8B"; got != want {
		t.Fatalf("models %s, want %s", got, want)
	}
	// Requests pick their pool by model.
	if r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody("Qwen/Qwen3-8B", "hi", false), nil); r.Header.Get(router.HeaderInstance) != "qwen-0" {
		t.Fatalf("Qwen request went to %q", r.Header.Get(router.HeaderInstance))
	}
}

func TestLoRAAdapters(t *testing.T) {
	mk := func(fallback string) *servertest.Harness {
		h := servertest.New(t, 0, func(c *config.Config) {
			c.Pools[0].AdapterFallback = fallback
			c.Pools[0].Discovery = config.DiscoveryConfig{Interval: time.Second}
			for i, ad := range [][]string{{"sql-lora"}, {}, {"sql-lora", "chat-lora"}, {}} {
				u := routertest.New(t, fmt.Sprintf("vllm-%d", i), servertest.Model, ad...)
				c.Pools[0].Instances = append(c.Pools[0].Instances, config.InstanceConfig{ID: u.ID, URL: u.URL()})
			}
			// One adapter known only from config.
			c.Pools[0].Instances[3].Adapters = []string{"static-lora"}
		})
		h.Run()
		p, _ := h.Srv.Pool("llama")
		servertest.WaitFor(t, "adapters discovered", func() bool {
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
		{servertest.Model, map[string]bool{"vllm-0": true, "vllm-1": true, "vllm-2": true, "vllm-3": true}},
	}
	for _, tc := range tests {
		seen := map[string]bool{}
		for i := range 40 {
			r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody(tc.model, fmt.Sprintf("q%d", i), false), nil)
			if r.Status != 200 {
				t.Fatalf("%s: %d %s", tc.model, r.Status, r.Body)
			}
			seen[r.Header.Get(router.HeaderInstance)] = true
		}
		if fmt.Sprint(seen) != fmt.Sprint(tc.want) {
			t.Errorf("%s routed to %v, want %v", tc.model, seen, tc.want)
		}
	}
	// The only holder of chat-lora goes down: 503 without fallback ...
	p, _ := h.Srv.Pool("llama")
	p.Instances()[2].SetHealthy(false)
	if r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody("chat-lora", "x", false), nil); r.Status != 503 || !strings.Contains(string(r.Body), "chat-lora") {
		t.Fatalf("no holder, no fallback: %d %s", r.Status, r.Body)
	}
	// ... and any healthy instance with fallback "all".
	h2 := mk("all")
	p2, _ := h2.Srv.Pool("llama")
	p2.Instances()[2].SetHealthy(false)
	if r := h2.Do("POST", "/v1/chat/completions", servertest.ChatBody("chat-lora", "x", false), nil); r.Status != 200 {
		t.Fatalf("fallback all: %d %s", r.Status, r.Body)
	}
	// The raw path names the adapter in a header.
	if r := h.Do("POST", "/invocations", []byte(`{}`), map[string]string{router.HeaderAdapter: "sql-lora"}); r.Status != 200 || !map[string]bool{"vllm-0": true, "vllm-2": true}[r.Header.Get(router.HeaderInstance)] {
		t.Fatalf("raw adapter: %d on %s", r.Status, r.Header.Get(router.HeaderInstance))
	}
	if r := h.Do("POST", "/invocations", []byte(`{}`), map[string]string{router.HeaderAdapter: "nope-lora"}); r.Status != 404 {
		t.Fatalf("raw unknown adapter: %d", r.Status)
	}
}

func TestHealthChecksEjectAndReadmit(t *testing.T) {
	h := servertest.New(t, 2, func(c *config.Config) {
		c.Pools[0].Health = config.HealthConfig{Interval: 100 * time.Millisecond, Timeout: 500 * time.Millisecond, UnhealthyThreshold: 2, HealthyThreshold: 3}
	})
	h.Run()
	p, _ := h.Srv.Pool("llama")
	in := p.Instances()[1]
	h.Ups[1].SetHealthy(false)
	servertest.WaitFor(t, "instance ejected", func() bool { return !in.Healthy() })
	probesAtEject := h.Ups[1].Probes.Load()
	if probesAtEject < 2 {
		t.Fatalf("ejected after %d probes, want >= 2", probesAtEject)
	}
	for i := range 20 {
		if r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody(servertest.Model, fmt.Sprint(i), false), nil); r.Header.Get(router.HeaderInstance) != "vllm-0" {
			t.Fatalf("request went to ejected instance %s", r.Header.Get(router.HeaderInstance))
		}
	}
	h.Ups[1].SetHealthy(true)
	okFrom := h.Ups[1].Probes.Load()
	servertest.WaitFor(t, "instance re-admitted", func() bool { return in.Healthy() })
	if n := h.Ups[1].Probes.Load() - okFrom; n < 3 {
		t.Fatalf("re-admitted after %d good probes, want >= 3", n)
	}
	// A dead instance (connection refused) is ejected too.
	h.Ups[0].Server.Close()
	servertest.WaitFor(t, "closed instance ejected", func() bool { return !p.Instances()[0].Healthy() })
}

func TestReloadKeepsInstanceState(t *testing.T) {
	h := servertest.New(t, 2, nil)
	p, _ := h.Srv.Pool("llama")
	kept := p.Instances()[0]
	kept.Acquire()
	defer kept.Release()
	cfg := config.Config{Pools: []config.PoolConfig{{Name: "llama", Model: servertest.Model, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Routing:   config.RoutingConfig{Strategy: "least_outstanding"},
		Instances: []config.InstanceConfig{{ID: "vllm-0", URL: h.Ups[0].URL()}, {ID: "vllm-9", URL: h.Ups[1].URL()}}}}}
	if err := h.Srv.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	np, _ := h.Srv.Pool("llama")
	if np.Instances()[0] != kept || kept.InFlight() != 1 {
		t.Fatal("reload lost the instance and its in-flight count")
	}
	if rc, _ := np.Routing(); rc.Strategy != "least_outstanding" {
		t.Fatalf("strategy after reload %q", rc.Strategy)
	}
	// least_outstanding avoids the busy one.
	if r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody(servertest.Model, "x", false), nil); r.Header.Get(router.HeaderInstance) != "vllm-9" {
		t.Fatalf("went to %s", r.Header.Get(router.HeaderInstance))
	}
	bad := cfg
	bad.Pools = []config.PoolConfig{cfg.Pools[0]}
	bad.Pools[0].Routing.ConcurrencyThreshold = 5000
	if err := h.Srv.Reload(bad); err == nil || !strings.Contains(err.Error(), "pools[0].routing.concurrency_threshold") {
		t.Fatalf("bad reload: %v", err)
	}
	if rc, _ := np.Routing(); rc.ConcurrencyThreshold != 64 {
		t.Fatal("a rejected reload changed the routing")
	}
}

func TestHealthzReadyz(t *testing.T) {
	h := servertest.New(t, 1, nil)
	for _, path := range []string{"/healthz", "/readyz", "/ping"} {
		if r := h.Do("GET", path, nil, nil); r.Status != http.StatusOK {
			t.Errorf("%s: %d", path, r.Status)
		}
	}
}

func TestPoolLevelAdapterOnEveryInstance(t *testing.T) {
	h := servertest.New(t, 3, func(c *config.Config) { c.Pools[0].Adapters = []string{"shared-lora"} })
	seen := map[string]bool{}
	for i := range 30 {
		r := h.Do("POST", "/v1/chat/completions", servertest.ChatBody("shared-lora", fmt.Sprintf("q%d", i), false), nil)
		if r.Status != 200 {
			t.Fatalf("%d %s", r.Status, r.Body)
		}
		seen[r.Header.Get(router.HeaderInstance)] = true
	}
	if len(seen) != 3 {
		t.Fatalf("pool-level adapter routed to %v, want all 3 instances", seen)
	}
}
