package main

import (
	"context"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/sim"
)

// simEngine adapts sim.Engine to the driver's Engine interface.
type simEngine struct {
	e   *sim.Engine
	buf []sim.Update
}

var _ des.Engine = (*simEngine)(nil)

func (s *simEngine) Submit(r des.EngineRequest, now time.Duration) error {
	return s.e.Submit(sim.Request{ID: r.ID, Prompt: r.Prompt, MaxTokens: r.MaxTokens, LoRA: r.Adapter, CacheSalt: r.CacheSalt}, now)
}

func (s *simEngine) Advance(now time.Duration, out []des.Update) []des.Update {
	s.buf = s.e.Advance(now, s.buf[:0])
	for _, u := range s.buf {
		var k des.UpdateKind
		switch u.Kind {
		case sim.FirstToken:
			k = des.FirstToken
		case sim.Finished:
			k = des.Finished
		case sim.Aborted:
			k = des.Aborted
		default:
			continue
		}
		out = append(out, des.Update{ID: u.ID, Kind: k, At: u.At, CachedTokens: u.CachedTokens, OutputTokens: u.OutputTokens})
	}
	return out
}

func (s *simEngine) NextEventTime() (time.Duration, bool) { return s.e.NextEventTime() }

// simFactory builds sim engines from one config; each instance gets its own
// hash seed, as separate vLLM processes hash with their own PYTHONHASHSEED.
func simFactory(cfg sim.Config) des.EngineFactory {
	return func(name string, sink func(events.Batch)) (des.Engine, error) {
		c := cfg
		h := fnv.New64a()
		h.Write([]byte(name))
		c.HashSeed = h.Sum64()
		e, err := sim.New(c, sink)
		if err != nil {
			return nil, err
		}
		return &simEngine{e: e}, nil
	}
}

// strategyRouter runs one of the router's real strategies in the driver.
// The router's Instance type keeps the in-flight counts the strategies read.
type strategyRouter struct {
	s     router.Strategy
	model string
	insts map[string]*router.Instance
	cands []*router.Instance
}

var _ des.Router = (*strategyRouter)(nil)

func newStrategyRouter(name string, cfg router.RoutingConfig, seed uint64, model string) (*strategyRouter, error) {
	s, err := router.NewStrategy(name, cfg, router.WithSeed(seed))
	if err != nil {
		return nil, err
	}
	return &strategyRouter{s: s, model: model, insts: map[string]*router.Instance{}}, nil
}

func (r *strategyRouter) Name() string { return r.s.Name() }

func (r *strategyRouter) instance(name string) (*router.Instance, error) {
	in, ok := r.insts[name]
	if !ok {
		var err error
		// The URL is never dialled: strategies only need identity and counts.
		in, err = router.NewInstance(name, "http://"+name+".sim.invalid")
		if err != nil {
			return nil, err
		}
		r.insts[name] = in
	}
	return in, nil
}

func (r *strategyRouter) Pick(ctx context.Context, req *des.RouteRequest, cands []string) (des.Decision, error) {
	r.cands = r.cands[:0]
	for _, c := range cands {
		in, err := r.instance(c)
		if err != nil {
			return des.Decision{}, err
		}
		r.cands = append(r.cands, in)
	}
	rq := &router.Request{
		Endpoint:     router.EndpointCompletions,
		Model:        r.model,
		Adapter:      req.Adapter,
		RoutingText:  req.RoutingText,
		TenantKey:    req.Tenant,
		PromptTokens: req.Tokens,
	}
	d, err := r.s.Pick(ctx, rq, r.cands)
	if err != nil {
		return des.Decision{}, err
	}
	if d.Instance == nil {
		return des.Decision{}, fmt.Errorf("strategy %s returned no instance", r.s.Name())
	}
	return des.Decision{Instance: d.Instance.ID(), Reason: string(d.Reason),
		Overflow: d.Reason == router.ReasonOverflow || d.Reason == router.ReasonSaturated}, nil
}

func (r *strategyRouter) Started(name string) {
	if in, ok := r.insts[name]; ok {
		in.Acquire()
	}
}

func (r *strategyRouter) Finished(name string) {
	if in, ok := r.insts[name]; ok {
		in.Release()
	}
}

func (r *strategyRouter) Removed(name string) {
	if in, ok := r.insts[name]; ok {
		in.SetHealthy(false)
	}
}
