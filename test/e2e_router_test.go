package test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/routertest"
)

const routerModel = "meta-llama/Llama-3.1-8B-Instruct"

// buildRouter builds the real kvrouter binary into a temporary directory.
func buildRouter(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "kvrouter")
	out, err := exec.Command("go", "build", "-o", bin, "../cmd/kvrouter").CombinedOutput()
	if err != nil {
		t.Fatalf("go build ./cmd/kvrouter: %v\n%s", err, out)
	}
	return bin
}

// routerProc is a running kvrouter binary.
type routerProc struct {
	cmd   *exec.Cmd
	data  string // base URL of the data listener
	admin string // base URL of the admin listener
	done  chan error
	mu    sync.Mutex // guards logs
	logs  []string
}

func (p *routerProc) logText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.logs, "\n")
}

// startRouter runs bin with args and env, waiting for its "kvrouter
// listening" log line to learn the bound addresses.
func startRouter(t *testing.T, bin string, env []string, args ...string) *routerProc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &routerProc{cmd: cmd, done: make(chan error, 1)}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		var once sync.Once
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.logs = append(p.logs, line)
			p.mu.Unlock()
			var rec map[string]any
			if json.Unmarshal([]byte(line), &rec) == nil && rec["msg"] == "kvrouter listening" {
				p.data = "http://" + rec["listen"].(string)
				if a, ok := rec["admin_listen"].(string); ok {
					p.admin = "http://" + a
				}
				once.Do(func() { close(ready) })
			}
		}
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
		}
	})
	select {
	case <-ready:
	case err := <-p.done:
		t.Fatalf("kvrouter exited before listening: %v\n%s", err, p.logText())
	case <-time.After(20 * time.Second):
		t.Fatalf("kvrouter did not start listening\n%s", p.logText())
	}
	return p
}

// routerUpstreams starts n fake vLLM instances of routerModel, vllm-0 ..
// vllm-(n-1).
func routerUpstreams(t *testing.T, n int) []*routertest.Upstream {
	ups := make([]*routertest.Upstream, n)
	for i := range ups {
		ups[i] = routertest.New(t, fmt.Sprintf("vllm-%d", i), routerModel)
	}
	return ups
}

func writeRouterConfig(t *testing.T, path, strategy string, ups []*routertest.Upstream) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "listen: \"127.0.0.1:0\"\nadmin_listen: \"127.0.0.1:0\"\nlog: {level: debug, format: json}\nmax_body_bytes: 1048576\n")
	fmt.Fprintf(&b, "pools:\n  - name: llama\n    model: %s\n    routing: {strategy: %s, prefix_length: 1024, concurrency_threshold: 8}\n", routerModel, strategy)
	fmt.Fprintf(&b, "    health: {interval: 100ms, timeout: 500ms, unhealthy_threshold: 2, healthy_threshold: 1}\n    discovery: {disable: true}\n    instances:\n")
	for _, u := range ups {
		fmt.Fprintf(&b, "      - id: %s\n        url: %s\n", u.ID, u.URL())
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
}

type httpResult struct {
	status int
	header http.Header
	body   string
}

// httpDo is testenv.Do with the body and the answer as strings.
func httpDo(t *testing.T, method, url, body string, hdr map[string]string) httpResult {
	t.Helper()
	r := testenv.Do(t, method, url, []byte(body), hdr)
	return httpResult{r.Status, r.Header, string(r.Body)}
}

func chatJSON(model, text string, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": model, "stream": stream, "messages": []map[string]string{{"role": "user", "content": text}}})
	return string(b)
}

// TestE2ERouterBinary runs the real kvrouter binary in front of fake vLLM
// instances (real HTTP, vLLM's response and SSE shapes) and walks the
// request path, every error path, the admin API, SIGHUP reload and SIGTERM.
func TestE2ERouterBinary(t *testing.T) {
	bin := buildRouter(t)
	ups := routerUpstreams(t, 3)
	cfgPath := filepath.Join(t.TempDir(), "router.yaml")
	writeRouterConfig(t, cfgPath, "prefix_aware", ups)
	p := startRouter(t, bin, []string{"KVROUTER_ADMIN_TOKEN=e2e-token"}, "--config", cfgPath, "--max-body-bytes", "4096")
	chat := p.data + "/v1/chat/completions"

	t.Run("chat routes by prefix and explains", func(t *testing.T) {
		r := httpDo(t, "POST", chat, chatJSON(routerModel, "a long shared prompt", false), nil)
		if r.status != 200 || r.header.Get("X-Kvrouter-Strategy") != "prefix_aware" || r.header.Get("X-Kvrouter-Reason") != "hash" {
			t.Fatalf("%d %v %s", r.status, r.header, r.body)
		}
		inst := r.header.Get("X-Kvrouter-Instance")
		if r.header.Get("X-Upstream-Id") != inst || r.header.Get("X-Kvrouter-Overhead-Us") == "" {
			t.Fatalf("instance header %q, upstream %q", inst, r.header.Get("X-Upstream-Id"))
		}
		for range 5 {
			if got := httpDo(t, "POST", chat, chatJSON(routerModel, "a long shared prompt", false), nil).header.Get("X-Kvrouter-Instance"); got != inst {
				t.Fatalf("same prefix moved from %s to %s", inst, got)
			}
		}
	})

	t.Run("streaming passes events through as they come", func(t *testing.T) {
		for _, u := range ups {
			u.SetStream(3, 300*time.Millisecond)
		}
		defer func() {
			for _, u := range ups {
				u.SetStream(5, 0)
			}
		}()
		resp, err := http.Post(chat, "application/json", strings.NewReader(chatJSON(routerModel, "stream it", true)))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var finishedAtFirst int64 = -1
		var events []string
		testenv.EachSSEData(resp.Body, func(d string) bool {
			if len(events) == 0 {
				finishedAtFirst = 0
				for _, u := range ups {
					finishedAtFirst += u.Finished.Load()
				}
			}
			events = append(events, d)
			return true
		})
		if finishedAtFirst != 0 || len(events) != 4 || events[3] != "[DONE]" {
			t.Fatalf("finished streams at first event: %d; events %q", finishedAtFirst, events)
		}
	})

	t.Run("error paths", func(t *testing.T) {
		tests := []struct {
			name, path, body string
			hdr              map[string]string
			status           int
		}{
			{"malformed JSON", "/v1/chat/completions", `{"model":`, nil, 400},
			{"unknown model", "/v1/chat/completions", chatJSON("nope", "x", false), nil, 404},
			{"body over --max-body-bytes (flag beats the file)", "/v1/chat/completions", chatJSON(routerModel, strings.Repeat("y", 5000), false), nil, 413},
			{"bad tenant header", "/invocations", `{}`, map[string]string{"X-Amzn-SageMaker-Prefix-Aware-Id": strings.Repeat("z", 65)}, 400},
			{"unknown pool", "/invocations", `{}`, map[string]string{"X-Kvrouter-Pool": "nope"}, 404},
		}
		for _, tc := range tests {
			r := httpDo(t, "POST", p.data+tc.path, tc.body, tc.hdr)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if r.status != tc.status || json.Unmarshal([]byte(r.body), &e) != nil || e.Error.Code != tc.status || e.Error.Message == "" {
				t.Errorf("%s: %d %s, want %d with an OpenAI error body", tc.name, r.status, r.body, tc.status)
			}
		}
	})

	t.Run("upstream failure retried, then 502", func(t *testing.T) {
		body := chatJSON(routerModel, "retry through the binary", false)
		first := httpDo(t, "POST", chat, body, nil).header.Get("X-Kvrouter-Instance")
		var firstUp *routertest.Upstream
		for _, u := range ups {
			if u.ID == first {
				firstUp = u
			}
		}
		// A retry status; a hang-up after the request was written is not
		// retried (the instance may be prefilling it): 502 below.
		firstUp.Set(routertest.Status, 503, 0)
		r := httpDo(t, "POST", chat, body, nil)
		if r.status != 200 || r.header.Get("X-Kvrouter-Instance") == first || r.header.Get("X-Kvrouter-Attempts") != "2" {
			t.Fatalf("retry: %d on %s attempts %q", r.status, r.header.Get("X-Kvrouter-Instance"), r.header.Get("X-Kvrouter-Attempts"))
		}
		for _, u := range ups {
			u.Set(routertest.HangUp, 0, 0)
		}
		if r := httpDo(t, "POST", chat, body, nil); r.status != 502 {
			t.Fatalf("all failing: %d %s", r.status, r.body)
		}
		for _, u := range ups {
			u.Set(routertest.Normal, 0, 0)
		}
	})

	t.Run("mid-stream failure ends with an error event", func(t *testing.T) {
		for _, u := range ups {
			u.Set(routertest.BreakStream, 0, 1)
		}
		defer func() {
			for _, u := range ups {
				u.Set(routertest.Normal, 0, 0)
			}
		}()
		r := httpDo(t, "POST", chat, chatJSON(routerModel, "break", true), nil)
		if r.status != 200 || !strings.Contains(r.body, `"code":502`) || !strings.HasSuffix(r.body, "data: [DONE]\n\n") {
			t.Fatalf("%d %q", r.status, r.body)
		}
	})

	t.Run("health checks eject all: 503 with Retry-After, then recover", func(t *testing.T) {
		for _, u := range ups {
			u.SetHealthy(false)
		}
		deadline := time.Now().Add(10 * time.Second)
		var r httpResult
		for time.Now().Before(deadline) {
			if r = httpDo(t, "POST", chat, chatJSON(routerModel, "x", false), nil); r.status == 503 {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if r.status != 503 || r.header.Get("Retry-After") == "" {
			t.Fatalf("after ejection: %d retry-after %q", r.status, r.header.Get("Retry-After"))
		}
		if rr := httpDo(t, "GET", p.data+"/readyz", "", nil); rr.status != 503 {
			t.Fatalf("readyz while all ejected: %d", rr.status)
		}
		for _, u := range ups {
			u.SetHealthy(true)
		}
		for time.Now().Before(deadline.Add(10 * time.Second)) {
			if r = httpDo(t, "POST", chat, chatJSON(routerModel, "x", false), nil); r.status == 200 {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("not re-admitted: %d", r.status)
	})

	t.Run("admin API needs the env token", func(t *testing.T) {
		if p.admin == "" {
			t.Fatal("no admin listener")
		}
		if r := httpDo(t, "GET", p.data+"/admin/pools", "", nil); r.status != 404 {
			t.Fatalf("admin on data listener: %d", r.status)
		}
		if r := httpDo(t, "PUT", p.admin+"/admin/pools/llama/routing", `{"strategy":"round_robin"}`, nil); r.status != 401 {
			t.Fatalf("no token: %d", r.status)
		}
		auth := map[string]string{"Authorization": "Bearer e2e-token"}
		if r := httpDo(t, "PUT", p.admin+"/admin/pools/llama/routing", `{"prefix_length": 10}`, auth); r.status != 400 || !strings.Contains(r.body, "prefix_length 10 out of range 1024..65536") {
			t.Fatalf("bad value: %d %s", r.status, r.body)
		}
		if r := httpDo(t, "PUT", p.admin+"/admin/pools/llama/routing", `{"strategy":"round_robin"}`, auth); r.status != 200 {
			t.Fatalf("switch: %d %s", r.status, r.body)
		}
		if r := httpDo(t, "POST", chat, chatJSON(routerModel, "x", false), nil); r.header.Get("X-Kvrouter-Strategy") != "round_robin" {
			t.Fatalf("strategy after switch %q", r.header.Get("X-Kvrouter-Strategy"))
		}
		m := httpDo(t, "GET", p.admin+"/metrics", "", nil)
		if m.status != 200 || !strings.Contains(m.body, `kvrouter_requests_total{instance="vllm-`) || !strings.Contains(m.body, "kvrouter_retries_total") {
			t.Fatalf("metrics: %d", m.status)
		}
	})

	t.Run("SIGHUP reloads the file", func(t *testing.T) {
		writeRouterConfig(t, cfgPath, "least_outstanding", ups)
		if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			if r := httpDo(t, "POST", chat, chatJSON(routerModel, "x", false), nil); r.header.Get("X-Kvrouter-Strategy") == "least_outstanding" {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if r := httpDo(t, "POST", chat, chatJSON(routerModel, "x", false), nil); r.header.Get("X-Kvrouter-Strategy") != "least_outstanding" {
			t.Fatalf("after SIGHUP: %q", r.header.Get("X-Kvrouter-Strategy"))
		}
		// A broken file is rejected and the running config kept.
		os.WriteFile(cfgPath, []byte("pools: [{name: llama, routing: {prefix_length: 5}}]\n"), 0o600)
		_ = p.cmd.Process.Signal(syscall.SIGHUP)
		deadline = time.Now().Add(10 * time.Second)
		for !strings.Contains(p.logText(), "reload failed") && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if !strings.Contains(p.logText(), "reload failed") {
			t.Fatal("bad reload not logged")
		}
		if r := httpDo(t, "POST", chat, chatJSON(routerModel, "x", false), nil); r.status != 200 || r.header.Get("X-Kvrouter-Strategy") != "least_outstanding" {
			t.Fatalf("after bad reload: %d %q", r.status, r.header.Get("X-Kvrouter-Strategy"))
		}
	})

	t.Run("SIGTERM drains and exits 0", func(t *testing.T) {
		for _, u := range ups {
			u.SetStream(3, 200*time.Millisecond)
		}
		resp, err := http.Post(chat, "application/json", strings.NewReader(chatJSON(routerModel, "drain me", true)))
		if err != nil {
			t.Fatal(err)
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) {
			t.Fatalf("in-flight stream cut by shutdown: %q", b)
		}
		select {
		case err := <-p.done:
			if err != nil {
				t.Fatalf("exit: %v\n%s", err, p.logText())
			}
		case <-time.After(10 * time.Second):
			t.Fatal("did not exit after SIGTERM")
		}
	})
}

func TestE2ERouterBinaryBadConfig(t *testing.T) {
	bin := buildRouter(t)
	dir := t.TempDir()
	tests := []struct {
		name, doc string
		args      []string
		want      string
	}{
		{"out of range", "pools: [{name: p, model: m, routing: {concurrency_threshold: 0}, instances: [{id: a, url: 'http://h:1'}]}]\n", nil, ""},
		{"threshold too big", "pools: [{name: p, model: m, routing: {concurrency_threshold: 4096}, instances: [{id: a, url: 'http://h:1'}]}]\n", nil, "pools[0].routing.concurrency_threshold 4096 out of range 1..1024"},
		{"typo", "pools: [{name: p, modle: m}]\n", nil, "pools[0].modle: unknown field (did you mean \"model\"?)"},
		{"flag out of range", "pools: [{name: p, model: m, instances: [{id: a, url: 'http://h:1'}]}]\n", []string{"--prefix-length", "99"}, "pools[0].routing.prefix_length 99 out of range 1024..65536"},
	}
	for i, tc := range tests {
		path := filepath.Join(dir, fmt.Sprintf("c%d.yaml", i))
		os.WriteFile(path, []byte(tc.doc), 0o600)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		out, err := exec.CommandContext(ctx, bin, append([]string{"--config", path, "--check-config"}, tc.args...)...).CombinedOutput()
		cancel()
		if tc.want == "" { // 0 means the default: valid
			if err != nil {
				t.Errorf("%s: %v %s", tc.name, err, out)
			}
			continue
		}
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("%s: err %v, output %q, want it to mention %q", tc.name, err, out, tc.want)
		}
	}
	if out, err := exec.Command(bin).CombinedOutput(); err == nil || !strings.Contains(string(out), "--config is required") {
		t.Errorf("no --config: %v %s", err, out)
	}
}
