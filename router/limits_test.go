package router_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// limitsRig is a router with one fake vLLM behind it, served by the same
// http.Server the binary builds (router.NewHTTPServer) on a real socket.
type limitsRig struct {
	up   *routertest.Upstream
	srv  *router.Server
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
	srv, err := router.NewServer(cfg, router.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := router.NewHTTPServer(cfg.Limits, srv.Handler())
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
	r := newLimitsRig(t, config.LimitsConfig{MaxHeaderBytes: 2048, MaxMessages: 3, MaxPromptTokenIDs: 10})
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
			req, _ := http.NewRequest(method, "http://"+r.addr+tc.path, strings.NewReader(tc.body))
			for k, v := range tc.header {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, b)
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

func TestLimitsConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		l    config.LimitsConfig
		want string // "" = valid
	}{
		{"defaults", config.LimitsConfig{}, ""},
		{"header too small", config.LimitsConfig{MaxHeaderBytes: 100}, "limits.max_header_bytes 100 out of range"},
		{"negative messages", config.LimitsConfig{MaxMessages: -1}, "limits.max_messages"},
		{"negative token ids", config.LimitsConfig{MaxPromptTokenIDs: -5}, "limits.max_prompt_token_ids"},
		{"tokenize above the token source's bound", config.LimitsConfig{MaxTokenizeBytes: config.MaxTokenizeBytes + 1}, "limits.max_tokenize_bytes"},
		{"negative timeout", config.LimitsConfig{BodyReadTimeout: -time.Second}, "timeouts"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.l.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, config.ErrInvalidConfig) {
				t.Fatalf("err = %v, want ErrInvalidConfig mentioning %q", err, tc.want)
			}
		})
	}
	d := config.LimitsConfig{}.WithDefaults()
	if d.MaxHeaderBytes != 64<<10 || d.MaxMessages != 4096 || d.MaxPromptTokenIDs != 1<<20 || d.MaxTokenizeBytes != config.MaxTokenizeBytes ||
		d.ReadHeaderTimeout != 10*time.Second || d.BodyReadTimeout != time.Minute || d.IdleTimeout != 2*time.Minute {
		t.Fatalf("defaults %+v", d)
	}
}

func TestSecurityConfigFromYAML(t *testing.T) {
	base := "pools:\n  - name: p\n    model: m\n    instances: [{id: a, url: 'http://127.0.0.1:1'}]\n"
	tests := []struct {
		name, yaml string
		secret     []byte
		want       string // "" = valid
	}{
		{"limits section", "limits: {max_messages: 10, max_header_bytes: 4096, body_read_timeout: 5s}\n" + base, nil, ""},
		{"body memory of 3 x max_body_bytes", "max_body_bytes: 1048576\nlimits: {max_body_memory_bytes: 3145728}\n" + base, nil, ""},
		{"body memory below 3 x max_body_bytes", "max_body_bytes: 1048576\nlimits: {max_body_memory_bytes: 3145727}\n" + base, nil, "limits.max_body_memory_bytes 3145727 out of range 3145728"},
		{"tls needs both files", "tls: {cert_file: /x.crt}\n" + base, nil, "tls: cert_file and key_file are both required"},
		{"tls min version", "tls: {cert_file: /x.crt, key_file: /x.key, min_version: '1.0'}\n" + base, nil, "tls.min_version"},
		{"cache_salt needs the secret", base + "    cache_salt: {enabled: true}\n", nil, "pools[0].cache_salt.enabled needs the secret in KVROUTER_CACHE_SALT_SECRET"},
		{"cache_salt with the secret", base + "    cache_salt: {enabled: true, client: keep}\n", make([]byte, 16), ""},
		{"cache_salt bad client policy", base + "    cache_salt: {enabled: true, client: merge}\n", make([]byte, 16), "pools[0].cache_salt.client"},
		{"secret is not a file field", "cache_salt_secret: abc\n" + base, nil, "cache_salt_secret"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.ParseConfig(strings.NewReader(tc.yaml))
			if err == nil {
				cfg.CacheSaltSecret = tc.secret
				err = cfg.WithDefaults().Validate()
			}
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

// TestTokenizeLimitRoutesHeuristically: a body over max_tokenize_bytes is
// never handed to the tokenizer; the request still routes.
func TestTokenizeLimitRoutesHeuristically(t *testing.T) {
	req := &router.Request{Body: make([]byte, 100)}
	router.LimitTokenizeForTest(config.LimitsConfig{MaxTokenizeBytes: 99}, req)
	if _, err := req.TokenIDs(context.Background()); !errors.Is(err, router.ErrPromptTooLong) || !errors.Is(err, router.ErrTokenSource) {
		t.Fatalf("over the limit: err %v, want ErrPromptTooLong", err)
	}
	req = &router.Request{Body: make([]byte, 99)}
	router.LimitTokenizeForTest(config.LimitsConfig{MaxTokenizeBytes: 99}, req)
	if req.Tokenizer != nil {
		t.Fatal("a body at the limit lost its tokenizer")
	}
	req = &router.Request{Body: make([]byte, 100), PromptTokens: []uint32{1}}
	router.LimitTokenizeForTest(config.LimitsConfig{MaxTokenizeBytes: 99}, req)
	if ids, err := req.TokenIDs(context.Background()); err != nil || len(ids) != 1 {
		t.Fatalf("given token ids: %v %v", ids, err)
	}
}
