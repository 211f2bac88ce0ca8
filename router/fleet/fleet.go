// Package fleet keeps the router's pool table equal to the configuration
// file plus the instances the KV-state pipeline discovered from bridge
// heartbeats. The pipeline (package kvstate) only reports what it found
// (kvstate.Discovery); the router (router/httpapi's Server) only applies whole
// configurations (Server.Reload). Fleet is the one place that joins the
// two, so neither calls back into the other.
package fleet

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/tick"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvstate"
)

// Pools is the pool table fleet applies configurations to (httpapi.Server).
type Pools interface {
	Reload(config.Config) error
	Pool(name string) (*router.Pool, bool)
}

// Discoverer is the KV-state pipeline side (kvstate.Pipeline).
type Discoverer interface {
	Admit(config.Config) *kvstate.Admission
	Readmit(*kvstate.Admission)
	Discover(base config.Config) kvstate.Discovery
	Publish(kvstate.Discovery) map[string]bool
	Unpublish(map[string]bool)
	Report(prev map[string]bool, d kvstate.Discovery)
}

var _ Discoverer = (*kvstate.Pipeline)(nil)

// DefaultInterval is how often Run looks for discovered instances.
const DefaultInterval = time.Second

// Reconciler applies file configurations (Apply, on SIGHUP) and
// heartbeat discoveries (Run) to the pool table, one at a time.
type Reconciler struct {
	pools    Pools
	disc     Discoverer
	log      *slog.Logger
	interval time.Duration

	// mu serialises applies and guards base and applied.
	mu      sync.Mutex
	base    config.Config // the file's configuration, before discovered instances
	applied string        // fingerprint of the discovered instances last applied
}

// New returns a Reconciler for the pool table and the pipeline, with base
// the configuration the table was built from. interval <= 0 means
// DefaultInterval; a nil log, slog.Default().
func New(pools Pools, disc Discoverer, base config.Config, interval time.Duration, log *slog.Logger) *Reconciler {
	if interval <= 0 {
		interval = DefaultInterval
	}
	if log == nil {
		log = slog.Default()
	}
	return &Reconciler{pools: pools, disc: disc, log: log, interval: interval, base: base}
}

// Apply applies a new file configuration, keeping the heartbeat-discovered
// instances. On error the running configuration is kept.
func (r *Reconciler) Apply(cfg config.Config) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	prevAdm := r.disc.Admit(cfg)
	if err := r.applyLocked(r.disc.Discover(cfg)); err != nil {
		r.disc.Readmit(prevAdm)
		return err
	}
	r.base = cfg
	return nil
}

// Run adds instances announced by heartbeats to their pools and removes
// purged ones, checking every interval until ctx ends. A change reloads
// the pools with the base configuration plus the discovered instances,
// keeping each pool's current (possibly admin-changed) routing.
func (r *Reconciler) Run(ctx context.Context) error {
	_ = tick.Every(ctx, r.interval, r.sync)
	return nil
}

func (r *Reconciler) sync() {
	r.mu.Lock()
	defer r.mu.Unlock()
	d := r.disc.Discover(r.base)
	if d.Fingerprint == r.applied {
		return
	}
	for i, pc := range d.Config.Pools {
		if p, ok := r.pools.Pool(pc.Name); ok {
			d.Config.Pools[i].Routing, _ = p.Routing()
		}
	}
	if err := r.applyLocked(d); err != nil {
		r.log.Error("discovered instances not applied", "err", err)
	}
}

// applyLocked publishes d's discovered set, reloads the pools with
// d.Config (which forgets the instances that left: Pools.Reload) and
// reports who joined and left (r.mu held).
func (r *Reconciler) applyLocked(d kvstate.Discovery) error {
	prev := r.disc.Publish(d)
	if err := r.pools.Reload(d.Config); err != nil {
		r.disc.Unpublish(prev)
		return err
	}
	r.applied = d.Fingerprint
	r.disc.Report(prev, d)
	return nil
}
