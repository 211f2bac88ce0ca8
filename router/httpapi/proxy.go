package httpapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/openai"
)

// Response headers of the proxy (the decision's own are router.HeaderInstance
// and the rest).
const (
	HeaderOverheadUS = "X-Kvrouter-Overhead-Us"
	HeaderAttempts   = "X-Kvrouter-Attempts"
)

// serveEndpoint serves one data-plane endpoint: /v1/chat/completions and
// /v1/completions (OpenAI bodies) and the raw SageMaker invocations.
func (s *Server) serveEndpoint(ep router.Endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) { s.serve(w, r, HTTPInbound(ep, r)) }
}

// HTTPInbound is what the HTTP data plane reads of a request besides its
// body: the tenant header, and for raw invocations the pool and adapter
// headers (OpenAI bodies name their model). The router forwards the body
// itself, so the pool's cache_salt is injected into it.
func HTTPInbound(ep router.Endpoint, r *http.Request) router.Inbound {
	in := router.Inbound{Endpoint: ep, Tenant: r.Header.Values(router.TenantHeader), Forwards: true}
	if !ep.OpenAI() {
		in.PoolHeader, in.PoolName, in.Adapter = router.HeaderPool, r.Header.Get(router.HeaderPool), r.Header.Get(router.HeaderAdapter)
	}
	return in
}

// serve is the data plane's driver: every step of a request is a call
// from here, in the order it is taken, and returns here; no step hands the
// request on to the next. Read the body (readRequest, over body.go), Resolve it against
// the pool table as every edge does (router/resolve.go), admit it through
// the pool's queue (flowcontrol.go, pools with flow_control), run its
// prefill stage (disagg.go, pools with disaggregation), then route and
// proxy it (route, below).
func (s *Server) serve(w http.ResponseWriter, r *http.Request, in router.Inbound) {
	st := s.table.Load()

	body, held, ready, ok := s.readRequest(w, r, st)
	if !ok {
		return
	}
	defer s.body.release(held)
	in.Body = body

	var psp span
	if in.Endpoint.OpenAI() { // raw invocations are not parsed
		_, psp = s.span(r.Context(), SpanParse)
	}
	req, pool, err := st.Resolve(in)
	psp.endErr(err)
	if err != nil {
		re := router.AsRequestError(err)
		s.reject(w, re.Pool, re.Status, re.Message)
		return
	}
	pc := pool.Config()
	rc, strat := pool.Routing()
	path := r.URL.Path
	switch in.Endpoint {
	case router.EndpointInvoke:
		path = pc.InvokePath
	case router.EndpointInvokeStream:
		path = pc.InvokeStreamPath
	}

	var tk *flowcontrol.Ticket // nil: the pool has no queue
	if gate, fc := pool.Queue(); gate != nil {
		if tk, ok = s.admit(w, r, pool, gate, fc, strat, req, ready); !ok {
			return
		}
		defer tk.Done()
		// The queue's wait is the engines' load, not the router's work:
		// x-kvrouter-overhead-us leaves it out (X-Kvrouter-Queued-Ms has it).
		ready = ready.Add(tk.Waited())
	}

	if in.Endpoint.OpenAI() && pool.Disaggregated() {
		var exchange time.Duration
		if req, exchange, ok = s.disaggregate(w, r, pool, strat, rc.ConcurrencyThreshold, req, path); !ok {
			return
		}
		// The prefill exchange is the engines' time, not the router's:
		// x-kvrouter-overhead-us leaves it out.
		ready = ready.Add(exchange)
	}

	s.route(w, r, st, pool, strat, req, tk, path, ready)
}

// readRequest reads the body of a request on either path and notes when it
// became ready to route; ok is false after the error was answered and
// counted. The caller releases held bytes of the body budget once the
// request is answered.
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request, st *router.Table) (body []byte, held int64, ready time.Time, ok bool) {
	if msg := checkContentType(r.Header.Get("Content-Type")); msg != "" {
		s.reject(w, "", http.StatusUnsupportedMediaType, msg)
		return nil, 0, time.Time{}, false
	}
	body, held, status := s.readBody(w, r, st.Config().MaxBodyBytes)
	if status != 0 {
		s.countRejected("", status)
		return nil, 0, time.Time{}, false
	}
	if msg := checkUTF8(body); msg != "" {
		s.body.release(held)
		s.reject(w, "", http.StatusBadRequest, msg)
		return nil, 0, time.Time{}, false
	}
	return body, held, time.Now(), true
}

// reject answers a request the router refuses before routing it, in the
// OpenAI error shape, and counts it.
func (s *Server) reject(w http.ResponseWriter, pool string, status int, msg string) {
	openai.WriteError(w, status, msg)
	s.countRejected(pool, status)
}

// countRejected counts a request answered before any strategy saw it.
func (s *Server) countRejected(pool string, status int) {
	s.m.requests.WithLabelValues(pool, "", "", "", strconv.Itoa(status)).Inc()
}

// attempt is one try of a request against one instance; it travels in the
// request context from the handler to the ReverseProxy hooks.
type attempt struct {
	pool     *router.Pool
	dec      router.Decision
	path     string // upstream path
	ready    time.Time
	sent     time.Time
	n        int // 1-based attempt number
	canRetry bool
	// noStatusRetry is set for a request whose retry statuses are not retried
	// (a disaggregated decode request, RemotePrefill): once it reached an
	// instance, that instance may have pulled the prompt's KV, and the
	// transfer parameters are for one decode. Only a failure before the
	// request was written goes to another instance.
	noStatusRetry bool
	ticket        *flowcontrol.Ticket // the request's flow-control ticket; nil without a queue

	// wrote is set by the transport (its write goroutine, through an
	// httptrace hook) once the whole request went out to the instance:
	// from then on the instance may be prefilling it, so a transport
	// failure is not retried elsewhere (that would duplicate the work, and
	// the request).
	wrote atomic.Bool

	// Set by the hooks (same goroutine as ServeHTTP).
	retry     bool  // failed before any byte reached the client: try the next candidate
	err       error // the failure
	status    int
	streamErr bool
	// usage reads the engine-reported cached tokens from the response for
	// the decision's Observer (nil without one, or without a response).
	usage *usageTee

	span span // the attempt's client span (tracing.go); empty when not traced
}

type attemptKey struct{}

func attemptFrom(ctx context.Context) *attempt {
	a, _ := ctx.Value(attemptKey{}).(*attempt)
	return a
}

// errRetryStatus marks an upstream status that is retried elsewhere.
type errRetryStatus int

func (e errRetryStatus) Error() string { return fmt.Sprintf("upstream answered %d", int(e)) }

// route picks an instance and proxies, retrying once on the next candidate
// when the first fails before any byte reached the client, and either
// before the request reached it or with a retry status (errorHandler). tk
// is the request's flow-control ticket (nil without a queue): the pick is
// among the instances with room under the per-instance prefill budget, and
// is charged to the first.
func (s *Server) route(w http.ResponseWriter, r *http.Request, st *router.Table, pool *router.Pool, strat router.Strategy, req *router.Request, tk *flowcontrol.Ticket, path string, ready time.Time) {
	s.traceRequest(r.Context(), req)
	var buf [32]*router.Instance // candidates live on the stack for typical pools
	var exclude *router.Instance
	var prev *attempt
	maxAttempts := 2
	if st.Config().Proxy.DisableRetry {
		maxAttempts = 1
	}
	// This edge sends warm-up copies (warm.go) of OpenAI requests, whose
	// body it can rewrite to one output token; picks made before it (a
	// disaggregated request's prefill stage) leave the flag false.
	req.Warmable = req.ProxyCanWarm()
	for n := 1; n <= maxAttempts; n++ {
		t0 := time.Now()
		cands, _ := pool.Candidates(buf[:0], req.Adapter, exclude)
		if tk != nil {
			cands = flowcontrol.FilterRoom(tk, cands, (*router.Instance).ID)
			req.KeptFree = tk.KeptFree(req.KeptFree[:0])
		}
		dctx, dsp := s.span(r.Context(), SpanDecide)
		dec, err := strat.Pick(dctx, req, cands)
		dsp.endDecide(r.Context(), dec, strat.Name(), len(cands), err)
		s.m.decision.WithLabelValues(pool.Name(), strat.Name()).Observe(time.Since(t0).Seconds())
		if err != nil {
			if r.Context().Err() != nil {
				// The client went away while the pick was held (kv_aware's
				// sequencing holds a request for its epoch): nobody to
				// answer, and no routing failure.
				var last router.Decision
				if prev != nil {
					last = prev.dec
				}
				s.clientLeft(pool, strat, last)
				return
			}
			if prev != nil {
				// The retry has nowhere to go: report the first failure.
				s.setDecisionHeaders(w.Header(), prev)
				openai.WriteError(w, http.StatusBadGateway, failedMessage(prev.dec.Instance.ID(), prev.err))
				s.m.requests.WithLabelValues(pool.Name(), prev.dec.Instance.ID(), strat.Name(), string(prev.dec.Reason), "502").Inc()
				return
			}
			w.Header().Set("Retry-After", "1")
			w.Header().Set(router.HeaderStrategy, strat.Name())
			msg := fmt.Sprintf("no eligible instance in pool %q", pool.Name())
			if req.Adapter != "" {
				msg += fmt.Sprintf(" holding adapter %q", req.Adapter)
			}
			openai.WriteError(w, http.StatusServiceUnavailable, msg)
			s.m.requests.WithLabelValues(pool.Name(), "", strat.Name(), "", "503").Inc()
			return
		}
		if dec.Warm != nil {
			var wt *flowcontrol.Ticket
			if tk != nil {
				// The copy holds its instance's budgets as a request would.
				wt = tk.Companion(dec.Warm.Instance.ID())
			}
			s.sendWarm(r, pool, req, path, dec.Warm, wt)
		}
		if tk != nil {
			tk.Bind(dec.Instance.ID()) // the first pick; a retry elsewhere stays charged to it
			if !req.Stream {
				// Its first byte comes after the whole generation: the
				// queue releases its prefill at a predicted first token
				// (the strategy's, kv_aware's, until the queue has its own).
				var fallback time.Duration
				if dec.Explain != nil {
					fallback = dec.Explain.PredictedTTFT
				}
				tk.Unstreamed(fallback)
			}
		}
		if dec.Reason == router.ReasonOverflow || dec.Reason == router.ReasonSaturated {
			s.m.overflows.WithLabelValues(pool.Name(), strat.Name(), string(dec.Reason)).Inc()
		}
		a := &attempt{pool: pool, dec: dec, path: path, ready: ready, n: n, canRetry: n < maxAttempts && len(cands) > 1, noStatusRetry: req.RemotePrefill, ticket: tk}
		ctx := context.WithValue(s.startAttempt(r.Context(), a), attemptKey{}, a)
		ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: a.wroteRequest})
		out := r.WithContext(ctx)
		out.Body = io.NopCloser(bytes.NewReader(req.Body))
		out.ContentLength = int64(len(req.Body))
		out.Header.Del("Content-Length") // ReverseProxy writes it from ContentLength
		if dec.Observer != nil && !req.Stream && dec.Explain != nil {
			// A non-streamed response starts only after the whole
			// generation: release its pending prefill when the prefill is
			// predicted to be over rather than at the first byte.
			if pr, ok := dec.Observer.(router.PrefillReleaser); ok {
				pr.ReleasePrefillAfter(dec.Explain.PredictedTTFT)
			}
		}
		dec.Instance.Acquire()
		func() {
			// ReverseProxy panics with http.ErrAbortHandler when the copy to
			// the client fails mid-response (client gone): release anyway,
			// or the instance would count that request in flight forever.
			defer func() {
				dec.Instance.Release()
				p := recover()
				defer a.endAttempt(p != nil)
				if p != nil {
					// Aborted mid-response: the client went away (499) or the
					// upstream broke off a non-SSE body (502). Count it here,
					// since the panic skips the accounting after this call.
					if r.Context().Err() != nil {
						a.status = 499
					} else if a.streamErr {
						a.status = http.StatusBadGateway
					}
				}
				if dec.Observer != nil {
					dec.Observer.Done(a.status, a.usage.cachedTokens())
				}
				if p != nil {
					s.m.requests.WithLabelValues(pool.Name(), dec.Instance.ID(), strat.Name(), string(dec.Reason), strconv.Itoa(a.status)).Inc()
					panic(p)
				}
			}()
			s.proxy.ServeHTTP(w, out)
		}()
		if !a.retry {
			s.m.requests.WithLabelValues(pool.Name(), dec.Instance.ID(), strat.Name(), string(dec.Reason), strconv.Itoa(a.status)).Inc()
			s.log.Debug("request", "pool", pool.Name(), "instance", dec.Instance.ID(), "strategy", strat.Name(), "reason", dec.Reason, "status", a.status, "attempt", n, "stream", req.Stream)
			return
		}
		s.m.retries.WithLabelValues(pool.Name(), dec.Instance.ID()).Inc()
		s.log.Warn("upstream failed before responding; retrying on the next candidate", "pool", pool.Name(), "instance", dec.Instance.ID(), "err", a.err)
		exclude, prev = dec.Instance, a
		if !a.sent.IsZero() {
			// The failed instance's time is not the router's either: the
			// next attempt's overhead counts the decisions, not the wait.
			ready = ready.Add(time.Since(a.sent))
		}
	}
}

// clientLeft counts a request whose client went away before any instance
// answered it, as the proxy counts one that leaves mid-answer: 499, the
// status nobody reads. last is the request's last decision, whose
// instance and reason label it (none: the zero Decision).
func (s *Server) clientLeft(pool *router.Pool, strat router.Strategy, last router.Decision) {
	inst := ""
	if last.Instance != nil {
		inst = last.Instance.ID()
	}
	s.m.requests.WithLabelValues(pool.Name(), inst, strat.Name(), string(last.Reason), "499").Inc()
	s.log.Debug("request", "pool", pool.Name(), "instance", inst, "strategy", strat.Name(), "reason", last.Reason, "status", 499)
}

func (s *Server) setDecisionHeaders(h http.Header, a *attempt) {
	h.Set(router.HeaderInstance, a.dec.Instance.ID())
	h.Set(router.HeaderStrategy, a.dec.Strategy)
	h.Set(router.HeaderReason, string(a.dec.Reason))
	if !a.sent.IsZero() {
		h.Set(HeaderOverheadUS, strconv.FormatInt(a.sent.Sub(a.ready).Microseconds(), 10))
	}
	if a.n > 1 {
		h.Set(HeaderAttempts, strconv.Itoa(a.n))
	}
	if e := a.dec.Explain; e != nil {
		h.Set(router.HeaderMatchedTokens, e.MatchedTokensHeader())
		h.Set(router.HeaderPredictedTTFT, strconv.FormatFloat(float64(e.PredictedTTFT)/1e6, 'f', 2, 64))
	}
}

// rewrite points the outbound request at the attempt's instance.
func (s *Server) rewrite(pr *httputil.ProxyRequest) {
	a := attemptFrom(pr.In.Context())
	u := a.dec.Instance.URL()
	pr.Out.URL.Scheme = u.Scheme
	pr.Out.URL.Host = u.Host
	pr.Out.URL.Path = strings.TrimSuffix(u.Path, "/") + a.path
	pr.Out.URL.RawPath = ""
	pr.Out.Host = ""
	pr.SetXForwarded()
	s.injectTrace(pr.In.Context(), pr.Out.Header)
	a.sent = time.Now()
}

// modifyResponse turns retryable statuses into errors (so the request is
// retried elsewhere), adds the decision headers and wraps the body to time
// its first byte and end a broken stream with an error event.
func (s *Server) modifyResponse(resp *http.Response) error {
	a := attemptFrom(resp.Request.Context())
	a.status = resp.StatusCode
	if a.canRetry && !a.noStatusRetry && s.table.Load().RetryStatus(resp.StatusCode) {
		return errRetryStatus(resp.StatusCode)
	}
	s.setDecisionHeaders(resp.Header, a)
	ct := resp.Header.Get("Content-Type")
	if o := a.dec.Observer; o != nil {
		a.usage = &usageTee{rc: resp.Body, sse: strings.HasPrefix(ct, "text/event-stream")}
		if prefilled(resp.StatusCode) {
			a.usage.onFirst = o.FirstByte
		}
		resp.Body = a.usage
	}
	resp.Body = &upstreamBody{
		rc:  resp.Body,
		s:   s,
		a:   a,
		ctx: resp.Request.Context(),
		sse: strings.HasPrefix(ct, "text/event-stream") && resp.ContentLength < 0,
	}
	return nil
}

// prefilled reports whether an upstream answer with this status means the
// engine prefilled the prompt before its first byte: only a success does.
// A refusal (vLLM answers a prompt over its context at once, 400) or an
// error status ends the request without a prefill, so its first byte must
// not tell the flow-control queue (its service time and fit) or kv_aware
// (its measured prefill rate) that a whole prompt's work took a
// millisecond; the work the request held is given back at its end (Done)
// all the same.
func prefilled(status int) bool { return status >= 200 && status < 300 }

// wroteRequest is the attempt's httptrace.ClientTrace.WroteRequest hook. A
// write that failed part way is not counted: the instance never got the
// whole request, so it cannot be working on it.
func (a *attempt) wroteRequest(info httptrace.WroteRequestInfo) {
	if info.Err == nil {
		a.wrote.Store(true)
	}
}

// errorHandler runs when the upstream failed before its response reached
// the client: nothing has been written to the client. The request is
// retried on the next candidate for a configured retry status, or for a
// transport failure before the request was written (dial error, connection
// refused or reset while sending); not after it was (a reset or hang-up
// while waiting, response_header_timeout), since the instance may already
// be prefilling it.
func (s *Server) errorHandler(w http.ResponseWriter, r *http.Request, err error) {
	a := attemptFrom(r.Context())
	a.err = err
	if r.Context().Err() != nil {
		a.status = 499 // client closed request: nobody to answer
		return
	}
	var rs errRetryStatus
	isStatus := errors.As(err, &rs)
	if a.canRetry && (isStatus || !a.wrote.Load()) {
		a.retry = true
		return
	}
	status := http.StatusBadGateway
	if isStatus {
		status = int(rs)
	} else if errors.Is(err, context.DeadlineExceeded) {
		status = http.StatusGatewayTimeout
	}
	a.status = status
	s.setDecisionHeaders(w.Header(), a)
	s.log.Warn("upstream failed", "pool", a.pool.Name(), "instance", a.dec.Instance.ID(), "err", err)
	openai.WriteError(w, status, failedMessage(a.dec.Instance.ID(), err))
}

// failedMessage is what a client is told of an instance that failed before
// answering. A transport error names the instance's address ("dial tcp
// 10.0.3.7:8000: connect: connection refused"), which is the operator's,
// not the client's: it stays in the log and the attempt's span.
func failedMessage(instance string, err error) string {
	var rs errRetryStatus
	switch {
	case errors.As(err, &rs):
		return fmt.Sprintf("instance %s answered %d", instance, int(rs))
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("instance %s timed out before answering", instance)
	}
	return fmt.Sprintf("instance %s failed before answering", instance)
}

// upstreamBody wraps an upstream response body.
type upstreamBody struct {
	rc   io.ReadCloser
	s    *Server
	a    *attempt
	ctx  context.Context
	sse  bool
	got  bool    // first byte seen
	last [2]byte // last two bytes passed on: is the stream at an event boundary?
	tail []byte  // pending error event
	done bool
}

func (b *upstreamBody) Read(p []byte) (int, error) {
	if b.tail != nil {
		n := copy(p, b.tail)
		b.tail = b.tail[n:]
		if len(b.tail) == 0 {
			b.tail, b.done = nil, true
		}
		return n, nil
	}
	if b.done {
		return 0, io.EOF
	}
	n, err := b.rc.Read(p)
	if n > 0 {
		if !b.got {
			b.got = true
			b.a.firstByte()
			if t := b.a.ticket; t != nil && prefilled(b.a.status) {
				t.FirstToken() // its pending prefill is over
			}
			b.s.m.ttfb.WithLabelValues(b.a.pool.Name(), b.a.dec.Instance.ID()).Observe(time.Since(b.a.sent).Seconds())
		}
		if n >= 2 {
			b.last = [2]byte{p[n-2], p[n-1]}
		} else {
			b.last = [2]byte{b.last[1], p[0]}
		}
	}
	if err == nil || err == io.EOF || b.ctx.Err() != nil {
		return n, err
	}
	b.a.streamErr = true
	b.s.m.streamErr.WithLabelValues(b.a.pool.Name(), b.a.dec.Instance.ID()).Inc()
	b.s.log.Warn("upstream failed mid-response", "pool", b.a.pool.Name(), "instance", b.a.dec.Instance.ID(), "sse", b.sse, "err", err)
	if !b.sse {
		return n, err // the client sees a truncated body (connection aborted)
	}
	var tail []byte
	switch {
	case !b.got || b.last == [2]byte{'\n', '\n'}:
	case b.last[1] == '\n':
		tail = append(tail, '\n')
	default:
		tail = append(tail, "\n\n"...)
	}
	b.tail = append(tail, openai.SSEErrorEvent(fmt.Sprintf("instance %s failed mid-stream", b.a.dec.Instance.ID()))...) // the error stays in the log (failedMessage)
	return n, nil
}

func (b *upstreamBody) Close() error { return b.rc.Close() }

// copyBufferPool recycles ReverseProxy's response copy buffers.
type copyBufferPool struct{ p sync.Pool }

var _ httputil.BufferPool = (*copyBufferPool)(nil)

func newCopyBufferPool(size int) *copyBufferPool {
	return &copyBufferPool{p: sync.Pool{New: func() any { b := make([]byte, size); return &b }}}
}

func (c *copyBufferPool) Get() []byte { return *c.p.Get().(*[]byte) }

func (c *copyBufferPool) Put(b []byte) { c.p.Put(&b) }
