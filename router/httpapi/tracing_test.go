package httpapi_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http/httpguts"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

const (
	traceModel = "llama-trace"
	// traceSecret is in every prompt: no span may carry it.
	traceSecret = "zebra-quartz-secret"
	// Incoming W3C trace context of the tests (traceparent version 00).
	inTraceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	inSpanID  = "00f067aa0ba902b7"
)

// traceEngine is an engine that answers chat completions and records the
// traceparent of each request it receives.
type traceEngine struct {
	srv *httptest.Server
	// fail503 answers this many requests (across every engine sharing the
	// counter) with 503, to make the router retry.
	fail503 *atomic.Int32

	mu      sync.Mutex // guards parents
	parents []string   // traceparent header of each request ("" = none)
}

func newTraceEngine(t *testing.T, fail503 *atomic.Int32) *traceEngine {
	e := &traceEngine{fail503: fail503}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		e.mu.Lock()
		e.parents = append(e.parents, r.Header.Get("traceparent"))
		e.mu.Unlock()
		if e.fail503 != nil && e.fail503.Add(-1) >= 0 {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}`)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *traceEngine) seen() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.parents...)
}

type traceRig struct {
	t       *testing.T
	ts      *httptest.Server
	exp     *tracetest.InMemoryExporter
	engines []*traceEngine
}

// newTraceRig serves a kv_aware pool (simple tokenizer, memory index) of n
// engines through the real HTTP server; sampler nil = tracing off.
func newTraceRig(t *testing.T, n int, sampler sdktrace.Sampler, fail503 *atomic.Int32) *traceRig {
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: traceModel, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	rig := &traceRig{t: t, exp: tracetest.NewInMemoryExporter()}
	pc := config.PoolConfig{Name: "trace-pool", Model: traceModel,
		Routing:   config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{SpeculativeTTL: 10 * time.Minute}},
		Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
		Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range n {
		e := newTraceEngine(t, fail503)
		rig.engines = append(rig.engines, e)
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("vllm-%d", i), URL: e.srv.URL})
	}
	opts := httpapi.Options{
		Logger: slog.New(slog.DiscardHandler),
		KV:     kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil }),
	}
	if sampler != nil {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(rig.exp), sdktrace.WithSampler(sampler))
		t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
		opts.TracerProvider = tp
	}
	_, rig.ts = servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, opts)
	return rig
}

// chat sends a chat request with the given traceparent ("" = none).
func (rig *traceRig) chat(traceparent string, body []byte) *http.Response {
	rig.t.Helper()
	req, err := http.NewRequest("POST", rig.ts.URL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		rig.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if traceparent != "" {
		req.Header.Set("traceparent", traceparent)
		req.Header.Set("tracestate", "vendor=abc")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		rig.t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// serverSpans waits until n server spans have ended (the server span ends
// after the handler returns, which may be after the client read the
// response) and returns every span ended so far.
func (rig *traceRig) serverSpans(n int) tracetest.SpanStubs {
	rig.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		spans := rig.exp.GetSpans()
		got := 0
		for _, s := range spans {
			if s.SpanKind == trace.SpanKindServer {
				got++
			}
		}
		if got >= n {
			return spans
		}
		if time.Now().After(deadline) {
			rig.t.Fatalf("%d server spans after 20s, want %d: %v", got, n, names(spans))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (rig *traceRig) parents() []string {
	var out []string
	for _, e := range rig.engines {
		out = append(out, e.seen()...)
	}
	return out
}

func traceChat() []byte {
	return chatBody(traceModel, "Tell me about "+traceSecret+" "+strings.Repeat("and the long history of routers ", 20), false)
}

func names(spans tracetest.SpanStubs) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name)
	}
	return out
}

func attrOf(s tracetest.SpanStub, k attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

func findSpans(spans tracetest.SpanStubs, name string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func oneSpan(t *testing.T, spans tracetest.SpanStubs, name string) tracetest.SpanStub {
	t.Helper()
	got := findSpans(spans, name)
	if len(got) != 1 {
		t.Fatalf("%d spans named %s, want 1 (spans: %v)", len(got), name, names(spans))
	}
	return got[0]
}

func wantParent(t *testing.T, child, parent tracetest.SpanStub) {
	t.Helper()
	if child.Parent.SpanID() != parent.SpanContext.SpanID() || child.SpanContext.TraceID() != parent.SpanContext.TraceID() {
		t.Errorf("span %s: parent %s, want %s (%s)", child.Name, child.Parent.SpanID(), parent.SpanContext.SpanID(), parent.Name)
	}
}

func wantAttr(t *testing.T, s tracetest.SpanStub, k attribute.Key, want any) {
	t.Helper()
	v, ok := attrOf(s, k)
	if !ok {
		t.Errorf("span %s: no attribute %s", s.Name, k)
		return
	}
	if got := v.AsInterface(); got != want {
		t.Errorf("span %s: %s = %v (%T), want %v (%T)", s.Name, k, got, got, want, want)
	}
}

// noSecret fails if the prompt's marker is in any attribute, event or
// status of the spans.
func noSecret(t *testing.T, spans tracetest.SpanStubs) {
	t.Helper()
	for _, s := range spans {
		text := fmt.Sprint(s.Attributes, s.Events, s.Status, s.Name)
		if strings.Contains(text, traceSecret) {
			t.Errorf("span %s carries prompt text: %s", s.Name, text)
		}
	}
}

// TestTracingChatSpanTree: a chat request through the real server produces
// the server span (continuing the caller's trace) with parse, decide
// (tokenize and index lookup inside), and a client span per proxy attempt,
// with the routing facts as attributes and no prompt text; the engine
// receives a traceparent of the same trace whose parent is the proxy span.
func TestTracingChatSpanTree(t *testing.T) {
	rig := newTraceRig(t, 3, sdktrace.ParentBased(sdktrace.AlwaysSample()), nil)
	incoming := "00-" + inTraceID + "-" + inSpanID + "-01"
	body := traceChat()
	var resps []*http.Response
	for range 2 { // the second finds the first's blocks (speculative entries)
		resps = append(resps, rig.chat(incoming, body))
	}
	for i, r := range resps {
		if r.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, r.StatusCode)
		}
	}
	spans := rig.serverSpans(2)
	noSecret(t, spans)

	var second tracetest.SpanStubs // the second request's spans
	servers := findSpans(spans, "POST /v1/chat/completions")
	if len(servers) != 2 {
		t.Fatalf("server spans: %v", names(spans))
	}
	srv := servers[1]
	for _, s := range spans {
		if s.SpanContext.TraceID().String() != inTraceID {
			t.Errorf("span %s in trace %s, want the incoming %s", s.Name, s.SpanContext.TraceID(), inTraceID)
		}
		if s.SpanKind == trace.SpanKindServer && s.SpanContext.SpanID() == srv.SpanContext.SpanID() ||
			s.Parent.SpanID() == srv.SpanContext.SpanID() {
			second = append(second, s)
		}
	}
	if srv.Parent.SpanID().String() != inSpanID || !srv.Parent.IsRemote() {
		t.Errorf("server span's parent %s (remote %v), want the incoming %s", srv.Parent.SpanID(), srv.Parent.IsRemote(), inSpanID)
	}
	if got := srv.SpanContext.TraceState().String(); got != "vendor=abc" {
		t.Errorf("tracestate %q, want the incoming vendor=abc", got)
	}
	inst := resps[1].Header.Get(router.HeaderInstance)
	wantAttr(t, srv, httpapi.AttrHTTPMethod, "POST")
	wantAttr(t, srv, httpapi.AttrHTTPRoute, "/v1/chat/completions")
	wantAttr(t, srv, httpapi.AttrHTTPStatus, int64(200))
	wantAttr(t, srv, httpapi.AttrPool, "trace-pool")
	wantAttr(t, srv, httpapi.AttrModel, traceModel)
	wantAttr(t, srv, httpapi.AttrStrategy, config.StrategyKVAware)
	wantAttr(t, srv, httpapi.AttrReason, resps[1].Header.Get(router.HeaderReason))
	wantAttr(t, srv, httpapi.AttrInstance, inst)
	wantAttr(t, srv, httpapi.AttrStream, false)
	if srv.SpanKind != trace.SpanKindServer || srv.Status.Code == codes.Error {
		t.Errorf("server span kind %v status %v", srv.SpanKind, srv.Status)
	}

	parse := oneSpan(t, second, httpapi.SpanParse)
	decide := oneSpan(t, second, httpapi.SpanDecide)
	proxy := oneSpan(t, second, httpapi.SpanProxy)
	wantParent(t, parse, srv)
	wantParent(t, decide, srv)
	wantParent(t, proxy, srv)
	var tok, look []tracetest.SpanStub
	for _, s := range spans {
		if s.Parent.SpanID() == decide.SpanContext.SpanID() {
			switch s.Name {
			case router.SpanTokenize:
				tok = append(tok, s)
			case router.SpanLookup:
				look = append(look, s)
			}
		}
	}
	if len(tok) != 1 || len(look) != 1 {
		t.Fatalf("under decide: %d tokenize and %d lookup spans, want 1 and 1 (spans %v)", len(tok), len(look), names(spans))
	}
	promptTokens, _ := attrOf(tok[0], httpapi.AttrPromptTokens)
	if promptTokens.AsInt64() < 100 {
		t.Errorf("tokenize: prompt tokens %d", promptTokens.AsInt64())
	}
	blocks, _ := attrOf(look[0], httpapi.AttrLookupBlocks)
	if blocks.AsInt64() != promptTokens.AsInt64()/16 {
		t.Errorf("lookup: %d blocks for %d tokens of 16-token blocks", blocks.AsInt64(), promptTokens.AsInt64())
	}
	wantAttr(t, decide, httpapi.AttrInstance, inst)
	wantAttr(t, decide, httpapi.AttrCandidates, int64(3))
	wantAttr(t, decide, httpapi.AttrPromptTokens, promptTokens.AsInt64())
	// The first request computed the prompt on inst: the second finds
	// every full block of it there, on the GPU tier, and reuses them but
	// the one holding the last token, which vLLM recomputes.
	reused := min(blocks.AsInt64()*16, (promptTokens.AsInt64()-1)/16*16)
	wantAttr(t, decide, httpapi.AttrMatchedTokens+"gpu", reused)
	wantAttr(t, srv, httpapi.AttrMatchedTokens+"gpu", reused)
	wantAttr(t, decide, httpapi.AttrMatchedTokens+"cpu", int64(0))
	if v, ok := attrOf(decide, httpapi.AttrPredictedTTFT); !ok || strconv.FormatFloat(v.AsFloat64(), 'f', 2, 64) != resps[1].Header.Get(router.HeaderPredictedTTFT) {
		t.Errorf("decide: predicted TTFT %v ms (set %v), header %q", v.AsFloat64(), ok, resps[1].Header.Get(router.HeaderPredictedTTFT))
	}
	if got := resps[1].Header.Get(router.HeaderMatchedTokens); !strings.HasPrefix(got, fmt.Sprintf("gpu=%d,", reused)) {
		t.Errorf("header %s %q disagrees with the span", router.HeaderMatchedTokens, got)
	}

	if proxy.SpanKind != trace.SpanKindClient {
		t.Errorf("proxy span kind %v", proxy.SpanKind)
	}
	wantAttr(t, proxy, httpapi.AttrInstance, inst)
	wantAttr(t, proxy, httpapi.AttrAttempt, int64(1))
	wantAttr(t, proxy, httpapi.AttrRetry, false)
	wantAttr(t, proxy, httpapi.AttrHTTPStatus, int64(200))
	if len(proxy.Events) != 1 || proxy.Events[0].Name != "first_byte" {
		t.Errorf("proxy span events %v, want first_byte", proxy.Events)
	}
	for _, s := range []tracetest.SpanStub{parse, decide, proxy, tok[0], look[0]} {
		if s.Status.Code == codes.Error {
			t.Errorf("span %s failed: %v", s.Name, s.Status)
		}
		if s.StartTime.Before(srv.StartTime) || s.EndTime.After(srv.EndTime) {
			t.Errorf("span %s [%v, %v] outside the server span [%v, %v]", s.Name, s.StartTime, s.EndTime, srv.StartTime, srv.EndTime)
		}
	}

	// The engine continues the trace: same trace id, the proxy span as
	// parent, sampled.
	seen := rig.parents()
	if len(seen) != 2 {
		t.Fatalf("engines got %d requests, want 2", len(seen))
	}
	want := fmt.Sprintf("00-%s-%s-01", inTraceID, proxy.SpanContext.SpanID())
	if !contains(seen, want) {
		t.Errorf("engine traceparents %q, want one %q", seen, want)
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// TestTracingRetry: an attempt answered 503 and retried elsewhere is its own
// client span (retry true, error), the second another; each engine gets the
// traceparent of its own attempt.
func TestTracingRetry(t *testing.T) {
	var fail atomic.Int32
	fail.Store(1)
	rig := newTraceRig(t, 2, sdktrace.AlwaysSample(), &fail)
	resp := rig.chat("", traceChat())
	if resp.StatusCode != 200 || resp.Header.Get(httpapi.HeaderAttempts) != "2" {
		t.Fatalf("status %d, attempts %q: want 200 after 2", resp.StatusCode, resp.Header.Get(httpapi.HeaderAttempts))
	}
	spans := rig.serverSpans(1)
	srv := oneSpan(t, spans, "POST /v1/chat/completions")
	if srv.Parent.IsValid() {
		t.Errorf("no incoming traceparent, yet the server span has parent %v", srv.Parent.SpanID())
	}
	proxies := findSpans(spans, httpapi.SpanProxy)
	if len(proxies) != 2 || len(findSpans(spans, httpapi.SpanDecide)) != 2 {
		t.Fatalf("spans %v: want two decide and two proxy spans", names(spans))
	}
	first, second := proxies[0], proxies[1]
	if v, _ := attrOf(first, httpapi.AttrAttempt); v.AsInt64() != 1 {
		first, second = second, first
	}
	wantAttr(t, first, httpapi.AttrRetry, true)
	wantAttr(t, first, httpapi.AttrHTTPStatus, int64(503))
	if first.Status.Code != codes.Error {
		t.Errorf("retried attempt status %v, want error", first.Status)
	}
	wantAttr(t, second, httpapi.AttrAttempt, int64(2))
	wantAttr(t, second, httpapi.AttrRetry, false)
	wantAttr(t, second, httpapi.AttrHTTPStatus, int64(200))
	wantAttr(t, second, httpapi.AttrInstance, resp.Header.Get(router.HeaderInstance))
	i1, _ := attrOf(first, httpapi.AttrInstance)
	if i1.AsString() == resp.Header.Get(router.HeaderInstance) {
		t.Errorf("both attempts on %s", i1.AsString())
	}
	seen := rig.parents()
	for _, p := range []tracetest.SpanStub{first, second} {
		want := fmt.Sprintf("00-%s-%s-01", srv.SpanContext.TraceID(), p.SpanContext.SpanID())
		if !contains(seen, want) {
			t.Errorf("engine traceparents %q, want %q", seen, want)
		}
	}
}

// TestTracingOff: without a tracer provider the router adds no traceparent,
// and forwards the caller's untouched.
func TestTracingOff(t *testing.T) {
	rig := newTraceRig(t, 2, nil, nil)
	incoming := "00-" + inTraceID + "-" + inSpanID + "-01"
	for _, tp := range []string{"", incoming} {
		if resp := rig.chat(tp, traceChat()); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	seen := rig.parents()
	if len(seen) != 2 || seen[0] != "" && seen[1] != "" {
		t.Fatalf("engine traceparents %q: want one absent", seen)
	}
	if !contains(seen, incoming) {
		t.Errorf("engine traceparents %q: want the caller's %q forwarded as is", seen, incoming)
	}
}

// TestTracingNotSampled: a trace the caller did not sample (flags 00), or
// one the ratio leaves out, records no span, yet the engine gets the trace
// context with the sampled flag off, so that it does not sample it either.
func TestTracingNotSampled(t *testing.T) {
	rig := newTraceRig(t, 1, sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0)), nil)
	rig.chat("00-"+inTraceID+"-"+inSpanID+"-00", traceChat())
	rig.chat("", traceChat())
	if spans := rig.exp.GetSpans(); len(spans) != 0 {
		t.Errorf("spans recorded: %v", names(spans))
	}
	seen := rig.parents()
	if len(seen) != 2 {
		t.Fatalf("engine got %d requests", len(seen))
	}
	if !strings.HasPrefix(seen[0], "00-"+inTraceID+"-") || !strings.HasSuffix(seen[0], "-00") || strings.Contains(seen[0], inSpanID) {
		t.Errorf("engine traceparent %q: want trace %s, a span of the router's, flags 00", seen[0], inTraceID)
	}
	if len(seen[1]) != 55 || !strings.HasSuffix(seen[1], "-00") {
		t.Errorf("engine traceparent %q: want a new unsampled trace", seen[1])
	}
}

// TestTracingRejected: a request refused before routing still has its
// server span, with the status and a failed parse span; no proxy span.
func TestTracingRejected(t *testing.T) {
	rig := newTraceRig(t, 1, sdktrace.AlwaysSample(), nil)
	resp := rig.chat("", []byte(`{"model":"`+traceModel+`","messages":"`+traceSecret+`"}`))
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("status %d", resp.StatusCode)
	}
	spans := rig.serverSpans(1)
	noSecret(t, spans)
	srv := oneSpan(t, spans, "POST /v1/chat/completions")
	wantAttr(t, srv, httpapi.AttrHTTPStatus, int64(400))
	if srv.Status.Code == codes.Error {
		t.Errorf("a 4xx is the client's error, not the server span's: %v", srv.Status)
	}
	parse := oneSpan(t, spans, httpapi.SpanParse)
	if parse.Status.Code != codes.Error || !strings.Contains(parse.Status.Description, "messages") {
		t.Errorf("parse span status %v", parse.Status)
	}
	if len(findSpans(spans, httpapi.SpanProxy)) != 0 || len(rig.parents()) != 0 {
		t.Errorf("a rejected request reached an engine")
	}
}

// newUpstreamTraceRig serves a prefix_aware pool of the one upstream u,
// every request traced to an in-memory exporter.
func newUpstreamTraceRig(t *testing.T, u *routertest.Upstream) *traceRig {
	rig := &traceRig{t: t, exp: tracetest.NewInMemoryExporter()}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(rig.exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	pc := config.PoolConfig{Name: "p", Model: traceModel, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: u.ID, URL: u.URL()}}}
	_, rig.ts = servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler), TracerProvider: tp})
	return rig
}

// TestTracingStreamBrokenMidway: an engine that cuts a stream after two
// events leaves the client a 200 with an error event, and the proxy span
// failed with the reason; the first_byte event is there.
func TestTracingStreamBrokenMidway(t *testing.T) {
	u := routertest.New(t, "vllm-0", traceModel)
	u.SetStream(6, 0)
	u.Set(routertest.BreakStream, 0, 2)
	rig := newUpstreamTraceRig(t, u)
	resp := rig.chat("", chatBody(traceModel, "break", true))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	spans := rig.serverSpans(1)
	proxy := oneSpan(t, spans, httpapi.SpanProxy)
	if proxy.Status.Code != codes.Error || proxy.Status.Description != "upstream failed mid-response" {
		t.Errorf("proxy span status %v", proxy.Status)
	}
	if len(proxy.Events) != 1 || proxy.Events[0].Name != "first_byte" {
		t.Errorf("proxy span events %v", proxy.Events)
	}
	wantAttr(t, oneSpan(t, spans, "POST /v1/chat/completions"), httpapi.AttrStream, true)
}

// TestTracingClientGone: a client that leaves while the engine is still
// prefilling gives a server span and a proxy span with status 499.
func TestTracingClientGone(t *testing.T) {
	u := routertest.New(t, "vllm-0", traceModel)
	release := u.Hold()
	defer release()
	rig := newUpstreamTraceRig(t, u)
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "POST", rig.ts.URL+"/v1/chat/completions", bytes.NewReader(chatBody(traceModel, "bye", false)))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	deadline := time.Now().Add(20 * time.Second)
	for u.Requests.Load() == 0 { // the engine has it: the client now leaves
		if time.Now().After(deadline) {
			t.Fatal("the request never reached the engine")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err == nil {
		t.Fatal("the cancelled request succeeded")
	}
	spans := rig.serverSpans(1)
	wantAttr(t, oneSpan(t, spans, "POST /v1/chat/completions"), httpapi.AttrHTTPStatus, int64(499))
	proxy := oneSpan(t, spans, httpapi.SpanProxy)
	wantAttr(t, proxy, httpapi.AttrHTTPStatus, int64(499))
	if proxy.Status.Code != codes.Error {
		t.Errorf("proxy span status %v", proxy.Status)
	}
}

// FuzzTraceContextHeaders: whatever traceparent and tracestate a client
// sends, the request is served and the engine receives a well-formed
// traceparent naming the router's proxy span; a valid incoming one is
// continued (same trace id), anything else starts a new trace.
func FuzzTraceContextHeaders(f *testing.F) {
	f.Add("00-"+inTraceID+"-"+inSpanID+"-01", "vendor=abc")
	f.Add("00-"+inTraceID+"-"+inSpanID+"-00", "")
	f.Add("00-00000000000000000000000000000000-"+inSpanID+"-01", "")
	f.Add("ff-"+inTraceID+"-"+inSpanID+"-01", "a=b,c=d")
	f.Add("01-"+inTraceID+"-"+inSpanID+"-01-extra", "x=\x00")
	f.Add("garbage", "=,=,==")
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	var got atomic.Pointer[string]
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tp := r.Header.Get("traceparent")
		got.Store(&tp)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","object":"chat.completion","choices":[]}`)
	}))
	defer eng.Close()
	pc := config.PoolConfig{Name: "p", Model: traceModel, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: "vllm-0", URL: eng.URL}}}
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler), TracerProvider: tp})
	if err != nil {
		f.Fatal(err)
	}
	h := srv.Handler()
	body := chatBody(traceModel, "hi", false)
	f.Fuzz(func(t *testing.T, parent, state string) {
		if !httpguts.ValidHeaderFieldValue(parent) || !httpguts.ValidHeaderFieldValue(state) {
			return // net/http's server answers 400 before any handler sees it
		}
		req := httptest.NewRequest("POST", "/v1/chat/completions", bytes.NewReader(body))
		req.Header.Set("traceparent", parent)
		req.Header.Set("tracestate", state)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != 200 {
			t.Fatalf("status %d: %s", rec.Code, rec.Body.Bytes())
		}
		sent := *got.Load()
		sc, ok := parseTraceparent(sent)
		if !ok {
			t.Fatalf("engine got traceparent %q", sent)
		}
		if in, ok := parseTraceparent(parent); ok && reservedFlagsClear(parent) && in.TraceID() != sc.TraceID() {
			t.Fatalf("incoming %q not continued: engine got %q", parent, sent)
		}
		if strings.Contains(sent, "-"+inSpanID+"-") {
			t.Fatalf("engine got the client's span as parent: %q", sent)
		}
	})
}

// parseTraceparent reads a version-00 traceparent strictly.
func parseTraceparent(s string) (trace.SpanContext, bool) {
	var tid trace.TraceID
	var sid trace.SpanID
	// Version 00's trace-flags are 8 bits in lower-case hex: besides
	// sampled (01), W3C Trace Context Level 2 defines random (02), which
	// the propagator carries on (a fuzzed "…-02" parent: well-formed); a
	// parent with a reserved bit set is well-formed here but not
	// continued (reservedFlagsClear).
	if len(s) != 55 || s[:3] != "00-" || s[35] != '-' || s[52] != '-' || !lowerHex(s[53:]) {
		return trace.SpanContext{}, false
	}
	tid, err := trace.TraceIDFromHex(s[3:35])
	if err != nil {
		return trace.SpanContext{}, false
	}
	if sid, err = trace.SpanIDFromHex(s[36:52]); err != nil {
		return trace.SpanContext{}, false
	}
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}), true
}

// reservedFlagsClear reports whether a well-formed version-00 parent sets
// no trace-flags bit beyond sampled (01) and random (02, W3C Trace Context
// Level 2): OpenTelemetry's propagator (go.opentelemetry.io/otel
// propagation.TraceContext) refuses a version-00 parent with a reserved bit
// set and starts a new trace, as the fuzzer found with "…-07".
func reservedFlagsClear(parent string) bool {
	b, err := strconv.ParseUint(parent[53:55], 16, 8)
	return err == nil && b <= 3
}

func lowerHex(s string) bool {
	for _, c := range []byte(s) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// BenchmarkHandlerChatTracing is BenchmarkHandlerChat with tracing on:
// every request sampled (five spans, batched to an exporter that drops
// them), and none sampled (ratio 0: spans not recorded, traceparent still
// sent).
func BenchmarkHandlerChatTracing(b *testing.B) {
	for _, tc := range []struct {
		name    string
		sampler sdktrace.Sampler
	}{
		{"sampled", sdktrace.AlwaysSample()},
		{"unsampled", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0))},
	} {
		b.Run(tc.name, func(b *testing.B) {
			tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()), sdktrace.WithSampler(tc.sampler))
			defer func() { _ = tp.Shutdown(context.Background()) }()
			benchHandlerChat(b, httpapi.Options{TracerProvider: tp})
		})
	}
}
