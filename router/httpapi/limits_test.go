package httpapi_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
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

// limitsRig is a router with one fake vLLM behind it, served by the same
// http.Server the binary builds (httpapi.NewHTTPServer) on a real socket.
type limitsRig struct {
	up   *routertest.Upstream
	srv  *httpapi.Server
	addr string
}

func newLimitsRig(t *testing.T, limits config.LimitsConfig) *limitsRig {
	t.Helper()
	up := routertest.New(t, "vllm-0", "m")
	cfg := config.Config{Limits: limits, Pools: []config.PoolConfig{{
		Name: "p", Model: "m",
		Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: up.ID, URL: up.URL()}},
	}}}
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := httpapi.NewHTTPServer(cfg.Limits, srv.Handler())
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	return &limitsRig{up: up, srv: srv, addr: ln.Addr().String()}
}

// openAIError decodes an OpenAI-shaped error body, failing on any other shape.
func openAIError(t *testing.T, b []byte) (msg string, code int) {
	t.Helper()
	var e struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Error == nil || e.Error.Type == "" {
		t.Fatalf("not an OpenAI error: %q (%v)", b, err)
	}
	return e.Error.Message, e.Error.Code
}

func TestInputLimits(t *testing.T) {
	r := newLimitsRig(t, config.LimitsConfig{MaxHeaderBytes: 2048, MaxMessages: 3, MaxPromptTokenIDs: 10, MaxPrompts: 3, MaxContentParts: 4})
	msgs := func(n int) string {
		var parts []string
		for range n {
			parts = append(parts, `{"role":"user","content":"hi"}`)
		}
		return `{"model":"m","messages":[` + strings.Join(parts, ",") + `]}`
	}
	tests := []struct {
		name       string
		path, body string
		header     map[string]string
		status     int
		msg        string // substring of the error message; "" = success
	}{
		{name: "messages at the limit", path: "/v1/chat/completions", body: msgs(3), status: 200},
		{name: "messages over the limit", path: "/v1/chat/completions", body: msgs(4), status: 400, msg: "messages: 4 messages exceed the limit of 3"},
		{name: "token ids at the limit", path: "/v1/completions", body: `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10]}`, status: 200},
		{name: "token ids over the limit", path: "/v1/completions", body: `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11]}`, status: 400, msg: "prompt: 11 token ids exceed the limit of 10"},
		{name: "token ids over the limit across a batch", path: "/v1/completions", body: `{"model":"m","prompt":[[1,2,3,4,5,6],[7,8,9,10,11]]}`, status: 400, msg: "11 token ids exceed"},
		{name: "prompts at the limit", path: "/v1/completions", body: `{"model":"m","prompt":["a","b","c"]}`, status: 200},
		{name: "prompts over the limit", path: "/v1/completions", body: `{"model":"m","prompt":["a","b","c","d"]}`, status: 400, msg: "prompt: 4 prompts exceed the limit of 3"},
		{name: "token-id prompts over the limit", path: "/v1/completions", body: `{"model":"m","prompt":[[1],[2],[3],[4]]}`, status: 400, msg: "prompt: 4 prompts exceed the limit of 3"},
		{name: "content parts at the limit", path: "/v1/chat/completions", body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user","content":[{"type":"text","text":"c"},{"type":"text","text":"d"}]}]}`, status: 200},
		{name: "content parts over the limit", path: "/v1/chat/completions", body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"},{"type":"text","text":"c"}]},{"role":"user","content":[{"type":"text","text":"d"},{"type":"text","text":"e"}]}]}`, status: 400, msg: "messages: content parts exceed the limit of 4"},
		{name: "text prompt is not counted as ids", path: "/v1/completions", body: `{"model":"m","prompt":"` + strings.Repeat("x", 5000) + `"}`, status: 200},
		{name: "headers over the limit", path: "/v1/completions", body: `{"model":"m","prompt":"x"}`, header: map[string]string{"X-Pad": strings.Repeat("a", 2100)}, status: 431, msg: "exceed the limit of 2048 bytes"},
		{name: "headers over the limit on GET", path: "/v1/models", header: map[string]string{"X-Pad": strings.Repeat("a", 2100)}, status: 431, msg: "exceed the limit of 2048 bytes"},
		{name: "bad tenant id", path: "/v1/completions", body: `{"model":"m","prompt":"x"}`, header: map[string]string{router.TenantHeader: strings.Repeat("t", 65)}, status: 400, msg: "1-64 printable ASCII"},
		{name: "nesting beyond 10000", path: "/v1/completions", body: `{"model":"m","prompt":"x","x":` + strings.Repeat("[", 10001) + strings.Repeat("]", 10001) + `}`, status: 400, msg: "exceeded max depth"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			method := http.MethodPost
			if tc.body == "" {
				method = http.MethodGet
			}
			res := servertest.Do(t, "http://"+r.addr, method, tc.path, []byte(tc.body), tc.header)
			b := res.Body
			if res.Status != tc.status {
				t.Fatalf("status %d, want %d: %s", res.Status, tc.status, b)
			}
			if tc.msg == "" {
				return
			}
			msg, code := openAIError(t, b)
			if code != tc.status || !strings.Contains(msg, tc.msg) {
				t.Fatalf("error %d %q, want %d containing %q", code, msg, tc.status, tc.msg)
			}
		})
	}

	// Far beyond the limit net/http refuses the headers itself, without
	// reading them all (a plain 431: no handler runs).
	req, _ := http.NewRequest(http.MethodGet, "http://"+r.addr+"/v1/models", nil)
	req.Header.Set("X-Pad", strings.Repeat("a", 16<<10))
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("huge header: status %d, want 431", resp.StatusCode)
		}
	}
}

// rawRequest writes head (and then body, after delay) on a fresh
// connection and returns the response status line, or an error when the
// server closed the connection without answering.
func rawRequest(t *testing.T, addr, head, body string, delay time.Duration) (string, error) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, head); err != nil {
		return "", err
	}
	time.Sleep(delay)
	_, _ = io.WriteString(c, body) // may fail: the server gave up
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(line), nil
}

func TestSlowClients(t *testing.T) {
	r := newLimitsRig(t, config.LimitsConfig{ReadHeaderTimeout: 200 * time.Millisecond, BodyReadTimeout: 300 * time.Millisecond})
	body := `{"model":"m","prompt":"hello"}`
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(body))

	t.Run("prompt body is served", func(t *testing.T) {
		line, err := rawRequest(t, r.addr, head, body, 0)
		if err != nil || !strings.Contains(line, " 200 ") {
			t.Fatalf("got %q, %v", line, err)
		}
	})
	t.Run("body slower than body_read_timeout gets 408", func(t *testing.T) {
		before := r.up.Requests.Load()
		line, err := rawRequest(t, r.addr, head, body[:5], 600*time.Millisecond)
		if err != nil || !strings.Contains(line, " 408 ") {
			t.Fatalf("got %q, %v; want 408", line, err)
		}
		if r.up.Requests.Load() != before {
			t.Fatal("a timed-out request reached the upstream")
		}
	})
	t.Run("headers slower than read_header_timeout are cut", func(t *testing.T) {
		line, err := rawRequest(t, r.addr, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n", "X-Late: 1\r\n\r\n", 600*time.Millisecond)
		if err == nil && !strings.Contains(line, " 408 ") && !strings.Contains(line, " 400 ") {
			t.Fatalf("slow headers answered %q", line)
		}
	})
	t.Run("a stream outlives the body deadline", func(t *testing.T) {
		// 6 events 150ms apart: the response lasts 3x body_read_timeout.
		r.up.SetStream(6, 150*time.Millisecond)
		defer r.up.SetStream(5, 0)
		resp, err := http.Post("http://"+r.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x","stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("stream cut after %d bytes: %v", len(b), err)
		}
		if !strings.HasSuffix(string(b), "data: [DONE]\n\n") || strings.Contains(string(b), `"error"`) {
			t.Fatalf("stream incomplete: %q", b)
		}
	})
}

// TestParseAllocationBoundedOverHTTP: a body that is all list items
// ("{}," messages) costs the router a few times its size, not hundreds:
// before the limits were checked inside the parse, a 3 MiB body of
// messages allocated 862 MB before its 400, past any
// max_body_memory_bytes.
func TestParseAllocationBoundedOverHTTP(t *testing.T) {
	h := servertest.New(t, 1, nil)
	body := []byte(`{"model":"` + servertest.Model + `","messages":[` + strings.Repeat(`{},`, 1<<20) + `{}]}`)
	var r servertest.Result
	alloc := testenv.Allocated(func() { r = h.Do(http.MethodPost, "/v1/chat/completions", body, nil) })
	if msg, _ := servertest.ErrorOf(t, r); r.Status != http.StatusBadRequest || !strings.Contains(msg, "messages exceed the limit of 4096") {
		t.Fatalf("%d %s", r.Status, r.Body)
	}
	// The client's copy and the router's (body, chunks) are in it too.
	if alloc > 16*uint64(len(body)) {
		t.Fatalf("a %d-byte body cost %d bytes (%.0fx)", len(body), alloc, float64(alloc)/float64(len(body)))
	}
}
