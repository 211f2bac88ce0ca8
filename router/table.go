package router

import "github.com/kvrouter/kvrouter/config"

// The pool table: what Resolve reads and a reload replaces. The server
// publishes one table at a time (atomically); every edge resolves against
// the table it loaded, so a request never sees two configurations.

// state is one loaded configuration: immutable once published, replaced
// whole on reload.
type state struct {
	cfg         config.Config
	pools       []*Pool
	byName      map[string]*Pool
	byModel     map[string]*Pool
	defaultPool *Pool
	retryStatus map[int]bool
}

// buildState builds the table of cfg, keeping what prev's pools of the same
// name hold (instances' in-flight counts and health, exact-routing state
// through kvFor) across a reload.
func buildState(cfg config.Config, prev *state, kvFor func(config.PoolConfig, *Pool) (Exact, error)) (*state, error) {
	st := &state{cfg: cfg, byName: map[string]*Pool{}, byModel: map[string]*Pool{}, retryStatus: map[int]bool{}}
	for _, c := range cfg.Proxy.RetryStatuses {
		if c != 0 {
			st.retryStatus[c] = true
		}
	}
	for _, pc := range cfg.Pools {
		var old *Pool
		if prev != nil {
			old = prev.byName[pc.Name]
		}
		kv, err := kvFor(pc, old)
		if err != nil {
			return nil, err
		}
		p, err := NewPool(pc, old, WithPoolKVState(kv))
		if err != nil {
			return nil, err
		}
		st.pools = append(st.pools, p)
		st.byName[p.Name()] = p
		st.byModel[p.Model()] = p
	}
	if cfg.DefaultPool != "" {
		st.defaultPool = st.byName[cfg.DefaultPool]
	}
	return st, nil
}
