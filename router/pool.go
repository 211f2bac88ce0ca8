package router

import (
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
)

// Pool is one model deployment: its instances and its current routing.
// The routing (config and strategy) is swapped atomically, so a switch at
// runtime never blocks or tears a request.
type Pool struct {
	cfg       config.PoolConfig
	instances []*Instance
	byID      map[string]*Instance
	routing   atomic.Pointer[poolRouting]
	kv        Exact        // exact-routing state (router/kvaware); nil when the pool has no KV index
	flow      *flowControl // admission queue; nil when flow control is off
	disagg    bool         // cfg.Disaggregation.Enabled(), read once
}

type poolRouting struct {
	cfg   config.RoutingConfig
	strat Strategy
}

// NewPool builds a pool from its config (defaults applied), reusing
// instances from prev with the same id and URL so that in-flight counts and
// health survive a reload. prev may be nil.
//
// Building changes nothing prev shares with the new pool: what the new pool
// must change there (a kept queue pointed at it, a kept exact-routing
// state told of its routing, the health of reused instances when health
// checks are off) is its commit, which NewTable's commit runs once the
// table is published. A pool that is never published (a reload that fails
// on a later pool) leaves prev as it was.
func NewPool(cfg config.PoolConfig, prev *Pool, opts ...PoolOption) (*Pool, error) {
	p := &Pool{cfg: cfg, byID: make(map[string]*Instance, len(cfg.Instances)), disagg: cfg.Disaggregation.Enabled()}
	for _, o := range opts {
		o(p)
	}
	for _, ic := range cfg.Instances {
		var in *Instance
		if prev != nil {
			if old := prev.byID[ic.ID]; old != nil && old.url.String() == ic.URL && slices.Equal(old.configured, ic.Adapters) && old.role == roleOf(ic.Role) {
				in = old
			}
		}
		if in == nil {
			var err error
			if in, err = NewInstance(ic.ID, ic.URL, ic.Adapters...); err != nil {
				return nil, fmt.Errorf("router: pool %q: %w", cfg.Name, err)
			}
			in.role = roleOf(ic.Role)
		}
		p.instances = append(p.instances, in)
		p.byID[in.id] = in
	}
	r, err := p.newRouting(cfg.Routing)
	if err != nil {
		return nil, fmt.Errorf("router: pool %q: %w", cfg.Name, err)
	}
	p.routing.Store(r)
	if p.flow, err = newFlowControl(cfg.FlowControl, p, prev); err != nil {
		return nil, fmt.Errorf("router: pool %q: %w", cfg.Name, err)
	}
	return p, nil
}

// commit makes the pool the one the state it shares with the pool it
// replaced serves: its queue reads its budgets and instances from it, its
// exact-routing state compares under its routing and keeps what its
// strategy was built with (routingChanged), and with health checks off
// its instances are admitted (nothing would ever re-admit them).
func (p *Pool) commit() {
	if p.flow != nil {
		p.flow.pool.Store(p)
	}
	p.routingChanged(p.routing.Load())
	if p.cfg.Health.Disable {
		for _, in := range p.instances {
			in.SetHealthy(true)
		}
	}
	p.PokeQueue() // its instances and budgets are the queue's now
}

// Name is the pool's name.
func (p *Pool) Name() string { return p.cfg.Name }

// Model is the pool's base model name.
func (p *Pool) Model() string { return p.cfg.Model }

// Config is the pool's configuration as loaded (routing as at load time;
// see Routing for the current one).
func (p *Pool) Config() config.PoolConfig { return p.cfg }

// Disaggregated reports whether the pool splits requests into prefill and
// decode (its config's disaggregation, read when the pool was built: the
// request path reads typed values, not the config's methods).
func (p *Pool) Disaggregated() bool { return p.disagg }

// Instances lists the pool's instances in configuration order.
func (p *Pool) Instances() []*Instance { return slices.Clone(p.instances) }

// Instance returns the pool's instance named id.
func (p *Pool) Instance(id string) (*Instance, bool) {
	in, ok := p.byID[id]
	return in, ok
}

// Queue is the pool's admission queue and its configuration; nil, nil
// when flow control is off.
func (p *Pool) Queue() (*flowcontrol.Gate, *config.FlowControlConfig) {
	if p.flow == nil {
		return nil, nil
	}
	return p.flow.gate, &p.flow.cfg
}

// Routing returns the current routing config and strategy.
func (p *Pool) Routing() (config.RoutingConfig, Strategy) {
	r := p.routing.Load()
	return r.cfg, r.strat
}

// SetRouting validates rc, builds its strategy and swaps it in.
func (p *Pool) SetRouting(rc config.RoutingConfig) error {
	r, err := p.newRouting(rc)
	if err != nil {
		return err
	}
	p.routingChanged(r)
	p.routing.Store(r)
	p.PokeQueue() // a higher concurrency_threshold raises the queue's budget
	return nil
}

// newRouting validates rc and builds its strategy, changing nothing.
func (p *Pool) newRouting(rc config.RoutingConfig) (*poolRouting, error) {
	rc = rc.WithDefaults()
	if err := rc.Validate(); err != nil {
		return nil, err
	}
	st, err := NewStrategy(rc.Strategy, rc, WithKVState(p.kv))
	if err != nil {
		return nil, err
	}
	return &poolRouting{cfg: rc, strat: st}, nil
}

// routingChanged tells the exact-routing state the pool routes with r, r's
// commit: a new routing mode starts a new comparison (figures of two
// strategies are never summed), and the state keeps what r's strategy was
// built with (kv_aware's speculative overlay).
func (p *Pool) routingChanged(r *poolRouting) {
	if p.kv != nil {
		p.kv.RoutingChanged(r.strat, r.cfg.Shadow)
	}
}

// ServesAdapter reports whether name is an adapter of this pool, configured
// or held by any instance.
func (p *Pool) ServesAdapter(name string) bool {
	if slices.Contains(p.cfg.Adapters, name) {
		return true
	}
	for _, in := range p.instances {
		if in.HasAdapter(name) {
			return true
		}
	}
	return false
}

// Adapters lists the adapters served by the pool, sorted, without duplicates.
func (p *Pool) Adapters() []string {
	set := map[string]bool{}
	for _, a := range p.cfg.Adapters {
		set[a] = true
	}
	for _, in := range p.instances {
		for _, a := range in.Adapters() {
			set[a] = true
		}
	}
	out := make([]string, 0, len(set))
	for a := range set {
		out = append(out, a)
	}
	slices.Sort(out)
	return out
}

// Candidates appends to dst the healthy instances eligible for a request
// for adapter ("" = base model; a pool-level adapter is held by every
// instance, an instance-level one only where configured or discovered),
// skipping exclude. When no healthy instance holds the adapter and
// adapter_fallback is "all", every healthy instance is eligible (fellBack
// reports it).
func (p *Pool) Candidates(dst []*Instance, adapter string, exclude *Instance) (cands []*Instance, fellBack bool) {
	dst = dst[:0]
	everywhere := p.everywhere(adapter)
	for _, in := range p.instances {
		if in != exclude && servesAggregated(in) && (everywhere || in.HasAdapter(adapter)) {
			dst = append(dst, in)
		}
	}
	if len(dst) == 0 && adapter != "" && p.cfg.AdapterFallback == "all" {
		for _, in := range p.instances {
			if in != exclude && servesAggregated(in) {
				dst = append(dst, in)
			}
		}
		return dst, len(dst) > 0
	}
	return dst, false
}

// servesAggregated reports whether in may take a request now other than a
// disaggregated one's prefill: healthy, not a prefill-role instance.
func servesAggregated(in *Instance) bool { return in.Healthy() && in.role != config.RolePrefill }

// everywhere reports whether every instance holds adapter: none asked
// for, or a pool-level one (every instance was started with it); else
// only the instances that list it do.
func (p *Pool) everywhere(adapter string) bool {
	return adapter == "" || slices.Contains(p.cfg.Adapters, adapter)
}

// Eligible is, for the flow-control queue, the test of the instances a
// request for adapter may go to (flowcontrol.Item.Eligible), as
// Candidates chooses them: nil when any may (no adapter, or a pool-level
// one), else those holding it — nil again with adapter_fallback "all"
// when no healthy instance holds it now.
func (p *Pool) Eligible(adapter string) func(instance string) bool {
	if p.everywhere(adapter) {
		return nil
	}
	if p.cfg.AdapterFallback == "all" && !slices.ContainsFunc(p.instances, func(in *Instance) bool {
		return servesAggregated(in) && in.HasAdapter(adapter)
	}) {
		return nil
	}
	return func(id string) bool {
		in := p.byID[id]
		return in != nil && in.HasAdapter(adapter)
	}
}

// PrefillCandidates appends to dst the healthy prefill instances (role
// prefill) eligible for adapter, skipping exclude: the first stage of a
// disaggregated request. Candidates never returns them: a prefill
// instance takes only prefill requests.
func (p *Pool) PrefillCandidates(dst []*Instance, adapter string, exclude *Instance) []*Instance {
	dst = dst[:0]
	everywhere := p.everywhere(adapter)
	for _, in := range p.instances {
		if in.role != config.RolePrefill || in == exclude || !in.Healthy() {
			continue
		}
		if !everywhere && !in.HasAdapter(adapter) {
			continue
		}
		dst = append(dst, in)
	}
	return dst
}

// roleOf normalises a configured role ("" is both).
func roleOf(r string) string {
	if r == "" {
		return config.RoleBoth
	}
	return r
}

// PoolStatus is the admin view of a pool.
type PoolStatus struct {
	Name      string               `json:"name"`
	Model     string               `json:"model"`
	Adapters  []string             `json:"adapters"`
	Routing   config.RoutingConfig `json:"routing"`
	Instances []InstanceStatus     `json:"instances"`
}

// InstanceStatus is the admin view of an instance.
type InstanceStatus struct {
	ID       string   `json:"id"`
	URL      string   `json:"url"`
	Healthy  bool     `json:"healthy"`
	InFlight int      `json:"in_flight"`
	Adapters []string `json:"adapters"`
}

// Status reports the pool's live state.
func (p *Pool) Status() PoolStatus {
	rc, _ := p.Routing()
	ps := PoolStatus{Name: p.Name(), Model: p.Model(), Adapters: p.Adapters(), Routing: rc}
	for _, in := range p.Instances() {
		ps.Instances = append(ps.Instances, InstanceStatus{ID: in.ID(), URL: in.URL().String(), Healthy: in.Healthy(), InFlight: in.InFlight(), Adapters: in.Adapters()})
	}
	return ps
}
