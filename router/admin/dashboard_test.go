package admin_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
)

const dashModel = "dash-model"

// dashRouter is a router with a KV index in front of n simulated engines
// (sim/simserver: real OpenAI handlers reporting cached tokens), kv_aware with
// shadow comparison, behind an admin token.
func dashRouter(t testing.TB, n int, mod func(*config.Config)) (*httpapi.Server, kvindex.Index) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: dashModel, BlockSize: sim.DefaultBlockSize})
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	pc := config.PoolConfig{Name: "dash", Model: dashModel,
		Routing:   config.RoutingConfig{Strategy: "kv_aware", Shadow: true},
		Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
		Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range n {
		in, err := simserver.Start(ctx, simserver.Config{Engine: sim.Config{Model: dashModel, HashSeed: uint64(i + 1)}, TimeScale: 100, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = in.Close() })
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: string(rune('a' + i)), URL: in.URL()})
	}
	cfg := config.Config{Pools: []config.PoolConfig{pc}, AdminToken: "s3cret"}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: log, Admin: admin.Routes(nil), KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })})
	if err != nil {
		t.Fatal(err)
	}
	return srv, idx
}

func get(t *testing.T, h http.Handler, path, token string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(http.MethodGet, path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

func TestDashboardRoutesAndToken(t *testing.T) {
	srv, _ := dashRouter(t, 1, nil)
	split, _ := dashRouter(t, 1, func(c *config.Config) { c.AdminListen = "127.0.0.1:0"; c.AdminToken = "" })
	tests := []struct {
		name   string
		h      http.Handler
		path   string
		token  string
		status int
		ctype  string
	}{
		{"page needs no token", srv.Handler(), "/dashboard", "", 200, "text/html"},
		{"data needs the token", srv.Handler(), "/admin/dashboard.json", "", 401, "application/json"},
		{"wrong token", srv.Handler(), "/admin/dashboard.json", "nope", 401, "application/json"},
		{"right token", srv.Handler(), "/admin/dashboard.json", "s3cret", 200, "application/json"},
		{"admin listener serves the page", split.AdminHandler(), "/dashboard", "", 200, "text/html"},
		{"no token configured", split.AdminHandler(), "/admin/dashboard.json", "", 200, "application/json"},
		{"not on the data listener when admin is separate", split.Handler(), "/dashboard", "", 404, "application/json"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rec := get(t, tc.h, tc.path, tc.token)
			if rec.Code != tc.status || !strings.HasPrefix(rec.Header().Get("Content-Type"), tc.ctype) {
				t.Fatalf("GET %s: %d %q, want %d %q: %s", tc.path, rec.Code, rec.Header().Get("Content-Type"), tc.status, tc.ctype, rec.Body.Bytes())
			}
		})
	}
	page := get(t, srv.Handler(), "/dashboard", "").Body.String()
	for _, want := range []string{"<title>kvrouter dashboard</title>", "admin/dashboard.json", "v1/kv/evictions", "sessionStorage"} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	// Offline: nothing is loaded from another origin.
	for _, bad := range []string{"http://", "https://", "<link", "src="} {
		if strings.Contains(page, bad) {
			t.Errorf("page refers to an external asset (%q)", bad)
		}
	}
	if strings.Contains(page, "s3cret") {
		t.Error("page carries the admin token")
	}
	if csp := get(t, srv.Handler(), "/dashboard", "").Header().Get("Content-Security-Policy"); !strings.Contains(csp, "connect-src 'self'") {
		t.Errorf("CSP %q", csp)
	}
}

func TestDashboardSummary(t *testing.T) {
	srv, idx := dashRouter(t, 2, nil)
	ctx := context.Background()
	// Instance a holds three blocks on GPU, two of them also on CPU;
	// b holds one on GPU. The CPU event has only hashes, as vLLM sends it.
	toks := make([]uint32, 3*sim.DefaultBlockSize)
	for i := range toks {
		toks[i] = uint32(1000 + i)
	}
	apply := []struct {
		inst string
		ev   events.Event
	}{
		{"a", events.Event{Kind: events.BlockStored, BlockHashes: []uint64{11, 12, 13}, TokenIDs: toks, BlockSize: sim.DefaultBlockSize, Medium: "GPU"}},
		{"a", events.Event{Kind: events.BlockStored, BlockHashes: []uint64{11, 12}, Medium: "CPU"}},
		{"b", events.Event{Kind: events.BlockStored, BlockHashes: []uint64{21}, TokenIDs: toks[:sim.DefaultBlockSize], BlockSize: sim.DefaultBlockSize, Medium: "GPU"}},
	}
	for _, a := range apply {
		if _, err := idx.Apply(ctx, a.inst, []events.Event{a.ev}); err != nil {
			t.Fatal(err)
		}
	}
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	const requests = 5
	body := map[string]any{"model": dashModel, "max_tokens": 2, "messages": []map[string]string{
		{"role": "system", "content": strings.Repeat("a long shared system prompt for the dashboard test ", 20)},
		{"role": "user", "content": "hello"}}}
	for range requests {
		if resp := testenv.PostJSON(t, ts.URL+"/v1/chat/completions", body); resp.Status != 200 {
			t.Fatalf("chat: HTTP %d", resp.Status)
		}
	}

	rec := get(t, srv.Handler(), "/admin/dashboard.json", "s3cret")
	var sum admin.DashboardSummary
	if err := json.Unmarshal(rec.Body.Bytes(), &sum); err != nil {
		t.Fatalf("decode: %v\n%s", err, rec.Body.Bytes())
	}
	if len(sum.Pools) != 1 {
		t.Fatalf("pools: %+v", sum.Pools)
	}
	p := sum.Pools[0]
	total := func(m map[string]int64) (n int64) {
		for _, v := range m {
			n += v
		}
		return n
	}
	blocks := map[string]map[string]int{}
	var perInst int64
	for _, in := range p.Instances {
		blocks[in.ID] = in.Blocks
		perInst += in.Requests
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"strategy", p.Strategy, "kv_aware"},
		{"shadow", p.Shadow, true},
		{"kv index", p.KVIndex, true},
		{"stream healthy", p.StreamHealthy != nil && *p.StreamHealthy, true},
		{"requests", p.Requests, int64(requests)},
		{"requests per instance add up", perInst, int64(requests)},
		{"statuses by class", p.Statuses["2xx"], int64(requests)},
		{"no 5xx", p.Statuses["5xx"], int64(0)},
		{"ttfb observed per request", p.TTFB.Count, int64(requests)},
		{"ttfb +Inf bucket is the count", len(p.TTFB.Bounds) > 0 && len(p.TTFB.Buckets) == len(p.TTFB.Bounds) && p.TTFB.Buckets[len(p.TTFB.Buckets)-1] <= p.TTFB.Count, true},
		{"ttfb time spent", p.TTFB.Sum > 0, true},
		{"decisions add up", total(p.Decisions), int64(requests)},
		{"kv decisions add up", total(p.KVDecisions), int64(requests)},
		{"compared", p.Agreement.Compared, int64(requests)},
		{"usage reported", p.HitRate.Reported, int64(requests)},
		{"a gpu", blocks["a"]["gpu"], 3},
		{"a cpu", blocks["a"]["cpu"], 2},
		{"b gpu", blocks["b"]["gpu"], 1},
		{"b cpu", blocks["b"]["cpu"], 0},
		{"index entries", p.IndexEntries, 4},
		{"some prompt tokens", p.HitRate.PromptTokens > 0, true},
		// The same prompt five times: the engine reports the last four
		// cached, and the index predicts the hits through its speculative
		// entries.
		{"engine cached tokens", p.HitRate.EngineCachedTokens > 0, true},
		{"engine hit rate in (0,1)", p.HitRate.Engine > 0 && p.HitRate.Engine < 1, true},
		{"agreement rate in [0,1]", p.Agreement.Rate >= 0 && p.Agreement.Rate <= 1, true},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s: got %v, want %v", c.name, c.got, c.want)
		}
	}
	if t.Failed() {
		t.Logf("summary: %s", rec.Body.Bytes())
	}
}

// BenchmarkDashboardJSON is one poll of the page: a Gather of the router's
// registry, the pool's compare state and the index's instance stats, for a
// kv_aware pool of 8 instances after some traffic.
func BenchmarkDashboardJSON(b *testing.B) {
	srv, idx := dashRouter(b, 8, func(c *config.Config) { c.AdminToken = "" })
	toks := make([]uint32, 64*sim.DefaultBlockSize)
	for i := range toks {
		toks[i] = uint32(i)
	}
	for i := range 8 {
		hashes := make([]uint64, 64)
		for j := range hashes {
			hashes[j] = uint64(i<<20 | j + 1)
		}
		ev := events.Event{Kind: events.BlockStored, BlockHashes: hashes, TokenIDs: toks, BlockSize: sim.DefaultBlockSize, Medium: "GPU"}
		if _, err := idx.Apply(context.Background(), string(rune('a'+i)), []events.Event{ev}); err != nil {
			b.Fatal(err)
		}
	}
	h := srv.Handler()
	body, _ := json.Marshal(map[string]any{"model": dashModel, "max_tokens": 1, "messages": []map[string]string{{"role": "user", "content": "warm up"}}})
	for range 16 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body)))
		if rec.Code != 200 {
			b.Fatalf("chat: %d %s", rec.Code, rec.Body.Bytes())
		}
	}
	req := httptest.NewRequest(http.MethodGet, "/admin/dashboard.json", nil)
	b.ReportAllocs()
	for b.Loop() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != 200 {
			b.Fatal(rec.Code)
		}
	}
}
