package grpcapi

import (
	"context"
	"errors"
	"net"
	"net/http"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/tiers"
)

// maxLookupTokens bounds the token ids a Lookup keys, as kv_aware does
// (2^20): matches are prefixes, so the head decides.
const maxLookupTokens = 1 << 20

// requestStatus is a refused request as a gRPC status: the HTTP edge's
// status mapped to the code gRPC clients expect (a table of RFC 9110 and
// grpc-go's status mapping, read the other way).
func requestStatus(err error) error {
	re := router.AsRequestError(err)
	code := codes.Internal
	switch re.Status {
	case http.StatusBadRequest:
		code = codes.InvalidArgument
	case http.StatusNotFound:
		code = codes.NotFound
	case http.StatusRequestEntityTooLarge, http.StatusTooManyRequests:
		code = codes.ResourceExhausted
	case http.StatusServiceUnavailable:
		code = codes.Unavailable
	}
	return status.Error(code, re.Message)
}

// resolvePrompt resolves a Pick or Lookup's prompt (text or token ids)
// exactly as the HTTP data plane resolves the same /v1/completions body.
func (s *Server) resolvePrompt(pool, model, adapter, prompt string, ids []uint32, tenant, salt string) (*router.Request, *router.Pool, error) {
	in, err := router.CompletionsInbound(pool, model, adapter, prompt, ids, tenant, salt)
	if err != nil {
		return nil, nil, requestStatus(err)
	}
	req, p, err := s.pools.Resolve(in)
	if err != nil {
		return nil, nil, requestStatus(err)
	}
	return req, p, nil
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
	req, p, err := s.resolvePrompt(in.GetPool(), in.GetModel(), in.GetAdapter(), in.GetPrompt(), in.GetTokenIds(), in.GetTenant(), in.GetCacheSalt())
	if err != nil {
		return nil, err
	}
	*pool = p.Name()
	_, strat := p.Routing()
	var buf [32]*router.Instance
	cands, _ := p.Candidates(buf[:0], req.Adapter, nil)
	dec, err := strat.Pick(ctx, req, cands)
	if err != nil && ctx.Err() != nil {
		// The caller went away while the pick was held (kv_aware's
		// sequencing holds a request for its epoch): its context's code,
		// Canceled or DeadlineExceeded, as the HTTP edge counts such a
		// client 499; no routing failure.
		return nil, status.FromContextError(ctx.Err()).Err()
	}
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
		dec.Observer.Done(0, -1)
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
	pool := in.GetPool()
	if pool == "" {
		// A lookup names no model: the default pool, else the first.
		if pool = s.cfg.DefaultPool; pool == "" {
			if ps := s.pools.Pools(); len(ps) > 0 {
				pool = ps[0].Name()
			}
		}
	}
	req, p, err := s.resolvePrompt(pool, "", in.GetAdapter(), in.GetPrompt(), in.GetTokenIds(), "", in.GetCacheSalt())
	if err != nil {
		return nil, err
	}
	kv := kvaware.Of(p)
	if kv == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "pool %q has no KV index", p.Name())
	}
	if req.Tokenizer == nil { // else limits.max_tokenize_bytes refused tokenizing it
		req.Tokenizer = kv.TokenSource()
	}
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
