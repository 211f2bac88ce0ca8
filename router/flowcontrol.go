package router

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/config"
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
func (f *flowControl) item(r *http.Request, req *Request, arrived time.Time) (flowcontrol.Item, error) {
	it := flowcontrol.Item{Tenant: req.TenantKey}
	if req.Parsed != nil {
		p, ok, err := flowcontrol.PriorityJSON(req.Parsed.Priority)
		if err != nil {
			return it, badRequest("priority: want an integer")
		}
		if ok {
			it.Priority = p
		}
	}
	if h := r.Header.Get(HeaderPriority); h != "" {
		p, err := flowcontrol.ParsePriority(h)
		if err != nil {
			return it, badRequest("%s: want an integer", HeaderPriority)
		}
		it.Priority = p
	}
	obj := f.cfg.TTFTObjective
	if h := r.Header.Get(HeaderTTFTObjective); h != "" {
		d, err := flowcontrol.ParseTTFTObjective(h)
		if err != nil {
			return it, badRequest("%s: want a positive integer of milliseconds up to %d", HeaderTTFTObjective, flowcontrol.MaxTTFTObjective.Milliseconds())
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
func promptTokenEstimate(req *Request) int64 {
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

type ticketKey struct{}

// flowRoom narrows cands, in place, to the instances with room under the
// per-instance prefill budget for the request whose context carries a
// flow-control ticket (all of them when none has room, or without a
// ticket).
func flowRoom(ctx context.Context, cands []*Instance) []*Instance {
	if t, _ := ctx.Value(ticketKey{}).(*flowcontrol.Ticket); t != nil {
		return flowcontrol.FilterRoom(t, cands, (*Instance).ID)
	}
	return cands
}

// flowBind charges the request's ticket to the instance it was routed to
// (the first pick; a retry elsewhere stays charged to the first).
func flowBind(ctx context.Context, in *Instance) {
	if t, _ := ctx.Value(ticketKey{}).(*flowcontrol.Ticket); t != nil {
		t.Bind(in.ID())
	}
}

// flowFirstByte frees the pending prefill of the request whose context
// carries a flow-control ticket (called at the upstream's first byte).
func flowFirstByte(ctx context.Context) {
	if t, _ := ctx.Value(ticketKey{}).(*flowcontrol.Ticket); t != nil {
		t.FirstToken()
	}
}

// admit passes req through its pool's queue. It returns the request to
// route (carrying its ticket) and a func to call when it has been
// answered; ok is false when the request was answered here: shed (429
// with Retry-After), malformed flow-control fields (400), or its client
// left while it waited.
func (s *Server) admit(w http.ResponseWriter, r *http.Request, pool *Pool, strat Strategy, req *Request, arrived time.Time) (out *http.Request, done func(), ok bool) {
	f := pool.flow
	if f == nil {
		return r, func() {}, true
	}
	it, err := f.item(r, req, arrived)
	if err != nil {
		re := AsRequestError(err)
		s.reject(w, pool.Name(), re.Status, re.Message)
		return nil, nil, false
	}
	fm := s.m.flow
	prio := priorityLabel(it.Priority)
	tk, err := f.gate.Acquire(r.Context(), it)
	if err == nil {
		fm.admitted.WithLabelValues(pool.Name(), prio).Inc()
		fm.wait.WithLabelValues(pool.Name(), prio).Observe(tk.Waited().Seconds())
		w.Header().Set(HeaderQueuedMs, strconv.FormatInt(tk.Waited().Milliseconds(), 10))
		return r.WithContext(context.WithValue(r.Context(), ticketKey{}, tk)), tk.Done, true
	}
	var se *flowcontrol.ShedError
	if !errors.As(err, &se) {
		// The client went away while waiting: nobody to answer.
		fm.shed.WithLabelValues(pool.Name(), prio, string(flowcontrol.Canceled)).Inc()
		s.m.requests.WithLabelValues(pool.Name(), "", strat.Name(), string(flowcontrol.Canceled), "499").Inc()
		return nil, nil, false
	}
	fm.shed.WithLabelValues(pool.Name(), prio, string(se.Reason)).Inc()
	h := w.Header()
	h.Set("Retry-After", strconv.FormatInt(int64(math.Ceil(se.RetryAfter.Seconds())), 10))
	h.Set(HeaderStrategy, strat.Name())
	h.Set(HeaderReason, string(se.Reason))
	h.Set(HeaderQueuedMs, strconv.FormatInt(se.Waited.Milliseconds(), 10))
	openai.WriteError(w, http.StatusTooManyRequests, fmt.Sprintf("pool %q is overloaded: request shed (%s)", pool.Name(), se.Reason))
	s.m.requests.WithLabelValues(pool.Name(), "", strat.Name(), string(se.Reason), "429").Inc()
	return nil, nil, false
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

// QueueStatus is GET /admin/pools/{pool}/queue: whether flow control is on
// and, when it is, the queue's state.
type QueueStatus struct {
	Pool    string                    `json:"pool"`
	Enabled bool                      `json:"enabled"`
	Config  *config.FlowControlConfig `json:"config,omitempty"`
	Queue   *flowcontrol.Stats        `json:"queue,omitempty"`
}

// QueueStatus reports the pool's flow-control queue.
func (p *Pool) QueueStatus() QueueStatus {
	qs := QueueStatus{Pool: p.Name()}
	if f := p.flow; f != nil {
		st := f.gate.Stats()
		cfg := f.cfg
		qs.Enabled, qs.Config, qs.Queue = true, &cfg, &st
	}
	return qs
}
