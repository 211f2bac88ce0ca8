package httpapi

import (
	"context"
	"net/http"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkTracingHooksOff is every tracing hook one untraced request
// passes through (parse, request, decide, attempt start/end, first byte,
// inject, and the tokenize and lookup spans' checks), on a context as deep
// as a served request's: the whole cost of tracing when it is off.
func BenchmarkTracingHooksOff(b *testing.B) {
	s := &Server{} // tracer nil: tracing off
	type k struct{ int }
	ctx := context.Background()
	for i := range 6 { // net/http's server, connection and request values, and the router's
		ctx = context.WithValue(ctx, k{i}, i)
	}
	inst, err := router.NewInstance("vllm-0", "http://127.0.0.1:1")
	if err != nil {
		b.Fatal(err)
	}
	req := &router.Request{Pool: "p", Model: "m"}
	dec := router.Decision{Instance: inst, Strategy: config.StrategyKVAware, Reason: router.ReasonKVMatch, Explain: &router.Explanation{PromptTokens: 100}}
	h := http.Header{}
	b.ReportAllocs()
	cpu0, n := cputime.Process(), 0
	for b.Loop() {
		n++
		_, psp := s.span(ctx, SpanParse)
		psp.end(nil, "")
		s.traceRequest(ctx, req)
		dctx, dsp := s.span(ctx, SpanDecide)
		_, tsp := router.StartSpan(dctx, SpanTokenize)
		tsp.End(nil)
		_, lsp := router.StartSpan(dctx, SpanLookup)
		lsp.End(nil)
		dsp.endDecide(ctx, dec, config.StrategyKVAware, 8, nil)
		a := attempt{dec: dec, n: 1}
		actx := s.startAttempt(ctx, &a)
		s.injectTrace(actx, h)
		a.firstByte()
		a.endAttempt(false)
	}
	b.ReportMetric(float64(cputime.Process()-cpu0)/float64(n), "cpu-ns/op")
	if len(h) != 0 {
		b.Fatalf("tracing off wrote headers %v", h)
	}
}
