package router

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestQueueBudgetsLeavePrefillInstancesOut: in a pool with prefill-role
// instances, the queue's concurrency budget and its per-instance budgets
// are the decode-capable instances': an admitted request holds a decode
// (or both) instance for its whole generation, where its ticket is bound,
// and a prefill instance only for its prefill stage, which the queue never
// binds. Counting the prefill set raised the budget by (P+D)/D and gave
// per-instance budgets idle instances that no request is ever charged to.
func TestQueueBudgetsLeavePrefillInstancesOut(t *testing.T) {
	pc := config.PoolConfig{Name: "pd", Model: "m",
		Routing:        config.RoutingConfig{Strategy: config.StrategyRoundRobin, ConcurrencyThreshold: 4},
		Disaggregation: &config.DisaggregationConfig{Mode: config.DisaggAlways},
		FlowControl:    &config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 1000},
		Instances: []config.InstanceConfig{
			{ID: "p0", URL: "http://p0", Role: config.RolePrefill},
			{ID: "p1", URL: "http://p1", Role: config.RolePrefill},
			{ID: "p2", URL: "http://p2", Role: config.RolePrefill},
			{ID: "d0", URL: "http://d0", Role: config.RoleDecode},
			{ID: "m0", URL: "http://m0"},
		}}
	tbl, commit, err := NewTable(config.Config{Pools: []config.PoolConfig{pc}}, nil, func(config.PoolConfig, *Pool) (Exact, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	commit()
	p, _ := tbl.Pool("pd")
	conc, _ := p.flow.limits()
	insts := p.flow.instances()
	slices.Sort(insts)
	if conc != 8 || !slices.Equal(insts, []string{"d0", "m0"}) {
		t.Fatalf("2 decode-capable instances at threshold 4 (and 3 prefill instances): max_concurrency %d over %v, want 8 over [d0 m0]", conc, insts)
	}
	// Only prefill instances healthy: one request goes through, to be
	// answered by the strategy (no eligible instance) rather than held.
	for _, in := range p.instances {
		if in.role != config.RolePrefill {
			in.SetHealthy(false)
		}
	}
	if conc, _ := p.flow.limits(); conc != 4 || len(p.flow.instances()) != 0 {
		t.Fatalf("no healthy decode-capable instance: max_concurrency %d over %v, want 4 (one instance's) over none", conc, p.flow.instances())
	}
}
