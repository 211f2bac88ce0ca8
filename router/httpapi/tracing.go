package httpapi

import (
	"context"
	"net/http"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
)

// Tracing (docs/operations.md, "Tracing"). Each data-plane request gets a
// server span, continuing the caller's W3C trace context when it sent one;
// its children are parse, tokenize, index lookup, decide and one client
// span per proxy attempt, whose context goes to the engine in traceparent
// so that vLLM (--otlp-traces-endpoint) continues the trace.
//
// Off (Options.TracerProvider nil), the handlers are not wrapped, every
// helper below returns after a nil check and the core's router.StartSpan
// after one context lookup: no span, no allocation, no header. Spans carry routing facts (pool, model, strategy, reason,
// instance, token counts), never prompt text, bodies or headers.

// TracerScope is the instrumentation scope of the router's spans (named
// for package router, where the data plane was first: what trace queries
// select on stays the same).
const TracerScope = "github.com/kvrouter/kvrouter/router"

// Span names of the request path (the server span is named after its
// route, "POST /v1/chat/completions").
const (
	SpanParse    = "kvrouter.parse"
	SpanTokenize = router.SpanTokenize // started by the core, through router.Spans
	SpanLookup   = router.SpanLookup   // started by kv_aware, through router.Spans
	SpanDecide   = "kvrouter.decide"
	SpanProxy    = "kvrouter.proxy"
)

// Span attributes. HTTP and model keys follow the OpenTelemetry semantic
// conventions (http.*, url.*, server.*, gen_ai.request.model); the rest
// are the router's own.
const (
	AttrHTTPMethod    = attribute.Key("http.request.method")
	AttrHTTPRoute     = attribute.Key("http.route")
	AttrHTTPStatus    = attribute.Key("http.response.status_code")
	AttrServerAddress = attribute.Key("server.address")
	AttrURLPath       = attribute.Key("url.path")
	AttrModel         = attribute.Key("gen_ai.request.model")
	AttrPool          = attribute.Key("kvrouter.pool")
	AttrAdapter       = attribute.Key("kvrouter.adapter")
	AttrStream        = attribute.Key("kvrouter.stream")
	AttrBodyBytes     = attribute.Key("kvrouter.body_bytes")
	AttrStrategy      = attribute.Key("kvrouter.strategy")
	AttrReason        = attribute.Key("kvrouter.reason")
	AttrInstance      = attribute.Key("kvrouter.instance")
	AttrCandidates    = attribute.Key("kvrouter.candidates")
	AttrAttempt       = attribute.Key("kvrouter.attempt")
	AttrRetry         = attribute.Key("kvrouter.retry")
	AttrPromptTokens  = attribute.Key(router.AttrPromptTokens)
	AttrPredictedTTFT = attribute.Key("kvrouter.predicted_ttft_ms")
	AttrLookupBlocks  = attribute.Key(router.AttrLookupBlocks)
	AttrLookupHolders = attribute.Key(router.AttrLookupHolders)
	// AttrMatchedTokens prefixes kvrouter.matched_tokens.<tier>: the
	// prompt tokens the chosen instance holds in that tier beyond faster
	// tiers (the x-kvrouter-matched-tokens header).
	AttrMatchedTokens = "kvrouter.matched_tokens."
)

// matchedKeys are the per-tier matched-token keys.
var matchedKeys = func() (k [tiers.Count]attribute.Key) {
	for t := range k {
		k[t] = attribute.Key(AttrMatchedTokens + tiers.Tier(t).String())
	}
	return k
}()

// traceContext is the propagation format: W3C traceparent and tracestate,
// what vLLM extracts from its requests' headers.
var traceContext propagation.TraceContext

// traced wraps a data-plane handler registered on pattern ("POST /path")
// in a server span; with tracing off it returns h itself.
func (s *Server) traced(pattern string, h http.HandlerFunc) http.HandlerFunc {
	if s.tracer == nil {
		return h
	}
	method, route, _ := strings.Cut(pattern, " ")
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := traceContext.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, sp := s.tracer.Start(ctx, pattern, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(AttrHTTPMethod.String(method), AttrHTTPRoute.String(route), AttrURLPath.String(r.URL.Path)))
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			p := recover()
			status := sw.status
			switch {
			case status != 0:
			case r.Context().Err() != nil:
				status = 499 // the client went away before an answer (as the metrics count it)
			case p == nil:
				status = http.StatusOK // nothing written: net/http answers 200
			}
			if status != 0 {
				sp.SetAttributes(AttrHTTPStatus.Int(status))
			}
			switch {
			case p != nil:
				// ReverseProxy aborts with http.ErrAbortHandler when the
				// client or the upstream broke off mid-response.
				sp.SetStatus(codes.Error, "response aborted")
			case status >= 500:
				sp.SetStatus(codes.Error, http.StatusText(status))
			}
			sp.End()
			if p != nil {
				panic(p)
			}
		}()
		if sp.IsRecording() {
			// The core's steps (tokenize, kv_aware's lookup) start their
			// spans through it; an unsampled request is spared the value.
			ctx = router.WithSpans(ctx, childSpan)
		}
		h(sw, r.WithContext(ctx))
	}
}

// statusWriter notes the status a handler answered. ReverseProxy reaches
// Flush and the rest through Unwrap (http.ResponseController).
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// span is a child span of the request's, or nothing when the request is not
// being recorded (tracing off, or its trace not sampled): every method is
// then a no-op. A value, so that an untraced request allocates nothing.
type span struct{ s trace.Span }

// span starts an internal child span of the request's on the server's
// request path: with tracing off, a nil check.
func (s *Server) span(ctx context.Context, name string) (context.Context, span) {
	if s.tracer == nil {
		return ctx, span{}
	}
	return startSpan(ctx, name, trace.SpanKindInternal)
}

// startSpan starts a child of ctx's span when that one is recording: one
// context lookup when it is not.
func startSpan(ctx context.Context, name string, kind trace.SpanKind) (context.Context, span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, span{}
	}
	ctx, sp := parent.TracerProvider().Tracer(TracerScope).Start(ctx, name, trace.WithSpanKind(kind))
	return ctx, span{sp}
}

// childSpan is the router.Spans the traced handlers put in the request
// context: the core's steps (tokenize, kv_aware's lookup) start their
// spans through it.
func childSpan(ctx context.Context, name string) (context.Context, router.SpanEnder) {
	ctx, sp := startSpan(ctx, name, trace.SpanKindInternal)
	if sp.s == nil {
		return ctx, nil
	}
	return ctx, sp
}

var (
	_ router.Spans     = childSpan
	_ router.SpanEnder = span{}
)

// SetInt implements router.SpanEnder.
func (sp span) SetInt(key string, v int) { sp.s.SetAttributes(attribute.Int(key, v)) }

// End implements router.SpanEnder.
func (sp span) End(err error, desc string) { sp.end(err, desc) }

// endErr ends the span, failed with err's description (router.ErrDesc)
// when err is not nil; the description is made only for a recorded span.
func (sp span) endErr(err error) {
	if sp.s != nil {
		sp.end(err, router.ErrDesc(err))
	}
}

// end ends the span, marking it failed with desc when err is not nil.
func (sp span) end(err error, desc string) {
	if sp.s == nil {
		return
	}
	if err != nil {
		sp.s.SetStatus(codes.Error, desc)
	}
	sp.s.End()
}

// traceRequest puts what the handler learnt about the request on its
// server span.
func (s *Server) traceRequest(ctx context.Context, req *router.Request) {
	if s.tracer == nil {
		return
	}
	sp := trace.SpanFromContext(ctx)
	if !sp.IsRecording() {
		return
	}
	sp.SetAttributes(AttrPool.String(req.Pool), AttrModel.String(req.Model), AttrStream.Bool(req.Stream), AttrBodyBytes.Int(len(req.Body)))
	if req.Adapter != "" {
		sp.SetAttributes(AttrAdapter.String(req.Adapter))
	}
}

// endDecide ends a decide span with the decision, and records the
// decision on the server span (the parent) too, so that one span says how
// the request was routed: the last attempt's decision wins.
func (sp span) endDecide(ctx context.Context, dec router.Decision, strategy string, cands int, err error) {
	if sp.s == nil {
		return
	}
	if err != nil {
		sp.s.SetAttributes(AttrStrategy.String(strategy), AttrCandidates.Int(cands))
		sp.end(err, router.ErrDesc(err))
		return
	}
	attrs := make([]attribute.KeyValue, 0, 6+tiers.Count)
	attrs = append(attrs, AttrStrategy.String(dec.Strategy), AttrReason.String(string(dec.Reason)), AttrInstance.String(dec.Instance.ID()))
	if e := dec.Explain; e != nil {
		attrs = append(attrs, AttrPromptTokens.Int(e.PromptTokens), AttrPredictedTTFT.Float64(float64(e.PredictedTTFT)/1e6))
		for t, n := range e.MatchedTokens {
			attrs = append(attrs, matchedKeys[t].Int(n))
		}
	}
	trace.SpanFromContext(ctx).SetAttributes(attrs...)
	sp.s.SetAttributes(append(attrs, AttrCandidates.Int(cands))...)
	sp.s.End()
}

// startAttempt starts the client span of a proxy attempt.
func (s *Server) startAttempt(ctx context.Context, a *attempt) context.Context {
	if s.tracer == nil {
		return ctx
	}
	ctx, a.span = startSpan(ctx, SpanProxy, trace.SpanKindClient)
	if a.span.s != nil {
		u := a.dec.Instance.URL()
		a.span.s.SetAttributes(AttrHTTPMethod.String(http.MethodPost), AttrServerAddress.String(u.Host),
			AttrURLPath.String(a.path), AttrInstance.String(a.dec.Instance.ID()), AttrAttempt.Int(a.n))
	}
	return ctx
}

// endAttempt ends an attempt's client span: its status, and whether the
// request went on to the next candidate.
func (a *attempt) endAttempt(aborted bool) {
	sp := a.span.s
	if sp == nil {
		return
	}
	if a.status != 0 {
		sp.SetAttributes(AttrHTTPStatus.Int(a.status))
	}
	sp.SetAttributes(AttrRetry.Bool(a.retry))
	switch {
	case a.err != nil:
		sp.SetStatus(codes.Error, router.ErrDesc(a.err))
	case aborted:
		sp.SetStatus(codes.Error, "response aborted")
	case a.streamErr:
		sp.SetStatus(codes.Error, "upstream failed mid-response")
	case a.status >= 400:
		sp.SetStatus(codes.Error, http.StatusText(a.status))
	}
	sp.End()
}

// firstByte marks the attempt's first response byte on its span.
func (a *attempt) firstByte() {
	if a.span.s != nil {
		a.span.s.AddEvent("first_byte")
	}
}

// injectTrace writes the attempt's trace context into the request to the
// engine (replacing any the client sent, whose trace it continues).
func (s *Server) injectTrace(ctx context.Context, h http.Header) {
	if s.tracer != nil {
		traceContext.Inject(ctx, propagation.HeaderCarrier(h))
	}
}
