// Package routertest provides a fake vLLM OpenAI-compatible server for
// router tests: real HTTP on loopback, vLLM's response and SSE shapes, and
// knobs for every failure the router must handle.
package routertest

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Behavior selects how the upstream answers the next requests.
type Behavior int

// Behaviors.
const (
	// Normal answers like vLLM.
	Normal Behavior = iota
	// HangUp closes the connection without answering (fails before any byte).
	HangUp
	// Status answers with Upstream.Status and an error body.
	Status
	// BreakStream sends Upstream.BreakAfter SSE events, then cuts the connection.
	BreakStream
)

// Upstream is a fake vLLM instance.
type Upstream struct {
	ID     string
	Server *httptest.Server

	// Model is the base model served; Adapters are listed in /v1/models.
	Model    string
	Adapters []string

	behavior atomic.Int32
	// Status is the status for the Status behavior.
	status atomic.Int32
	// breakAfter events for BreakStream.
	breakAfter atomic.Int32
	healthy    atomic.Bool

	// streamEvents is how many content events a stream sends (default 5);
	// eventDelay (ns) spaces them. See SetStream.
	streamEvents atomic.Int32
	eventDelay   atomic.Int64

	// Requests counts data-plane requests received; Canceled counts those
	// whose context ended before the upstream finished answering.
	Requests atomic.Int64
	Canceled atomic.Int64
	// Finished counts streams the upstream wrote to the end.
	Finished atomic.Int64
	Probes   atomic.Int64

	// mu guards last and paths.
	mu    sync.Mutex
	last  []byte
	paths []string

	// release, when non-nil, blocks each data-plane request until closed
	// (to hold requests in flight).
	release chan struct{}
	// Started is signalled once per data-plane request when it arrives.
	Started chan struct{}
}

// New starts a fake instance serving model; it is closed at test cleanup.
func New(t testing.TB, id, model string, adapters ...string) *Upstream {
	t.Helper()
	u := &Upstream{ID: id, Model: model, Adapters: adapters, Started: make(chan struct{}, 1024)}
	u.healthy.Store(true)
	u.streamEvents.Store(5)
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Server.Close)
	return u
}

// URL is the instance's base URL.
func (u *Upstream) URL() string { return u.Server.URL }

// Set switches behaviour; status is used by Status, n by BreakStream.
func (u *Upstream) Set(b Behavior, status, n int) {
	u.status.Store(int32(status))
	u.breakAfter.Store(int32(n))
	u.behavior.Store(int32(b))
}

// SetStream sets how many content events a stream sends and the delay
// between them.
func (u *Upstream) SetStream(events int, delay time.Duration) {
	u.streamEvents.Store(int32(events))
	u.eventDelay.Store(int64(delay))
}

// SetHealthy makes /health answer 200 (true) or 503 (false).
func (u *Upstream) SetHealthy(ok bool) { u.healthy.Store(ok) }

// Hold makes data-plane requests wait until the returned func is called.
func (u *Upstream) Hold() (release func()) {
	ch := make(chan struct{})
	u.mu.Lock()
	u.release = ch
	u.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			u.mu.Lock()
			u.release = nil
			u.mu.Unlock()
			close(ch)
		})
	}
}

// LastBody is the body of the last data-plane request.
func (u *Upstream) LastBody() []byte {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.last
}

// Paths lists the paths of data-plane requests, in arrival order.
func (u *Upstream) Paths() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.paths...)
}

func (u *Upstream) serve(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		u.Probes.Add(1)
		if !u.healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
		return
	case "/v1/models":
		u.serveModels(w)
		return
	}
	body, _ := io.ReadAll(r.Body)
	u.Requests.Add(1)
	u.mu.Lock()
	u.last = body
	u.paths = append(u.paths, r.URL.Path)
	rel := u.release
	u.mu.Unlock()
	select {
	case u.Started <- struct{}{}:
	default:
	}
	if rel != nil {
		select {
		case <-rel:
		case <-r.Context().Done():
			u.Canceled.Add(1)
			return
		}
	}
	switch Behavior(u.behavior.Load()) {
	case HangUp:
		hj, ok := w.(http.Hijacker)
		if !ok {
			panic("routertest: response writer cannot hijack")
		}
		c, _, err := hj.Hijack()
		if err == nil {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // RST: a hard failure
			}
			c.Close()
		}
		return
	case Status:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(u.status.Load()))
		fmt.Fprintf(w, `{"error":{"message":"fake %s failure","type":"InternalServerError","param":null,"code":%d}}`, u.ID, u.status.Load())
		return
	}
	var req struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	stream := req.Stream || strings.HasSuffix(r.URL.Path, "-response-stream") || strings.HasSuffix(r.URL.Path, "_stream")
	w.Header().Set("X-Upstream-Id", u.ID)
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-%s","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hello from %s"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0}}}`, u.ID, req.Model, u.ID)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	fl := w.(http.Flusher)
	breakAt := -1
	if Behavior(u.behavior.Load()) == BreakStream {
		breakAt = int(u.breakAfter.Load())
	}
	nEvents, delay := int(u.streamEvents.Load()), time.Duration(u.eventDelay.Load())
	for i := 0; i < nEvents; i++ {
		if i == breakAt {
			fl.Flush()
			panic(http.ErrAbortHandler) // cut the connection mid-stream
		}
		fmt.Fprintf(w, "data: {\"id\":\"cmpl-%s\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok%d \"},\"finish_reason\":null}]}\n\n", u.ID, req.Model, i)
		fl.Flush()
		if delay > 0 {
			select {
			case <-time.After(delay):
			case <-r.Context().Done():
				u.Canceled.Add(1)
				return
			}
		}
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
	u.Finished.Add(1)
}

func (u *Upstream) serveModels(w http.ResponseWriter) {
	type m struct {
		ID     string  `json:"id"`
		Object string  `json:"object"`
		Root   string  `json:"root"`
		Parent *string `json:"parent"`
	}
	data := []m{{ID: u.Model, Object: "model", Root: u.Model}}
	for _, a := range u.Adapters {
		data = append(data, m{ID: a, Object: "model", Root: "/adapters/" + a, Parent: &u.Model})
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
}
