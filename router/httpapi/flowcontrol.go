package httpapi

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/openai"
)

// Flow-control request and response headers.
const (
	// HeaderPriority sets the request's priority (an integer, lower is
	// more urgent, default 0); it overrides the OpenAI body's "priority".
	HeaderPriority = "X-Kvrouter-Priority"
	// HeaderTTFTObjective sets the request's TTFT objective in
	// milliseconds (overrides flow_control.ttft_objective).
	HeaderTTFTObjective = "X-Kvrouter-Ttft-Objective-Ms"
	// HeaderQueuedMs is the time the request waited in the pool's queue.
	HeaderQueuedMs = "X-Kvrouter-Queued-Ms"
)

// charsPerToken estimates prompt tokens from characters where the router
// has no token ids before admission: about four characters of English
// text per token for BPE vocabularies (OpenAI's rule of thumb,
// https://help.openai.com/en/articles/4936856). Fair queuing needs the
// proportions between tenants, which the rule keeps.
const charsPerToken = 4

// item describes req to the queue: tenant, priority (header, else body),
// deadline (header, else the pool's objective) and cost in tokens (prompt
// plus the output bound it asks for).
// Its errors are the message of a 400.
func queueItem(r *http.Request, req *router.Request, fc *config.FlowControlConfig, arrived time.Time) (flowcontrol.Item, error) {
	it := flowcontrol.Item{Tenant: req.TenantKey}
	if req.Parsed != nil {
		p, ok, err := flowcontrol.PriorityJSON(req.Parsed.Priority)
		if err != nil {
			return it, errors.New("priority: want an integer")
		}
		if ok {
			it.Priority = p
		}
	}
	if h := r.Header.Get(HeaderPriority); h != "" {
		p, err := flowcontrol.ParsePriority(h)
		if err != nil {
			return it, fmt.Errorf("%s: want an integer", HeaderPriority)
		}
		it.Priority = p
	}
	obj := fc.TTFTObjective
	if h := r.Header.Get(HeaderTTFTObjective); h != "" {
		d, err := flowcontrol.ParseTTFTObjective(h)
		if err != nil {
			return it, fmt.Errorf("%s: want a positive integer of milliseconds up to %d", HeaderTTFTObjective, flowcontrol.MaxTTFTObjective.Milliseconds())
		}
		obj = d
	}
	if obj > 0 {
		it.Deadline = arrived.Add(obj)
	}
	it.Prefill = promptTokenEstimate(req)
	it.Cost = it.Prefill + outputBound(req.Parsed)
	return it, nil
}

// promptTokenEstimate is the prompt's length in tokens: exact when the
// request carries token ids, else its characters over charsPerToken.
func promptTokenEstimate(req *router.Request) int64 {
	if req.PromptTokens != nil {
		return int64(len(req.PromptTokens))
	}
	n := 0
	if p := req.Parsed; p != nil {
		for _, m := range p.Messages {
			for _, part := range m.Content.Parts {
				n += len(part)
			}
		}
		if p.Prompt != nil {
			for _, t := range p.Prompt.Texts {
				n += len(t)
			}
			for _, ids := range p.Prompt.Tokens {
				n += charsPerToken * len(ids)
			}
		}
	} else {
		n = len(req.Body)
	}
	return int64(n / charsPerToken)
}

// outputBound is the output tokens the request may generate, as it states
// them (max_completion_tokens, else max_tokens); 0 when unstated or not a
// positive integer (the engine answers a bad value).
func outputBound(p *openai.Request) int64 {
	if p == nil {
		return 0
	}
	for _, raw := range [][]byte{p.MaxCompletionTokens, p.MaxTokens} {
		if n, err := strconv.ParseInt(string(raw), 10, 64); err == nil && n > 0 {
			return min(n, math.MaxInt32)
		}
	}
	return 0
}

// admit passes req through its pool's queue (gate, configured by fc). It
// returns the request's ticket, whose Done the caller calls when the
// request has been answered; ok is false when the request was answered
// here: shed (429 with Retry-After), malformed flow-control fields (400),
// or its client left while it waited.
func (s *Server) admit(w http.ResponseWriter, r *http.Request, pool *router.Pool, gate *flowcontrol.Gate, fc *config.FlowControlConfig, strat router.Strategy, req *router.Request, arrived time.Time) (tk *flowcontrol.Ticket, ok bool) {
	it, err := queueItem(r, req, fc, arrived)
	if err != nil {
		s.reject(w, pool.Name(), http.StatusBadRequest, err.Error())
		return nil, false
	}
	it.Eligible = pool.Eligible(req.Adapter) // room counts only where it may go
	if holds, prompt, ok := cachedHolds(r.Context(), pool, strat, req); ok {
		out := it.Cost - it.Prefill
		it.Prefill, it.Cached = int64(prompt), holds
		it.Cost = it.Prefill + out
	}
	fm := s.m.flow
	prio := priorityLabel(it.Priority)
	tk, err = gate.Acquire(r.Context(), it)
	if err == nil {
		fm.admitted.WithLabelValues(pool.Name(), prio).Inc()
		fm.wait.WithLabelValues(pool.Name(), prio).Observe(tk.Waited().Seconds())
		w.Header().Set(HeaderQueuedMs, strconv.FormatInt(tk.Waited().Milliseconds(), 10))
		return tk, true
	}
	var se *flowcontrol.ShedError
	if !errors.As(err, &se) {
		// The client went away while waiting: nobody to answer.
		fm.shed.WithLabelValues(pool.Name(), prio, string(flowcontrol.Canceled)).Inc()
		s.m.requests.WithLabelValues(pool.Name(), "", strat.Name(), string(flowcontrol.Canceled), "499").Inc()
		return nil, false
	}
	fm.shed.WithLabelValues(pool.Name(), prio, string(se.Reason)).Inc()
	h := w.Header()
	h.Set("Retry-After", strconv.FormatInt(int64(math.Ceil(se.RetryAfter.Seconds())), 10))
	h.Set(router.HeaderStrategy, strat.Name())
	h.Set(router.HeaderReason, string(se.Reason))
	h.Set(HeaderQueuedMs, strconv.FormatInt(se.Waited.Milliseconds(), 10))
	openai.WriteError(w, http.StatusTooManyRequests, fmt.Sprintf("pool %q is overloaded: request shed (%s)", pool.Name(), se.Reason))
	s.m.requests.WithLabelValues(pool.Name(), "", strat.Name(), string(se.Reason), "429").Inc()
	return nil, false
}

// priorityLabel bounds the priority label's values: vLLM priorities are
// any int64, metrics series must not be.
func priorityLabel(p int64) string {
	switch {
	case p < -10:
		return "<-10"
	case p > 10:
		return ">10"
	}
	return strconv.FormatInt(p, 10)
}

// cacheHolder is a strategy that can tell how much of a prompt each
// candidate holds without committing a pick (kv_aware).
type cacheHolder interface {
	HeldBy(ctx context.Context, req *router.Request, cands []*router.Instance, dst []int) (per []int, prompt int, ok bool)
}

// cachedHolds is, for the queue (flowcontrol.Item.Cached), how many of
// req's prompt tokens each of the pool's candidates holds, and the
// prompt's length in tokens; ok is false when the strategy cannot tell.
// It runs before the request is offered, outside the queue's lock: with
// a shared index the lookup is a round trip. The pick that follows
// admission reuses the prompt's token ids and block keys
// (router.Request.ShareKeys) and looks the index up again, fresh.
func cachedHolds(ctx context.Context, pool *router.Pool, strat router.Strategy, req *router.Request) (holds []flowcontrol.Hold, prompt int, ok bool) {
	kv, isKV := strat.(cacheHolder)
	if !isKV {
		return nil, 0, false
	}
	var buf [32]*router.Instance
	cands, _ := pool.Candidates(buf[:0], req.Adapter, nil)
	req.ShareKeys = true
	var hb [32]int
	per, prompt, ok := kv.HeldBy(ctx, req, cands, hb[:0])
	if !ok || prompt <= 0 {
		return nil, 0, false
	}
	for i, h := range per {
		if h > 0 {
			holds = append(holds, flowcontrol.Hold{Instance: cands[i].ID(), Tokens: int64(h)})
		}
	}
	return holds, prompt, true
}
