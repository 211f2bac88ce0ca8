package grpcapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
)

// maxLookupTokens bounds the token ids a Lookup keys, as kv_aware does
// (2^20): matches are prefixes, so the head decides.
const maxLookupTokens = 1 << 20

// errNoPool is returned when a request names a pool or model the router
// does not serve.
var errNoPool = errors.New("grpcapi: no such pool")

// poolFor resolves a request's pool: by name, else the pool serving model
// (as base model, else as adapter, which is then returned), else the
// default pool.
func (s *Server) poolFor(name, model string) (p *router.Pool, adapter string, err error) {
	if name != "" {
		if p, ok := s.pools.Pool(name); ok {
			return p, "", nil
		}
		return nil, "", fmt.Errorf("%w %q", errNoPool, name)
	}
	pools := s.pools.Pools()
	if model != "" {
		for _, p := range pools {
			if p.Model() == model {
				return p, "", nil
			}
		}
		for _, p := range pools {
			if p.ServesAdapter(model) {
				return p, model, nil
			}
		}
		return nil, "", fmt.Errorf("%w serving model %q", errNoPool, model)
	}
	if s.cfg.DefaultPool != "" {
		if p, ok := s.pools.Pool(s.cfg.DefaultPool); ok {
			return p, "", nil
		}
	}
	if len(pools) == 0 {
		return nil, "", fmt.Errorf("%w: the router has no pools", errNoPool)
	}
	return pools[0], "", nil
}

// promptRequest builds the router.Request of a completions call for a
// prompt given as text or token ids, exactly as the HTTP data plane would
// for the same /v1/completions body, so that gRPC and HTTP picks agree.
func promptRequest(p *router.Pool, adapter, prompt string, ids []uint32, tenant, salt string) (*router.Request, error) {
	if prompt == "" && len(ids) == 0 {
		return nil, status.Error(codes.InvalidArgument, "prompt or token_ids: required")
	}
	if prompt != "" && len(ids) > 0 {
		return nil, status.Error(codes.InvalidArgument, "prompt and token_ids: give one, not both")
	}
	if tenant != "" && !router.ValidTenantKey(tenant) {
		return nil, status.Error(codes.InvalidArgument, "tenant: want 1-64 printable ASCII characters")
	}
	if len(prompt) > router.MaxTokenizeBytes {
		return nil, status.Errorf(codes.InvalidArgument, "prompt: %d bytes exceeds the limit of %d", len(prompt), router.MaxTokenizeBytes)
	}
	model := p.Model()
	if adapter != "" {
		model = adapter
	}
	// The request is built directly rather than by encoding a body and
	// parsing it back (a 2k-token prompt cost 2,000 allocations that way);
	// the body carries what strategies read from it: the model and the
	// cache salt.
	parsed := &router.OpenAIRequest{Model: model, Prompt: &router.Prompt{}}
	if len(ids) > 0 {
		parsed.Prompt.Tokens = [][]uint32{ids}
	} else {
		parsed.Prompt.Texts = []string{prompt}
	}
	raw, err := json.Marshal(struct {
		Model     string `json:"model"`
		CacheSalt string `json:"cache_salt,omitempty"`
	}{model, salt})
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "model: %v", err)
	}
	rc, _ := p.Routing()
	req := &router.Request{
		Endpoint:    router.EndpointCompletions,
		Pool:        p.Name(),
		Model:       model,
		Adapter:     adapter,
		RoutingText: router.OpenAIRoutingText(parsed, rc.PrefixLength),
		TenantKey:   tenant,
		Body:        raw,
		Parsed:      parsed,
	}
	if len(ids) > 0 {
		req.PromptTokens = ids
	}
	return req, nil
}

// checkAdapter rejects an adapter the pool does not serve (unless its
// adapter_fallback sends such requests anywhere).
func checkAdapter(p *router.Pool, adapter string) error {
	if adapter != "" && !p.ServesAdapter(adapter) && p.Config().AdapterFallback != "all" {
		return status.Errorf(codes.NotFound, "the adapter %q does not exist in pool %q", adapter, p.Name())
	}
	return nil
}

// hostPort is the instance's address as Envoy needs it: host:port, the
// port defaulted from the scheme.
func hostPort(in *router.Instance) string {
	u := in.URL()
	if u.Port() != "" {
		return u.Host
	}
	port := "80"
	if u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port)
}

func tierCounts(v [tiers.Count]int) *kvrouterv1.TierCounts {
	return &kvrouterv1.TierCounts{
		Gpu: int64(v[tiers.GPU]), Cpu: int64(v[tiers.CPU]),
		Disk: int64(v[tiers.Disk]), Shared: int64(v[tiers.Shared]),
	}
}

type routerService struct {
	kvrouterv1.UnimplementedRouterServer
	s *Server
}

// Pick implements kvrouter.v1.Router.
func (r routerService) Pick(ctx context.Context, in *kvrouterv1.PickRequest) (*kvrouterv1.PickResponse, error) {
	var pool string // the resolved pool: a label from the request would be unbounded
	out, err := r.s.pick(ctx, in, &pool)
	r.s.m.picks.WithLabelValues(pool, status.Code(err).String()).Inc()
	return out, err
}

func (s *Server) pick(ctx context.Context, in *kvrouterv1.PickRequest, pool *string) (*kvrouterv1.PickResponse, error) {
	p, adapter, err := s.poolFor(in.GetPool(), in.GetModel())
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	*pool = p.Name()
	if in.GetAdapter() != "" {
		adapter = in.GetAdapter()
	}
	if err := checkAdapter(p, adapter); err != nil {
		return nil, err
	}
	req, err := promptRequest(p, adapter, in.GetPrompt(), in.GetTokenIds(), in.GetTenant(), in.GetCacheSalt())
	if err != nil {
		return nil, err
	}
	_, strat := p.Routing()
	var buf [32]*router.Instance
	cands, _ := p.Candidates(buf[:0], adapter, nil)
	dec, err := strat.Pick(ctx, req, cands)
	if errors.Is(err, router.ErrNoCandidates) {
		return nil, status.Errorf(codes.Unavailable, "no eligible instance in pool %q", p.Name())
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "pick: %v", err)
	}
	if dec.Observer != nil {
		// The request goes elsewhere: the router will never see its
		// response, so end the observation now (pending prefill released;
		// speculative holds, which the caller is about to make true, stay).
		dec.Observer.Finish(0)
	}
	out := &kvrouterv1.PickResponse{
		Pool:     p.Name(),
		Instance: dec.Instance.ID(),
		Address:  hostPort(dec.Instance),
		Url:      dec.Instance.URL().String(),
		Strategy: dec.Strategy,
		Reason:   string(dec.Reason),
	}
	if e := dec.Explain; e != nil {
		out.HasExplanation = true
		out.MatchedTokens = tierCounts(e.MatchedTokens)
		out.PromptTokens = int64(e.PromptTokens)
		out.PredictedTtftMs = float64(e.PredictedTTFT) / 1e6
	}
	return out, nil
}

type indexService struct {
	kvrouterv1.UnimplementedIndexServer
	s *Server
}

// Lookup implements kvrouter.v1.Index.
func (x indexService) Lookup(ctx context.Context, in *kvrouterv1.LookupRequest) (*kvrouterv1.LookupResponse, error) {
	s := x.s
	p, _, err := s.poolFor(in.GetPool(), "")
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	kv := p.KV()
	if kv == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "pool %q has no KV index", p.Name())
	}
	req, err := promptRequest(p, in.GetAdapter(), in.GetPrompt(), in.GetTokenIds(), "", in.GetCacheSalt())
	if err != nil {
		return nil, err
	}
	req.Tokenizer = kv.TokenSource()
	ids, err := req.TokenIDs(ctx)
	if errors.Is(err, router.ErrNoTokens) {
		return nil, status.Errorf(codes.FailedPrecondition, "pool %q has no tokenizer: give token_ids", p.Name())
	}
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "tokenize prompt: %v", err)
	}
	if len(ids) > maxLookupTokens {
		ids = ids[:maxLookupTokens]
	}
	idx := kv.Index()
	rc, _ := p.Routing()
	bs := idx.BlockSize()
	if rc.KV != nil && rc.KV.BlockSize > 0 {
		bs = rc.KV.BlockSize
	}
	out := &kvrouterv1.LookupResponse{Pool: p.Name(), BlockSize: int32(bs), PromptTokens: int64(len(ids))}
	if bs <= 0 {
		// No event has told the block size yet: nothing can be held.
		return out, nil
	}
	keys := kvindex.Keys(kvindex.Root(p.Model(), in.GetAdapter(), in.GetCacheSalt()), ids, bs)
	out.Blocks = int64(len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	matches, err := idx.Lookup(ctx, keys)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "index lookup: %v", err)
	}
	slices.SortFunc(matches, func(a, b kvindex.Match) int {
		for t := range tiers.Count {
			if a.Blocks[t] != b.Blocks[t] {
				return b.Blocks[t] - a.Blocks[t]
			}
		}
		return strings.Compare(a.Instance, b.Instance)
	})
	for _, m := range matches {
		// kvindex counts cumulatively; the API counts each tier beyond the
		// faster ones, as the HTTP lookup does.
		var blk, tok [tiers.Count]int
		prev := 0
		for t := range tiers.Count {
			blk[t] = m.Blocks[t] - prev
			tok[t] = blk[t] * bs
			prev = m.Blocks[t]
		}
		out.Matches = append(out.Matches, &kvrouterv1.InstanceMatch{
			Instance: m.Instance, Blocks: tierCounts(blk), Tokens: tierCounts(tok),
		})
	}
	return out, nil
}
