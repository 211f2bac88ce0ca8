package httpapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/openai"
)

// Disaggregated serving: a pool with disaggregation on sends an OpenAI
// request first to a prefill instance, as a prefill request (vLLM's
// kv_transfer_params with do_remote_decode, max_tokens 1, not streamed),
// then the original request, with the kv_transfer_params the prefill
// answered, to a decode instance, which pulls the prompt's KV instead of
// computing it. The protocol is vLLM's (NixlConnector; its proxy
// tests/v1/kv_connector/nixl_integration/toy_proxy_server.py and
// docs/features/nixl_connector_usage.md); the prefill's answer is passed
// on unchanged, whatever fields the engine's connector version adds.
// docs/disaggregation.md has the design.

// Response headers of a disaggregated request.
const (
	// HeaderPrefillInstance names the instance that prefilled the request.
	HeaderPrefillInstance = "X-Kvrouter-Prefill-Instance"
	// HeaderDisagg says how the request was served: "disaggregated", or
	// "aggregated; <why>" when a pool with disaggregation on served it
	// whole on a decode-capable instance.
	HeaderDisagg = "X-Kvrouter-Disagg"
)

// Why a request of a disaggregating pool went aggregated.
const (
	aggNoPrefill    = "no_prefill_instance" // no healthy prefill instance
	aggShort        = "short"               // conditional: the uncached part is under min_prefill_tokens
	aggPrefillBusy  = "prefill_saturated"   // conditional: every prefill instance is at its threshold
	aggPrefillError = "prefill_failed"      // the prefill failed on every prefill instance tried
	aggRefused      = "prefill_refused"     // the prefill instance refused the request (4xx): another would too
	aggNoParams     = "no_transfer_params"  // the prefill answered without kv_transfer_params saying do_remote_prefill
	aggBatch        = "batch"               // several prompts, or n or best_of above 1: one set of transfer parameters cannot serve them
)

// headerRequestID is the request id vLLM's OpenAI server takes for its
// own; vLLM's toy proxy sends one to both stages, and engines before
// vllm-project/vllm#29665 match a decode's transfer to its prefill by it
// (without it the prefill's blocks stay held until the connector's abort
// timeout).
const headerRequestID = "X-Request-Id"

// requestID is a disaggregated request's id: always a new random one (a
// UUID, as the toy proxy makes), after the client's X-Request-Id (its first
// value, when it is at most 128 printable ASCII characters without spaces)
// and a dash, so that logs still carry the client's. Never the client's
// alone: on engines that match a decode's transfer to its prefill by this
// id, a client sending another client's id would disturb that request's
// transfer, and two clients' equal ids would collide.
func requestID(h http.Header) string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	id := fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
	if c := h.Get(headerRequestID); c != "" && len(c) <= 128 && strings.IndexFunc(c, func(r rune) bool { return r <= ' ' || r > '~' }) < 0 {
		return c + "-" + id
	}
	return id
}

// maxPrefillAnswer bounds the prefill's answer (one token and the transfer
// parameters: a block id per 16 tokens, so a 128k-token prompt is ~50 KiB).
const maxPrefillAnswer = 4 << 20

// prefillOverrides turn a request into vLLM's prefill request (the toy
// proxy's send_request_to_service): not streamed, one token, no minimum,
// and kv_transfer_params asking for a remote decode.
var prefillOverrides = []openai.Member{
	{Key: "kv_transfer_params", Value: json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)},
	{Key: "stream", Value: json.RawMessage(`false`)},
	{Key: "stream_options"},
	{Key: "max_tokens", Value: json.RawMessage(`1`)},
	{Key: "min_tokens"},
	{Key: "min_completion_tokens"},
}

// prefillBody is body as a prefill request.
func prefillBody(body []byte) ([]byte, error) {
	set := prefillOverrides
	if openai.TopLevelRaw(body, "max_completion_tokens") != nil {
		set = append(append([]openai.Member(nil), set...), openai.Member{Key: "max_completion_tokens", Value: json.RawMessage(`1`)})
	}
	return openai.SetMembers(body, set...)
}

// transferParams reads kv_transfer_params from a prefill's answer; nil
// when it has none (an engine without a KV connector) or they do not say
// do_remote_prefill true ({}, or false): nothing for a decode to pull.
func transferParams(answer []byte) (json.RawMessage, error) {
	var a struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(answer, &a); err != nil {
		return nil, fmt.Errorf("prefill answer is not JSON: %w", err)
	}
	if len(a.KV) == 0 || bytes.Equal(a.KV, []byte("null")) {
		return nil, nil
	}
	if a.KV[0] != '{' {
		return nil, fmt.Errorf("prefill answer's kv_transfer_params is not an object")
	}
	if !bytes.Equal(bytes.TrimSpace(openai.TopLevelRaw(a.KV, "do_remote_prefill")), []byte("true")) {
		return nil, nil
	}
	return a.KV, nil
}

// disaggregate runs the prefill stage of a request of a pool with
// disaggregation on, and returns the request the decode stage routes: the
// original with the prefill's kv_transfer_params, or the original
// unchanged when the request goes aggregated (HeaderDisagg says why), and
// the time spent in prefill exchanges with the engines. It never answers
// the client: a failed prefill falls back to aggregated serving, since a
// decode-capable instance can always prefill itself. ok is false when the
// client went away during the prefill stage (counted here, as a client
// that left, not as a failed prefill): nothing is left to route.
//
// threshold is the pool's routing concurrency_threshold (the strategy's).
func (s *Server) disaggregate(w http.ResponseWriter, r *http.Request, pool *router.Pool, strat router.Strategy, threshold int, req *router.Request, path string) (_ *router.Request, exchange time.Duration, ok bool) {
	dc := pool.Config().Disaggregation
	aggregated := func(why string) (*router.Request, time.Duration, bool) {
		w.Header().Set(HeaderDisagg, "aggregated; "+why)
		s.m.disagg.WithLabelValues(pool.Name(), "aggregated", why).Inc()
		return req, exchange, true
	}
	left := func(last router.Decision) (*router.Request, time.Duration, bool) {
		s.clientLeft(pool, strat, last)
		return req, exchange, false
	}
	var buf [32]*router.Instance
	pcands := pool.PrefillCandidates(buf[:0], req.Adapter, nil)
	// Picked twice (prefill, then decode): the prompt's block keys are made once.
	req.ShareKeys = true
	if len(pcands) == 0 {
		return aggregated(aggNoPrefill)
	}
	if req.Parsed != nil && req.Parsed.Sequences() {
		// vLLM's decode request takes one set of transfer parameters, for
		// one sequence's blocks.
		return aggregated(aggBatch)
	}
	if dc.Mode == config.DisaggConditional {
		if uncached, known := s.uncachedOnDecode(r.Context(), pool, strat, req); known && uncached < dc.MinPrefillTokens {
			return aggregated(aggShort)
		}
	}
	// Both stages carry one request id (sideHeader copies it to the
	// prefill request; the decode request is r's).
	r.Header.Set(headerRequestID, requestID(r.Header))
	pbody, err := prefillBody(req.Body)
	if err != nil {
		// Resolve parsed this body; an edit that fails is a bug, not the client's.
		s.log.Error("disaggregation: cannot write the prefill request", "pool", pool.Name(), "err", err)
		return aggregated(aggPrefillError)
	}
	// prefill_timeout bounds the whole stage: a second attempt gets what
	// the first left of it.
	pctx, cancel := context.WithTimeout(r.Context(), dc.PrefillTimeout)
	defer cancel()
	var exclude *router.Instance
	for n := 1; n <= 2; n++ {
		if n > 1 {
			if pctx.Err() != nil {
				break // no time left for another prefill instance
			}
			pcands = pool.PrefillCandidates(buf[:0], req.Adapter, exclude)
			if len(pcands) == 0 {
				break
			}
		}
		if n == 1 && dc.Mode == config.DisaggConditional && allFull(pcands, threshold) {
			// Every prefill instance is at its threshold: the prefill set is
			// the bottleneck, and a decode-capable instance prefills now.
			// Told before picking: a pick is committed (kv_aware's
			// speculative entries, pending prefill, peers' announcements,
			// decision counters) and cannot be taken back.
			return aggregated(aggPrefillBusy)
		}
		dec, err := strat.Pick(r.Context(), req, pcands)
		if err != nil {
			if r.Context().Err() != nil {
				return left(router.Decision{}) // while the pick was held (kv_aware's sequencing)
			}
			break
		}
		t0 := time.Now()
		kv, err := s.prefill(pctx, r, pool, dec, pbody, path)
		exchange += time.Since(t0)
		if err == nil && kv == nil {
			s.log.Warn("disaggregation: the prefill instance answered without kv_transfer_params saying do_remote_prefill (is vLLM started with --kv-transfer-config?)", "pool", pool.Name(), "instance", dec.Instance.ID())
			return aggregated(aggNoParams)
		}
		if err != nil {
			if r.Context().Err() != nil {
				return left(dec)
			}
			var ps prefillStatus
			if errors.As(err, &ps) && ps.refused() {
				// The request's fault, not the instance's: another prefill
				// instance would refuse it too, and the decode-capable
				// instance answers the client's own request (whose error
				// then names the client's parameters, not the prefill's).
				s.log.Debug("disaggregation: the prefill instance refused the request", "pool", pool.Name(), "instance", dec.Instance.ID(), "err", err)
				return aggregated(aggRefused)
			}
			s.log.Warn("disaggregation: prefill failed", "pool", pool.Name(), "instance", dec.Instance.ID(), "attempt", n, "err", err)
			s.m.disaggPrefillErrors.WithLabelValues(pool.Name(), dec.Instance.ID()).Inc()
			exclude = dec.Instance
			continue
		}
		dbody, err := openai.SetMembers(req.Body, openai.Member{Key: "kv_transfer_params", Value: kv})
		if err != nil {
			s.log.Error("disaggregation: cannot write the decode request", "pool", pool.Name(), "err", err)
			return aggregated(aggPrefillError)
		}
		w.Header().Set(HeaderPrefillInstance, dec.Instance.ID())
		w.Header().Set(HeaderDisagg, "disaggregated")
		s.m.disagg.WithLabelValues(pool.Name(), "disaggregated", "").Inc()
		// The prompt is unchanged, so whatever was derived from the body
		// (routing text, tokens) still holds.
		req.Body = dbody
		req.RemotePrefill = true
		return req, exchange, true
	}
	return aggregated(aggPrefillError)
}

// prefill sends the prefill request for the client's r to dec's instance,
// under ctx (the stage's deadline), and returns the kv_transfer_params of
// its answer (nil when there are none).
func (s *Server) prefill(ctx context.Context, r *http.Request, pool *router.Pool, dec router.Decision, body []byte, path string) (kv json.RawMessage, err error) {
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, sideURL(dec.Instance, path), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	out.Header = sideHeader(r)
	s.injectTrace(r.Context(), out.Header)
	dec.Instance.Acquire()
	status := 0
	var usage *usageTee // the engine-reported cached tokens, for the observer
	defer func() {
		dec.Instance.Release()
		if dec.Observer != nil {
			dec.Observer.Done(status, usage.cachedTokens())
		}
	}()
	resp, err := s.proxy.Transport.RoundTrip(out)
	if err != nil {
		return nil, err
	}
	status = resp.StatusCode
	rc := resp.Body
	if o := dec.Observer; o != nil {
		usage = &usageTee{rc: rc}
		if prefilled(status) {
			usage.onFirst = o.FirstByte
		}
		rc = usage
	}
	defer rc.Close()
	answer, err := io.ReadAll(io.LimitReader(rc, maxPrefillAnswer+1))
	if err != nil {
		return nil, fmt.Errorf("reading the prefill answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%w: %s", prefillStatus(resp.StatusCode), truncate(answer, 200))
	}
	if len(answer) > maxPrefillAnswer {
		return nil, errors.New("prefill answer over " + strconv.Itoa(maxPrefillAnswer) + " bytes")
	}
	return transferParams(answer)
}

// prefillStatus is a prefill answer's status other than 200.
type prefillStatus int

func (e prefillStatus) Error() string { return fmt.Sprintf("prefill answered %d", int(e)) }

// refused reports whether the status refuses the request itself, which
// any prefill instance would: 400 (vLLM's answer to a prompt over the
// model's context or a bad parameter, and to a body its validation
// refuses), 413 and 422. Any other status names the instance (401 or 403:
// behind auth; 404 or 405: the wrong path, or a model it does not serve;
// 408, 429: its load) and is tried elsewhere as a 5xx is, counted and
// warned of, so a misconfigured prefill set does not turn
// disaggregation off unseen.
func (e prefillStatus) refused() bool {
	return e == http.StatusBadRequest || e == http.StatusRequestEntityTooLarge || e == http.StatusUnprocessableEntity
}

// allFull reports whether every candidate has threshold or more requests
// in flight: what makes every strategy's pick "saturated".
func allFull(cands []*router.Instance, threshold int) bool {
	for _, c := range cands {
		if !c.Full(threshold) {
			return false
		}
	}
	return true
}

// sideURL is path on inst: where a request the router makes beside the
// client's (a prefill stage, a warm-up copy) goes.
func sideURL(inst *router.Instance, path string) string {
	u := *inst.URL()
	u.Path = strings.TrimSuffix(u.Path, "/") + path
	u.RawPath = ""
	return u.String()
}

// sideHeader is the client's headers as a request beside it carries them
// (credentials and tenant kept; hop-by-hop and length headers dropped; a
// JSON body).
func sideHeader(r *http.Request) http.Header {
	h := make(http.Header, len(r.Header))
	for k, v := range r.Header {
		switch http.CanonicalHeaderKey(k) {
		case "Content-Length", "Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Keep-Alive", "Proxy-Connection", "Accept-Encoding":
			continue
		}
		h[k] = v
	}
	h.Set("Content-Type", "application/json")
	return h
}

// promptHolder is a strategy that can tell how much of a prompt the
// candidates hold without committing a pick (kv_aware).
type promptHolder interface {
	Held(ctx context.Context, req *router.Request, cands []*router.Instance) (held, prompt int, ok bool)
}

// uncachedOnDecode is the part of the prompt the best-placed decode
// instance does not hold, from kv_aware's view without committing
// anything; known is false when the strategy cannot tell (not kv_aware,
// or the prompt's tokens are unknown).
func (s *Server) uncachedOnDecode(ctx context.Context, pool *router.Pool, strat router.Strategy, req *router.Request) (uncached int, known bool) {
	kv, ok := strat.(promptHolder)
	if !ok {
		return 0, false
	}
	var buf [32]*router.Instance
	cands, _ := pool.Candidates(buf[:0], req.Adapter, nil)
	held, prompt, ok := kv.Held(ctx, req, cands)
	if !ok {
		return 0, false
	}
	return max(prompt-held, 0), true
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
}
