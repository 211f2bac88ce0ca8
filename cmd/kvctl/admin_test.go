package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
)

const testModel = "meta-llama/Llama-3.1-8B-Instruct"

// testRouter is a real in-process kvrouter with fake vLLM instances, its
// admin API on an httptest server.
type testRouter struct {
	srv   *httpapi.Server
	admin *httptest.Server
	ups   []*routertest.Upstream
}

// newTestRouter starts pool "llama" with n instances (and pool "qwen" with
// one when two is set); mod adjusts the config.
func newTestRouter(t *testing.T, n int, two bool, mod func(*config.Config)) *testRouter {
	t.Helper()
	tr := &testRouter{}
	pool := func(name, model string, n int) config.PoolConfig {
		pc := config.PoolConfig{Name: name, Model: model, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
		for i := range n {
			u := routertest.New(t, fmt.Sprintf("%s-%d", name, i), model)
			tr.ups = append(tr.ups, u)
			pc.Instances = append(pc.Instances, config.InstanceConfig{ID: u.ID, URL: u.URL()})
		}
		return pc
	}
	cfg := config.Config{AdminListen: "127.0.0.1:0", Pools: []config.PoolConfig{pool("llama", testModel, n)}}
	if two {
		cfg.Pools = append(cfg.Pools, pool("qwen", "Qwen/Qwen2.5-7B-Instruct", 1))
	}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler), Admin: admin.Routes(nil)})
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	tr.srv = srv
	tr.admin = httptest.NewServer(srv.AdminHandler())
	t.Cleanup(tr.admin.Close)
	return tr
}

// kvctl runs the CLI against the router's admin API.
func (tr *testRouter) kvctl(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	return runCLI(t, append(args, "--router", tr.admin.URL)...)
}

func TestRoutingSetAndGet(t *testing.T) {
	tr := newTestRouter(t, 2, true, nil)
	tests := []struct {
		name    string
		args    []string
		code    int
		stdout  []string
		stderr  string
		current string // llama's strategy afterwards
	}{
		{"get one", []string{"routing", "get", "--pool", "llama"}, 0, []string{"POOL", "llama", "prefix_aware", "8192", "64"}, "", "prefix_aware"},
		{"get all", []string{"routing", "get"}, 0, []string{"llama", "qwen", "prefix_aware"}, "", "prefix_aware"},
		{"set strategy", []string{"routing", "set", "--pool", "llama", "--strategy", "round_robin"}, 0, []string{"llama", "round_robin", "8192", "64"}, "", "round_robin"},
		{"set numbers keep strategy", []string{"routing", "set", "--pool", "llama", "--prefix-length", "2048", "--concurrency-threshold", "8"}, 0, []string{"round_robin", "2048", "8"}, "", "round_robin"},
		{"out of range", []string{"routing", "set", "--pool", "llama", "--prefix-length", "100"}, 1, nil, "400 Bad Request: routing.prefix_length 100 out of range 1024..65536", "round_robin"},
		{"threshold out of range", []string{"routing", "set", "--pool", "llama", "--concurrency-threshold", "5000"}, 1, nil, "routing.concurrency_threshold 5000 out of range 1..1024", "round_robin"},
		{"unknown strategy", []string{"routing", "set", "--pool", "llama", "--strategy", "fastest"}, 1, nil, `routing.strategy "fastest"`, "round_robin"},
		{"kv_aware without index", []string{"routing", "set", "--pool", "llama", "--strategy", "kv_aware"}, 1, nil, "400 Bad Request", "round_robin"},
		{"unknown pool", []string{"routing", "set", "--pool", "nope", "--strategy", "random"}, 1, nil, `404 Not Found: no pool "nope"`, "round_robin"},
		{"unknown pool get", []string{"routing", "get", "--pool", "nope"}, 1, nil, `no pool "nope"`, "round_robin"},
		{"nothing to change", []string{"routing", "set", "--pool", "llama"}, 2, []string{"Usage: kvctl routing set"}, "nothing to change", "round_robin"},
		{"no pool", []string{"routing", "set", "--strategy", "random"}, 2, nil, "--pool is required", "round_robin"},
		{"bad int", []string{"routing", "set", "--pool", "llama", "--prefix-length", "lots"}, 2, nil, "invalid value", "round_robin"},
		{"stray argument", []string{"routing", "get", "llama"}, 2, nil, `unexpected argument "llama"`, "round_robin"},
		{"shadow without index", []string{"routing", "set", "--pool", "llama", "--shadow=true"}, 1, nil, "400 Bad Request", "round_robin"},
		{"set back", []string{"routing", "set", "--pool", "llama", "--strategy", "least_outstanding", "--json"}, 0, []string{`"strategy": "least_outstanding"`, `"prefix_length": 2048`}, "", "least_outstanding"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := tr.kvctl(t, tc.args...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d\nstdout %s\nstderr %s", code, tc.code, out, errOut)
			}
			for _, s := range tc.stdout {
				if !strings.Contains(out, s) {
					t.Errorf("stdout lacks %q:\n%s", s, out)
				}
			}
			if !strings.Contains(errOut, tc.stderr) {
				t.Errorf("stderr %q lacks %q", errOut, tc.stderr)
			}
			p, _ := tr.srv.Pool("llama")
			if rc, _ := p.Routing(); rc.Strategy != tc.current {
				t.Errorf("router's strategy %q, want %q", rc.Strategy, tc.current)
			}
		})
	}
	// The other pool never changed.
	q, _ := tr.srv.Pool("qwen")
	if rc, _ := q.Routing(); rc.Strategy != "prefix_aware" || rc.PrefixLength != 8192 {
		t.Fatalf("qwen routing changed: %+v", rc)
	}
}

func TestRoutingGetJSONAllPools(t *testing.T) {
	tr := newTestRouter(t, 1, true, nil)
	code, out, errOut := tr.kvctl(t, "routing", "get", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var got []struct {
		Pool    string
		Model   string
		Routing struct {
			Strategy     string `json:"strategy"`
			PrefixLength int    `json:"prefix_length"`
		}
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	if len(got) != 2 || got[0].Pool != "llama" || got[0].Model != testModel || got[1].Pool != "qwen" || got[1].Routing.Strategy != "prefix_aware" || got[1].Routing.PrefixLength != 8192 {
		t.Fatalf("routing get --json: %+v", got)
	}
}

func TestAdminTokenAndConnectionErrors(t *testing.T) {
	tr := newTestRouter(t, 1, false, func(c *config.Config) { c.AdminToken = "s3cret" })
	closed := fmt.Sprintf("http://127.0.0.1:%d", testenv.FreePort(t))
	// A router that accepts and never answers.
	hung := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	t.Cleanup(hung.Close)
	tests := []struct {
		name   string
		env    map[string]string
		args   []string
		code   int
		stderr string
	}{
		{"no token", nil, []string{"--router", tr.admin.URL}, 1, "401 Unauthorized: admin API: missing or wrong bearer token (set --token or KVROUTER_ADMIN_TOKEN)"},
		{"wrong token", nil, []string{"--router", tr.admin.URL, "--token", "nope"}, 1, "401"},
		{"token flag", nil, []string{"--router", tr.admin.URL, "--token", "s3cret"}, 0, ""},
		{"env", map[string]string{"KVROUTER_ADMIN_URL": tr.admin.URL, "KVROUTER_ADMIN_TOKEN": "s3cret"}, nil, 0, ""},
		{"flag beats env", map[string]string{"KVROUTER_ADMIN_URL": closed, "KVROUTER_ADMIN_TOKEN": "s3cret"}, []string{"--router", tr.admin.URL}, 0, ""},
		{"connection refused", nil, []string{"--router", closed}, 1, "connection refused: is kvrouter running with its admin API there?"},
		{"env connection refused", map[string]string{"KVROUTER_ADMIN_URL": closed}, nil, 1, closed + "/admin/pools"},
		{"timeout", nil, []string{"--router", hung.URL, "--timeout", "200ms"}, 1, "no answer within 200ms (--timeout)"},
		{"bad url", nil, []string{"--router", "127.0.0.1:8081"}, 2, "want an http:// or https:// URL"},
		{"bad timeout", nil, []string{"--router", tr.admin.URL, "--timeout", "0s"}, 2, "--timeout 0s: must be positive"},
		{"data listener", nil, []string{"--router", tr.admin.URL + "/nothing-here", "--token", "s3cret"}, 1, "404 Not Found"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("KVROUTER_ADMIN_URL", "")
			t.Setenv("KVROUTER_ADMIN_TOKEN", "")
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			code, out, errOut := runCLI(t, append([]string{"routing", "get"}, tc.args...)...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d\nstdout %s\nstderr %s", code, tc.code, out, errOut)
			}
			if !strings.Contains(errOut, tc.stderr) {
				t.Errorf("stderr %q lacks %q", errOut, tc.stderr)
			}
			if tc.code == 0 && !strings.Contains(out, "prefix_aware") {
				t.Errorf("stdout %q", out)
			}
		})
	}
}

func TestErrorMessage(t *testing.T) {
	tests := []struct{ body, want string }{
		{`{"error":{"message":"no pool \"x\"","type":"not_found_error","param":null,"code":404}}`, `no pool "x"`},
		{"unknown tier \"x\" (want gpu, cpu, disk, shared or all)\n", `unknown tier "x" (want gpu, cpu, disk, shared or all)`},
		{`{"error":"flat"}`, `{"error":"flat"}`},
		{"", ""},
		{strings.Repeat("x", 400), strings.Repeat("x", 300) + "…"},
	}
	for _, tc := range tests {
		if got := errorMessage([]byte(tc.body)); got != tc.want {
			t.Errorf("errorMessage(%.40q) = %q, want %q", tc.body, got, tc.want)
		}
	}
}

// TestNotFoundHint: a 404 a handler answered (a pool, model or instance
// the router lacks) carries its message alone; only a path the router has
// no route for gets the hint about --router and the router's version.
func TestNotFoundHint(t *testing.T) {
	const hint = "does not serve that endpoint"
	tests := []struct {
		body     string
		wantHint bool
	}{
		{`{"error":{"message":"decide: the model \"m\" does not exist in pool \"llama\"","type":"not_found_error","param":null,"code":404}}`, false},
		{`{"error":{"message":"no pool \"x\"","type":"not_found_error","param":null,"code":404}}`, false},
		{"unknown pool \"nope\"\n", false},
		{"404 page not found\n", true},
		// The data listener's answer for a path it has no route for (the
		// admin API mounted there).
		{`{"error":{"message":"no route for GET /admin/pools/x/nothing","type":"not_found_error","param":null,"code":404}}`, true},
	}
	for _, tc := range tests {
		e := newHTTPError("GET", "http://r/admin/x", http.StatusNotFound, []byte(tc.body))
		if got := strings.Contains(e.Hint, hint); got != tc.wantHint {
			t.Errorf("404 %.50q: hint %q, want the endpoint hint %v", tc.body, e.Hint, tc.wantHint)
		}
	}
}

func TestHelpPerCommand(t *testing.T) {
	tests := []struct {
		args   []string
		want   string
		common bool // lists the common admin flags
	}{
		{[]string{"instances", "--help"}, "GET /admin/pools/{pool}/instances", true},
		{[]string{"lookup", "--help"}, "--prompt-file", true},
		{[]string{"decide", "--help"}, "POST /admin/pools/{pool}/decide", true},
		{[]string{"routing", "set", "--help"}, "PUT /admin/pools/{pool}/routing", true},
		{[]string{"routing", "get", "-h"}, "GET /admin/pools/{pool}/routing", true},
		{[]string{"tail", "evictions", "--help"}, "kv.evictions.<pool>.<instance>", true},
		{[]string{"routing", "--help"}, "routing set", false},
		{[]string{"tail", "--help"}, "tail evictions", false},
	}
	for _, tc := range tests {
		code, out, errOut := runCLI(t, tc.args...)
		if code != 0 || !strings.Contains(out, tc.want) || tc.common && !strings.Contains(out, "KVROUTER_ADMIN_TOKEN") {
			t.Errorf("%v: exit %d, stdout lacks %q or the common flags:\n%s%s", tc.args, code, tc.want, out, errOut)
		}
	}
}
