package router

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/fmix"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/kvrouter/kvrouter/tiers"
)

// ErrNoCandidates is returned by a Strategy given no instance to pick from;
// the HTTP edge turns it into 503 with Retry-After.
var ErrNoCandidates = errors.New("router: no eligible instance")

// ErrUnknownStrategy is returned by NewStrategy for a name it does not know.
var ErrUnknownStrategy = errors.New("router: unknown strategy")

// ErrTokenSource reports a token source that cannot be built, or a body
// it cannot tokenize.
var ErrTokenSource = errors.New("router: token source")

// ErrNoTokens is returned by Request.TokenIDs when the request carries no
// token ids and no TokenSource is configured.
var ErrNoTokens = errors.New("router: no token ids for request")

// Strategy picks one instance for a request among candidates. The candidates
// are healthy, serve the request's model and hold its adapter; they may be
// Full — honouring the concurrency threshold is the strategy's job, so that
// overflow stays in the strategy's own order.
//
// Pick is called concurrently from many requests; implementations keep
// their own state safe. It must not retain cands.
type Strategy interface {
	// Name is the strategy's configured name (the x-kvrouter-strategy header).
	Name() string
	// Pick returns the decision, or ErrNoCandidates when cands is empty.
	Pick(ctx context.Context, req *Request, cands []*Instance) (Decision, error)
}

// Reason says why a decision picked its instance (the x-kvrouter-reason header).
type Reason string

// Reasons of the plain strategies; the kv_aware strategy's own follow.
const (
	ReasonHash             Reason = "hash"              // prefix_aware: first in rendezvous order
	ReasonOverflow         Reason = "overflow"          // prefix_aware: first in rendezvous order was full
	ReasonSaturated        Reason = "saturated"         // every candidate full: least outstanding
	ReasonRandom           Reason = "random"            // random
	ReasonRoundRobin       Reason = "round_robin"       // round_robin
	ReasonLeastOutstanding Reason = "least_outstanding" // least_outstanding
)

// Reasons of kv_aware decisions (the x-kvrouter-reason header). kv_aware
// also returns ReasonOverflow (its best candidate was full) and
// ReasonSaturated (every candidate was full).
const (
	// ReasonKVMatch: the candidate with the least predicted TTFT, from the
	// blocks the index (or the speculative overlay) says it holds.
	ReasonKVMatch Reason = "kv_match"
	// ReasonHeuristic: nobody holds the prompt's first block, or the
	// request has no token ids: prefix_aware decided.
	ReasonHeuristic Reason = "heuristic"
	// ReasonStaleFallback: a stale instance's blocks were not counted, and
	// that changed the pick.
	ReasonStaleFallback Reason = "stale_fallback"
	// ReasonStreamDown: the pool's event stream is down, so the index may be
	// arbitrarily wrong: prefix_aware decided.
	ReasonStreamDown Reason = "stream_down"
	// ReasonLoadBound: the preferred instance (the best holder, or the
	// hash-home of a prompt nobody holds) was over the load bound; another
	// took the request.
	ReasonLoadBound Reason = "load_bound"
	// ReasonReplicate: the best holder's prefix had paid, in its requests'
	// extra waiting there, the price of a copy on the least-loaded
	// instance, which took the request (router/kvaware/replicate.go).
	ReasonReplicate Reason = "replicate"
)

// Decision is a strategy's pick and its explanation.
type Decision struct {
	Instance *Instance
	Strategy string
	Reason   Reason
	// Explain, when set, carries what an exact strategy knew (headers
	// x-kvrouter-matched-tokens, x-kvrouter-predicted-ttft-ms).
	Explain *Explanation
	// Observer, when set, follows the routed attempt (see Observer).
	Observer Observer
	// Warm, when set, asks the edge to copy the request's prompt onto
	// another instance beside this attempt (a hot prefix's purchase,
	// router/kvaware/replicate.go). Set only for requests marked
	// Warmable; the edge must end Warm.Observer whatever happens.
	Warm *Warm
}

// ProxyCanWarm reports whether the HTTP data plane can send a warm-up
// copy of r: an OpenAI request, whose body it can rewrite to one output
// token (router/httpapi/warm.go).
// A disaggregated request's decode pick cannot (RemotePrefill): its
// instance pulls the prompt's KV from the prefill instance, and a copy
// would be the one prompt that instance computes itself; moving the
// request to the copy's instance pulls it there instead.
func (r *Request) ProxyCanWarm() bool {
	return r.Endpoint.OpenAI() && len(r.Body) > 0 && !r.RemotePrefill
}

// WarmsWhole reports whether a warm-up copy of r must be its whole prompt
// as the client sent it, never a prefix of its token ids (Warm.Tokens):
// r carries media (an image, audio), whose blocks the engine hashes from
// the media as well as the ids (router/httpapi/warm.go).
func (r *Request) WarmsWhole() bool { return r.Parsed != nil && r.Parsed.HasMedia() }

// Warm is a warm-up copy: the edge sends the request's prompt, or its
// first Tokens token ids, to Instance for one output token, so that the
// instance computes and caches it, and follows that request with Observer
// (first byte, then done) as it would a routed attempt.
type Warm struct {
	Instance *Instance
	Observer Observer
	// Tokens, when above 0, is the prefix the copy is for: the first
	// Tokens of the request's token ids (Request.TokenIDs), sent as a
	// completion of token ids (router/httpapi/warm.go), whose blocks the
	// engine hashes as the request's. 0, or ids the edge cannot get: the
	// request's whole prompt, as the client sent it.
	Tokens int
}

// Explanation is the optional detail of a kv-aware decision.
type Explanation struct {
	// MatchedTokens per tier: tokens of the prompt held by the instance in
	// that tier beyond those held in faster tiers.
	MatchedTokens [tiers.Count]int
	PromptTokens  int
	PredictedTTFT time.Duration
}

// Response headers explaining a decision, set by the edges that answer
// (the HTTP data plane, Envoy's ext_proc).
const (
	HeaderInstance = "X-Kvrouter-Instance"
	HeaderStrategy = "X-Kvrouter-Strategy"
	HeaderReason   = "X-Kvrouter-Reason"

	// HeaderMatchedTokens (exact routing decisions) lists the prompt tokens the chosen instance was
	// predicted to hold, per tier, each beyond faster tiers:
	// "gpu=128,cpu=32,disk=0,shared=0".
	HeaderMatchedTokens = "X-Kvrouter-Matched-Tokens"
	// HeaderPredictedTTFT is the predicted time to first token, in ms.
	HeaderPredictedTTFT = "X-Kvrouter-Predicted-Ttft-Ms"
)

// MatchedTokensHeader formats MatchedTokens as HeaderMatchedTokens does.
func (e *Explanation) MatchedTokensHeader() string {
	var b strings.Builder
	for t, n := range e.MatchedTokens {
		if t > 0 {
			b.WriteByte(',')
		}
		b.WriteString(tiers.Tier(t).String())
		b.WriteByte('=')
		b.WriteString(strconv.Itoa(n))
	}
	return b.String()
}

// Endpoint is the kind of request being routed.
type Endpoint uint8

// Endpoints.
const (
	EndpointChatCompletions Endpoint = iota + 1 // POST /v1/chat/completions
	EndpointCompletions                         // POST /v1/completions
	EndpointInvoke                              // POST /invocations
	EndpointInvokeStream                        // POST /invocations-response-stream
)

// OpenAI reports whether the endpoint takes an OpenAI body (chat or
// completions) rather than a raw SageMaker invocation.
func (e Endpoint) OpenAI() bool { return e == EndpointChatCompletions || e == EndpointCompletions }

// TokenSource turns a request's prompt into the token ids the engine will
// see (chat template rendered, add_special_tokens=false); tokensource.go
// builds it from a pool's tokenizer: config.
type TokenSource interface {
	Tokens(ctx context.Context, req *Request) ([]uint32, error)
}

// Request is what a strategy knows about a request. The proxy fills it from
// the HTTP request; simulators build it directly.
type Request struct {
	Endpoint Endpoint
	Pool     string
	// Model is the requested model name (the pool's model or an adapter).
	Model string
	// Adapter is the LoRA adapter named by the request, "" for the base model.
	Adapter string
	// RoutingText is the prompt prefix that routes (already cut to prefix_length).
	RoutingText string
	// TenantKey isolates placements of equal prompts of different tenants.
	TenantKey string
	// Body is the body as forwarded; Parsed is set on the OpenAI paths, and
	// describes Body but for a cache_salt the router injected.
	Body   []byte
	Parsed *openai.Request
	// InjectedCacheSalt is the cache_salt the router wrote into Body, ""
	// when it wrote none (see saltRequestBody).
	InjectedCacheSalt string
	// PromptTokens are token ids given in the request (/v1/completions with
	// an int array prompt), else nil.
	PromptTokens []uint32
	// Stream is true when the client asked for server-sent events.
	Stream bool
	// Tokenizer, when set, produces token ids on demand (see TokenIDs).
	Tokenizer TokenSource

	hashOnce bool
	hash     uint64
	tokOnce  sync.Once
	tokens   []uint32
	tokErr   error
	tokErrN  atomic.Bool // TokenErrorFirst has said true

	// RemotePrefill is set once another instance prefilled the prompt
	// (disaggregated serving: the body carries its kv_transfer_params);
	// the pick that follows chooses where the KV is pulled to.
	RemotePrefill bool

	// Warmable says the edge can send a warm-up copy (Decision.Warm)
	// beside this request: an exact strategy may then make a hot prefix's
	// copy without moving the request. Edges that cannot leave it false;
	// a dry evaluation of what the HTTP data plane would decide sets it as
	// that edge does (ProxyCanWarm).
	Warmable bool

	// KeptFree names the instances the admission queue keeps free of
	// prompts larger than a step (flowcontrol.Sched.KeptFree), set for a
	// request that fits a step: a copy of its prefix that an exact
	// strategy buys goes to one of them with room rather than to an
	// instance running long contexts, whose decode steps it would wait
	// behind. Nil: no preference.
	KeptFree []string

	// ShareKeys is set on a request picked twice (disaggregated: prefill,
	// then decode): an exact strategy may keep what it derived from the
	// prompt for the second pick in KeyMemo (router/kvaware keeps the
	// prompt's block keys). The core never reads KeyMemo.
	ShareKeys bool
	KeyMemo   any
}

// RoutingHash is xxhash64 of (RoutingText, TenantKey), computed once.
// Strategies call it rather than hashing the text again (32 KiB costs ~2 µs).
// It is not safe to call concurrently for one Request (one request is routed
// by one goroutine).
func (r *Request) RoutingHash() uint64 {
	if !r.hashOnce {
		h := xxhash.Sum64String(r.RoutingText)
		if r.TenantKey != "" {
			// Mix rather than concatenate: no copy of the text is needed, and
			// fmix64 spreads the tenant's bits over the whole word.
			h = fmix.Mix64(h ^ fmix.Mix64(xxhash.Sum64String(r.TenantKey)+0x9e3779b97f4a7c15))
		}
		r.hash, r.hashOnce = h, true
	}
	return r.hash
}

// SetRoutingHash gives the request a routing hash computed elsewhere: a
// peer replica's request decided from its intent (replica sequencing),
// whose routing text this replica never saw.
func (r *Request) SetRoutingHash(h uint64) { r.hash, r.hashOnce = h, true }

// TokenIDs returns the prompt's token ids: those given in the request, else
// from the Tokenizer (once, cached), else ErrNoTokens.
func (r *Request) TokenIDs(ctx context.Context) ([]uint32, error) {
	if r.PromptTokens != nil {
		return r.PromptTokens, nil
	}
	r.tokOnce.Do(func() {
		if r.Tokenizer == nil {
			r.tokErr = ErrNoTokens
			return
		}
		r.tokens, r.tokErr = tracedTokens(ctx, r.Tokenizer, r)
	})
	return r.tokens, r.tokErr
}

// TokenErrorFirst reports whether the caller is the first to see the
// request's tokenization error: a request is evaluated more than once
// (flow control's estimate at arrival, the pick, a disaggregated second
// pick) and its failure must count once.
func (r *Request) TokenErrorFirst() bool { return r.tokErrN.CompareAndSwap(false, true) }

// StrategyOption adjusts a strategy built by NewStrategy.
type StrategyOption func(*strategyOptions)

type strategyOptions struct {
	rnd func(n uint64) uint64
	kv  Exact // the pool's exact-routing state (kv_aware, shadow mode); see WithKVState
}

// WithSeed makes the random choices (random strategy, least-outstanding
// ties) a deterministic function of seed, for simulations and tests.
func WithSeed(seed uint64) StrategyOption {
	return func(o *strategyOptions) {
		var mu sync.Mutex // guards r: rand.Rand is not safe for concurrent use
		r := rand.New(rand.NewPCG(seed, seed^0x5851f42d4c957f2d))
		o.rnd = func(n uint64) uint64 {
			mu.Lock()
			defer mu.Unlock()
			return r.Uint64N(n)
		}
	}
}

// WithRand makes rnd the strategy's randomness (rnd(n) is uniform in
// [0, n) and safe for concurrent use).
func WithRand(rnd func(n uint64) uint64) StrategyOption {
	return func(o *strategyOptions) { o.rnd = rnd }
}

// NewStrategy builds the named strategy with cfg (defaults applied). It
// needs no network and no server: simulators call it directly.
func NewStrategy(name string, cfg config.RoutingConfig, opts ...StrategyOption) (Strategy, error) {
	cfg.Strategy = name
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		if !config.KnownStrategy(cfg.Strategy) {
			return nil, fmt.Errorf("%w %q", ErrUnknownStrategy, name)
		}
		return nil, err
	}
	o := strategyOptions{rnd: rand.Uint64N}
	for _, f := range opts {
		f(&o)
	}
	if cfg.Strategy == config.StrategyKVAware || cfg.Shadow {
		if o.kv == nil {
			what := "kv_aware"
			if cfg.Strategy != config.StrategyKVAware {
				what = "shadow mode"
			}
			return nil, fmt.Errorf("%w: %s: configure index: (and events:) for the pool", ErrNoKVState, what)
		}
		return o.kv.Strategy(cfg, o.rnd)
	}
	thr := cfg.ConcurrencyThreshold
	switch cfg.Strategy {
	case config.StrategyRandom:
		return &Random{Threshold: thr, rnd: o.rnd}, nil
	case config.StrategyRoundRobin:
		return &RoundRobin{Threshold: thr, rnd: o.rnd}, nil
	case config.StrategyLeastOutstanding:
		return &LeastOutstanding{rnd: o.rnd}, nil
	case config.StrategyPrefixAware:
		return &PrefixAware{Threshold: thr, rnd: o.rnd}, nil
	}
	return nil, fmt.Errorf("%w %q", ErrUnknownStrategy, name)
}
