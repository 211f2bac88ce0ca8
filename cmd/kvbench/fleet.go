package main

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
)

// simEngine adapts sim.Engine to the driver's Engine interface.
type simEngine struct {
	e   *sim.Engine
	buf []sim.Update
}

var _ des.Engine = (*simEngine)(nil)

func (s *simEngine) Submit(r des.EngineRequest, now time.Duration) error {
	return s.e.Submit(sim.Request{ID: r.ID, Prompt: r.Prompt, MaxTokens: r.MaxTokens, LoRA: r.Adapter, CacheSalt: r.CacheSalt, RemotePrefill: r.RemotePrefill}, now)
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

// BusyTime implements des.BusyReporter.
func (s *simEngine) BusyTime() (busy, prefillBusy time.Duration) {
	st := s.e.Stats()
	return st.BusyTime, st.PrefillBusyTime
}

// RemoteTokens implements des.RemoteReporter.
func (s *simEngine) RemoteTokens() uint64 { return s.e.Stats().RemoteTokens }

// simFactory builds sim engines from one config; each instance gets its own
// hash seed, as separate vLLM processes hash with their own PYTHONHASHSEED.
// made, when set, is told every engine built (for load scraping).
func simFactory(cfg sim.Config, made func(name string, e *sim.Engine)) des.EngineFactory {
	return func(name string, sink func(events.Batch)) (des.Engine, error) {
		c := cfg
		h := fnv.New64a()
		h.Write([]byte(name))
		c.HashSeed = h.Sum64()
		e, err := sim.New(c, sink)
		if err != nil {
			return nil, err
		}
		if made != nil {
			made(name, e)
		}
		return &simEngine{e: e}, nil
	}
}

// strategyRouter runs one of the router's real strategies in the driver.
// The router's Instance type keeps the in-flight counts the strategies read;
// for kv_aware, a KVState over a real memory index fed by the engines'
// events (after the driver's event delay), on the virtual clock.
type strategyRouter struct {
	s     router.Strategy
	model string
	insts map[string]*router.Instance
	cands []*router.Instance

	// kv is set for strategies that need the KV index (kv_aware).
	kv *kvSim
	// obs follows each in-flight request's decision, as the proxy does.
	obs map[uint64]router.Observer
	// cached holds the engine-reported cached tokens of each request whose
	// response started (FirstToken), for its observer's Done.
	cached map[uint64]int
	// predicted is the last decision's predicted time to first token
	// (0 when the strategy gave none), for the decision trace.
	predicted time.Duration
}

var _ des.Router = (*strategyRouter)(nil)

// kvSim is the exact-routing state of a simulated pool.
type kvSim struct {
	index   *kvindex.Memory
	state   *kvaware.KVState
	engines map[string]*sim.Engine
	// now is the driver's virtual clock (set through des.Config.Clock).
	now        time.Duration
	lastScrape time.Duration
	scraped    bool
	scrape     time.Duration
}

// epoch anchors virtual time for components that read a wall clock.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func (k *kvSim) wall() time.Time { return epoch.Add(k.now) }

// needsKV reports whether a strategy routes on the KV index.
func needsKV(name string) bool { return name == config.StrategyKVAware }

func newStrategyRouter(name string, cfg config.RoutingConfig, seed uint64, model string) (*strategyRouter, error) {
	return newStrategyRouterSized(name, cfg, seed, model, 0)
}

// indexCapacity is the block-index size a simulated fleet needs: every
// (block, instance) entry its engines can hold, twice over (room for the
// instances a scale-out adds; the index evicts the least recently used
// beyond it). A real deployment sizes the index the same way
// (kvindex.MemoryConfig.Capacity); an index smaller than the fleet's
// caches forgets blocks the engines still hold, and kv_aware then routes
// as if they were cold.
func indexCapacity(instances int, scfg sim.Config) int {
	per := scfg.GPUBlocks + scfg.CPUBlocks
	if scfg.GPUBlocks == 0 {
		per += sim.DefaultGPUBlocks
	}
	return min(2*instances*per, kvindex.MaxCapacity)
}

// newStrategyRouterSized is newStrategyRouter with an index of capacity
// (block, instance) entries (0 = kvindex's default).
func newStrategyRouterSized(name string, cfg config.RoutingConfig, seed uint64, model string, capacity int) (*strategyRouter, error) {
	return newStrategyRouterShared(name, cfg, seed, model, capacity, kvShare{})
}

// kvShare is what one router replica shares with the others of a
// replicated run (replicas.go); the zero value shares nothing.
type kvShare struct {
	index   *kvindex.Memory    // nil = the replica's own index
	fresh   kvindex.Freshness  // replica sync (kvaware.PeerState), nil = none
	metrics *kvaware.KVMetrics // nil = unregistered
}

func newStrategyRouterShared(name string, cfg config.RoutingConfig, seed uint64, model string, capacity int, share kvShare) (*strategyRouter, error) {
	r := &strategyRouter{model: model, insts: map[string]*router.Instance{}, obs: map[uint64]router.Observer{}, cached: map[uint64]int{}}
	opts := []router.StrategyOption{router.WithSeed(seed)}
	if needsKV(name) {
		k := &kvSim{engines: map[string]*sim.Engine{}, scrape: kvaware.DefaultScrapeInterval}
		idx := share.index
		if idx == nil {
			var err error
			if idx, err = kvindex.NewMemory(kvindex.MemoryConfig{Model: model, BlockSize: sim.DefaultBlockSize, Now: k.wall, Capacity: capacity}); err != nil {
				return nil, err
			}
		}
		st, err := kvaware.NewKVState(kvaware.KVStateConfig{Pool: "des", Model: model, Index: idx, Now: k.wall,
			Freshness: share.fresh, Metrics: share.metrics,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			return nil, err
		}
		k.index, k.state = idx, st
		r.kv = k
		// The proxy's pool loops tell the state where the instances are,
		// so that replica sync publishes their in-flight counts; without
		// this a simulated replica's peers never saw its requests start.
		st.SetInstances(r.instanceList)
		opts = append(opts, router.WithKVState(st))
	}
	s, err := router.NewStrategy(name, cfg, opts...)
	if err != nil {
		return nil, err
	}
	r.s = s
	return r, nil
}

// index is what the driver feeds events into (nil when the strategy needs none).
func (r *strategyRouter) index() des.IndexWriter {
	if r.kv == nil {
		return nil
	}
	return r.kv.index
}

// clock follows the driver's virtual time.
func (r *strategyRouter) clock(now time.Duration) {
	if r.kv != nil {
		r.kv.now = now
	}
}

// loadScrape gives kv_aware the engines' waiting and running counts at the
// router's scrape interval, as its /metrics scraper would.
func (r *strategyRouter) loadScrape() {
	k := r.kv
	if k == nil || (k.scraped && k.now-k.lastScrape < k.scrape) {
		return
	}
	k.scraped, k.lastScrape = true, k.now
	for name, e := range k.engines {
		st := e.Stats()
		k.state.SetLoad(name, float64(st.Waiting), float64(st.Running))
	}
}

func (r *strategyRouter) Name() string { return r.s.Name() }

// instanceList is every instance this router has seen, in name order.
func (r *strategyRouter) instanceList() []*router.Instance {
	out := make([]*router.Instance, 0, len(r.insts))
	for _, name := range slices.Sorted(maps.Keys(r.insts)) {
		out = append(out, r.insts[name])
	}
	return out
}

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
	r.loadScrape()
	rq := r.request(req)
	d, err := r.s.Pick(ctx, rq, r.cands)
	if err != nil {
		return des.Decision{}, err
	}
	if d.Instance == nil {
		return des.Decision{}, fmt.Errorf("strategy %s returned no instance", r.s.Name())
	}
	if d.Observer != nil {
		r.obs[req.EngineID] = d.Observer
	}
	warm, warmTokens := "", 0
	if d.Warm != nil {
		warmTokens = d.Warm.Tokens
		// The warm-up copy's lifecycle calls come under its own id.
		warm = d.Warm.Instance.ID()
		if d.Warm.Observer != nil {
			r.obs[req.EngineID|des.WarmTag] = d.Warm.Observer
		}
	}
	r.predicted = 0
	if d.Explain != nil {
		r.predicted = d.Explain.PredictedTTFT
	}
	return des.Decision{Instance: d.Instance.ID(), Reason: string(d.Reason),
		Overflow: d.Reason == router.ReasonOverflow || d.Reason == router.ReasonSaturated, Warm: warm, WarmTokens: warmTokens}, nil
}

// request is the router's view of a driver request.
func (r *strategyRouter) request(req *des.RouteRequest) *router.Request {
	rq := &router.Request{
		Endpoint:     router.EndpointCompletions,
		Model:        r.model,
		Adapter:      req.Adapter,
		RoutingText:  req.RoutingText,
		TenantKey:    req.Tenant,
		PromptTokens: req.Tokens,
		// The driver sends warm-up copies (des.Decision.Warm) where the
		// HTTP edge does.
		Warmable:      !req.NoWarm,
		RemotePrefill: req.RemotePrefill,
		KeptFree:      req.KeptFree,
	}
	if req.CacheSalt != "" {
		// The router reads cache_salt from the body it forwards, so that
		// its block keys fold the salt in as the engine's do.
		rq.Body, _ = json.Marshal(map[string]string{"cache_salt": req.CacheSalt})
	}
	return rq
}

func (r *strategyRouter) Started(_ uint64, name string) {
	if in, ok := r.insts[name]; ok {
		in.Acquire()
	}
}

// FirstToken tells the decision's observer the response started (which
// releases the pending prefill the router counted) and keeps the cached
// tokens the engine reported for Done, where kv_aware compares them with
// its prediction.
func (r *strategyRouter) FirstToken(id uint64, _ string, cached, prompt int) {
	o, ok := r.obs[id]
	if !ok {
		return
	}
	o.FirstByte()
	r.cached[id] = cached
}

// Finished ends the request's decision as the proxy would: the observer
// learns the status (releasing the pending prefill the router counted, if
// the first byte did not already) and the instance's in-flight count drops.
// A refused or aborted request ends here too, or its pending prefill would
// pin the instance for the rest of the run.
func (r *strategyRouter) Finished(id uint64, name string, err error) {
	if o, ok := r.obs[id]; ok {
		status := 200
		if err != nil {
			status = 500
		}
		cached, ok := r.cached[id]
		if !ok {
			cached = -1
		}
		o.Done(status, cached)
		delete(r.obs, id)
		delete(r.cached, id)
	}
	if in, ok := r.insts[name]; ok {
		in.Release()
	}
}

func (r *strategyRouter) Removed(name string) {
	if in, ok := r.insts[name]; ok {
		in.SetHealthy(false)
	}
	if r.kv != nil {
		delete(r.kv.engines, name)
	}
}

// engineMade registers a new engine for load scraping.
func (r *strategyRouter) engineMade(name string, e *sim.Engine) {
	if r.kv != nil {
		r.kv.engines[name] = e
	}
}

// desConfig is the driver configuration that runs this router over sim
// engines built from scfg.
func (r *strategyRouter) desConfig(instances int, scfg sim.Config) des.Config {
	return des.Config{Instances: instances, NewEngine: simFactory(scfg, r.engineMade), Router: r, Index: r.index(), Clock: r.clock}
}
