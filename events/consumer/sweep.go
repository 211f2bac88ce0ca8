package consumer

import (
	"context"

	"github.com/kvrouter/kvrouter/kvindex"
)

// Sweeper is a shared index that can purge the instances silent for
// longer than its own TTL, including those no running router has seen
// (they died while none ran): kvindex.Redis, whose block keys carry no
// TTL.
type Sweeper interface {
	Sweep(ctx context.Context) ([]string, error)
}

var _ Sweeper = (*kvindex.Redis)(nil)

// Forgetter is a shared-index Applier that keeps per-instance state of its
// own beside the index (the router's tier accounting): a purged
// instance's is dropped (Forget), while the index's, which other routers
// share, is left to its TTL and Sweep. Without it, with pod names that
// change at every rollout, that state would grow for the router's life.
type Forgetter interface {
	Forget(instance string)
}

// sweep runs the shared index's Sweep, when it has one (every PurgeAfter,
// from watchShared).
func (c *Consumer) sweep(ctx context.Context) {
	sw, ok := c.shared.idx.(Sweeper)
	if !ok {
		return
	}
	gone, err := sw.Sweep(ctx)
	if err != nil {
		c.cfg.Logger.Warn("consumer: sweep of the shared index failed", "err", err)
		return
	}
	if len(gone) > 0 {
		c.m.purges.Add(float64(len(gone)))
		c.cfg.Logger.Info("consumer: swept instances silent for longer than the index TTL", "instances", gone)
	}
}
