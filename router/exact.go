package router

import (
	"context"
	"errors"

	"github.com/kvrouter/kvrouter/config"
)

// ErrNoKVState is returned when kv_aware (or shadow mode) is selected for a
// pool that has no KV index.
var ErrNoKVState = errors.New("router: kv_aware needs a KV index for the pool")

// Exact is a pool's exact-routing state: what its engines hold (the KV
// index), what the router has sent them since, and how its predictions
// compared with what they reported. router/kvaware builds it (KVState);
// the core knows it only as the maker of the pool's kv_aware and shadow
// strategies, so that the core needs no index, metrics or transport.
type Exact interface {
	// Strategy builds rc's strategy when it needs exact state: kv_aware,
	// or any strategy in shadow mode. rnd is the strategy's randomness
	// (WithSeed).
	Strategy(rc config.RoutingConfig, rnd func(n uint64) uint64) (Strategy, error)
	// RoutingChanged says the pool now routes with s (shadowed or not),
	// one of the state's strategies or any other: figures of two routing
	// modes are never summed, and what s was built to change in the state
	// is changed now. It is the commit of a strategy (a runtime switch, or
	// a reload once its table is published), so building one changes
	// nothing a strategy in use reads.
	RoutingChanged(s Strategy, shadow bool)
	// Run runs the state's background work for the pool's instances (the
	// engines' load scraping, per rc) until ctx ends; it returns at once
	// when rc asks for none.
	Run(ctx context.Context, rc config.RoutingConfig, instances func() []*Instance)
	// ForgetInstance drops what the state keeps about an instance that
	// left the pool (its series included): one that returns starts anew.
	ForgetInstance(id string)
}

// WithKVState gives NewStrategy the pool's exact-routing state, which
// kv_aware and shadow mode need.
func WithKVState(st Exact) StrategyOption {
	return func(o *strategyOptions) { o.kv = st }
}

// PoolOption adjusts a pool built by NewPool.
type PoolOption func(*Pool)

// WithPoolKVState gives the pool its exact-routing state (nil = none).
func WithPoolKVState(st Exact) PoolOption {
	return func(p *Pool) { p.kv = st }
}

// Exact is the pool's exact-routing state, nil when it has no KV index.
func (p *Pool) Exact() Exact { return p.kv }
