// Package servertest runs a router's HTTP server in front of fake vLLM
// instances (router/routertest) for the tests of the packages that serve
// it: one harness, so that the data plane, the admin API and kv_aware are
// tested through the same real HTTP path.
package servertest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// Model is the harness pool's model.
const Model = "meta-llama/Llama-3.1-8B-Instruct"

// Harness is a router (its data and admin routes on one listener) in front
// of fake instances.
type Harness struct {
	T    testing.TB
	Srv  *httpapi.Server
	TS   *httptest.Server
	Ups  []*routertest.Upstream
	ByID map[string]*routertest.Upstream
}

// Quiet is a logger that discards everything.
func Quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// New starts n fake instances ("vllm-0", …) in pool "llama" and a router
// in front of them, with the admin API mounted; mod adjusts the config,
// opts the server's options, before the server is built.
func New(t testing.TB, n int, mod func(*config.Config), opts ...func(*httpapi.Options)) *Harness {
	t.Helper()
	h := &Harness{T: t, ByID: map[string]*routertest.Upstream{}}
	pc := config.PoolConfig{Name: "llama", Model: Model, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range n {
		u := routertest.New(t, fmt.Sprintf("vllm-%d", i), Model)
		h.Ups = append(h.Ups, u)
		h.ByID[u.ID] = u
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: u.ID, URL: u.URL()})
	}
	cfg := config.Config{Pools: []config.PoolConfig{pc}, Log: config.LogConfig{Level: "debug"}}
	if mod != nil {
		mod(&cfg)
	}
	o := httpapi.Options{Logger: Quiet(), Admin: admin.Routes(nil)}
	for _, f := range opts {
		f(&o)
	}
	h.Srv, h.TS = Serve(t, cfg, o)
	return h
}

// Serve builds a server from cfg and o and serves its handler on a test
// listener until the test ends.
func Serve(t testing.TB, cfg config.Config, o httpapi.Options) (*httpapi.Server, *httptest.Server) {
	t.Helper()
	srv, err := httpapi.NewServer(cfg, o)
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return srv, ts
}

// Run starts the server's background loops until the test ends.
func (h *Harness) Run() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.Srv.Run(ctx) }()
	h.T.Cleanup(func() { cancel(); <-done })
}

// Result is a response, read whole.
type Result = testenv.Result

// Do sends a request with a JSON body and headers hdr to the router.
func (h *Harness) Do(method, path string, body []byte, hdr map[string]string) Result {
	h.T.Helper()
	return testenv.Do(h.T, method, h.TS.URL+path, body, hdr)
}

// Do sends a request with a JSON body and headers hdr to base+path.
func Do(t testing.TB, base, method, path string, body []byte, hdr map[string]string) Result {
	t.Helper()
	return testenv.Do(t, method, base+path, body, hdr)
}

// ChatBody is a chat completion request: a system message and text.
func ChatBody(model, text string, stream bool) []byte {
	b, _ := json.Marshal(map[string]any{"model": model, "stream": stream, "messages": []map[string]any{
		{"role": "system", "content": "You are a helpful assistant."},
		{"role": "user", "content": text},
	}})
	return b
}

// ErrorOf decodes an OpenAI-shaped error body, failing if it is not one.
func ErrorOf(t testing.TB, r Result) (msg string, code int) {
	t.Helper()
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(r.Body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("not an OpenAI error body (%v): %s", err, r.Body)
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error Content-Type %q", ct)
	}
	return e.Error.Message, e.Error.Code
}

// Metric sums the counter or gauge samples of the family name gathered
// from g whose labels include every one of labels (0 when none do): it is
// testenv.Metric, kept here for the data-plane tests that use this harness.
func Metric(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	return testenv.Metric(t, g, name, labels)
}

// WaitFor polls cond until it holds, failing after a generous deadline.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	WaitWithin(t, 5*time.Second, what, cond)
}

// WaitWithin polls cond until it holds, failing after d.
func WaitWithin(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Record serves one request without a body through h.
func Record(t testing.TB, h http.Handler, method, path string) *httptest.ResponseRecorder {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, path, nil))
	return rec
}

// Syncer runs replica name of pool's replica sync on the NATS server at
// url until the test ends, on test timings (a 10 ms interval, a 100 ms
// heartbeat, a 500 ms peer timeout), sequencing bursts in epochs of seq
// (0: off) whose peers' intents are waited for grace after their end: two
// of them make a kv_aware pool's sequencing hold (the pool's Freshness
// carrying the first, as router/kvstate's PeerFreshness).
func Syncer(t testing.TB, url, pool, name string, seq, grace time.Duration) *replicasync.Syncer {
	t.Helper()
	s, err := replicasync.New(replicasync.Config{Conn: testenv.Connect(t, url), Pool: pool, Replica: name,
		Interval: 10 * time.Millisecond, Heartbeat: 100 * time.Millisecond, PeerTimeout: 500 * time.Millisecond,
		Sequence: seq, SequenceGrace: grace, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, context.Background(), s.Run)
	return s
}
