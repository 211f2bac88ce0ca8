package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

const (
	kvModel = "llama-kv-http"
	kvBS    = 16
)

// kvEngine is a fake vLLM instance with a prefix cache: it answers
// completions with usage.prompt_tokens_details.cached_tokens computed from
// the blocks it holds, and — like the engine with KV events on — reports
// every block it stores to the router's index (the events consumer's job
// in production, done directly here). It honours cache_salt as vLLM does:
// the salt roots the block chain, so a prompt cached under one salt is a
// miss under another, and the salt goes on the event (vLLM puts it in
// block 0's extra_keys).
type kvEngine struct {
	id  string
	idx kvindex.Index
	srv *httptest.Server

	mu    sync.Mutex // guards held and salts
	held  map[kvindex.Key]bool
	salts []string // cache_salt of every request received, in order ("" = none)
}

func newKVEngine(t *testing.T, id string, idx kvindex.Index) *kvEngine {
	e := &kvEngine{id: id, idx: idx, held: map[kvindex.Key]bool{}}
	e.srv = httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *kvEngine) hash(k kvindex.Key) uint64 { return uint64(k) ^ 0x5bd1e995 ^ uint64(len(e.id))<<40 }

// store computes the prompt's blocks under salt: cached_tokens for it,
// then BlockStored for the new blocks.
func (e *kvEngine) store(salt string, tokens []uint32) (cached int) {
	keys := kvindex.Keys(kvindex.Root(kvModel, "", salt), tokens, kvBS)
	e.mu.Lock()
	hit := 0
	for hit < len(keys) && e.held[keys[hit]] {
		hit++
	}
	for _, k := range keys[hit:] {
		e.held[k] = true
	}
	e.mu.Unlock()
	if hit < len(keys) {
		ev := events.Event{Kind: events.BlockStored, BlockSize: kvBS, Medium: "GPU", CacheSalt: salt, TokenIDs: tokens[hit*kvBS : len(keys)*kvBS]}
		for _, k := range keys[hit:] {
			ev.BlockHashes = append(ev.BlockHashes, e.hash(k))
		}
		if hit > 0 {
			ev.ParentHash, ev.HasParent = e.hash(keys[hit-1]), true
		}
		if _, err := e.idx.Apply(context.Background(), e.id, []events.Event{ev}); err != nil {
			panic(err)
		}
	}
	return hit * kvBS
}

// evict drops every block, with the BlockRemoved events.
func (e *kvEngine) evict() {
	e.mu.Lock()
	ev := events.Event{Kind: events.BlockRemoved, Medium: "GPU"}
	for k := range e.held {
		ev.BlockHashes = append(ev.BlockHashes, e.hash(k))
	}
	e.held = map[kvindex.Key]bool{}
	e.mu.Unlock()
	if _, err := e.idx.Apply(context.Background(), e.id, []events.Event{ev}); err != nil {
		panic(err)
	}
}

func (e *kvEngine) serve(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Prompt    []uint32 `json:"prompt"`
		Stream    bool     `json:"stream"`
		CacheSalt string   `json:"cache_salt"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	e.mu.Lock()
	e.salts = append(e.salts, req.CacheSalt)
	e.mu.Unlock()
	cached := e.store(req.CacheSalt, req.Prompt)
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}`, len(req.Prompt), len(req.Prompt)+2, cached)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-%s","object":"text_completion","model":%q,"choices":[{"index":0,"text":"ok"}],"usage":%s}`, e.id, kvModel, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	for _, tok := range []string{"o", "k"} {
		fmt.Fprintf(w, "data: {\"id\":\"cmpl-%s\",\"choices\":[{\"index\":0,\"text\":%q}],\"usage\":null}\n\n", e.id, tok)
		fl.Flush()
	}
	fmt.Fprintf(w, "data: {\"id\":\"cmpl-%s\",\"choices\":[],\"usage\":%s}\n\ndata: [DONE]\n\n", e.id, usage)
}

func (e *kvEngine) lastSalt() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.salts) == 0 {
		return "<no request>"
	}
	return e.salts[len(e.salts)-1]
}

type kvHTTP struct {
	t       *testing.T
	srv     *httpapi.Server
	ts      *httptest.Server
	engines map[string]*kvEngine
}

// newKVHTTP serves one pool "p" of n kvEngines sharing a memory index;
// edits change the configuration before the server is built.
func newKVHTTP(t *testing.T, n int, routing config.RoutingConfig, edits ...func(*config.Config)) *kvHTTP {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
	if err != nil {
		t.Fatal(err)
	}
	h := &kvHTTP{t: t, engines: map[string]*kvEngine{}}
	pc := config.PoolConfig{Name: "p", Model: kvModel, Routing: routing,
		Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range n {
		e := newKVEngine(t, fmt.Sprintf("vllm-%d", i), idx)
		h.engines[e.id] = e
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: e.id, URL: e.srv.URL})
	}
	cfg := config.Config{Pools: []config.PoolConfig{pc}}
	for _, edit := range edits {
		edit(&cfg)
	}
	h.srv, h.ts = servertest.Serve(t, cfg, httpapi.Options{Admin: admin.Routes(nil),
		Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(p config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
			return idx, nil
		}),
	})
	return h
}

func (h *kvHTTP) complete(tokens []uint32, stream bool) (servertest.Result, []byte) {
	h.t.Helper()
	resp := testenv.PostJSON(h.t, h.ts.URL+"/v1/completions", map[string]any{"model": kvModel, "prompt": tokens, "stream": stream, "stream_options": map[string]any{"include_usage": true}})
	if resp.Status != http.StatusOK {
		h.t.Fatalf("status %d: %s", resp.Status, resp.Body)
	}
	return resp, resp.Body
}

// TestKVAwareHTTP runs kv_aware in shadow mode through the real server in
// front of cache-holding engines: it follows a prefix evicted from the
// instance the hash prefers, explains itself in headers, leaves responses
// untouched, and reports predicted versus engine-reported cached tokens.
func TestKVAwareHTTP(t *testing.T) {
	// Speculative entries last 100ms here: step 2 waits them out, so that
	// the first request's guess does not outlive the eviction below.
	h := newKVHTTP(t, 4, config.RoutingConfig{Strategy: config.StrategyKVAware, Shadow: true, KV: &config.KVScoringConfig{SpeculativeTTL: 100 * time.Millisecond}})
	prompt := routertest.Prompt(1, 64*kvBS+7)

	// 1. Nobody holds the prefix: the heuristic places it.
	resp, _ := h.complete(prompt, false)
	if r := resp.Header.Get(router.HeaderReason); r != string(router.ReasonHeuristic) {
		t.Fatalf("first request: reason %q, want heuristic", r)
	}
	home := resp.Header.Get(router.HeaderInstance)
	if got := resp.Header.Get(router.HeaderMatchedTokens); got != "gpu=0,cpu=0,disk=0,shared=0" {
		t.Errorf("first request: matched %q", got)
	}

	// 2. The home evicts it; another instance computes it (say, it took an
	// overflow). Exact routing follows the blocks; the hash cannot.
	var other string
	for id := range h.engines {
		if id != home {
			other = id
			break
		}
	}
	h.engines[home].evict()
	h.engines[other].store("", prompt)
	time.Sleep(150 * time.Millisecond)

	resp, body := h.complete(prompt, false)
	if got := resp.Header.Get(router.HeaderInstance); got != other {
		t.Fatalf("after eviction: routed to %s, want the holder %s", got, other)
	}
	if r := resp.Header.Get(router.HeaderReason); r != string(router.ReasonKVMatch) {
		t.Errorf("after eviction: reason %q", r)
	}
	if got, want := resp.Header.Get(router.HeaderMatchedTokens), "gpu=1024,cpu=0,disk=0,shared=0"; got != want {
		t.Errorf("matched header %q, want %q", got, want)
	}
	if resp.Header.Get(router.HeaderPredictedTTFT) == "" {
		t.Error("no predicted TTFT header")
	}
	if !strings.Contains(string(body), `"cached_tokens":1024`) {
		t.Errorf("body not passed through: %s", body)
	}

	// 3. A stream: bytes pass unchanged, usage is read from its last chunk.
	resp, body = h.complete(prompt, true)
	if got := resp.Header.Get(router.HeaderInstance); got != other {
		t.Fatalf("stream: routed to %s, want %s", got, other)
	}
	if !strings.HasSuffix(string(body), "data: [DONE]\n\n") || strings.Count(string(body), "data: ") != 4 {
		t.Errorf("stream altered: %q", body)
	}

	// 4. The comparison: the heuristic would have sent requests 2 and 3 to
	// the cold home; engines reported 0, 1024, 1024 cached tokens.
	cmpResp, err := http.Get(h.ts.URL + "/admin/pools/p/compare")
	if err != nil {
		t.Fatal(err)
	}
	defer cmpResp.Body.Close()
	var sum kvaware.CompareSummary
	if err := json.NewDecoder(cmpResp.Body).Decode(&sum); err != nil {
		t.Fatal(err)
	}
	if sum.Compared != 3 || sum.Agreed != 1 || !sum.Shadow || sum.Strategy != config.StrategyKVAware {
		t.Errorf("compare: %+v", sum)
	}
	if r := sum.Reported; r.Finished != 3 || r.WithUsage != 3 || r.CachedTokens != 2048 || r.PredictedTokens != 2048 || r.MeanAbsErrorTokens != 0 {
		t.Errorf("reported: %+v", r)
	}
	kv, pa := sum.Predicted[config.StrategyKVAware], sum.Predicted[config.StrategyPrefixAware]
	if kv.MatchedTokens != 2048 || pa.MatchedTokens != 0 || kv.MeanPredictedTTFTMs >= pa.MeanPredictedTTFTMs {
		t.Errorf("predicted: kv %+v, prefix %+v", kv, pa)
	}
	if len(sum.Recent) != 3 || sum.Recent[0].ReportedCachedTokens == nil || *sum.Recent[0].ReportedCachedTokens != 1024 || sum.Recent[0].Agree {
		t.Errorf("recent: %+v", sum.Recent)
	}

	if len(sum.Instances) != 4 {
		t.Errorf("instances: %+v", sum.Instances)
	}
	if sum.Window != "all" || sum.StartedBy != "start" || sum.Since.IsZero() {
		t.Errorf("window %q started_by %q since %v", sum.Window, sum.StartedBy, sum.Since)
	}
	// A window, a bad window, and a reset.
	getSum := func(method, path string, wantStatus int) kvaware.CompareSummary {
		t.Helper()
		resp := testenv.Do(t, method, h.ts.URL+path, nil, nil)
		var out kvaware.CompareSummary
		if resp.Status != wantStatus {
			t.Fatalf("%s %s: %d %s, want %d", method, path, resp.Status, resp.Body, wantStatus)
		}
		if wantStatus == 200 {
			if err := json.Unmarshal(resp.Body, &out); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	if w := getSum("GET", "/admin/pools/p/compare?window=5m", 200); w.Compared != 3 || w.Window != "5m0s" {
		t.Errorf("5m window: compared %d window %q", w.Compared, w.Window)
	}
	getSum("GET", "/admin/pools/p/compare?window=banana", 400)
	getSum("GET", "/admin/pools/p/compare?window=2h", 400)
	if r := getSum("POST", "/admin/pools/p/compare/reset", 200); r.Compared != 0 || r.StartedBy != "reset" || len(r.Recent) != 0 || r.Reported.Finished != 0 {
		t.Errorf("after reset: %+v", r)
	}
	for _, in := range sum.Instances {
		if in.PendingPrefillTokens != 0 || in.PendingRequests != 0 || in.InFlight != 0 {
			t.Errorf("instance %s still has pending work after all responses: %+v", in.ID, in)
		}
	}

	// 5. Metrics.
	mb := testenv.Do(t, "GET", h.ts.URL+"/metrics", nil, nil).Body
	for _, want := range []string{
		`kvrouter_kv_decisions_total{pool="p",reason="kv_match"} 2`,
		`kvrouter_kv_engine_cached_tokens_total{pool="p"} 2048`,
		`kvrouter_shadow_decisions_total{agree="false",pool="p"} 2`,
		`kvrouter_kv_usage_reports_total{pool="p",result="reported"} 3`,
	} {
		if !strings.Contains(string(mb), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// TestKVAwareHTTPSwitching: kv_aware is switched on and off at runtime;
// a pool without an index refuses it with a clear error.
func TestKVAwareHTTPSwitching(t *testing.T) {
	h := newKVHTTP(t, 3, config.RoutingConfig{})
	put := func(body string) (int, string) {
		r := servertest.Do(t, h.ts.URL, http.MethodPut, "/admin/pools/p/routing", []byte(body), nil)
		return r.Status, string(r.Body)
	}
	prompt := routertest.Prompt(2, 40*kvBS)
	if resp, _ := h.complete(prompt, false); resp.Header.Get(router.HeaderStrategy) != config.StrategyPrefixAware || resp.Header.Get(router.HeaderMatchedTokens) != "" {
		t.Fatalf("default strategy: %v", resp.Header)
	}
	if code, b := put(`{"strategy":"kv_aware","kv":{"speculative_ttl":-1}}`); code != http.StatusOK {
		t.Fatalf("switch to kv_aware: %d %s", code, b)
	}
	resp, _ := h.complete(prompt, false)
	if resp.Header.Get(router.HeaderStrategy) != config.StrategyKVAware || resp.Header.Get(router.HeaderReason) != string(router.ReasonKVMatch) {
		t.Fatalf("after switch: %v", resp.Header)
	}
	if code, b := put(`{"kv":{"tie_tolerance":-5}}`); code != http.StatusBadRequest || !strings.Contains(b, "tie_tolerance") {
		t.Fatalf("bad kv config: %d %s", code, b)
	}

	// A pool without an index.
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{{Name: "q", Model: "m", Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
		Instances: []config.InstanceConfig{{ID: "a", URL: "http://127.0.0.1:9"}}}}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
	if err == nil || !strings.Contains(err.Error(), "KV index") {
		t.Fatalf("kv_aware without an index: server %v err %v", srv, err)
	}
	if !slices.Contains(config.StrategyNames(), config.StrategyKVAware) {
		t.Error("kv_aware not listed")
	}
}

// TestMidStreamDisconnectReleases: a client that goes away in the middle
// of a stream (ReverseProxy then aborts the handler with a panic) leaves
// no request counted in flight and no prefill pending.
func TestMidStreamDisconnectReleases(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 200 {
			if _, err := fmt.Fprintf(w, "data: {\"i\":%d}\n\n", i); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}))
	defer up.Close()
	idx, _ := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
	pc := config.PoolConfig{Name: "p", Model: kvModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
		Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: "a", URL: up.URL}}}
	srv, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{
		Logger: slog.New(slog.DiscardHandler),
		KV:     kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil }),
	})
	body, _ := json.Marshal(map[string]any{"model": kvModel, "prompt": routertest.Prompt(9, 40*kvBS), "stream": true})
	resp, err := http.Post(ts.URL+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := resp.Body.Read(make([]byte, 16)); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close() // gone mid-stream
	p, _ := srv.Pool("p")
	in := p.Instances()[0]
	deadline := time.Now().Add(5 * time.Second)
	for in.InFlight() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := in.InFlight(); n != 0 {
		t.Fatalf("%d requests still in flight after the client left", n)
	}
	if tok, n := kvaware.Of(p).PendingPrefill("a"); tok != 0 || n != 0 {
		t.Fatalf("pending prefill %d tokens / %d requests after the client left", tok, n)
	}
	if got := kvaware.Of(p).Compare(config.StrategyKVAware, false, nil, 0).Reported.Finished; got != 1 {
		t.Fatalf("%d observed requests finished, want 1", got)
	}
}
