package admin_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/admin/adminapi"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/servertest"
	"github.com/kvrouter/kvrouter/tokenizer"
)

const (
	kvModel = "llama-kv-http"
	kvBS    = 16
)

// kvAdminServer is a router with one kv_aware pool ("kv", simple
// tokenizer) over idx and one heuristic pool without KV state ("plain").
func kvAdminServer(t testing.TB, idx kvindex.Index, token string) *httptest.Server {
	t.Helper()
	return kvAdminServerWith(t, idx, token, nil)
}

// kvAdminServerWith is kvAdminServer with kve as the events pipeline.
func kvAdminServerWith(t testing.TB, idx kvindex.Index, token string, kve admin.KVEvents) *httptest.Server {
	t.Helper()
	pools := []config.PoolConfig{
		{Name: "kv", Model: kvModel, Adapters: []string{"lora-a"}, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
			Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: "http://127.0.0.1:1"}, {ID: "vllm-1", URL: "http://127.0.0.1:2"}}},
		{Name: "plain", Model: "other", Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "x", URL: "http://127.0.0.1:3"}}},
	}
	_, ts := servertest.Serve(t, config.Config{Pools: pools, AdminToken: token}, httpapi.Options{Admin: admin.Routes(kve),
		Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(pc config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
			if pc.Name != "kv" {
				return nil, nil
			}
			return idx, kvindex.FreshnessFuncs{IsStale: func(id string) bool { return id == "vllm-1" }}
		}),
	})
	return ts
}

func TestAdminKVLookupAndInstances(t *testing.T) {
	ctx := context.Background()
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel})
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Repeat("the quick brown fox jumps over the lazy dog ", 20)
	ids, err := tokenizer.Simple{}.Encode(text)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) < 4*kvBS {
		t.Fatalf("prompt of %d tokens too short", len(ids))
	}
	// vllm-0: 4 blocks on GPU, the last one also offloaded to CPU and then
	// dropped from GPU (3 GPU + 1 CPU); vllm-1 (stale): 2 blocks on GPU.
	store := func(inst string, n int, base uint64) {
		hs := make([]uint64, n)
		for i := range hs {
			hs[i] = base + uint64(i)
		}
		if _, err := idx.Apply(ctx, inst, []events.Event{{Kind: events.BlockStored, BlockHashes: hs, TokenIDs: ids[:n*kvBS], BlockSize: kvBS, Medium: "GPU"}}); err != nil {
			t.Fatal(err)
		}
	}
	store("vllm-0", 4, 100)
	store("vllm-1", 2, 200)
	// vllm-0 also holds 2 blocks of a chat, keyed from the chat's rendering.
	msgs := []tokenizer.Message{{Role: "system", Content: strings.Repeat("You are helpful. ", 20)}, {Role: "user", Content: "hi"}}
	rendered, err := tokenizer.Simple{}.Render(msgs, tokenizer.RenderOptions{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	chatIDs, err := tokenizer.Simple{}.Encode(rendered)
	if err != nil || len(chatIDs) < 2*kvBS {
		t.Fatalf("chat of %d tokens: %v", len(chatIDs), err)
	}
	if _, err := idx.Apply(ctx, "vllm-0", []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{300, 301}, TokenIDs: chatIDs[:2*kvBS], BlockSize: kvBS, Medium: "GPU"}}); err != nil {
		t.Fatal(err)
	}
	msgsJSON, _ := json.Marshal(msgs)
	if _, err := idx.Apply(ctx, "vllm-0", []events.Event{
		{Kind: events.BlockStored, BlockHashes: []uint64{103}, Medium: "CPU"},
		{Kind: events.BlockRemoved, BlockHashes: []uint64{103}, Medium: "GPU"},
	}); err != nil {
		t.Fatal(err)
	}
	ts := kvAdminServer(t, idx, "tok")
	idsJSON, _ := json.Marshal(ids)
	textJSON, _ := json.Marshal(text)
	matches := `[{"instance":"vllm-0","gpu_blocks":3,"cpu_blocks":1,"disk_blocks":0,"shared_blocks":0,"live":true},` +
		`{"instance":"vllm-1","gpu_blocks":2,"cpu_blocks":0,"disk_blocks":0,"shared_blocks":0,"live":false}]`
	tests := []struct {
		name, method, path, body, token string
		status                          int
		want                            string // compact JSON of the answer's "matches", or a substring of an error
	}{
		{"token ids", "POST", "/admin/pools/kv/lookup", `{"token_ids":` + string(idsJSON) + `}`, "tok", 200, matches},
		{"prompt through the pool's tokenizer", "POST", "/admin/pools/kv/lookup", `{"prompt":` + string(textJSON) + `}`, "tok", 200, matches},
		{"other adapter's keys hold nothing", "POST", "/admin/pools/kv/lookup", `{"adapter":"lora-a","token_ids":` + string(idsJSON) + `}`, "tok", 200, `[]`},
		// A chat request's "model", as a client sends it: the pool's base
		// model, or an adapter it serves (keyed as that adapter's).
		{"model, the pool's", "POST", "/admin/pools/kv/lookup", `{"model":"` + kvModel + `","token_ids":` + string(idsJSON) + `}`, "tok", 200, matches},
		{"model naming an adapter", "POST", "/admin/pools/kv/lookup", `{"model":"lora-a","token_ids":` + string(idsJSON) + `}`, "tok", 200, `[]`},
		{"cache salt changes the keys", "POST", "/admin/pools/kv/lookup", `{"cache_salt":"s","token_ids":` + string(idsJSON) + `}`, "tok", 200, `[]`},
		{"short prompt: no full block", "POST", "/admin/pools/kv/lookup", `{"token_ids":[1,2,3]}`, "tok", 200, `[]`},
		{"no token", "POST", "/admin/pools/kv/lookup", `{"token_ids":[1]}`, "", 401, "bearer"},
		{"wrong token", "POST", "/admin/pools/kv/lookup", `{"token_ids":[1]}`, "nope", 401, "bearer"},
		{"unknown pool", "POST", "/admin/pools/nope/lookup", `{"token_ids":[1]}`, "tok", 404, "no pool"},
		{"pool without KV", "POST", "/admin/pools/plain/lookup", `{"token_ids":[1]}`, "tok", 409, "no KV index"},
		// The pool exists: its comparison is a conflict with its configuration, as
		// its lookups and decisions are, not a path that is not there.
		{"compare of a pool without KV", "GET", "/admin/pools/plain/compare", ``, "tok", 409, "no KV index"},
		{"chat messages through the pool's template", "POST", "/admin/pools/kv/lookup", `{"messages":` + string(msgsJSON) + `}`, "tok", 200,
			`[{"instance":"vllm-0","gpu_blocks":2,"cpu_blocks":0,"disk_blocks":0,"shared_blocks":0,"live":true}]`},
		{"malformed messages", "POST", "/admin/pools/kv/lookup", `{"messages":{"role":"user"}}`, "tok", 400, "lookup:"},
		{"both inputs", "POST", "/admin/pools/kv/lookup", `{"token_ids":[1],"prompt":"x"}`, "tok", 400, "exactly one of token_ids, prompt and messages"},
		{"prompt and messages", "POST", "/admin/pools/kv/lookup", `{"prompt":"x","messages":[]}`, "tok", 400, "exactly one of"},
		{"neither input", "POST", "/admin/pools/kv/lookup", `{}`, "tok", 400, "exactly one of"},
		{"malformed", "POST", "/admin/pools/kv/lookup", `{"token_ids":[-1]}`, "tok", 400, "malformed"},
		{"unknown field", "POST", "/admin/pools/kv/lookup", `{"tokens":[1]}`, "tok", 400, "malformed"},
		{"a request's other fields", "POST", "/admin/pools/kv/lookup", `{"prompt":"x","max_tokens":5}`, "tok", 400, "decide"},
		{"unknown model", "POST", "/admin/pools/kv/lookup", `{"model":"zzz","token_ids":[1]}`, "tok", 404, "model"},
		{"model and another adapter", "POST", "/admin/pools/kv/lookup", `{"model":"lora-a","adapter":"lora-b","token_ids":[1]}`, "tok", 400, "model"},
		{"unknown adapter", "POST", "/admin/pools/kv/lookup", `{"adapter":"zzz","token_ids":[1]}`, "tok", 404, "adapter"},
		{"evictions without events", "GET", "/v1/kv/evictions?pool=kv", "", "tok", 503, "events disabled"},
		// A body over the bound is refused as such, not cut short and
		// reported as malformed JSON ("unexpected EOF").
		{"lookup body over the bound", "POST", "/admin/pools/kv/lookup", `{"token_ids":[` + strings.Repeat("1,", 9<<20) + `1]}`, "tok", 413, "lookup: body over 16777216 bytes"},
		{"routing body over the bound", "PUT", "/admin/pools/kv/routing", `{"strategy":"kv_aware"` + strings.Repeat(" ", 64<<10) + `}`, "tok", 413, "routing: body over 65536 bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			hdr := map[string]string{}
			if tc.token != "" {
				hdr["Authorization"] = "Bearer " + tc.token
			}
			r := servertest.Do(t, ts.URL, tc.method, tc.path, []byte(tc.body), hdr)
			b := r.Body
			if r.Status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.Status, tc.status, b)
			}
			if tc.status != 200 {
				if !strings.Contains(string(b), tc.want) {
					t.Fatalf("error %s lacks %q", b, tc.want)
				}
				return
			}
			var out struct {
				BlockSize int             `json:"block_size"`
				Matches   json.RawMessage `json:"matches"`
			}
			if err := json.Unmarshal(b, &out); err != nil {
				t.Fatal(err)
			}
			if out.BlockSize != kvBS {
				t.Errorf("block_size %d", out.BlockSize)
			}
			var got, want any
			_ = json.Unmarshal(out.Matches, &got)
			_ = json.Unmarshal([]byte(tc.want), &want)
			g, _ := json.Marshal(got)
			w, _ := json.Marshal(want)
			if string(g) != string(w) {
				t.Fatalf("matches %s, want %s", g, w)
			}
		})
	}

	// Instances: the index's blocks per tier beside the pool's membership
	// (no events pipeline here: the consumer's fields stay zero).
	resp := servertest.Do(t, ts.URL, "GET", "/admin/pools/kv/instances", nil, map[string]string{"Authorization": "Bearer tok"})
	var iv admin.KVInstancesResponse
	if err := json.Unmarshal(resp.Body, &iv); err != nil {
		t.Fatal(err)
	}
	if len(iv.Instances) != 2 || iv.BlockSize != kvBS {
		t.Fatalf("instances %+v", iv)
	}
	v0 := iv.Instances[0]
	// 3 of the prompt on GPU (its 4th moved to CPU) and the chat's 2.
	if v0.Instance != "vllm-0" || !v0.InPool || !v0.Configured || v0.Blocks["gpu"] != 5 || v0.Blocks["cpu"] != 1 || v0.LastEvent.IsZero() || v0.State != "unknown" {
		t.Fatalf("vllm-0 %+v", v0)
	}
}

// FuzzAdminKVLookup: no body makes the lookup endpoint crash or answer 5xx.
func FuzzAdminKVLookup(f *testing.F) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
	if err != nil {
		f.Fatal(err)
	}
	ts := kvAdminServer(f, idx, "")
	for _, s := range []string{`{"token_ids":[1,2,3]}`, `{"prompt":"hello world"}`, `{"prompt":""}`, `{"adapter":"lora-a","prompt":"x","cache_salt":"s"}`, `[]`, `{"token_ids":[4294967296]}`, `null`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		if resp := servertest.Do(t, ts.URL, "POST", "/admin/pools/kv/lookup", []byte(body), nil); resp.Status >= 500 {
			t.Fatalf("status %d for %q", resp.Status, body)
		}
	})
}

// GET /admin/pools/{pool}/instances on a hung Redis (SIGSTOP: connections
// held, nothing answered): the view read the index with no time limit and
// did not answer within 0.4 s of a Redis outage on the binaries, while
// /metrics did (go-redis alone waits its read timeout on each retry). It
// must answer at its bound with a partial view marked as such (the pool's
// and the consumer's, blocks unknown), then whole again once Redis runs.
func TestAdminKVInstancesBoundedWhenRedisHung(t *testing.T) {
	srv := testenv.StartRedis(t)
	pools := []config.PoolConfig{{Name: "kv", Model: kvModel, Routing: config.RoutingConfig{KV: &config.KVScoringConfig{BlockSize: kvBS}}}}
	// The router's own client (kvstate: context deadlines honoured).
	pi, err := kvstate.NewPoolIndexes(config.Config{Index: &config.IndexConfig{Backend: "redis",
		Redis: &config.RedisConfig{Addrs: []string{srv.Addr}, KeyPrefix: testenv.UniqueName(t)}}, Pools: pools})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pi.Close() })
	idx := pi.ByPool["kv"]
	ids := make([]uint32, 2*kvBS)
	for i := range ids {
		ids[i] = uint32(i + 1)
	}
	if _, err := idx.Apply(context.Background(), "vllm-0", []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{1, 2},
		TokenIDs: ids, BlockSize: kvBS, Medium: "GPU"}}); err != nil {
		t.Fatal(err)
	}
	ts := kvAdminServer(t, idx, "tok")
	hdr := map[string]string{"Authorization": "Bearer tok"}
	get := func() (adminapi.KVInstancesResponse, time.Duration) {
		t.Helper()
		start := time.Now()
		r := servertest.Do(t, ts.URL, "GET", "/admin/pools/kv/instances", nil, hdr)
		took := time.Since(start)
		if r.Status != 200 {
			t.Fatalf("status %d after %v: %s", r.Status, took, r.Body)
		}
		var out adminapi.KVInstancesResponse
		if err := json.Unmarshal(r.Body, &out); err != nil {
			t.Fatalf("%v: %s", err, r.Body)
		}
		return out, took
	}
	blocksOf := func(out adminapi.KVInstancesResponse, id string) map[string]int {
		for _, v := range out.Instances {
			if v.Instance == id {
				return v.Blocks
			}
		}
		t.Fatalf("no %s in %+v", id, out.Instances)
		return nil
	}
	if out, _ := get(); out.IndexError != "" || blocksOf(out, "vllm-0")["gpu"] != 2 {
		t.Fatalf("before the hang: %+v", out)
	}

	srv.Pause()
	resumed := false
	defer func() {
		if !resumed {
			srv.Resume()
		}
	}()
	out, took := get()
	srv.Resume()
	resumed = true
	// The bound is 250 ms; 2 s leaves room for a loaded machine and is
	// less than one read of go-redis alone (5 s).
	if took > 2*time.Second {
		t.Fatalf("instances on a hung Redis answered after %v: want it cut at its bound", took)
	}
	t.Logf("instances on a hung Redis answered after %v: %s", took, out.IndexError)
	if out.IndexError == "" || !strings.Contains(out.IndexError, "within") {
		t.Fatalf("instances on a hung Redis: no index error marked: %+v", out)
	}
	if b := blocksOf(out, "vllm-0"); b != nil {
		t.Fatalf("instances on a hung Redis: blocks %v reported, want null (unknown)", b)
	}
	if len(out.Instances) != 2 { // the pool's vllm-0 and vllm-1
		t.Fatalf("instances on a hung Redis: %+v, want the pool's two", out.Instances)
	}

	testenv.WaitFor(t, 10*time.Second, "the whole view after the resume", func() bool {
		out, _ := get()
		return out.IndexError == "" && blocksOf(out, "vllm-0")["gpu"] == 2
	})
}

// fakeKVEvents is an events pipeline whose pool "kv" consumer reports sts.
type fakeKVEvents struct{ sts []consumer.InstanceStatus }

func (f fakeKVEvents) KVInstances(pool string) ([]consumer.InstanceStatus, bool) {
	return f.sts, pool == "kv"
}
func (fakeKVEvents) StreamHealthy(string) bool        { return true }
func (fakeKVEvents) EvictionHandler() http.Handler    { return http.NotFoundHandler() }
func (fakeKVEvents) IsDiscovered(string, string) bool { return false }

// An instance the consumer holds not live in a shared index (a hole
// pending, or being repaired: IndexUnsynced) has state "live" in the
// consumer's record, which the view showed alone: on the binaries, a
// router showed e0 "live" with 2,150 GPU blocks against the engine's
// 1,498 (its capacity 1,500) while kv_aware did not count it. The view
// now carries index_unsynced and replay_lost beside the state.
func TestAdminKVInstancesShowsUnsynced(t *testing.T) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel})
	if err != nil {
		t.Fatal(err)
	}
	kve := fakeKVEvents{sts: []consumer.InstanceStatus{
		{Instance: "vllm-0", State: consumer.StateLive, IndexUnsynced: true, ReplayLost: 1, Gaps: 1},
		{Instance: "vllm-1", State: consumer.StateLive},
	}}
	ts := kvAdminServerWith(t, idx, "", kve)
	resp := servertest.Do(t, ts.URL, "GET", "/admin/pools/kv/instances", nil, nil)
	var iv adminapi.KVInstancesResponse
	if err := json.Unmarshal(resp.Body, &iv); err != nil {
		t.Fatal(err)
	}
	if len(iv.Instances) != 2 {
		t.Fatalf("instances %+v", iv)
	}
	if v := iv.Instances[0]; v.Instance != "vllm-0" || !v.IndexUnsynced || v.ReplayLost != 1 {
		t.Fatalf("vllm-0 %+v: want index_unsynced and replay_lost 1 shown", v)
	}
	if v := iv.Instances[1]; v.IndexUnsynced || v.ReplayLost != 0 || v.State != "live" {
		t.Fatalf("vllm-1 %+v", v)
	}
	if !strings.Contains(strings.Join(strings.Fields(string(resp.Body)), ""), `"index_unsynced":true`) {
		t.Fatalf("no index_unsynced in %s", resp.Body)
	}
}
