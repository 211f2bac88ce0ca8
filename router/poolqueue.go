package router

import (
	"reflect"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
)

// flowControl is a pool's admission queue. It outlives a reload that
// leaves flow_control unchanged (its waiting and admitted requests stay
// counted); pool points at the pool currently serving it.
type flowControl struct {
	cfg  config.FlowControlConfig
	gate *flowcontrol.Gate
	pool atomic.Pointer[Pool]
}

// newFlowControl returns p's queue: prev's when its configuration is
// unchanged, a new one otherwise, nil when flow control is off. prev's
// queue goes on reading prev until p is committed (Pool.commit): a reload
// that fails leaves it as it was.
func newFlowControl(cfg *config.FlowControlConfig, p, prev *Pool) (*flowControl, error) {
	if !cfg.On() {
		return nil, nil
	}
	if prev != nil && prev.flow != nil && reflect.DeepEqual(prev.flow.cfg, *cfg) {
		return prev.flow, nil
	}
	f := &flowControl{cfg: *cfg}
	f.pool.Store(p)
	g, err := flowcontrol.NewGate(queueConfig(cfg), flowcontrol.WithLimits(f.limits), flowcontrol.WithInstances(f.instances))
	if err != nil {
		return nil, err
	}
	f.gate = g
	return f, nil
}

// queueConfig is the queue a pool's flow_control asks for; the pool-wide
// concurrency budget and the healthy instances are read from the pool at
// each decision (limits, instances). The prefill budget holds per
// instance: a request goes to an instance with room for it (route), so no
// engine queues more than its budget, and prompts larger than it leave one
// instance to the requests that fit it (flowcontrol.Config.ReserveInstance).
// With kv_aware each request carries the tokens every instance holds
// (httpapi's cachedHolds), and a freed slot goes to the due request that
// holds most on an instance with room (flowcontrol.Config.PreferCached).
// Instances are still charged whole prompts: charging only uncached tokens
// (Config.ChargeUncached) lowered goodput under overload (docs/BENCHMARKS.md
// §12).
func queueConfig(c *config.FlowControlConfig) flowcontrol.Config {
	return flowcontrol.Config{MaxQueue: c.MaxQueue, MaxWait: c.MaxWait, AgingStep: c.AgingStep, Weights: c.TenantWeights,
		InstancePrefill: c.PrefillTokensPerInstance, ReserveInstance: true, PreferCached: true}
}

// instances are the pool's healthy decode-capable instances (role decode
// or both), where the per-instance budgets hold. An admitted request is
// bound to the instance route picks for it (flowcontrol.Ticket.Bind), one
// of these, and holds it for its whole generation; a disaggregated
// request's prefill stage holds a prefill-role instance for the prefill
// alone and is never bound. Listed, a prefill instance would always have
// room, and the per-instance budgets would admit past every instance a
// request can be bound to (docs/disaggregation.md, "Flow control").
func (f *flowControl) instances() []string {
	p := f.pool.Load()
	out := make([]string, 0, len(p.instances))
	for _, in := range p.instances {
		if servesAggregated(in) {
			out = append(out, in.ID())
		}
	}
	return out
}

// limits is the pool's budget now: the configured concurrency, or the
// concurrency threshold of every healthy decode-capable instance (the
// prefill budget is per instance: queueConfig). A request holds a decode
// slot from its decode pick to its end, a prefill instance only for its
// prefill stage, so the decode set bounds how many requests run at once;
// the prefill set's own load is the prefill pick's (its threshold,
// conditional mode's prefill_saturated). With no healthy decode-capable
// instance one instance's worth goes through, to be answered 503 by the
// strategy rather than held.
func (f *flowControl) limits() (int, int64) {
	p := f.pool.Load()
	rc, _ := p.Routing()
	n := 0
	for _, in := range p.instances {
		if servesAggregated(in) {
			n++
		}
	}
	n = max(n, 1)
	conc := f.cfg.MaxConcurrency
	if conc == 0 {
		conc = n * rc.ConcurrencyThreshold
	}
	return conc, 0
}

// PokeQueue tells the pool's queue that its budgets or instances may have
// changed (an instance healthy again, a routing or reload change): it
// admits at once the waiters that now have room (flowcontrol.Gate.Poke).
func (p *Pool) PokeQueue() {
	if f := p.flow; f != nil {
		f.gate.Poke()
	}
}

// QueueStatus is GET /admin/pools/{pool}/queue: whether flow control is on
// and, when it is, the queue's state.
type QueueStatus struct {
	Pool    string                    `json:"pool"`
	Enabled bool                      `json:"enabled"`
	Config  *config.FlowControlConfig `json:"config,omitempty"`
	Queue   *flowcontrol.Stats        `json:"queue,omitempty"`
}

// QueueStatus reports the pool's flow-control queue.
func (p *Pool) QueueStatus() QueueStatus {
	qs := QueueStatus{Pool: p.Name()}
	if f := p.flow; f != nil {
		st := f.gate.Stats()
		cfg := f.cfg
		qs.Enabled, qs.Config, qs.Queue = true, &cfg, &st
	}
	return qs
}
