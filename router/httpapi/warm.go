package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/openai"
)

// warmTimeout bounds a warm-up copy: a prefill of the longest prompt an
// engine takes (131,072 tokens at a few thousand tokens a second) with
// room for a queue; past it the copy is given up and its pending prefill
// released.
const warmTimeout = 2 * time.Minute

// warmAnswerLimit is how much of a warm-up's answer is read (one token's
// completion and its usage): the rest is discarded.
const warmAnswerLimit = 64 << 10

// warmBody is the request's body as a warm-up copy: the same prompt
// (messages and template options, cache salt, adapter) for one output
// token, not streamed, one choice. A minimum above one token would be
// refused (vLLM checks min_tokens <= max_tokens); for chat,
// max_completion_tokens wins over max_tokens, so both are set.
func warmBody(req *router.Request) ([]byte, error) {
	one := json.RawMessage("1")
	set := []openai.Member{
		{Key: "max_tokens", Value: one},
		{Key: "stream", Value: json.RawMessage("false")},
		{Key: "stream_options"}, {Key: "n"}, {Key: "best_of"}, {Key: "min_tokens"},
		{Key: "logprobs"}, {Key: "top_logprobs"}, {Key: "prompt_logprobs"}, {Key: "kv_transfer_params"},
	}
	if req.Endpoint == router.EndpointChatCompletions {
		set = append(set, openai.Member{Key: "max_completion_tokens", Value: one})
	}
	return openai.SetMembers(req.Body, set...)
}

// completionsPath is the engine's OpenAI completions endpoint, where a
// warm-up copy of a prefix goes as token ids (warmPrefixBody).
const completionsPath = "/v1/completions"

// warmPrefix is a warm-up copy of a prompt's first tokens: a completion of
// token ids for one output token. vLLM takes an id array as the prompt
// itself (no template, no special tokens added) and hashes its blocks
// from the ids, the adapter (the model name) and cache_salt, as it hashes
// the request's own: the copy's blocks are the request's leading ones.
type warmPrefix struct {
	Model     string   `json:"model"`
	Prompt    []uint32 `json:"prompt"`
	MaxTokens int      `json:"max_tokens"`
	Stream    bool     `json:"stream"`
	CacheSalt string   `json:"cache_salt,omitempty"`
	// Priority is the client's (vLLM's priority scheduling): the copy
	// waits in the engine's queue as the request it was bought for would,
	// not ahead of more urgent ones nor behind everything.
	Priority json.RawMessage `json:"priority,omitempty"`
}

// warmRequest is the body and path of w's copy of req: a completion of
// the first w.Tokens token ids when w names a prefix and the request's ids
// are known (the ids the decision keyed: their leading blocks are the ones
// the engine's events named), else the client's request rewritten to one
// output token (warmBody), on the client's path. A request with media
// (an image, audio) goes as itself too: vLLM hashes the blocks its
// placeholder tokens fill from the media as well, which bare ids lack.
func warmRequest(ctx context.Context, req *router.Request, path string, w *router.Warm) ([]byte, string, error) {
	if w.Tokens > 0 && req.Model != "" && !req.WarmsWhole() {
		if ids, err := req.TokenIDs(ctx); err == nil && len(ids) >= w.Tokens {
			prio := openai.TopLevelRaw(req.Body, "priority")
			if string(prio) == "null" {
				prio = nil
			}
			body, err := json.Marshal(warmPrefix{Model: req.Model, Prompt: ids[:w.Tokens], MaxTokens: 1, CacheSalt: req.CacheSalt(), Priority: prio})
			return body, completionsPath, err
		}
	}
	body, err := warmBody(req)
	return body, path, err
}

// sendWarm sends w, a warm-up copy a decision asked for (router.Warm), to
// its instance in the background: the prefix it names as token ids, or
// the request's prompt, for one output token (warmRequest), with the
// client's headers as the proxy forwards them. It outlives
// the client's request (the copy serves later requests) but not
// warmTimeout. Its observer ends whatever happens, so the pending prefill
// the strategy counted there is always released; the instance counts it
// in flight meanwhile, and so does the pool's flow-control queue through
// tk (Ticket.Companion; nil without a queue): its prefill until the first
// byte, its place until it ends.
func (s *Server) sendWarm(r *http.Request, pool *router.Pool, req *router.Request, path string, w *router.Warm, tk *flowcontrol.Ticket) {
	body, path, err := warmRequest(r.Context(), req, path, w)
	if err != nil {
		s.m.warms.WithLabelValues(pool.Name(), w.Instance.ID(), "body").Inc()
		if tk != nil {
			tk.Done()
		}
		if w.Observer != nil {
			w.Observer.Done(0, -1)
		}
		return
	}
	target, hdr := sideURL(w.Instance, path), sideHeader(r)
	w.Instance.Acquire()
	go func() {
		status, cached := 0, -1
		defer func() {
			w.Instance.Release()
			if tk != nil {
				tk.Done()
			}
			if w.Observer != nil {
				w.Observer.Done(status, cached)
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), warmTimeout)
		defer cancel()
		out, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(body))
		if err != nil {
			s.m.warms.WithLabelValues(pool.Name(), w.Instance.ID(), "error").Inc()
			return
		}
		out.Header = hdr
		resp, err := s.proxy.Transport.RoundTrip(out)
		if err != nil {
			s.m.warms.WithLabelValues(pool.Name(), w.Instance.ID(), "error").Inc()
			s.log.Debug("warm-up copy failed", "pool", pool.Name(), "instance", w.Instance.ID(), "err", err)
			return
		}
		status = resp.StatusCode
		rc := io.ReadCloser(resp.Body)
		var usage *usageTee
		if w.Observer != nil || tk != nil {
			usage = &usageTee{rc: rc, onFirst: func() {
				if !prefilled(status) {
					return // a refusal's first byte is no prefill (prefilled)
				}
				if w.Observer != nil {
					w.Observer.FirstByte()
				}
				if tk != nil {
					tk.FirstToken()
				}
			}}
			rc = usage
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(rc, warmAnswerLimit))
		_ = rc.Close()
		cached = usage.cachedTokens()
		outcome := "ok"
		if status != http.StatusOK {
			outcome = "status"
			s.log.Debug("warm-up copy refused", "pool", pool.Name(), "instance", w.Instance.ID(), "status", status)
		}
		s.m.warms.WithLabelValues(pool.Name(), w.Instance.ID(), outcome).Inc()
	}()
}
