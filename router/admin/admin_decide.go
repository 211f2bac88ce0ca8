package admin

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin/adminapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/kvrouter/kvrouter/tiers"
)

// The decide endpoint's answer types, declared in adminapi (kvctl decodes
// them).
type (
	DecidePick     = adminapi.DecidePick
	DecideResponse = adminapi.DecideResponse
)

// serveDecide answers POST /admin/pools/{pool}/decide: the body is a
// request as a client would send it to /v1/chat/completions (when it has
// "messages") or /v1/completions, resolved as the data plane resolves it
// (limits, tenant header or prompt_cache_key, cache salt), and the answer
// is where kv_aware would send it now and where prefix_aware's hash would,
// each with kv_aware's prediction there (kvaware.Preview: dry, nothing
// committed). The pool must score with kv_aware: route with it, or shadow
// it.
func (s *api) serveDecide(w http.ResponseWriter, r *http.Request) {
	p, _ := s.kvPool(w, r)
	if p == nil {
		return
	}
	body, ok := readBody(w, r, "decide", maxLookupBody)
	if !ok {
		return
	}
	// A chat request is one with messages; anything else, malformed JSON
	// included, is parsed as a completion by Resolve (which says what is
	// wrong with it).
	ep, epName := router.EndpointCompletions, "completions"
	if openai.TopLevelRaw(body, "messages") != nil {
		ep, epName = router.EndpointChatCompletions, "chat"
	}
	req, pool, err := s.srv.Resolve(router.Inbound{Endpoint: ep, Body: body, PoolName: p.Name(), PoolHeader: "pool",
		Tenant: r.Header.Values(router.TenantHeader), Forwards: true})
	if err != nil {
		re := router.AsRequestError(err)
		openai.WriteError(w, re.Status, "decide: "+re.Message)
		return
	}
	rc, strat := pool.Routing()
	cands, _ := pool.Candidates(nil, req.Adapter, nil)
	if len(cands) == 0 {
		openai.WriteError(w, http.StatusServiceUnavailable, fmt.Sprintf("decide: pool %q has no healthy instance for the request", pool.Name()))
		return
	}
	req.Warmable = req.ProxyCanWarm() // decide as the data plane would
	kv, hash, err := kvaware.Preview(r.Context(), strat, req, cands)
	switch {
	case errors.Is(err, kvaware.ErrNoPreview):
		openai.WriteError(w, http.StatusConflict, fmt.Sprintf("decide: pool %q routes with %s and does not shadow it with kv_aware (routing.shadow: true does)", pool.Name(), rc.Strategy))
		return
	case err != nil:
		openai.WriteError(w, http.StatusServiceUnavailable, "decide: "+err.Error())
		return
	}
	writeJSON(w, DecideResponse{Pool: pool.Name(), Endpoint: epName, Strategy: strat.Name(),
		KVAware: decidePick(kv), PrefixAware: decidePick(hash)})
}

// decidePick is a decision as the decide endpoint shows it.
func decidePick(d router.Decision) DecidePick {
	out := DecidePick{Reason: string(d.Reason)}
	if d.Instance != nil {
		out.Instance = d.Instance.ID()
	}
	if e := d.Explain; e != nil {
		ms := float64(e.PredictedTTFT) / float64(time.Millisecond)
		out.PromptTokens, out.PredictedTTFTMs = e.PromptTokens, &ms
		out.GPUTokens, out.CPUTokens = e.MatchedTokens[tiers.GPU], e.MatchedTokens[tiers.CPU]
		out.DiskTokens, out.SharedTokens = e.MatchedTokens[tiers.Disk], e.MatchedTokens[tiers.Shared]
	}
	return out
}
