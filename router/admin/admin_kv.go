package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/admin/adminapi"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/kvrouter/kvrouter/tiers"
)

// KVEvents is what the admin KV endpoints read from the events
// pipeline (router/kvstate's Pipeline implements it).
type KVEvents interface {
	// KVInstances is the pool consumer's view of its instances; false
	// when the pool has no consumer.
	KVInstances(pool string) ([]consumer.InstanceStatus, bool)
	// StreamHealthy reports whether the pool's event stream is consumed.
	StreamHealthy(pool string) bool
	// EvictionHandler serves GET /v1/kv/evictions (server-sent events).
	EvictionHandler() http.Handler
	// IsDiscovered reports an instance added to the pool from heartbeats.
	IsDiscovered(pool, instance string) bool
}

// maxLookupBody bounds a lookup request body: a million token ids as JSON
// is about 8 MiB.
const maxLookupBody = 16 << 20

// addKVAdminRoutes mounts the KV admin endpoints and the eviction stream
// wherever the admin API is served, behind the same bearer token.
func (s *api) addKVAdminRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /admin/pools/{pool}/lookup", s.auth(s.serveKVLookup))
	mux.HandleFunc("GET /admin/pools/{pool}/instances", s.auth(s.serveKVInstances))
	mux.HandleFunc("POST /admin/pools/{pool}/decide", s.auth(s.serveDecide))
	mux.HandleFunc("GET /v1/kv/evictions", s.auth(s.serveEvictions))
}

// KVLookupRequest is the body of POST /admin/pools/{pool}/lookup: token
// ids, a prompt, or chat messages (the latter two tokenized by the pool's
// token source, as /v1/completions and /v1/chat/completions requests).
type KVLookupRequest struct {
	TokenIDs []uint32 `json:"token_ids"`
	Prompt   string   `json:"prompt"`
	// Messages are OpenAI chat messages, as a chat request carries them
	// (rendered with the pool's chat template before tokenizing).
	Messages  json.RawMessage `json:"messages"`
	Adapter   string          `json:"adapter"`
	CacheSalt string          `json:"cache_salt"`
	// Model, as a chat or completions request names it: the pool's base
	// model, or an adapter it serves (then looked up as Adapter would be).
	Model string `json:"model"`
}

// The KV endpoints' answers, declared in adminapi so that clients
// (kvctl) decode the very types the server encodes.
type (
	KVLookupMatch       = adminapi.KVLookupMatch
	KVLookupResponse    = adminapi.KVLookupResponse
	KVInstanceView      = adminapi.KVInstanceView
	KVInstancesResponse = adminapi.KVInstancesResponse
)

func (s *api) kvPool(w http.ResponseWriter, r *http.Request) (*router.Pool, *kvaware.KVState) {
	p := s.poolFromPath(w, r)
	if p == nil {
		return nil, nil
	}
	if kvaware.Of(p) == nil {
		openai.WriteError(w, http.StatusConflict, fmt.Sprintf("pool %q has no KV index (events disabled, or no index section and no kv_aware pool)", p.Name()))
		return nil, nil
	}
	return p, kvaware.Of(p)
}

func (s *api) serveKVLookup(w http.ResponseWriter, r *http.Request) {
	p, kv := s.kvPool(w, r)
	if p == nil {
		return
	}
	var req KVLookupRequest
	body, ok := readBody(w, r, "lookup", maxLookupBody)
	if !ok {
		return
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		msg := "lookup: malformed JSON: " + err.Error()
		if strings.Contains(err.Error(), "unknown field") {
			msg += " (a lookup takes token_ids, prompt or messages, with model, adapter and cache_salt; POST a whole request body to /admin/pools/{pool}/decide)"
		}
		openai.WriteError(w, http.StatusBadRequest, msg)
		return
	}
	if req.Model != "" && req.Model != p.Model() {
		switch {
		case req.Adapter != "" && req.Adapter != req.Model:
			openai.WriteError(w, http.StatusBadRequest, fmt.Sprintf("lookup: model %q and adapter %q disagree", req.Model, req.Adapter))
			return
		case !p.ServesAdapter(req.Model):
			openai.WriteError(w, http.StatusNotFound, fmt.Sprintf("lookup: pool %q does not serve model %q", p.Name(), req.Model))
			return
		}
		req.Adapter = req.Model
	}
	given := 0
	for _, g := range []bool{len(req.TokenIDs) > 0, req.Prompt != "", len(req.Messages) > 0} {
		if g {
			given++
		}
	}
	if given != 1 {
		openai.WriteError(w, http.StatusBadRequest, "lookup: give exactly one of token_ids, prompt and messages")
		return
	}
	if req.Adapter != "" && !p.ServesAdapter(req.Adapter) {
		openai.WriteError(w, http.StatusNotFound, fmt.Sprintf("lookup: pool %q does not serve adapter %q", p.Name(), req.Adapter))
		return
	}
	ids := req.TokenIDs
	if len(ids) == 0 {
		var err error
		if ids, err = s.lookupTokens(r.Context(), p, kv, req); err != nil {
			status := http.StatusBadRequest
			if errors.Is(err, router.ErrNoTokens) {
				status = http.StatusConflict
			}
			openai.WriteError(w, status, "lookup: "+err.Error())
			return
		}
	}
	idx := kv.Index()
	bs := idx.BlockSize()
	if rc, _ := p.Routing(); rc.KV != nil && rc.KV.BlockSize > 0 {
		bs = rc.KV.BlockSize
	}
	out := KVLookupResponse{Pool: p.Name(), BlockSize: bs, PromptTokens: len(ids), Matches: []KVLookupMatch{}}
	if bs > 0 { // else no event has told the block size yet: nothing is held
		keys := kvindex.Keys(kvindex.Root(p.Model(), req.Adapter, req.CacheSalt), ids, bs)
		out.Blocks = len(keys)
		if len(keys) > 0 {
			ms, err := idx.Lookup(r.Context(), keys)
			if err != nil {
				openai.WriteError(w, http.StatusServiceUnavailable, "lookup: index: "+err.Error())
				return
			}
			for _, m := range ms {
				out.Matches = append(out.Matches, KVLookupMatch{
					Instance:     m.Instance,
					GPUBlocks:    m.Blocks[tiers.GPU],
					CPUBlocks:    m.Blocks[tiers.CPU] - m.Blocks[tiers.GPU],
					DiskBlocks:   m.Blocks[tiers.Disk] - m.Blocks[tiers.CPU],
					SharedBlocks: m.Blocks[tiers.Shared] - m.Blocks[tiers.Disk],
					Live:         kv.Freshness() == nil || !kv.Freshness().Stale(m.Instance),
				})
			}
		}
	}
	slices.SortFunc(out.Matches, func(a, b KVLookupMatch) int {
		if d := (b.GPUBlocks + b.CPUBlocks + b.DiskBlocks + b.SharedBlocks) - (a.GPUBlocks + a.CPUBlocks + a.DiskBlocks + a.SharedBlocks); d != 0 {
			return d
		}
		if d := b.GPUBlocks - a.GPUBlocks; d != 0 {
			return d
		}
		return strings.Compare(a.Instance, b.Instance)
	})
	writeJSON(w, out)
}

// lookupTokens tokenizes the lookup's prompt (as a /v1/completions
// request) or messages (as a /v1/chat/completions request) with the pool's
// token source, so the ids are the ones routing would compute.
func (s *api) lookupTokens(ctx context.Context, p *router.Pool, kv *kvaware.KVState, req KVLookupRequest) ([]uint32, error) {
	ts := kv.TokenSource()
	if ts == nil {
		return nil, fmt.Errorf("%w: pool %q has no tokenizer; give token_ids", router.ErrNoTokens, p.Name())
	}
	if n := len(req.Prompt) + len(req.Messages); n > config.MaxTokenizeBytes {
		return nil, fmt.Errorf("prompt of %d bytes exceeds %d", n, config.MaxTokenizeBytes)
	}
	model := p.Model()
	if req.Adapter != "" {
		model = req.Adapter
	}
	ep := router.EndpointCompletions
	var body []byte
	var err error
	if len(req.Messages) > 0 {
		ep = router.EndpointChatCompletions
		body, err = json.Marshal(struct {
			Model     string          `json:"model"`
			Messages  json.RawMessage `json:"messages"`
			CacheSalt string          `json:"cache_salt,omitempty"`
		}{model, req.Messages, req.CacheSalt})
	} else {
		body, err = json.Marshal(struct {
			Model     string `json:"model"`
			Prompt    string `json:"prompt"`
			CacheSalt string `json:"cache_salt,omitempty"`
		}{model, req.Prompt, req.CacheSalt})
	}
	if err != nil {
		return nil, err
	}
	parsed, err := router.ParseOpenAI(ep, body)
	if err != nil {
		return nil, err
	}
	rq := &router.Request{Endpoint: ep, Pool: p.Name(), Model: model, Adapter: req.Adapter, Body: body, Parsed: parsed}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	ids, err := ts.Tokens(ctx, rq)
	if err != nil {
		return nil, fmt.Errorf("tokenize prompt: %w", err)
	}
	return ids, nil
}

// instancesIndexTimeout bounds the index read of one GET
// /admin/pools/{pool}/instances, as kvindex.DefaultRedisLookupTimeout
// bounds a request's lookup: two round trips, well under a millisecond on
// a healthy Redis.
const instancesIndexTimeout = kvindex.DefaultRedisLookupTimeout

func (s *api) serveKVInstances(w http.ResponseWriter, r *http.Request) {
	p, kv := s.kvPool(w, r)
	if p == nil {
		return
	}
	// Bounded: a hung Redis (stopped, stuck in a fork) answers nothing,
	// and the view waited go-redis's read timeout times its retries while
	// /metrics answered. Past the bound the answer is partial (IndexError).
	ctx, cancel := context.WithTimeout(r.Context(), instancesIndexTimeout)
	stats, err := kv.Index().Instances(ctx)
	cancel()
	out := KVInstancesResponse{Pool: p.Name(), StreamHealthy: true, BlockSize: kv.Index().BlockSize(), Instances: []KVInstanceView{}}
	if err != nil {
		out.IndexError = fmt.Sprintf("index not read within %v: %v", instancesIndexTimeout, err)
	}
	views := map[string]*KVInstanceView{}
	view := func(id string) *KVInstanceView {
		v := views[id]
		if v == nil {
			v = &KVInstanceView{Instance: id, State: "unknown"}
			if err == nil {
				v.Blocks = map[string]int{}
				for _, t := range tiers.All {
					v.Blocks[t.String()] = 0
				}
			}
			views[id] = v
		}
		return v
	}
	for _, in := range p.Instances() {
		v := view(in.ID())
		v.InPool, v.URL, v.Healthy = true, in.URL().String(), in.Healthy()
		v.Configured = s.kve == nil || !s.kve.IsDiscovered(p.Name(), in.ID())
	}
	for _, st := range stats {
		v := view(st.Instance)
		for _, t := range tiers.All {
			v.Blocks[t.String()] = st.Blocks[t]
		}
		v.LastEvent = st.LastEvent
	}
	if src := s.kve; src != nil {
		out.StreamHealthy = src.StreamHealthy(p.Name())
		sts, _ := src.KVInstances(p.Name())
		for _, st := range sts {
			v := view(st.Instance)
			v.State = st.State.String()
			v.LastSeq, v.StreamSeq, v.Gaps, v.Clears, v.Malformed, v.Unknown = st.LastSeq, st.StreamSeq, st.Gaps, st.Clears, st.Malformed, st.Unknown
			v.Invalid, v.ReplayLost, v.NotLive, v.IndexUnsynced = st.Invalid, st.ReplayLost, st.NotLive, st.IndexUnsynced
			v.LastHeartbeat = st.LastHeartbeat
			if st.LastEvent.After(v.LastEvent) {
				v.LastEvent = st.LastEvent
			}
			if v.URL == "" && st.Heartbeat != nil {
				v.URL = st.Heartbeat.URL
			}
		}
	}
	for _, v := range views {
		out.Instances = append(out.Instances, *v)
	}
	slices.SortFunc(out.Instances, func(a, b KVInstanceView) int { return strings.Compare(a.Instance, b.Instance) })
	writeJSON(w, out)
}

func (s *api) serveEvictions(w http.ResponseWriter, r *http.Request) {
	if s.evictions == nil {
		openai.WriteError(w, http.StatusServiceUnavailable, "eviction stream: the router consumes no KV events (events disabled)")
		return
	}
	s.evictions.ServeHTTP(w, r)
}
