package router

import (
	"context"
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// modes records the routing modes an Exact was told of.
type modes struct{ seen []string }

func (*modes) Strategy(config.RoutingConfig, func(uint64) uint64) (Strategy, error) {
	return nil, ErrNoKVState
}
func (m *modes) RoutingChanged(s Strategy, _ bool)                           { m.seen = append(m.seen, s.Name()) }
func (*modes) Run(context.Context, config.RoutingConfig, func() []*Instance) {}
func (*modes) ForgetInstance(string)                                         {}

// TestNewTableChangesNothingUntilCommit: building a table over prev
// changes nothing prev's pools share with it — the kept queue's budget and
// instances, the kept exact state's routing mode, the health of reused
// instances — whether the build then fails (a later pool's state cannot be
// made) or succeeds; commit moves them over.
func TestNewTableChangesNothingUntilCommit(t *testing.T) {
	kv := &modes{}
	errB := errors.New("pool b: no tokenizer")
	failB := false
	kvFor := func(pc config.PoolConfig, _ *Pool) (Exact, error) {
		if pc.Name == "b" && failB {
			return nil, errB
		}
		if pc.Name == "a" {
			return kv, nil
		}
		return nil, nil
	}
	a := config.PoolConfig{Name: "a", Model: "ma", Routing: config.RoutingConfig{Strategy: config.StrategyPrefixAware, ConcurrencyThreshold: 8},
		FlowControl: &config.FlowControlConfig{Enabled: true},
		Instances:   []config.InstanceConfig{{ID: "a-0", URL: "http://a-0"}, {ID: "a-1", URL: "http://a-1"}}}
	b := config.PoolConfig{Name: "b", Model: "mb", Instances: []config.InstanceConfig{{ID: "b-0", URL: "http://b-0"}}}
	cfg := config.Config{Pools: []config.PoolConfig{a, b}}
	t1, commit, err := NewTable(cfg, nil, kvFor)
	if err != nil {
		t.Fatal(err)
	}
	commit()
	pa, _ := t1.Pool("a")
	pa.instances[1].SetHealthy(false)
	budget := func() (int, int) {
		conc, _ := pa.flow.limits()
		return conc, len(pa.flow.instances())
	}
	if c, n := budget(); c != 8 || n != 1 || len(kv.seen) != 1 {
		t.Fatalf("before: max_concurrency %d over %d instances, modes %v", c, n, kv.seen)
	}

	next := cfg
	next.Pools = []config.PoolConfig{a, b}
	next.Pools[0].Routing = config.RoutingConfig{Strategy: config.StrategyLeastOutstanding, ConcurrencyThreshold: 1}
	next.Pools[0].Health.Disable = true
	next.Pools[0].Instances = append(next.Pools[0].Instances, config.InstanceConfig{ID: "a-2", URL: "http://a-2"})
	unchanged := func(when string) {
		t.Helper()
		if c, n := budget(); c != 8 || n != 1 {
			t.Errorf("%s: the running queue reads max_concurrency %d over %d instances, want 8 over 1", when, c, n)
		}
		if pa.instances[1].Healthy() {
			t.Errorf("%s: an ejected instance was re-admitted", when)
		}
		if len(kv.seen) != 1 {
			t.Errorf("%s: the kept exact state was told of routing %v", when, kv.seen[1:])
		}
	}

	failB = true
	if _, c, err := NewTable(next, t1, kvFor); !errors.Is(err, errB) || c != nil {
		t.Fatalf("failed build: err %v, commit %v", err, c != nil)
	}
	unchanged("after a failed build")

	failB = false
	t2, commit, err := NewTable(next, t1, kvFor)
	if err != nil {
		t.Fatal(err)
	}
	unchanged("built, not committed")
	commit()
	p2, _ := t2.Pool("a")
	if p2.flow != pa.flow {
		t.Fatal("an unchanged flow_control did not keep its queue")
	}
	if c, n := budget(); c != 3 || n != 3 {
		t.Errorf("committed: max_concurrency %d over %d instances, want 3 over 3", c, n)
	}
	if len(kv.seen) != 2 || kv.seen[1] != config.StrategyLeastOutstanding {
		t.Errorf("committed: modes %v", kv.seen)
	}
}
