package admin_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/servertest"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// POST /admin/pools/{pool}/decide: where kv_aware would send a request
// and where the hash would, dry. vllm-0 holds the prompt's 4 blocks;
// vllm-1 (stale in kvAdminServer) holds 2, which do not count.
func TestAdminDecide(t *testing.T) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel})
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Repeat("pack my box with five dozen liquor jugs ", 20)
	ids, err := tokenizer.Simple{}.Encode(text)
	if err != nil || len(ids) < 5*kvBS {
		t.Fatalf("prompt of %d tokens: %v", len(ids), err)
	}
	for inst, n := range map[string]int{"vllm-0": 4, "vllm-1": 2} {
		hs := make([]uint64, n)
		for i := range hs {
			hs[i] = uint64(1000*len(inst)+i) + uint64(n)*7
		}
		if _, err := idx.Apply(context.Background(), inst, []events.Event{{Kind: events.BlockStored, BlockHashes: hs, TokenIDs: ids[:n*kvBS], BlockSize: kvBS, Medium: "GPU"}}); err != nil {
			t.Fatal(err)
		}
	}
	ts := kvAdminServer(t, idx, "tok")
	auth := map[string]string{"Authorization": "Bearer tok"}
	idsJSON, _ := json.Marshal(ids)
	textJSON, _ := json.Marshal(text)
	decide := func(t *testing.T, pool, body string, hdr map[string]string) (int, admin.DecideResponse, string) {
		t.Helper()
		r := servertest.Do(t, ts.URL, "POST", "/admin/pools/"+pool+"/decide", []byte(body), hdr)
		var out admin.DecideResponse
		if r.Status == 200 {
			if err := json.Unmarshal(r.Body, &out); err != nil {
				t.Fatalf("answer %s: %v", r.Body, err)
			}
		}
		return r.Status, out, string(r.Body)
	}

	for _, tc := range []struct{ name, body, endpoint string }{
		{"token ids", `{"model":"` + kvModel + `","prompt":` + string(idsJSON) + `}`, "completions"},
		{"text through the pool's tokenizer", `{"prompt":` + string(textJSON) + `}`, "completions"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, out, raw := decide(t, "kv", tc.body, auth)
			if st != 200 {
				t.Fatalf("status %d: %s", st, raw)
			}
			kv := out.KVAware
			if out.Pool != "kv" || out.Endpoint != tc.endpoint || out.Strategy != "kv_aware" ||
				kv.Instance != "vllm-0" || kv.Reason != "kv_match" || kv.GPUTokens != 4*kvBS || kv.PromptTokens != len(ids) || kv.PredictedTTFTMs == nil {
				t.Fatalf("answer %s", raw)
			}
			h := out.PrefixAware
			if h.Instance == "" || (h.Reason != "hash" && h.Reason != "overflow") || h.PredictedTTFTMs == nil {
				t.Fatalf("prefix_aware pick %s", raw)
			}
			// kv_aware's prediction on the hash's pick: what it holds there.
			if want := map[string]int{"vllm-0": 4 * kvBS, "vllm-1": 0}[h.Instance]; h.GPUTokens != want {
				t.Fatalf("hash pick %s predicted with %d GPU tokens, want %d: %s", h.Instance, h.GPUTokens, want, raw)
			}
		})
	}
	t.Run("nothing committed", func(t *testing.T) {
		// A burst of previews of a prompt nobody holds: each is the
		// heuristic, where routed requests would follow the first.
		body := `{"prompt":"an entirely new prompt that nobody has seen before, long enough for a block or two of tokens"}`
		for range 5 {
			st, out, raw := decide(t, "kv", body, auth)
			if st != 200 || out.KVAware.Reason != "heuristic" {
				t.Fatalf("status %d: %s", st, raw)
			}
		}
	})
	t.Run("chat", func(t *testing.T) {
		st, out, raw := decide(t, "kv", `{"messages":[{"role":"user","content":"hello"}]}`, auth)
		if st != 200 || out.Endpoint != "chat" || out.KVAware.Instance == "" {
			t.Fatalf("status %d: %s", st, raw)
		}
	})
	for _, tc := range []struct {
		name, pool, body string
		hdr              map[string]string
		status           int
		want             string
	}{
		{"no token", "kv", `{"prompt":"x"}`, nil, 401, "bearer"},
		{"pool without KV", "plain", `{"prompt":"x"}`, auth, 409, "no KV index"},
		{"unknown pool", "nope", `{"prompt":"x"}`, auth, 404, "no pool"},
		{"malformed", "kv", `{"prompt":`, auth, 400, "malformed JSON"},
		{"not a request", "kv", `{"prompt":7}`, auth, 400, "decide:"},
		{"unknown adapter", "kv", `{"model":"zzz","prompt":"x"}`, auth, 404, "zzz"},
		{"bad tenant header", "kv", `{"prompt":"x"}`, map[string]string{"Authorization": "Bearer tok", router.TenantHeader: strings.Repeat("t", 65)}, 400, "decide:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, _, raw := decide(t, tc.pool, tc.body, tc.hdr)
			if st != tc.status || !strings.Contains(raw, tc.want) {
				t.Fatalf("status %d %s, want %d with %q", st, raw, tc.status, tc.want)
			}
		})
	}
	t.Run("pool routing without kv_aware", func(t *testing.T) {
		if r := servertest.Do(t, ts.URL, "PUT", "/admin/pools/kv/routing", []byte(`{"strategy":"prefix_aware"}`), auth); r.Status != 200 {
			t.Fatalf("routing: %d %s", r.Status, r.Body)
		}
		st, _, raw := decide(t, "kv", `{"prompt":"x"}`, auth)
		if st != 409 || !strings.Contains(raw, "shadow") {
			t.Fatalf("status %d %s, want 409 naming shadow", st, raw)
		}
		if r := servertest.Do(t, ts.URL, "PUT", "/admin/pools/kv/routing", []byte(`{"strategy":"prefix_aware","shadow":true}`), auth); r.Status != 200 {
			t.Fatalf("routing: %d %s", r.Status, r.Body)
		}
		st, out, raw := decide(t, "kv", `{"prompt":`+string(textJSON)+`}`, auth)
		if st != 200 || out.Strategy != "prefix_aware" || out.KVAware.Instance != "vllm-0" {
			t.Fatalf("shadowed: status %d %s", st, raw)
		}
	})
}

// FuzzAdminDecide: no body makes the decide endpoint crash or answer 5xx.
func FuzzAdminDecide(f *testing.F) {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
	if err != nil {
		f.Fatal(err)
	}
	ts := kvAdminServer(f, idx, "")
	for _, s := range []string{`{"prompt":[1,2,3]}`, `{"prompt":"hello world"}`, `{"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"lora-a","prompt":"x","cache_salt":"s"}`, `[]`, `null`, `{"messages":7}`, `{"prompt":"x","max_tokens":-1}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		if resp := servertest.Do(t, ts.URL, "POST", "/admin/pools/kv/decide", []byte(body), nil); resp.Status >= 500 {
			t.Fatalf("status %d for %q: %s", resp.Status, body, resp.Body)
		}
	})
}
