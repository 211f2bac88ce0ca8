package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// saltEngine is a fake vLLM instance that honours cache_salt as vLLM does:
// the salt roots the block chain, so a prompt cached under one salt is a
// miss under another. It reports what it stores to the index, with the
// salt on the event (vLLM puts it in block 0's extra_keys).
type saltEngine struct {
	id  string
	idx kvindex.Index
	srv *httptest.Server

	mu    sync.Mutex // guards held and salts
	held  map[kvindex.Key]bool
	salts []string // cache_salt of every request received, in order ("" = none)
}

func newSaltEngine(t *testing.T, id string, idx kvindex.Index) *saltEngine {
	e := &saltEngine{id: id, idx: idx, held: map[kvindex.Key]bool{}}
	e.srv = httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *saltEngine) serve(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Prompt    []uint32 `json:"prompt"`
		CacheSalt string   `json:"cache_salt"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	keys := kvindex.Keys(kvindex.Root(kvModel, "", req.CacheSalt), req.Prompt, kvBS)
	e.mu.Lock()
	e.salts = append(e.salts, req.CacheSalt)
	hit := 0
	for hit < len(keys) && e.held[keys[hit]] {
		hit++
	}
	for _, k := range keys[hit:] {
		e.held[k] = true
	}
	e.mu.Unlock()
	if hit < len(keys) {
		ev := events.Event{Kind: events.BlockStored, BlockSize: kvBS, Medium: "GPU", CacheSalt: req.CacheSalt, TokenIDs: req.Prompt[hit*kvBS : len(keys)*kvBS]}
		for _, k := range keys[hit:] {
			ev.BlockHashes = append(ev.BlockHashes, uint64(k)^0xabcdef)
		}
		if hit > 0 {
			ev.ParentHash, ev.HasParent = uint64(keys[hit-1])^0xabcdef, true
		}
		if _, err := e.idx.Apply(context.Background(), e.id, []events.Event{ev}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"cmpl-%s","object":"text_completion","choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}}`, e.id, len(req.Prompt), hit*kvBS)
}

func (e *saltEngine) lastSalt() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.salts) == 0 {
		return "<no request>"
	}
	return e.salts[len(e.salts)-1]
}

// TestCacheSaltKVAware: with cache_salt on, the upstream receives the
// tenant's derived salt (equal for equal tenants, different otherwise, a
// client's own salt overwritten), and kv_aware keys blocks under the same
// salt: a tenant matches its own cached prompt and never another's.
func TestCacheSaltKVAware(t *testing.T) {
	secret := bytes.Repeat([]byte{7}, 32)
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
	if err != nil {
		t.Fatal(err)
	}
	engines := map[string]*saltEngine{}
	pc := config.PoolConfig{Name: "p", Model: kvModel,
		Routing:   config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{SpeculativeTTL: -1}},
		CacheSalt: &config.CacheSaltConfig{Enabled: true},
		Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range 3 {
		e := newSaltEngine(t, fmt.Sprintf("vllm-%d", i), idx)
		engines[e.id] = e
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: e.id, URL: e.srv.URL})
	}
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}, CacheSaltSecret: secret}, httpapi.Options{
		Logger: slog.New(slog.DiscardHandler),
		KV:     kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)

	prompt := routertest.Prompt(42, 32*kvBS)
	send := func(tenant, clientSalt string) (instance, reason, matched string) {
		t.Helper()
		body := map[string]any{"model": kvModel, "prompt": prompt}
		if clientSalt != "" {
			body["cache_salt"] = clientSalt
		}
		b, _ := json.Marshal(body)
		req, _ := http.NewRequest(http.MethodPost, ts.URL+"/v1/completions", bytes.NewReader(b))
		if tenant != "" {
			req.Header.Set(router.TenantHeader, tenant)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		rb, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, rb)
		}
		return resp.Header.Get(router.HeaderInstance), resp.Header.Get(router.HeaderReason), resp.Header.Get(router.HeaderMatchedTokens)
	}
	saltA, saltB := router.DeriveCacheSalt(secret, "tenant-a"), router.DeriveCacheSalt(secret, "tenant-b")
	const none = "gpu=0,cpu=0,disk=0,shared=0"
	const all = "gpu=512,cpu=0,disk=0,shared=0"

	steps := []struct {
		name, tenant, clientSalt string
		wantSalt                 string
		wantReason, wantMatched  string
		sameAs                   string // step whose instance this one must hit
	}{
		{name: "a cold", tenant: "tenant-a", wantSalt: saltA, wantReason: string(router.ReasonHeuristic), wantMatched: none},
		{name: "a warm", tenant: "tenant-a", wantSalt: saltA, wantReason: string(router.ReasonKVMatch), wantMatched: all, sameAs: "a cold"},
		{name: "b does not see a's blocks", tenant: "tenant-b", wantSalt: saltB, wantReason: string(router.ReasonHeuristic), wantMatched: none},
		{name: "b choosing a's salt is overwritten", tenant: "tenant-b", clientSalt: saltA, wantSalt: saltB, wantReason: string(router.ReasonKVMatch), wantMatched: all, sameAs: "b does not see a's blocks"},
		{name: "no tenant: forwarded unchanged", wantSalt: "", wantReason: string(router.ReasonHeuristic), wantMatched: none},
		{name: "no tenant keeps a client's salt", clientSalt: "mine", wantSalt: "mine", wantReason: string(router.ReasonHeuristic), wantMatched: none},
	}
	at := map[string]string{}
	for _, st := range steps {
		inst, reason, matched := send(st.tenant, st.clientSalt)
		at[st.name] = inst
		if got := engines[inst].lastSalt(); got != st.wantSalt {
			t.Errorf("%s: upstream cache_salt %q, want %q", st.name, got, st.wantSalt)
		}
		if reason != st.wantReason || matched != st.wantMatched {
			t.Errorf("%s: reason %q matched %q; want %q %q", st.name, reason, matched, st.wantReason, st.wantMatched)
		}
		if st.sameAs != "" && inst != at[st.sameAs] {
			t.Errorf("%s: routed to %s, want the holder %s", st.name, inst, at[st.sameAs])
		}
	}
	if saltA == saltB || strings.Contains(saltA, "tenant") {
		t.Fatalf("salts: a %q b %q", saltA, saltB)
	}
}

// TestCacheSaltRawPath: the raw invoke path salts JSON object bodies and
// forwards anything else unchanged; TenantCacheSalt agrees with what was sent.
func TestCacheSaltRawPath(t *testing.T) {
	secret := bytes.Repeat([]byte{9}, 16)
	up := routertest.New(t, "vllm-0", "m")
	cfg := config.Config{CacheSaltSecret: secret, Pools: []config.PoolConfig{{
		Name: "p", Model: "m", CacheSalt: &config.CacheSaltConfig{Enabled: true},
		Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: up.ID, URL: up.URL()}},
	}}}
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	want, ok := srv.TenantCacheSalt("p", "t-1")
	if !ok || want != router.DeriveCacheSalt(secret, "t-1") {
		t.Fatalf("TenantCacheSalt = %q %v", want, ok)
	}
	if _, ok := srv.TenantCacheSalt("p", ""); ok {
		t.Fatal("a salt for no tenant")
	}
	if _, ok := srv.TenantCacheSalt("nope", "t-1"); ok {
		t.Fatal("a salt for an unknown pool")
	}
	tests := []struct {
		name, body, tenant, want string
	}{
		{"json object is salted", `{"inputs":"hi","cache_salt":"mine"}`, "t-1", `{"cache_salt":"` + want + `","inputs":"hi"}`},
		{"no tenant: unchanged", `{"inputs":"hi"}`, "", `{"inputs":"hi"}`},
		{"not JSON: unchanged", `inputs=hi`, "t-1", `inputs=hi`},
		{"JSON array: unchanged", `[{"inputs":"hi"}]`, "t-1", `[{"inputs":"hi"}]`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, ts.URL+"/invocations", strings.NewReader(tc.body))
			if tc.tenant != "" {
				req.Header.Set(router.TenantHeader, tc.tenant)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			if got := string(up.LastBody()); got != tc.want {
				t.Fatalf("upstream body %s, want %s", got, tc.want)
			}
		})
	}
}
