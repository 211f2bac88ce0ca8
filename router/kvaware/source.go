package kvaware

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"reflect"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
)

// IndexFunc gives a pool its KV block index and the freshness of its event
// stream (the KV-state pipeline's KV; a nil Freshness = always fresh). A
// nil index makes kv_aware and shadow mode unavailable for the pool.
type IndexFunc func(pool config.PoolConfig) (kvindex.Index, kvindex.Freshness)

// Source builds the exact-routing state of a server's pools from their
// configuration: the one constructor of this package that a server calls
// (per pool, on start and on every reload). Its metrics are shared by all
// pools.
type Source struct {
	kv    IndexFunc
	m     *KVMetrics
	log   *slog.Logger
	probe *http.Client
}

// NewSource returns a Source over kv. Attach registers its metrics.
func NewSource(kv IndexFunc) *Source {
	return &Source{kv: kv, m: newKVMetrics(), log: slog.Default(),
		probe: &http.Client{Transport: &http.Transport{Proxy: nil, DialContext: (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext, MaxIdleConnsPerHost: 2}}}
}

// Attach registers the metrics on reg and logs to log (nil = slog.Default()).
func (s *Source) Attach(reg prometheus.Registerer, log *slog.Logger) error {
	if log != nil {
		s.log = log
	}
	return s.m.set.Register(reg)
}

// For returns pool pc's exact-routing state, keeping prev across a reload
// when the pool's index, model and tokenizer are unchanged (so that a
// reload loses no pending prefill, speculative entry or comparison); nil,
// nil when the pool has no index.
func (s *Source) For(pc config.PoolConfig, prev router.Exact, prevCfg config.PoolConfig) (router.Exact, error) {
	if s == nil || s.kv == nil {
		return nil, nil
	}
	idx, fresh := s.kv(pc)
	if idx == nil {
		return nil, nil
	}
	if old, ok := prev.(*KVState); ok && old.index == idx && prevCfg.Model == pc.Model &&
		reflect.DeepEqual(prevCfg.Tokenizer, pc.Tokenizer) {
		return old, nil
	}
	tokens, err := NewTokenSource(pc.Tokenizer, pc)
	if err != nil {
		return nil, err
	}
	st, err := NewKVState(KVStateConfig{
		Pool: pc.Name, Model: pc.Model, Index: idx, Freshness: fresh, Tokens: tokens,
		Metrics: s.m, Logger: s.log,
	})
	if err != nil {
		return nil, err
	}
	st.probe = s.probe
	return st, nil
}

// ForgetInstance drops the per-instance series of an instance that left
// its pool (the pool's KVState, if it still has one, drops its state too:
// KVState.ForgetInstance).
func (s *Source) ForgetInstance(pool, instance string) {
	s.m.forget(pool, instance)
}

// Of is a pool's exact-routing state, nil when it has none.
func Of(p *router.Pool) *KVState {
	st, _ := p.Exact().(*KVState)
	return st
}

// RoutingChanged implements router.Exact: a new routing mode starts a new
// comparison, and the speculative overlay s was built with becomes the
// kept one.
func (st *KVState) RoutingChanged(s router.Strategy, shadow bool) {
	st.cmp.setMode(s.Name(), shadow, st.now())
	st.keepOverlay(s)
}

// Run implements router.Exact: it scrapes the engines' load (/metrics)
// every scrape interval of rc until ctx ends.
func (st *KVState) Run(ctx context.Context, rc config.RoutingConfig, instances func() []*router.Instance) {
	st.SetInstances(instances)
	sc := resolveScoring(rc.KV)
	if sc.scrape < 0 {
		return
	}
	client := st.probe
	if client == nil {
		client = http.DefaultClient
	}
	st.runScraper(ctx, client, instances, sc.scrape, sc.scrapeTimeout, sc.scrapePath)
}

// Freshness is the freshness source of the pool's event stream (nil =
// always fresh).
func (st *KVState) Freshness() kvindex.Freshness { return st.fresh }
