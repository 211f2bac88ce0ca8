package router

import (
	"context"
	"errors"
	"time"
)

// Observer follows one routed attempt to its end. A strategy that
// predicts something about a request (kv_aware, shadow mode) sets it on its
// Decision. The edge that forwards the request calls FirstByte when the
// upstream's successful (2xx) response starts — an error status's first
// byte is no prefill, and is not told — and Done exactly once when the attempt is
// over (after the body reached the client, or after a failure with no
// response), with the engine-reported cached prompt tokens
// (usage.prompt_tokens_details.cached_tokens; -1 when not reported). Both
// are called from the request's goroutine; FirstByte may not come at all.
type Observer interface {
	FirstByte()
	Done(status, cachedTokens int)
}

// PrefillReleaser is implemented by observers that count the request's
// prefill as pending on its instance. The proxy calls it for a non-streamed
// request, whose first response byte arrives only after the whole
// generation: the pending prefill is then released after d (the predicted
// time to first token, when the prefill should be over), or at the first
// byte or Finish if sooner.
type PrefillReleaser interface {
	ReleasePrefillAfter(d time.Duration)
}

// Spans of the steps below the edge. The core traces the steps it runs for
// a strategy (tokenizing the prompt; kv_aware's index lookup, through
// StartSpan) without a tracing library: the edge that traces a request
// puts a Spans in its context (WithSpans; router/httpapi does, with
// OpenTelemetry), and without one StartSpan costs one context lookup.

// Span names and attribute keys of those steps.
const (
	SpanTokenize = "kvrouter.tokenize"
	SpanLookup   = "kvrouter.index.lookup"

	AttrPromptTokens  = "kvrouter.prompt_tokens"
	AttrLookupBlocks  = "kvrouter.lookup.blocks"
	AttrLookupHolders = "kvrouter.lookup.instances"
)

// Spans starts a child span of the traced request's span in ctx; it
// returns a nil SpanEnder when that span is not recording.
type Spans func(ctx context.Context, name string) (context.Context, SpanEnder)

// SpanEnder is a span Spans started.
type SpanEnder interface {
	SetInt(key string, v int)
	// End ends the span, failed with status desc when err is not nil.
	End(err error, desc string)
}

type spansKey struct{}

// WithSpans returns ctx carrying the edge's Spans.
func WithSpans(ctx context.Context, s Spans) context.Context {
	return context.WithValue(ctx, spansKey{}, s)
}

// StartSpan starts a child span of ctx's request span for one of the
// strategy's steps (kv_aware's index lookup), when the request is traced
// and sampled; else it returns an inert Span. End it with End.
func StartSpan(ctx context.Context, name string) (context.Context, Span) {
	if s, _ := ctx.Value(spansKey{}).(Spans); s != nil {
		ctx, e := s(ctx, name)
		return ctx, Span{e}
	}
	return ctx, Span{}
}

// Span is a span started by StartSpan (a no-op when not recording).
type Span struct{ e SpanEnder }

// Recording reports whether the span records (tracing on, sampled): set
// attributes only then, so that an untraced request allocates nothing.
func (s Span) Recording() bool { return s.e != nil }

// SetInt sets an integer attribute on the span.
func (s Span) SetInt(key string, v int) {
	if s.e != nil {
		s.e.SetInt(key, v)
	}
}

// End ends the span, failed when err is not nil (its message, cut to 200
// bytes, is the status: pass only errors that quote no request content).
func (s Span) End(err error) {
	if s.e != nil {
		s.e.End(err, ErrDesc(err))
	}
}

// ErrDesc is a span status description for err: its message up to 200
// bytes, for errors that describe the request's shape, never its content
// (parse errors, index errors).
func ErrDesc(err error) string {
	if err == nil {
		return ""
	}
	msg := err.Error()
	if len(msg) > 200 {
		msg = msg[:200]
	}
	return msg
}

// tracedTokens runs a token source under a tokenize span.
func tracedTokens(ctx context.Context, src TokenSource, req *Request) ([]uint32, error) {
	ctx, sp := StartSpan(ctx, SpanTokenize)
	ids, err := src.Tokens(ctx, req)
	if sp.e != nil {
		sp.e.SetInt(AttrPromptTokens, len(ids))
		// Not the message: a template or engine error may quote the prompt.
		desc := "tokenize failed"
		if errors.Is(err, context.DeadlineExceeded) {
			desc = "tokenize timed out"
		}
		sp.e.End(err, desc)
	}
	return ids, err
}
