package httpapi_test

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// TestCacheSaltKVAware: with cache_salt on, the upstream receives the
// tenant's derived salt (equal for equal tenants, different otherwise, a
// client's own salt overwritten), and kv_aware keys blocks under the same
// salt: a tenant matches its own cached prompt and never another's.
func TestCacheSaltKVAware(t *testing.T) {
	secret := bytes.Repeat([]byte{7}, 32)
	h := newKVHTTP(t, 3, config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{SpeculativeTTL: -1}},
		func(c *config.Config) {
			c.Pools[0].CacheSalt = &config.CacheSaltConfig{Enabled: true}
			c.CacheSaltSecret = secret
		})

	prompt := routertest.Prompt(42, 32*kvBS)
	send := func(tenant, clientSalt string) (instance, reason, matched string) {
		t.Helper()
		body := map[string]any{"model": kvModel, "prompt": prompt}
		if clientSalt != "" {
			body["cache_salt"] = clientSalt
		}
		b, _ := json.Marshal(body)
		hdr := map[string]string{}
		if tenant != "" {
			hdr[router.TenantHeader] = tenant
		}
		r := servertest.Do(t, h.ts.URL, http.MethodPost, "/v1/completions", b, hdr)
		if r.Status != http.StatusOK {
			t.Fatalf("status %d: %s", r.Status, r.Body)
		}
		return r.Header.Get(router.HeaderInstance), r.Header.Get(router.HeaderReason), r.Header.Get(router.HeaderMatchedTokens)
	}
	saltA, saltB := router.DeriveCacheSalt(secret, "tenant-a"), router.DeriveCacheSalt(secret, "tenant-b")
	const none = "gpu=0,cpu=0,disk=0,shared=0"
	const all = "gpu=496,cpu=0,disk=0,shared=0" // every block but the last, which vLLM recomputes

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
		if got := h.engines[inst].lastSalt(); got != st.wantSalt {
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
	srv, ts := servertest.Serve(t, cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
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
		status                   int
	}{
		{"json object is salted", `{"inputs":"hi","cache_salt":"mine"}`, "t-1", `{"cache_salt":"` + want + `","inputs":"hi"}`, 200},
		{"no tenant: unchanged", `{"inputs":"hi"}`, "", `{"inputs":"hi"}`, 200},
		// A body the salt must go into is one strict JSON object, or refused:
		// vLLM's json.loads reads some the router cannot (NaN, a BOM,
		// UTF-16), which would keep the client's own cache_salt.
		{"not JSON: refused", `inputs=hi`, "t-1", "", 400},
		{"JSON array: refused", `[{"inputs":"hi"}]`, "t-1", "", 400},
		{"NaN: refused", `{"inputs":"hi","cache_salt":"mine","t":NaN}`, "t-1", "", 400},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := string(up.LastBody())
			req, _ := http.NewRequest(http.MethodPost, ts.URL+"/invocations", strings.NewReader(tc.body))
			if tc.tenant != "" {
				req.Header.Set(router.TenantHeader, tc.tenant)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.status)
			}
			if tc.status != http.StatusOK {
				if got := string(up.LastBody()); got != before {
					t.Fatalf("a refused body reached the instance: %s", got)
				}
				return
			}
			if got := string(up.LastBody()); got != tc.want {
				t.Fatalf("upstream body %s, want %s", got, tc.want)
			}
		})
	}
}
