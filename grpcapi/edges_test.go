package grpcapi

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

// resolved is what every edge must agree on about one request.
type resolved struct {
	Pool, Model, Adapter, Tenant, RoutingText string
	Tokens                                    []uint32
	TooLongToTokenize                         bool
	Status                                    int // 0 = routed; else the refusal's HTTP status
}

func summarise(req *router.Request, p *router.Pool, err error) resolved {
	if err != nil {
		return resolved{Status: router.AsRequestError(err).Status}
	}
	r := resolved{Pool: p.Name(), Model: req.Model, Adapter: req.Adapter, Tenant: req.TenantKey, RoutingText: req.RoutingText, Tokens: req.PromptTokens}
	if req.Tokenizer != nil {
		_, terr := req.Tokenizer.Tokens(context.Background(), req)
		r.TooLongToTokenize = terr != nil && strings.Contains(terr.Error(), "max_tokenize_bytes")
	}
	return r
}

// TestEdgesResolveAlike runs a table of inbound requests through the three
// edges' front halves — the HTTP data plane (httpapi.HTTPInbound), Envoy's
// ext_proc (extProc.inbound) and gRPC Router.Pick (router.CompletionsInbound)
// — and Resolve, asserting each edge yields the same Request (pool, model,
// adapter, tenant, routing text, token ids, tokenize limit) or the same
// error class; a gRPC error carries the code mapped from that class.
func TestEdgesResolveAlike(t *testing.T) {
	mk := func(name, model string) config.PoolConfig {
		return config.PoolConfig{Name: name, Model: model, Adapters: []string{name + "-lora"},
			Routing: config.RoutingConfig{Strategy: config.StrategyPrefixAware},
			Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: name + "-0", URL: "http://10.0.0.1:8000"}}}
	}
	limits := config.LimitsConfig{MaxMessages: 2, MaxPromptTokenIDs: 8, MaxTokenizeBytes: 1024}
	newServers := func(defaultPool string) (*httpapi.Server, *extProc) {
		rs, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{mk("a", "model-a"), mk("b", "model-b")}, Limits: limits, DefaultPool: defaultPool},
			httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		s, err := New(rs, Config{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		return rs, &extProc{s: s}
	}
	chat := func(model string, n int, extra string) string {
		msgs := make([]string, n)
		for i := range msgs {
			msgs[i] = fmt.Sprintf(`{"role":"user","content":"message %d"}`, i)
		}
		m := ""
		if model != "" {
			m = fmt.Sprintf(`"model":%q,`, model)
		}
		return `{` + m + `"messages":[` + strings.Join(msgs, ",") + `]` + extra + `}`
	}
	long := strings.Repeat("lorem ipsum ", 200) // 2,400 bytes: over max_tokenize_bytes
	type pick struct {
		model, prompt, tenant, pool, adapter string
		ids                                  []uint32
	}
	tests := []struct {
		name, path, body, tenant, pool, adapter string
		defaultPool                             string
		pick                                    *pick // the same request through Pick, where Pick can say it
		status                                  int
		wantPool                                string
	}{
		{name: "chat by model", path: "/v1/chat/completions", body: chat("model-b", 1, ""), wantPool: "b"},
		{name: "chat by adapter", path: "/v1/chat/completions", body: chat("a-lora", 1, ""), wantPool: "a"},
		{name: "chat with tenant header", path: "/v1/chat/completions", body: chat("model-a", 1, `,"prompt_cache_key":"k1"`), tenant: "t-9", wantPool: "a"},
		{name: "chat with prompt_cache_key", path: "/v1/chat/completions", body: chat("model-a", 1, `,"prompt_cache_key":"k1"`), wantPool: "a"},
		{name: "chat without model", path: "/v1/chat/completions", body: chat("", 1, ""), status: http.StatusBadRequest},
		{name: "chat without model, default pool", path: "/v1/chat/completions", body: chat("", 1, ""), defaultPool: "b", wantPool: "b"},
		{name: "chat over max_messages", path: "/v1/chat/completions", body: chat("model-a", 3, ""), status: http.StatusBadRequest},
		{name: "chat unknown model", path: "/v1/chat/completions", body: chat("gpt-9", 1, ""), status: http.StatusNotFound},
		{name: "chat malformed", path: "/v1/chat/completions", body: `{"model":"model-a","messages":[`, status: http.StatusBadRequest},
		{name: "bad tenant", path: "/v1/chat/completions", body: chat("model-a", 1, ""), tenant: "\x01", status: http.StatusBadRequest},
		{name: "completions text", path: "/v1/completions", body: `{"model":"model-a","prompt":"hello world"}`, wantPool: "a",
			pick: &pick{model: "model-a", prompt: "hello world"}},
		{name: "completions token ids, tenant", path: "/v1/completions", body: `{"model":"model-b","prompt":[1,2,3]}`, tenant: "t-1", wantPool: "b",
			pick: &pick{model: "model-b", ids: []uint32{1, 2, 3}, tenant: "t-1"}},
		{name: "completions over max_prompt_token_ids", path: "/v1/completions", body: `{"model":"model-a","prompt":[1,2,3,4,5,6,7,8,9]}`, status: http.StatusBadRequest,
			pick: &pick{model: "model-a", ids: []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}}},
		{name: "completions over max_tokenize_bytes", path: "/v1/completions", body: fmt.Sprintf(`{"model":"model-a","prompt":%q}`, long), wantPool: "a"},
		{name: "completions without model", path: "/v1/completions", body: `{"prompt":"hi"}`, status: http.StatusBadRequest,
			pick: &pick{prompt: "hi"}},
		{name: "completions unknown model", path: "/v1/completions", body: `{"model":"gpt-9","prompt":"hi"}`, status: http.StatusNotFound,
			pick: &pick{model: "gpt-9", prompt: "hi"}},
		{name: "completions for an adapter (Pick: the pool and adapter fields)", path: "/v1/completions", body: `{"model":"a-lora","prompt":"hi"}`, wantPool: "a",
			pick: &pick{pool: "a", adapter: "a-lora", prompt: "hi"}},
		{name: "invoke, default pool = first", path: "/invocations", body: `{"inputs":"raw"}`, wantPool: "a"},
		{name: "invoke, pool header", path: "/invocations", body: `{"inputs":"raw"}`, pool: "b", wantPool: "b"},
		{name: "invoke, adapter", path: "/invocations", body: `{"inputs":"raw"}`, pool: "b", adapter: "b-lora", wantPool: "b"},
		{name: "invoke, unknown adapter", path: "/invocations", body: `{"inputs":"raw"}`, pool: "b", adapter: "zzz", status: http.StatusNotFound},
		{name: "invoke, unknown pool", path: "/invocations", body: `{"inputs":"raw"}`, pool: "zzz", status: http.StatusNotFound},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rs, x := newServers(tc.defaultPool)
			ep := router.EndpointInvoke
			switch tc.path {
			case "/v1/chat/completions":
				ep = router.EndpointChatCompletions
			case "/v1/completions":
				ep = router.EndpointCompletions
			}
			// HTTP.
			hr := httptest.NewRequest("POST", tc.path, bytes.NewReader([]byte(tc.body)))
			if tc.tenant != "" {
				hr.Header.Set(router.TenantHeader, tc.tenant)
			}
			if tc.pool != "" {
				hr.Header.Set(router.HeaderPool, tc.pool)
			}
			if tc.adapter != "" {
				hr.Header.Set(router.HeaderAdapter, tc.adapter)
			}
			in := httpapi.HTTPInbound(ep, hr)
			in.Body = []byte(tc.body)
			viaHTTP := summarise(rs.Resolve(in))
			// ext_proc: Envoy's headers, lower-cased; the pool header is
			// ext_proc's own (its config), the rest as on HTTP.
			st := &epStream{headers: map[string]string{":path": tc.path}, body: []byte(tc.body)}
			if tc.tenant != "" {
				st.headers[strings.ToLower(router.TenantHeader)] = tc.tenant
			}
			if tc.pool != "" {
				st.headers[x.s.cfg.ExtProc.PoolHeader] = tc.pool
			}
			if tc.adapter != "" {
				st.headers[strings.ToLower(router.HeaderAdapter)] = tc.adapter
			}
			viaExtProc := summarise(rs.Resolve(x.inbound(st)))

			if viaHTTP.Status != tc.status || (tc.status == 0 && viaHTTP.Pool != tc.wantPool) {
				t.Fatalf("HTTP: %+v, want status %d pool %q", viaHTTP, tc.status, tc.wantPool)
			}
			if !equalResolved(viaHTTP, viaExtProc) {
				t.Errorf("ext_proc differs from HTTP:\n ext_proc %+v\n HTTP     %+v", viaExtProc, viaHTTP)
			}
			if tc.name == "completions over max_tokenize_bytes" && !viaHTTP.TooLongToTokenize {
				t.Errorf("a body over max_tokenize_bytes would be tokenized: %+v", viaHTTP)
			}
			if tc.pick == nil {
				return
			}
			pk := tc.pick
			pin, err := router.CompletionsInbound(pk.pool, pk.model, pk.adapter, pk.prompt, pk.ids, pk.tenant, "")
			if err != nil {
				t.Fatal(err)
			}
			req, p, err := x.s.pools.Resolve(pin)
			viaPick := summarise(req, p, err)
			if !equalResolved(viaHTTP, viaPick) {
				t.Errorf("Pick differs from HTTP:\n Pick %+v\n HTTP %+v", viaPick, viaHTTP)
			}
			if err != nil {
				want := map[int]codes.Code{http.StatusBadRequest: codes.InvalidArgument, http.StatusNotFound: codes.NotFound}[viaHTTP.Status]
				if got := status.Code(requestStatus(err)); got != want {
					t.Errorf("Pick's gRPC code %v for HTTP %d, want %v", got, viaHTTP.Status, want)
				}
			}
		})
	}
}

func equalResolved(a, b resolved) bool {
	return a.Status == b.Status && a.Pool == b.Pool && a.Model == b.Model && a.Adapter == b.Adapter && a.Tenant == b.Tenant &&
		a.RoutingText == b.RoutingText && slices.Equal(a.Tokens, b.Tokens) && a.TooLongToTokenize == b.TooLongToTokenize
}
