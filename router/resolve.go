package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/openai"
)

// RequestError is a request refused before routing. Status is the HTTP
// status the HTTP data plane and Envoy's ext_proc answer with (gRPC edges
// map it to a code); Message is the client-facing text. It is the one
// error class every edge shares, so none has to read meaning out of error
// strings.
type RequestError struct {
	Status  int
	Message string
	// Pool is the pool the request was resolved to before it was refused
	// ("" when it never got that far), for metrics.
	Pool string
}

func (e *RequestError) Error() string { return e.Message }

// Is makes a 400 RequestError match ErrBadRequest.
func (e *RequestError) Is(target error) bool {
	return target == ErrBadRequest && e.Status == http.StatusBadRequest
}

func badRequest(format string, a ...any) *RequestError {
	return &RequestError{Status: http.StatusBadRequest, Message: fmt.Sprintf(format, a...)}
}

func notFound(pool, format string, a ...any) *RequestError {
	return &RequestError{Status: http.StatusNotFound, Message: fmt.Sprintf(format, a...), Pool: pool}
}

// AsRequestError returns err as a *RequestError, or one with status 500
// and err's text when it is something else.
func AsRequestError(err error) *RequestError {
	var re *RequestError
	if errors.As(err, &re) {
		return re
	}
	return &RequestError{Status: http.StatusInternalServerError, Message: err.Error()}
}

// The pool table: what Resolve reads and a reload replaces. The edge that
// owns the table (router/httpapi's Server) publishes one at a time
// (atomically); every edge resolves against the table it loaded, so a
// request never sees two configurations.

// Table is one loaded configuration: immutable once built, replaced whole
// on reload.
type Table struct {
	cfg         config.Config
	pools       []*Pool
	byName      map[string]*Pool
	byModel     map[string]*Pool
	defaultPool *Pool
	retryStatus map[int]bool
}

// NewTable builds the table of cfg (validated by the caller; its defaults
// are applied here too, as the request path reads the limits as they are),
// keeping what prev's pools of the same name hold (instances'
// in-flight counts and health, exact-routing state through kvFor) across
// a reload. prev may be nil.
//
// Building changes nothing the running table reads: commit does what the
// new pools must change in the state they keep from prev's (NewPool), and
// is called once the table is published. A build that fails, at any pool,
// returns no commit and leaves prev serving as it was.
func NewTable(cfg config.Config, prev *Table, kvFor func(pc config.PoolConfig, prev *Pool) (Exact, error)) (t *Table, commit func(), err error) {
	cfg = cfg.WithDefaults() // idempotent: a caller's defaults stay
	t = &Table{cfg: cfg, byName: map[string]*Pool{}, byModel: map[string]*Pool{}, retryStatus: map[int]bool{}}
	for _, c := range cfg.Proxy.RetryStatuses {
		if c != 0 {
			t.retryStatus[c] = true
		}
	}
	for _, pc := range cfg.Pools {
		var old *Pool
		if prev != nil {
			old = prev.byName[pc.Name]
		}
		kv, err := kvFor(pc, old)
		if err != nil {
			return nil, nil, err
		}
		p, err := NewPool(pc, old, WithPoolKVState(kv))
		if err != nil {
			return nil, nil, err
		}
		t.pools = append(t.pools, p)
		t.byName[p.Name()] = p
		t.byModel[p.Model()] = p
	}
	if cfg.DefaultPool != "" {
		t.defaultPool = t.byName[cfg.DefaultPool]
	}
	return t, func() {
		for _, p := range t.pools {
			p.commit()
		}
	}, nil
}

// Config is the configuration the table was built from. Callers must not
// modify it.
func (t *Table) Config() *config.Config { return &t.cfg }

// Pools lists the table's pools in configuration order. Callers must not
// modify the slice.
func (t *Table) Pools() []*Pool { return t.pools }

// Pool returns the named pool.
func (t *Table) Pool(name string) (*Pool, bool) {
	p, ok := t.byName[name]
	return p, ok
}

// RetryStatus reports whether an upstream answering status is retried on
// the next candidate (proxy.retry_statuses).
func (t *Table) RetryStatus(status int) bool { return t.retryStatus[status] }

// Inbound is a request as an edge received it, before routing: the HTTP
// data plane, Envoy's ext_proc and gRPC Router.Pick each fill one and call
// Server.Resolve, so that all three turn the same request into the same
// Request (pool, adapter, tenant, cache salt, routing text, limits) or the
// same RequestError.
type Inbound struct {
	Endpoint Endpoint
	// Body is the request body as received. For gRPC Pick it is the body
	// an equivalent /v1/completions request would carry.
	Body []byte
	// Parsed, when set, is Body already parsed (gRPC Pick builds it from
	// its fields); otherwise OpenAI bodies are parsed here.
	Parsed *openai.Request
	// PoolHeader names the header or field that chose PoolName, for error
	// messages ("X-Kvrouter-Pool").
	PoolHeader string
	// PoolName is a pool the edge names explicitly; "" resolves the pool
	// from the model (OpenAI endpoints) or takes the default pool.
	PoolName string
	// Adapter is an adapter named outside the body (the raw-invoke
	// adapter header, gRPC's adapter field).
	Adapter string
	// Tenant holds the values of the tenant header (TenantHeader) as
	// received; nil when absent (OpenAI requests then use prompt_cache_key).
	Tenant []string
	// Forwards says the edge forwards Body, or has it forwarded (HTTP;
	// Envoy's ext_proc, as a body mutation when Request.Body is not Body
	// itself), so Resolve writes the body forwarded: the pool's cache_salt
	// injected, a client's kv_transfer_params removed
	// (stripTransferParams), and kv_aware keys blocks by that body's salt.
	// gRPC Pick forwards nothing: it keys blocks by the salt the body
	// carries.
	Forwards bool
}

// Resolve turns an inbound request into the Request strategies route and
// the pool that serves it, applying the limits, the tenant key, the pool's
// cache salt and the removal of kv_transfer_params in one place; refusals
// are *RequestError.
func (st *Table) Resolve(in Inbound) (*Request, *Pool, error) {
	tenant := ""
	if len(in.Tenant) > 0 {
		if len(in.Tenant) > 1 || !ValidTenantKey(in.Tenant[0]) {
			return nil, nil, badRequest("%s: want one value of 1-64 printable ASCII characters", TenantHeader)
		}
		tenant = in.Tenant[0]
	}
	var named *Pool
	if in.PoolName != "" {
		if named = st.byName[in.PoolName]; named == nil {
			h := in.PoolHeader
			if h == "" {
				h = "pool"
			}
			return nil, nil, notFound("", "%s: no pool %q", h, in.PoolName)
		}
	}
	var req *Request
	var pool *Pool
	var err error
	if in.Endpoint.OpenAI() {
		req, pool, err = st.resolveOpenAI(in, named, tenant)
	} else {
		req, pool, err = st.resolveInvoke(in, named, tenant)
	}
	if err != nil {
		return nil, nil, err
	}
	if in.Forwards {
		if err := st.forwardedBody(req, pool); err != nil {
			re := AsRequestError(err)
			re.Pool = pool.Name()
			return nil, nil, re
		}
	}
	limitTokenize(st.cfg.Limits, req)
	return req, pool, nil
}

// forwardedBody writes the body an edge forwards for req: the pool's
// cache_salt, after the routing text (the salt changes the body, not the
// route; it is kept on the request so kv_aware folds it into its block
// keys without scanning the body again), and no kv_transfer_params from
// the client unless the pool passes them on. The salt is the request's
// tenant key's: the tenant header's, else an OpenAI body's
// prompt_cache_key (resolveOpenAI).
func (st *Table) forwardedBody(req *Request, pool *Pool) error {
	var err error
	if c := pool.cfg.CacheSalt; c != nil && c.Enabled {
		if req.Body, req.InjectedCacheSalt, err = saltRequestBody(c, st.cfg.CacheSaltSecret, req.TenantKey, req.Body); err != nil {
			return err
		}
	}
	if !pool.cfg.PassKVTransferParams {
		return stripTransferParams(req)
	}
	return nil
}

// stripTransferParams removes the kv_transfer_params a client sent from
// the body the edge forwards: they tell an engine's KV connector where to
// pull a prompt's KV from (a host the client would choose) or to hold its
// blocks for a remote decode, which only the router, running the prefill
// stage itself, may ask. A raw invocation body that may hold the member
// must therefore be one strict JSON object (NotJSONObject otherwise): the
// engine's parser takes bodies the router's does not (NaN, a BOM, UTF-16),
// and one of those forwarded unread would keep it.
func stripTransferParams(req *Request) error {
	if err := stripTopTransferParams(req); err != nil {
		return err
	}
	return stripXargsTransferParams(req)
}

// stripTopTransferParams removes the top-level kv_transfer_params.
func stripTopTransferParams(req *Request) error {
	if p := req.Parsed; p != nil {
		if p.KVTransferParams == nil {
			return nil
		}
		p.KVTransferParams = nil // Parsed describes the body forwarded
	} else if !mayHoldKey(req.Body, "kv_transfer_params") {
		return nil
	} else if v, err := openai.TopLevel(req.Body, "kv_transfer_params"); err != nil {
		return NotJSONObject(err)
	} else if v == nil {
		return nil
	}
	out, err := openai.SetMembers(req.Body, openai.Member{Key: "kv_transfer_params"})
	if err != nil {
		return NotJSONObject(err)
	}
	req.Body = out
	return nil
}

// stripXargsTransferParams removes kv_transfer_params from the body's
// vllm_xargs. vLLM copies vllm_xargs into SamplingParams.extra_args and
// sets extra_args["kv_transfer_params"] over it only from a top-level
// member (vllm/entrypoints/openai protocol.py, to_sampling_params); the
// engine's request reads its kv_transfer_params from there
// (vllm/v1/request.py, Request.__init__). With the top-level member gone,
// a client's vllm_xargs.kv_transfer_params (a string, number or list:
// vllm_xargs's value types) would reach the KV connector, which takes it
// for a dict. Every copy of vllm_xargs is rewritten as the last one (the
// one json.loads keeps) without the key. A body that reaches here holding
// the key's bytes is strict JSON (stripTopTransferParams read it, or
// Parse did).
func stripXargsTransferParams(req *Request) error {
	var x json.RawMessage
	if p := req.Parsed; p != nil {
		x = p.VLLMXargs // the last copy, as TopLevel's
	} else if !mayHoldKey(req.Body, "kv_transfer_params") {
		return nil
	} else if v, err := openai.TopLevel(req.Body, "vllm_xargs"); err != nil {
		return NotJSONObject(err)
	} else {
		x = v
	}
	if x == nil || !mayHoldKey(x, "kv_transfer_params") {
		return nil
	}
	if v, err := openai.TopLevel(x, "kv_transfer_params"); err != nil || v == nil {
		return nil // not an object (vLLM refuses it), or without the key
	}
	nx, err := openai.SetMembers(x, openai.Member{Key: "kv_transfer_params"})
	if err != nil {
		return NotJSONObject(err)
	}
	out, err := openai.SetMembers(req.Body, openai.Member{Key: "vllm_xargs", Value: nx})
	if err != nil {
		return NotJSONObject(err)
	}
	req.Body = out
	return nil
}

// mayHoldKey reports whether body may hold an object member key (ASCII)
// for vLLM's reader, Python's json.loads, whatever else the body holds.
// That reader takes a body as UTF-16 or UTF-32 only when one of its first
// four bytes is NUL or it opens with their byte-order mark (0xFE or 0xFF
// first), else as UTF-8 (a UTF-8 BOM dropped); in UTF-8 a key is its bytes,
// or spelled with \u escapes. A body with none of these cannot name key: it
// is forwarded as it came, JSON or not, at the cost of three byte searches
// rather than a parse.
func mayHoldKey(body []byte, key string) bool {
	return bytes.Contains(body, []byte(key)) || bytes.Contains(body, []byte(`\u`)) ||
		bytes.IndexByte(body[:min(len(body), 4)], 0) >= 0 || len(body) > 0 && body[0] >= 0xFE
}

func (st *Table) resolveOpenAI(in Inbound, named *Pool, tenant string) (*Request, *Pool, error) {
	parsed := in.Parsed
	if parsed == nil {
		var err error
		if parsed, err = parseOpenAI(in.Endpoint, in.Body, st.cfg.Limits); err != nil {
			return nil, nil, err
		}
	} else if msg := checkOpenAILimits(st.cfg.Limits, parsed); msg != "" {
		return nil, nil, badRequest("%s", msg)
	}
	if in.Tenant == nil {
		tenant = parsed.PromptCacheKey
	}
	pool, adapter := named, ""
	switch {
	case named != nil:
		// The named pool serves the model as its base model, or as one of
		// its adapters, or not at all.
		if parsed.Model != "" && parsed.Model != named.Model() {
			adapter = parsed.Model
			if !named.ServesAdapter(adapter) && named.cfg.AdapterFallback != "all" {
				return nil, nil, notFound(named.Name(), "the model %q does not exist in pool %q", adapter, named.Name())
			}
		}
	case parsed.Model == "" && st.defaultPool != nil:
		pool = st.defaultPool
	case parsed.Model == "":
		return nil, nil, badRequest("model: required (or set default_pool)")
	default:
		if pool = st.byModel[parsed.Model]; pool == nil {
			for _, p := range st.pools {
				if p.ServesAdapter(parsed.Model) {
					pool, adapter = p, parsed.Model
					break
				}
			}
		}
		if pool == nil {
			return nil, nil, notFound("", "the model %q does not exist", parsed.Model)
		}
	}
	if in.Adapter != "" && in.Adapter != adapter {
		if err := checkAdapter(pool, in.Adapter); err != nil {
			return nil, nil, err
		}
		adapter = in.Adapter
	}
	rc, _ := pool.Routing()
	model := parsed.Model
	if model == "" {
		model = pool.Model()
	}
	if adapter != "" {
		model = adapter
	}
	keep, terr := PromptTruncationSide(parsed.TruncatePromptTokens, parsed.TruncationSide)
	req := &Request{
		Endpoint:     in.Endpoint,
		Pool:         pool.Name(),
		Model:        model,
		Adapter:      adapter,
		RoutingText:  openai.RoutingTextKeep(parsed, rc.PrefixLength, keep),
		TenantKey:    tenant,
		Body:         in.Body,
		Parsed:       parsed,
		PromptTokens: KeepLast(openai.FirstTokens(parsed.Prompt), keep),
		Stream:       parsed.Stream,
	}
	if terr != nil {
		// The engine prefills a part of the prompt the router cannot
		// tell: no token ids, so kv_aware routes heuristically, and says
		// why (a token source error).
		req.PromptTokens, req.Tokenizer = nil, tokenError{fmt.Errorf("%w: %w", ErrTokenSource, terr)}
	}
	return req, pool, nil
}

func (st *Table) resolveInvoke(in Inbound, named *Pool, tenant string) (*Request, *Pool, error) {
	pool := named
	switch {
	case pool != nil:
	case st.defaultPool != nil:
		pool = st.defaultPool
	case len(st.pools) > 0:
		pool = st.pools[0]
	default:
		return nil, nil, notFound("", "the router has no pools")
	}
	if err := checkAdapter(pool, in.Adapter); err != nil {
		return nil, nil, err
	}
	rc, _ := pool.Routing()
	req := &Request{
		Endpoint:    in.Endpoint,
		Pool:        pool.Name(),
		Model:       pool.Model(),
		Adapter:     in.Adapter,
		RoutingText: RawRoutingText(in.Body, rc.PrefixLength, pool.cfg.CanonicalizeJSON),
		TenantKey:   tenant,
		Body:        in.Body,
		Stream:      in.Endpoint == EndpointInvokeStream,
	}
	if in.Adapter != "" {
		req.Model = in.Adapter
	}
	return req, pool, nil
}

// checkAdapter refuses an adapter the pool does not serve, unless its
// adapter_fallback sends such requests to any instance.
func checkAdapter(p *Pool, adapter string) error {
	if adapter != "" && !p.ServesAdapter(adapter) && p.cfg.AdapterFallback != "all" {
		return notFound(p.Name(), "the adapter %q does not exist in pool %q", adapter, p.Name())
	}
	return nil
}

// CompletionsInbound is the Inbound of a /v1/completions request whose
// prompt is text or token ids, built without encoding the ids (a 2k-token
// prompt costs 2,000 allocations that way): the body carries what engines
// and strategies read of it — the model, a text prompt, the cache salt.
// gRPC Router.Pick and Index.Lookup use it so their picks match HTTP's.
func CompletionsInbound(pool, model, adapter, prompt string, ids []uint32, tenant, salt string) (Inbound, error) {
	if (prompt == "") == (len(ids) == 0) {
		return Inbound{}, badRequest("prompt or token_ids: give exactly one")
	}
	if adapter != "" && model == "" && pool == "" {
		model = adapter // the pool is the one serving the adapter
	}
	parsed := &openai.Request{Model: model, Prompt: &openai.Prompt{}}
	body := struct {
		Model     string `json:"model,omitempty"`
		Prompt    string `json:"prompt,omitempty"`
		CacheSalt string `json:"cache_salt,omitempty"`
	}{Model: model, CacheSalt: salt}
	if len(ids) > 0 {
		parsed.Prompt.Tokens = [][]uint32{ids}
	} else {
		parsed.Prompt.Texts = []string{prompt}
		body.Prompt = prompt
	}
	raw, err := json.Marshal(body)
	if err != nil {
		return Inbound{}, badRequest("model: %v", err)
	}
	in := Inbound{Endpoint: EndpointCompletions, Body: raw, Parsed: parsed, PoolName: pool, PoolHeader: "pool", Adapter: adapter}
	if tenant != "" {
		in.Tenant = []string{tenant}
	}
	return in, nil
}

// ErrBadRequest matches every request-parsing error (a *RequestError with
// status 400); the HTTP edge answers 400.
var ErrBadRequest = errors.New("router: bad request")

// TenantHeader carries the tenant key on the raw invoke path (SageMaker's
// name, so clients written for PREFIX_AWARE routing work unchanged).
const TenantHeader = "X-Amzn-SageMaker-Prefix-Aware-Id"

// Request headers of the raw invoke path (HTTP and Envoy's ext_proc).
const (
	// HeaderPool selects the pool (else default_pool).
	HeaderPool = "X-Kvrouter-Pool"
	// HeaderAdapter names a LoRA adapter.
	HeaderAdapter = "X-Kvrouter-Adapter"
)

// RawRoutingText is the routing text of a raw invoke body: its first limit
// bytes, after canonicalising JSON when asked (and when the body is one
// JSON document within the canonical form's budgets:
// openai.CanonicalPrefix, which writes only those bytes).
func RawRoutingText(body []byte, limit int, canonicalize bool) string {
	if canonicalize {
		if c, ok := openai.CanonicalPrefix(body, limit); ok {
			return string(c)
		}
	}
	if len(body) > limit {
		body = body[:limit]
	}
	return string(body)
}

// ValidTenantKey reports whether s is 1-64 printable ASCII characters, the
// form SageMaker accepts for X-Amzn-SageMaker-Prefix-Aware-Id.
func ValidTenantKey(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// ParseOpenAI parses an OpenAI body posted to ep (openai.Parse) within the
// default limits (Resolve applies the table's); its errors are 400
// RequestErrors.
func ParseOpenAI(ep Endpoint, body []byte) (*openai.Request, error) {
	return parseOpenAI(ep, body, config.LimitsConfig{}.WithDefaults())
}

// parseOpenAI parses an OpenAI body within l: a body over a limit fails as
// the scan reaches it, before the parse has built what lies beyond.
func parseOpenAI(ep Endpoint, body []byte, l config.LimitsConfig) (*openai.Request, error) {
	kind := openai.Any
	switch ep {
	case EndpointChatCompletions:
		kind = openai.Chat
	case EndpointCompletions:
		kind = openai.Completions
	}
	r, err := openai.Parse(kind, body, openai.Limits{
		Messages:     l.MaxMessages,
		ContentParts: l.MaxContentParts,
		Prompts:      l.MaxPrompts,
		TokenIDs:     l.MaxPromptTokenIDs,
	})
	if err != nil {
		return nil, badRequest("%s", err.Error())
	}
	return r, nil
}

// checkOpenAILimits reports the first limit a request parsed by its edge
// (gRPC Pick's, CompletionsInbound) breaks, as the message of a 400, or
// "". A body parsed here was held to the limits as it was read.
func checkOpenAILimits(l config.LimitsConfig, r *openai.Request) string {
	if len(r.Messages) > l.MaxMessages {
		return fmt.Sprintf("messages: %d messages exceed the limit of %d", len(r.Messages), l.MaxMessages)
	}
	if r.Prompt != nil {
		n := 0
		for _, ids := range r.Prompt.Tokens {
			n += len(ids)
		}
		if n > l.MaxPromptTokenIDs {
			return fmt.Sprintf("prompt: %d token ids exceed the limit of %d", n, l.MaxPromptTokenIDs)
		}
	}
	return ""
}

// ErrPromptTooLong: a body above limits.max_tokenize_bytes is not
// tokenized; the request routes heuristically.
var ErrPromptTooLong = fmt.Errorf("%w: body exceeds limits.max_tokenize_bytes", ErrTokenSource)

// tokenError is the TokenSource of requests the router must not key
// (a body over limits.max_tokenize_bytes, a truncation it cannot follow):
// kv_aware then routes them heuristically.
type tokenError struct{ err error }

var _ TokenSource = tokenError{}

func (t tokenError) Tokens(context.Context, *Request) ([]uint32, error) {
	return nil, t.err
}

// limitTokenize keeps kv_aware from tokenizing bodies over the limit.
func limitTokenize(l config.LimitsConfig, req *Request) {
	if len(req.Body) > l.MaxTokenizeBytes && req.PromptTokens == nil {
		req.Tokenizer = tokenError{ErrPromptTooLong}
	}
}

// ErrTruncateToModelLen: truncate_prompt_tokens -1 keeps the prompt's
// last max_model_len tokens, a length the router does not know.
var ErrTruncateToModelLen = errors.New("truncate_prompt_tokens -1 keeps the model's max_model_len tokens, which the router does not know")

// PromptTruncation reads vLLM's truncate_prompt_tokens, a raw value (nil
// when absent): keep is how many of the prompt's last tokens the engine
// prefills, 0 for the whole prompt (absent or null). vLLM's serving layer
// keeps a token-id prompt's last k ids (prompt_ids[-k:]) and tokenizes a
// text prompt, or a chat's rendered template, with truncation to k tokens
// on the left (the tokenizer's truncation_side for generative models), -1
// meaning max_model_len (OpenAIServing._normalize_prompt_tokens_to_input
// and _normalize_prompt_text_to_input). The error is
// ErrTruncateToModelLen for -1 and names any value vLLM would refuse.
func PromptTruncation(v json.RawMessage) (keep int, err error) {
	v = bytes.TrimSpace(v)
	if len(v) == 0 || string(v) == "null" {
		return 0, nil
	}
	n, perr := strconv.Atoi(string(v))
	switch {
	case perr == nil && n >= 1:
		return n, nil
	case perr == nil && n == -1:
		return 0, ErrTruncateToModelLen
	}
	return 0, fmt.Errorf("truncate_prompt_tokens %s: want an integer ≥ 1, or -1", v)
}

// ErrTruncateRight: truncation_side "right" keeps the prompt's first tokens,
// which the router does not key exactly.
var ErrTruncateRight = errors.New(`truncation_side "right" keeps the prompt's first truncate_prompt_tokens tokens, which the router does not key exactly`)

// PromptTruncationSide is PromptTruncation with vLLM main's truncation_side
// (side, raw; nil when absent): "left" or null keep the last tokens as
// PromptTruncation says; "right" keeps the first ones
// (TokenizeParams._token_truncation, vllm/renderers/params.py; the
// request's truncation_side in vllm/entrypoints/openai/chat_completion/
// protocol.py @ 002032ee), an error (ErrTruncateRight) with keep 0, so that
// prefix_aware keys the prompt's start, where the kept tokens begin, and
// kv_aware routes heuristically; another side is an error (vLLM: 400).
func PromptTruncationSide(v, side json.RawMessage) (keep int, err error) {
	keep, err = PromptTruncation(v)
	switch s := string(bytes.TrimSpace(side)); {
	case err != nil || keep == 0 || s == "" || s == "null" || s == `"left"`:
		return keep, err
	case s == `"right"`:
		return 0, ErrTruncateRight
	default:
		return 0, fmt.Errorf("truncation_side %s: want \"left\" or \"right\"", s)
	}
}

// KeepLast is ids truncated on the left to their last keep (0: all).
func KeepLast(ids []uint32, keep int) []uint32 {
	if keep <= 0 || len(ids) <= keep {
		return ids
	}
	return ids[len(ids)-keep:]
}
