package router

import "time"

// Observer follows one routed attempt to its end. A strategy that
// predicts something about a request (kv_aware, shadow mode) sets it on its
// Decision. The edge that forwards the request calls FirstByte when the
// upstream's response starts, and Done exactly once when the attempt is
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
