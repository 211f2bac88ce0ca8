package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

const model = servertest.Model

// harness is servertest's harness under the names this package's tests
// were written with.
type harness struct {
	sh   *servertest.Harness
	t    testing.TB
	srv  *httpapi.Server
	ts   *httptest.Server
	ups  []*routertest.Upstream
	byID map[string]*routertest.Upstream
}

// newHarness starts n fake instances and a router in front of them; mod
// adjusts the config before the server is built.
func newHarness(t testing.TB, n int, mod func(*config.Config)) *harness {
	t.Helper()
	sh := servertest.New(t, n, mod)
	return &harness{sh: sh, t: t, srv: sh.Srv, ts: sh.TS, ups: sh.Ups, byID: sh.ByID}
}

// run starts the server's background loops until the test ends.
func (h *harness) run() { h.sh.Run() }

type result = servertest.Result

func (h *harness) do(method, path string, body []byte, hdr map[string]string) result {
	h.t.Helper()
	return servertest.Do(h.t, h.ts.URL, method, path, body, hdr)
}

func chatBody(model, text string, stream bool) []byte {
	return servertest.ChatBody(model, text, stream)
}

// errorOf decodes an OpenAI-shaped error body, failing if it is not one.
func errorOf(t *testing.T, r result) (msg string, code int) {
	t.Helper()
	return servertest.ErrorOf(t, servertest.Result{Status: r.Status, Header: r.Header, Body: r.Body})
}

func TestChatCompletionsRoutesAndExplains(t *testing.T) {
	h := newHarness(t, 4, nil)
	body := chatBody(model, "Summarise the attached contract.", false)
	r := h.do("POST", "/v1/chat/completions", body, nil)
	if r.Status != 200 {
		t.Fatalf("status %d: %s", r.Status, r.Body)
	}
	inst := r.Header.Get(router.HeaderInstance)
	if h.byID[inst] == nil {
		t.Fatalf("x-kvrouter-instance %q is not an instance", inst)
	}
	if r.Header.Get("X-Upstream-Id") != inst {
		t.Fatalf("header says %s, upstream %s answered", inst, r.Header.Get("X-Upstream-Id"))
	}
	if got := r.Header.Get(router.HeaderStrategy); got != "prefix_aware" {
		t.Errorf("strategy header %q", got)
	}
	if got := r.Header.Get(router.HeaderReason); got != "hash" {
		t.Errorf("reason header %q", got)
	}
	if _, err := fmt.Sscan(r.Header.Get(httpapi.HeaderOverheadUS), new(int)); err != nil {
		t.Errorf("overhead header %q: %v", r.Header.Get(httpapi.HeaderOverheadUS), err)
	}
	if !bytes.Equal(h.byID[inst].LastBody(), body) {
		t.Errorf("body not forwarded unchanged")
	}
	if p := h.byID[inst].Paths(); p[len(p)-1] != "/v1/chat/completions" {
		t.Errorf("upstream path %q", p[len(p)-1])
	}
	// The same prompt goes to the same instance, every time.
	for range 10 {
		if got := h.do("POST", "/v1/chat/completions", body, nil).Header.Get(router.HeaderInstance); got != inst {
			t.Fatalf("same prompt went to %s, then %s", inst, got)
		}
	}
}

func TestCompletionsPromptShapes(t *testing.T) {
	h := newHarness(t, 3, nil)
	tests := []struct {
		name, prompt string
		status       int
	}{
		{"string", `"Once upon a time"`, 200},
		{"list of strings", `["Once upon a time", "In a galaxy"]`, 200},
		{"token ids", `[128000, 791, 4320, 374]`, 200},
		{"list of token arrays", `[[128000, 791], [128000, 4320]]`, 200},
		{"negative token id", `[1, -5]`, 400},
		{"token id over uint32", `[4294967296]`, 400},
		{"number", `42`, 400},
		{"missing", `null`, 400},
		{"empty list", `[]`, 400},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":8}`, model, tc.prompt))
			r := h.do("POST", "/v1/completions", body, nil)
			if r.Status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.Status, tc.status, r.Body)
			}
			if tc.status != 200 {
				errorOf(t, r)
			}
		})
	}
}

func TestErrorPaths(t *testing.T) {
	h := newHarness(t, 2, func(c *config.Config) { c.MaxBodyBytes = 4096 })
	big := chatBody(model, strings.Repeat("x", 5000), false)
	tests := []struct {
		name   string
		path   string
		body   []byte
		hdr    map[string]string
		status int
		msg    string
	}{
		{"malformed JSON", "/v1/chat/completions", []byte(`{"model": "x", "messages": [`), nil, 400, "malformed JSON"},
		{"not an object", "/v1/chat/completions", []byte(`[1,2]`), nil, 400, "malformed JSON"},
		{"no messages", "/v1/chat/completions", []byte(`{"model":"` + model + `"}`), nil, 400, "messages"},
		{"bad content type", "/v1/chat/completions", []byte(`{"model":"` + model + `","messages":[{"role":"user","content":7}]}`), nil, 400, "content"},
		{"no model", "/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"hi"}]}`), nil, 400, "model"},
		{"unknown model", "/v1/chat/completions", chatBody("gpt-17", "hi", false), nil, 404, `"gpt-17" does not exist`},
		{"body over limit", "/v1/chat/completions", big, nil, 413, "limit of 4096"},
		{"raw body over limit", "/invocations", big, nil, 413, "limit of 4096"},
		{"tenant header empty", "/invocations", []byte(`{}`), map[string]string{router.TenantHeader: ""}, 400, router.TenantHeader},
		{"tenant header too long", "/invocations", []byte(`{}`), map[string]string{router.TenantHeader: strings.Repeat("a", 65)}, 400, router.TenantHeader},
		{"tenant header not printable", "/v1/chat/completions", chatBody(model, "hi", false), map[string]string{router.TenantHeader: "a\tb"}, 400, router.TenantHeader},
		{"unknown pool header", "/invocations", []byte(`{}`), map[string]string{router.HeaderPool: "nope"}, 404, "no pool"},
		{"unknown route", "/v1/embeddings", []byte(`{}`), nil, 404, "no route"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := h.do("POST", tc.path, tc.body, tc.hdr)
			if r.Status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.Status, tc.status, r.Body)
			}
			msg, code := errorOf(t, r)
			if code != tc.status || !strings.Contains(msg, tc.msg) {
				t.Fatalf("error %q (code %d), want it to mention %q (code %d)", msg, code, tc.msg, tc.status)
			}
		})
	}
	// A path served with another method: 405 with Allow, not "no route"
	// (the catch-all route used to answer 404 for GET /v1/completions).
	for _, tc := range []struct{ method, path, allow string }{
		{"GET", "/v1/completions", "POST"},
		{"PUT", "/v1/chat/completions", "POST"},
		{"POST", "/readyz", "GET"},
	} {
		r := h.do(tc.method, tc.path, nil, nil)
		if r.Status != http.StatusMethodNotAllowed || r.Header.Get("Allow") != tc.allow {
			t.Errorf("%s %s: status %d, Allow %q; want 405 with Allow %q (%s)", tc.method, tc.path, r.Status, r.Header.Get("Allow"), tc.allow, r.Body)
		}
	}
	// Chunked body over the limit (no Content-Length up front).
	req, _ := http.NewRequest("POST", h.ts.URL+"/v1/chat/completions", io.MultiReader(bytes.NewReader(big)))
	req.ContentLength = -1
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 413 {
		t.Fatalf("chunked body over limit: status %d, want 413", resp.StatusCode)
	}
	for _, u := range h.ups {
		if n := u.Requests.Load(); n != 0 {
			t.Errorf("%s received %d requests that should have been rejected", u.ID, n)
		}
	}
}

func TestNoEligibleInstance(t *testing.T) {
	h := newHarness(t, 2, nil)
	for _, p := range h.srv.Pools() {
		for _, in := range p.Instances() {
			in.SetHealthy(false)
		}
	}
	r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
	if r.Status != 503 {
		t.Fatalf("status %d, want 503", r.Status)
	}
	if r.Header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	errorOf(t, r)
	if rr := h.do("GET", "/readyz", nil, nil); rr.Status != 503 {
		t.Errorf("readyz with no healthy instance: %d", rr.Status)
	}
}

func TestRetryOnNextCandidate(t *testing.T) {
	tests := []struct {
		name     string
		behavior routertest.Behavior
		status   int
	}{
		// A reset after the request was written is not retried (the
		// instance may be prefilling it): retry_written_test.go.
		{"503 from upstream", routertest.Status, 503},
		{"502 from upstream", routertest.Status, 502},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, 3, nil)
			body := chatBody(model, "retry me "+tc.name, false)
			first := h.do("POST", "/v1/chat/completions", body, nil).Header.Get(router.HeaderInstance)
			h.byID[first].Set(tc.behavior, tc.status, 0)
			r := h.do("POST", "/v1/chat/completions", body, nil)
			if r.Status != 200 {
				t.Fatalf("status %d: %s", r.Status, r.Body)
			}
			got := r.Header.Get(router.HeaderInstance)
			if got == first || r.Header.Get("X-Upstream-Id") != got {
				t.Fatalf("retried on %s (upstream %s), first choice %s", got, r.Header.Get("X-Upstream-Id"), first)
			}
			if r.Header.Get(httpapi.HeaderAttempts) != "2" {
				t.Errorf("attempts header %q", r.Header.Get(httpapi.HeaderAttempts))
			}
			// The retry goes to the next instance in the prefix's rendezvous order.
			p, _ := h.srv.Pool("llama")
			order := router.RendezvousOrder(&router.Request{RoutingText: "You are a helpful assistant.\nretry me " + tc.name}, p.Instances())
			if order[0].ID() != first || order[1].ID() != got {
				t.Errorf("rendezvous order %s,%s; first %s, retry %s", order[0].ID(), order[1].ID(), first, got)
			}
		})
	}
}

func TestRetryExhausted(t *testing.T) {
	t.Run("both fail", func(t *testing.T) {
		h := newHarness(t, 2, nil)
		for _, u := range h.ups {
			u.Set(routertest.Status, 502, 0)
		}
		r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
		if r.Status != 502 {
			t.Fatalf("status %d, want 502: %s", r.Status, r.Body)
		}
		errorOf(t, r)
		if r.Header.Get(httpapi.HeaderAttempts) != "2" {
			t.Errorf("attempts %q, want 2", r.Header.Get(httpapi.HeaderAttempts))
		}
	})
	t.Run("single instance: no retry", func(t *testing.T) {
		h := newHarness(t, 1, nil)
		h.ups[0].Set(routertest.HangUp, 0, 0)
		r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
		if r.Status != 502 {
			t.Fatalf("status %d, want 502", r.Status)
		}
		errorOf(t, r)
		if h.ups[0].Requests.Load() != 1 {
			t.Errorf("upstream saw %d requests, want 1", h.ups[0].Requests.Load())
		}
	})
	t.Run("single instance: its 503 passes through", func(t *testing.T) {
		h := newHarness(t, 1, nil)
		h.ups[0].Set(routertest.Status, 503, 0)
		r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
		if r.Status != 503 || !strings.Contains(string(r.Body), "fake vllm-0 failure") {
			t.Fatalf("status %d body %s, want the upstream's 503", r.Status, r.Body)
		}
	})
	t.Run("retry disabled", func(t *testing.T) {
		h := newHarness(t, 3, func(c *config.Config) { c.Proxy.DisableRetry = true })
		for _, u := range h.ups {
			u.Set(routertest.HangUp, 0, 0)
		}
		r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
		if r.Status != 502 {
			t.Fatalf("status %d, want 502", r.Status)
		}
		total := int64(0)
		for _, u := range h.ups {
			total += u.Requests.Load()
		}
		if total != 1 {
			t.Errorf("upstreams saw %d requests, want 1", total)
		}
	})
	t.Run("500 is not retried", func(t *testing.T) {
		h := newHarness(t, 2, nil)
		for _, u := range h.ups {
			u.Set(routertest.Status, 500, 0)
		}
		r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
		if r.Status != 500 || r.Header.Get(httpapi.HeaderAttempts) != "" {
			t.Fatalf("status %d attempts %q, want 500 after one attempt", r.Status, r.Header.Get(httpapi.HeaderAttempts))
		}
	})
}

// TestUpstreamErrorHidesAddress: a client told that an instance failed
// learns the instance's id, not its address, which a transport error
// names ("dial tcp 10.0.3.7:8000: connect: connection refused"): that
// stays in the log and the attempt's span.
func TestUpstreamErrorHidesAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	for _, n := range []int{1, 2} { // one attempt; a retry that fails too
		h := newHarness(t, n, func(c *config.Config) {
			for i := range c.Pools[0].Instances {
				c.Pools[0].Instances[i].URL = "http://" + addr
			}
		})
		r := h.do("POST", "/v1/chat/completions", chatBody(model, "hi", false), nil)
		msg, _ := errorOf(t, r)
		if r.Status != http.StatusBadGateway || !strings.Contains(msg, "failed before answering") || strings.Contains(string(r.Body), addr) || strings.Contains(string(r.Body), "dial") {
			t.Fatalf("%d instances: %d %s", n, r.Status, r.Body)
		}
	}
}

func TestStreamingFirstEventBeforeUpstreamFinishes(t *testing.T) {
	h := newHarness(t, 1, nil)
	u := h.ups[0]
	u.SetStream(3, 400*time.Millisecond)
	resp, err := http.Post(h.ts.URL+"/v1/chat/completions", "application/json", bytes.NewReader(chatBody(model, "stream please", true)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	if resp.Header.Get(router.HeaderInstance) != "vllm-0" {
		t.Fatalf("decision headers missing on a stream: %v", resp.Header)
	}
	var events []string
	testenv.EachSSEData(resp.Body, func(data string) bool {
		if len(events) == 0 && u.Finished.Load() != 0 {
			t.Fatal("first event arrived only after the upstream finished")
		}
		events = append(events, data)
		return true
	})
	if len(events) != 4 || events[3] != "[DONE]" || u.Finished.Load() != 1 {
		t.Fatalf("events %q, finished %d", events, u.Finished.Load())
	}
}

func TestStreamBrokenMidwayEndsWithErrorEvent(t *testing.T) {
	h := newHarness(t, 2, nil)
	for _, u := range h.ups {
		u.SetStream(6, 0)
		u.Set(routertest.BreakStream, 0, 2)
	}
	resp, err := http.Post(h.ts.URL+"/v1/chat/completions", "application/json", bytes.NewReader(chatBody(model, "break", true)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	events := testenv.SSEData(resp.Body)
	if len(events) != 4 {
		t.Fatalf("events %q: want 2 content events, an error event and [DONE]", events)
	}
	var e struct {
		Error struct {
			Message string `json:"message"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(events[2]), &e); err != nil || e.Error.Code != 502 || !strings.Contains(e.Error.Message, "mid-stream") {
		t.Fatalf("third event %q is not the error event (%v)", events[2], err)
	}
	if events[3] != "[DONE]" {
		t.Fatalf("last event %q", events[3])
	}
	// Bytes reached the client: no retry happened.
	total := int64(0)
	for _, u := range h.ups {
		total += u.Requests.Load()
	}
	if total != 1 {
		t.Fatalf("upstreams saw %d requests, want 1 (no retry after streaming began)", total)
	}
}

func TestClientDisconnectCancelsUpstream(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			h := newHarness(t, 1, nil)
			u := h.ups[0]
			release := u.Hold()
			defer release()
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, "POST", h.ts.URL+"/v1/chat/completions", bytes.NewReader(chatBody(model, "hi", stream)))
			errc := make(chan error, 1)
			go func() {
				resp, err := http.DefaultClient.Do(req)
				if err == nil {
					resp.Body.Close()
				}
				errc <- err
			}()
			select {
			case <-u.Started:
			case <-time.After(5 * time.Second):
				t.Fatal("request never reached the upstream")
			}
			p, _ := h.srv.Pool("llama")
			if n := p.Instances()[0].InFlight(); n != 1 {
				t.Fatalf("in flight %d, want 1", n)
			}
			cancel()
			<-errc
			waitFor(t, "upstream request canceled", func() bool { return u.Canceled.Load() == 1 })
			waitFor(t, "in-flight released", func() bool { return p.Instances()[0].InFlight() == 0 })
		})
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	servertest.WaitFor(t, what, cond)
}

func TestOverflowThroughProxy(t *testing.T) {
	h := newHarness(t, 4, func(c *config.Config) { c.Pools[0].Routing.ConcurrencyThreshold = 1 })
	body := chatBody(model, "hot prefix", false)
	first := h.do("POST", "/v1/chat/completions", body, nil).Header.Get(router.HeaderInstance)
	release := h.byID[first].Hold()
	done := make(chan result, 1)
	go func() {
		req, _ := http.NewRequest("POST", h.ts.URL+"/v1/chat/completions", bytes.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- result{}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{Status: resp.StatusCode, Header: resp.Header, Body: b}
	}()
	<-h.byID[first].Started
	<-h.byID[first].Started // the first (unheld) request also signalled
	r := h.do("POST", "/v1/chat/completions", body, nil)
	release()
	if r.Status != 200 || r.Header.Get(router.HeaderReason) != "overflow" || r.Header.Get(router.HeaderInstance) == first {
		t.Fatalf("status %d reason %q instance %q (first %s)", r.Status, r.Header.Get(router.HeaderReason), r.Header.Get(router.HeaderInstance), first)
	}
	if held := <-done; held.Status != 200 || held.Header.Get(router.HeaderInstance) != first {
		t.Fatalf("held request: %d on %s", held.Status, held.Header.Get(router.HeaderInstance))
	}
}

func TestRawInvoke(t *testing.T) {
	h := newHarness(t, 8, func(c *config.Config) {
		c.Pools[0].InvokePath = "/v2/generate"
		c.Pools[0].InvokeStreamPath = "/v2/generate_stream"
		c.Pools[0].CanonicalizeJSON = true
	})
	body := []byte(`{"inputs": "Tell me a story", "parameters": {"max_new_tokens": 32, "temperature": 0.5}}`)
	r := h.do("POST", "/invocations", body, nil)
	if r.Status != 200 {
		t.Fatalf("status %d: %s", r.Status, r.Body)
	}
	inst := h.byID[r.Header.Get(router.HeaderInstance)]
	if !bytes.Equal(inst.LastBody(), body) {
		t.Fatalf("raw body changed: %s", inst.LastBody())
	}
	if p := inst.Paths(); p[len(p)-1] != "/v2/generate" {
		t.Fatalf("upstream path %q", p[len(p)-1])
	}
	r = h.do("POST", "/invocations-response-stream", body, map[string]string{router.HeaderPool: "llama"})
	inst = h.byID[r.Header.Get(router.HeaderInstance)]
	if p := inst.Paths(); r.Status != 200 || p[len(p)-1] != "/v2/generate_stream" || !strings.Contains(string(r.Body), "data: [DONE]") {
		t.Fatalf("stream invoke: %d, path %q, body %s", r.Status, p[len(p)-1], r.Body)
	}
	// Canonicalisation: the same document serialised differently routes together.
	for i := range 20 {
		a := fmt.Sprintf(`{"inputs":"doc %d","parameters":{"a":1,"b":[1,2]}}`, i)
		b := fmt.Sprintf("{\n  \"parameters\": {\"b\": [1, 2], \"a\": 1},\n  \"inputs\": \"doc %d\"\n}", i)
		ia := h.do("POST", "/invocations", []byte(a), nil).Header.Get(router.HeaderInstance)
		ib := h.do("POST", "/invocations", []byte(b), nil).Header.Get(router.HeaderInstance)
		if ia != ib {
			t.Fatalf("doc %d: %s vs %s for equal JSON", i, ia, ib)
		}
	}
}

func TestTenantKeySpreadsEqualPrompts(t *testing.T) {
	h := newHarness(t, 8, nil)
	seen := map[string]bool{}
	for i := range 40 {
		hdr := map[string]string{router.TenantHeader: fmt.Sprintf("tenant-%d", i)}
		a := h.do("POST", "/invocations", []byte(`{"inputs":"same"}`), hdr).Header.Get(router.HeaderInstance)
		b := h.do("POST", "/invocations", []byte(`{"inputs":"same"}`), hdr).Header.Get(router.HeaderInstance)
		if a != b {
			t.Fatalf("tenant %d moved from %s to %s", i, a, b)
		}
		seen[a] = true
		// prompt_cache_key on the OpenAI path does the same.
		body := []byte(fmt.Sprintf(`{"model":%q,"prompt":"same","prompt_cache_key":"tenant-%d"}`, model, i))
		c := h.do("POST", "/v1/completions", body, nil).Header.Get(router.HeaderInstance)
		d := h.do("POST", "/v1/completions", body, nil).Header.Get(router.HeaderInstance)
		if c != d {
			t.Fatalf("prompt_cache_key tenant %d moved from %s to %s", i, c, d)
		}
	}
	if len(seen) < 5 {
		t.Fatalf("40 tenants with the same prompt used %d of 8 instances", len(seen))
	}
}

// TestStreamBrokenMidEvent: an upstream that dies in the middle of an event
// line still leaves the client with a well-formed stream: the partial
// event is terminated and the error event follows on its own.
func TestStreamBrokenMidEvent(t *testing.T) {
	tests := []struct {
		name, sent string
	}{
		{"mid line", "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choi"},
		{"after line, before blank", "data: {\"x\":1}\n"},
		{"at boundary", "data: {\"x\":1}\n\n"},
		{"before any byte", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(200)
				io.WriteString(w, tc.sent)
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler)
			}))
			defer up.Close()
			h := newHarness(t, 0, func(c *config.Config) {
				c.Pools[0].Instances = []config.InstanceConfig{{ID: "only", URL: up.URL}}
			})
			r := h.do("POST", "/v1/chat/completions", chatBody(model, "x", true), nil)
			if r.Status != 200 || !strings.HasPrefix(string(r.Body), tc.sent) {
				t.Fatalf("status %d body %q", r.Status, r.Body)
			}
			rest := string(r.Body[len(tc.sent):])
			// Everything after what the upstream sent: the end of the broken
			// event (if any), the error event, [DONE].
			i := strings.Index(rest, "data: {\"error\"")
			if i < 0 || !strings.HasSuffix(rest, "\n\ndata: [DONE]\n\n") {
				t.Fatalf("no error event after %q: %q", tc.sent, rest)
			}
			if whole := tc.sent + rest[:i]; whole != "" && !strings.HasSuffix(whole, "\n\n") {
				t.Fatalf("error event not at an event boundary: %q", whole)
			}
		})
	}
}

// TestInstanceURLPathPrefix: an instance URL with a path (a server behind a
// path-routing gateway) keeps it in front of the request path.
func TestInstanceURLPathPrefix(t *testing.T) {
	u := routertest.New(t, "gw", model)
	h := newHarness(t, 0, func(c *config.Config) {
		c.Pools[0].Instances = []config.InstanceConfig{{ID: "gw", URL: u.URL() + "/tenant-a/"}}
	})
	for _, tc := range []struct{ path, want string }{
		{"/v1/chat/completions", "/tenant-a/v1/chat/completions"},
		{"/invocations", "/tenant-a/invocations"},
	} {
		if r := h.do("POST", tc.path, chatBody(model, "x", false), nil); r.Status != 200 {
			t.Fatalf("%s: %d %s", tc.path, r.Status, r.Body)
		}
		if p := u.Paths(); p[len(p)-1] != tc.want {
			t.Fatalf("upstream saw %q, want %q", p[len(p)-1], tc.want)
		}
	}
}
