package grpcapi_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
)

var saltSecret = bytes.Repeat([]byte{9}, 32)

// salted turns cache_salt on in every pool, with the client policy given.
func salted(client string) harnessOpt {
	return func(c *config.Config, _ *grpcapi.Config) {
		c.CacheSaltSecret = saltSecret
		for i := range c.Pools {
			c.Pools[i].CacheSalt = &config.CacheSaltConfig{Enabled: true, Client: client}
		}
	}
}

func passParams(c *config.Config, _ *grpcapi.Config) {
	for i := range c.Pools {
		c.Pools[i].PassKVTransferParams = true
	}
}

// upstream is what Envoy sends upstream once it applied the picker's body
// response: the body (replaced by a body mutation, else as received) and
// the content-length header (set by a header mutation, else as received).
type upstream struct {
	status        int // immediate response status, 0 = routed
	body          []byte
	mutated       bool
	contentLength string // "" = none
	instance      string
	reason        string
}

// forward plays Envoy in BUFFERED request-body mode with SEND request
// headers: the request headers (content-length among them when cl), then
// the whole body; it applies the answer as Envoy does
// (envoyproxy/envoy source/extensions/filters/http/ext_proc/
// processor_state.cc, ProcessorState::handleBodyResponse, v1.29+: header
// mutations first, then a body mutation whose length must equal a
// content-length header left on the request, else Envoy rejects it).
func (e *envoy) forward(path string, body []byte, cl bool, kv ...string) upstream {
	e.t.Helper()
	hdrs := append([]string{":method", "POST", ":path", path, "content-type", "application/json"}, kv...)
	contentLength := ""
	if cl {
		contentLength = strconv.Itoa(len(body))
		hdrs = append(hdrs, "content-length", contentLength)
	}
	if r := e.headers(nil, false, hdrs...); r.GetRequestHeaders() == nil {
		e.t.Fatalf("headers answered %v, want a headers response", r)
	}
	resp := e.body(nil, body)
	o := outcomeOf(e.t, resp)
	if o.status != 0 {
		return upstream{status: o.status}
	}
	common := resp.GetRequestBody().GetResponse()
	u := upstream{body: body, contentLength: contentLength, instance: o.instance, reason: o.reason}
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		if strings.EqualFold(h.GetHeader().GetKey(), "content-length") {
			u.contentLength = string(h.GetHeader().GetRawValue())
		}
	}
	for _, k := range common.GetHeaderMutation().GetRemoveHeaders() {
		if strings.EqualFold(k, "content-length") {
			u.contentLength = ""
		}
	}
	if bm := common.GetBodyMutation(); bm != nil {
		if bm.GetClearBody() {
			e.t.Fatalf("clear_body mutation, want a replaced body")
		}
		u.body, u.mutated = bm.GetBody(), true
	}
	if u.contentLength != "" && u.contentLength != strconv.Itoa(len(u.body)) {
		e.t.Fatalf("content-length %s for a body of %d bytes: Envoy would refuse the mutation", u.contentLength, len(u.body))
	}
	if common.GetStatus() != extprocv3.CommonResponse_CONTINUE {
		e.t.Fatalf("status %v, want CONTINUE", common.GetStatus())
	}
	return u
}

// members decodes a forwarded JSON object body.
func members(t *testing.T, body []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("forwarded body %q: %v", body, err)
	}
	return m
}

// TestExtProcBodyRewrite: the endpoint picker rewrites the body Envoy
// forwards as the HTTP data plane does (router.Table.Resolve with
// Forwards): a client's kv_transfer_params out unless the pool passes
// them, the tenant's cache_salt in per the pool's client policy, with
// content-length matching the new body; a body needing no rewrite is not
// touched, and one that needs a rewrite but is not strict JSON is refused.
// Before, every body went upstream as the client sent it.
func TestExtProcBodyRewrite(t *testing.T) {
	evil := json.RawMessage(`{"do_remote_prefill":true,"remote_host":"attacker.example","remote_port":5600}`)
	chat := func(extra map[string]any) []byte {
		m := map[string]any{"model": hashModel, "messages": []map[string]any{{"role": "user", "content": "hello"}}}
		for k, v := range extra {
			m[k] = v
		}
		b, _ := json.Marshal(m)
		return b
	}
	saltA := router.DeriveCacheSalt(saltSecret, "tenant-a")
	tenantA := []string{strings.ToLower(router.TenantHeader), "tenant-a"}
	hashPool := []string{"x-kvrouter-pool", "hash"}
	nanParams := `{"prompt":"hello","temperature":NaN,"kv_transfer_params":{"remote_host":"attacker.example"}}`
	tests := []struct {
		name    string
		opts    []harnessOpt
		path    string
		headers []string
		body    []byte
		noCL    bool // the request is chunked: no content-length
		status  int
		mutated bool
		// want: members the forwarded body must have (raw JSON), gone:
		// members it must not have.
		want map[string]string
		gone []string
	}{
		{name: "kv_transfer_params stripped", path: "/v1/chat/completions", body: chat(map[string]any{"kv_transfer_params": evil}), mutated: true, gone: []string{"kv_transfer_params"}, want: map[string]string{"model": `"` + hashModel + `"`}},
		{name: "kv_transfer_params stripped, chunked", path: "/v1/chat/completions", body: chat(map[string]any{"kv_transfer_params": evil}), noCL: true, mutated: true, gone: []string{"kv_transfer_params"}},
		{name: "raw invocation stripped", path: "/invocations", headers: hashPool, body: []byte(`{"prompt":"hello","kv_transfer_params":` + string(evil) + `}`), mutated: true, gone: []string{"kv_transfer_params"}, want: map[string]string{"prompt": `"hello"`}},
		{name: "pass_kv_transfer_params keeps them", opts: []harnessOpt{passParams}, path: "/v1/chat/completions", body: chat(map[string]any{"kv_transfer_params": evil}), want: map[string]string{"kv_transfer_params": string(evil)}},
		{name: "tenant salt injected", opts: []harnessOpt{salted("")}, path: "/v1/chat/completions", headers: tenantA, body: chat(nil), mutated: true, want: map[string]string{"cache_salt": `"` + saltA + `"`}},
		{name: "prompt_cache_key is the tenant", opts: []harnessOpt{salted("")}, path: "/v1/chat/completions", body: chat(map[string]any{"prompt_cache_key": "tenant-a"}), mutated: true, want: map[string]string{"cache_salt": `"` + saltA + `"`}},
		{name: "client salt overwritten", opts: []harnessOpt{salted(config.CacheSaltOverwrite)}, path: "/v1/chat/completions", headers: tenantA, body: chat(map[string]any{"cache_salt": "mine"}), mutated: true, want: map[string]string{"cache_salt": `"` + saltA + `"`}},
		{name: "client salt kept", opts: []harnessOpt{salted(config.CacheSaltKeep)}, path: "/v1/chat/completions", headers: tenantA, body: chat(map[string]any{"cache_salt": "mine"}), want: map[string]string{"cache_salt": `"mine"`}},
		{name: "keep adds a missing salt", opts: []harnessOpt{salted(config.CacheSaltKeep)}, path: "/v1/chat/completions", headers: tenantA, body: chat(nil), mutated: true, want: map[string]string{"cache_salt": `"` + saltA + `"`}},
		{name: "salt and params together", opts: []harnessOpt{salted("")}, path: "/invocations", headers: append(append([]string{}, hashPool...), tenantA...), body: []byte(`{"prompt":"hello","cache_salt":"mine","kv_transfer_params":` + string(evil) + `}`), mutated: true, want: map[string]string{"cache_salt": `"` + saltA + `"`}, gone: []string{"kv_transfer_params"}},
		{name: "no tenant: untouched", opts: []harnessOpt{salted("")}, path: "/v1/chat/completions", body: chat(map[string]any{"cache_salt": "mine"}), want: map[string]string{"cache_salt": `"mine"`}},
		{name: "nothing to rewrite", path: "/v1/chat/completions", body: chat(nil)},
		{name: "raw non-JSON without the member", path: "/invocations", headers: hashPool, body: []byte("plain text")},
		{name: "raw NaN without the member", path: "/invocations", headers: hashPool, body: []byte(`{"prompt":"hello","temperature":NaN}`)},
		{name: "raw NaN with kv_transfer_params refused", path: "/invocations", headers: hashPool, body: []byte(nanParams), status: http.StatusBadRequest},
		{name: "raw BOM with kv_transfer_params refused", path: "/invocations", headers: hashPool, body: []byte("\ufeff" + `{"prompt":"hello","kv_transfer_params":{}}`), status: http.StatusBadRequest},
		{name: "raw escaped key refused", path: "/invocations", headers: hashPool, body: []byte(`{"prompt":"hello","kv_transfer_p\u0061rams":{},"t":NaN}`), status: http.StatusBadRequest},
		{name: "raw NaN with a tenant to salt refused", opts: []harnessOpt{salted("")}, path: "/invocations", headers: append(append([]string{}, hashPool...), tenantA...), body: []byte(`{"prompt":"hello","temperature":NaN}`), status: http.StatusBadRequest},
		{name: "raw NaN passed on by the pool", opts: []harnessOpt{passParams}, path: "/invocations", headers: hashPool, body: []byte(nanParams)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.opts...)
			u := h.envoy(t).forward(tc.path, tc.body, !tc.noCL, tc.headers...)
			if u.status != tc.status {
				t.Fatalf("status %d, want %d", u.status, tc.status)
			}
			if tc.status != 0 {
				return
			}
			if u.mutated != tc.mutated {
				t.Fatalf("body mutated %v, want %v: forwarded %s", u.mutated, tc.mutated, u.body)
			}
			if !u.mutated {
				if u.contentLength != strconv.Itoa(len(tc.body)) && !tc.noCL {
					t.Errorf("content-length %q changed on an untouched body", u.contentLength)
				}
				return
			}
			if tc.noCL && u.contentLength != "" {
				t.Errorf("content-length %q added to a chunked request", u.contentLength)
			}
			if !tc.noCL && u.contentLength != strconv.Itoa(len(u.body)) {
				t.Errorf("content-length %q for a forwarded body of %d bytes", u.contentLength, len(u.body))
			}
			m := members(t, u.body)
			for k, v := range tc.want {
				if got := string(m[k]); got != v {
					t.Errorf("forwarded %s = %s, want %s", k, got, v)
				}
			}
			for _, k := range tc.gone {
				if _, ok := m[k]; ok {
					t.Errorf("forwarded body keeps %s: %s", k, u.body)
				}
			}
		})
	}
}

// TestExtProcSaltKeysKVAware: kv_aware keys a request's blocks under the
// cache_salt the forwarded body carries, as the engine will: a tenant's
// request matches the blocks stored under its derived salt, and a tenant
// that sends another's salt in its body matches nothing of it (the router
// overwrote it). Before, the picker keyed by the client's salt: tenant-a
// matched nothing and tenant-b, quoting a's salt, matched a's blocks.
func TestExtProcSaltKeysKVAware(t *testing.T) {
	h := newHarness(t, salted(""))
	p := routertest.Prompt(11, 6*bs)
	saltA := router.DeriveCacheSalt(saltSecret, "tenant-a")
	h.storeSalted("kv-2", saltA, p)
	body := func(salt string) []byte {
		m := map[string]any{"model": kvModel, "prompt": p}
		if salt != "" {
			m["cache_salt"] = salt
		}
		b, _ := json.Marshal(m)
		return b
	}
	tenant := strings.ToLower(router.TenantHeader)

	u := h.envoy(t).forward("/v1/completions", body(saltA), true, tenant, "tenant-b")
	if u.status != 0 || u.reason == string(router.ReasonKVMatch) {
		t.Errorf("tenant-b quoting a's salt: status %d reason %s on %s, want no match of a's blocks", u.status, u.reason, u.instance)
	}
	if got := string(members(t, u.body)["cache_salt"]); got != strconv.Quote(router.DeriveCacheSalt(saltSecret, "tenant-b")) {
		t.Errorf("tenant-b forwarded cache_salt %s, want b's", got)
	}
	u = h.envoy(t).forward("/v1/completions", body(""), true, tenant, "tenant-a")
	if u.status != 0 || u.reason != string(router.ReasonKVMatch) || u.instance != "kv-2" {
		t.Errorf("tenant-a: status %d reason %s on %s, want kv_match on kv-2", u.status, u.reason, u.instance)
	}
	if got := string(members(t, u.body)["cache_salt"]); got != strconv.Quote(saltA) {
		t.Errorf("tenant-a forwarded cache_salt %s, want a's", got)
	}
}

// TestExtProcHeadersOnlyNotRewritten: a request without a body (its
// headers end the stream: a GET through Envoy) has no body to write a salt
// into or strip: it is routed as before, not refused because an empty body
// is no JSON object (a 400 when the picker first forwarded every body).
func TestExtProcHeadersOnlyNotRewritten(t *testing.T) {
	h := newHarness(t, salted(""))
	e := h.envoy(t)
	r := e.headers(nil, true, ":method", "GET", ":path", "/v1/models", "x-kvrouter-pool", "hash", strings.ToLower(router.TenantHeader), "tenant-a")
	if o := outcomeOf(t, r); o.status != 0 || !strings.HasPrefix(o.instance, "hash-") {
		t.Fatalf("headers-only request: %+v, want routed in pool hash", o)
	}
	if r.GetRequestHeaders().GetResponse().GetBodyMutation() != nil {
		t.Fatal("a body mutation for a request without a body")
	}
}

// TestExtProcStreamedBodyNotMutated: a body that came in several messages
// (request_body_mode STREAMED or BUFFERED_PARTIAL) was let through chunk by
// chunk before the pick, so a body mutation on the last chunk would
// replace only that chunk and the engine would read the earlier chunks
// twice, with the client's members in. A rewrite is then refused (500,
// the filter's mode is wrong) rather than sent; a streamed body needing
// no rewrite routes as before.
func TestExtProcStreamedBodyNotMutated(t *testing.T) {
	h := newHarness(t)
	stream := func(body []byte) *extprocv3.ProcessingResponse {
		e := h.envoy(t)
		e.headers(nil, false, ":method", "POST", ":path", "/v1/completions", "content-type", "application/json")
		half := len(body) / 2
		if r := e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body[:half]}}}); r.GetRequestBody().GetResponse().GetBodyMutation() != nil {
			t.Fatalf("first chunk answered %v, want an untouched continue", r)
		}
		return e.body(nil, body[half:])
	}
	r := stream([]byte(`{"model":"` + hashModel + `","prompt":"hello","kv_transfer_params":{"remote_host":"attacker.example"}}`))
	if o := outcomeOf(t, r); o.status != http.StatusInternalServerError {
		t.Fatalf("streamed body needing a rewrite: %+v, want 500", o)
	}
	r = stream([]byte(`{"model":"` + hashModel + `","prompt":"hello"}`))
	if o := outcomeOf(t, r); o.status != 0 || r.GetRequestBody().GetResponse().GetBodyMutation() != nil {
		t.Fatalf("streamed body needing no rewrite: %+v, want routed untouched", o)
	}
}
