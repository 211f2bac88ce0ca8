package router

import (
	"fmt"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/config"
)

// Instance is one model server as the router sees it: identity, health,
// in-flight requests and the LoRA adapters it holds. All routing state about
// an instance lives here, so strategies, the proxy, health checks and metrics
// agree on one view. It needs no network to construct (the simulator in
// kvbench builds instances and calls Acquire/Release itself).
//
// All methods are safe for concurrent use.
type Instance struct {
	id   string
	url  *url.URL
	hash uint64 // xxhash of id: the instance's half of every rendezvous score

	healthy  atomic.Bool
	inflight atomic.Int64

	// role in disaggregated serving (config.RoleBoth, RolePrefill,
	// RoleDecode); fixed for the instance's life (a reload with another
	// role makes a new Instance).
	role string

	// configured adapters never change; discovered ones are swapped whole.
	configured []string
	adapters   atomic.Pointer[adapterSet]

	// streakMu guards fails and oks, the consecutive health-probe results
	// that decide ejection and re-admission.
	streakMu sync.Mutex
	fails    int
	oks      int
}

type adapterSet struct {
	names map[string]struct{}
	list  []string // sorted, for listing
}

// NewInstance returns a healthy, idle instance. rawURL is the base URL of
// its OpenAI-compatible server; adapters are LoRA adapters known to be loaded.
func NewInstance(id, rawURL string, adapters ...string) (*Instance, error) {
	if id == "" {
		return nil, fmt.Errorf("router: instance id is empty")
	}
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("router: instance %q: url %q: want an absolute http(s) URL", id, rawURL)
	}
	in := &Instance{id: id, url: u, hash: xxhash.Sum64String(id), role: config.RoleBoth, configured: slices.Clone(adapters)}
	in.healthy.Store(true)
	in.SetDiscoveredAdapters(nil)
	return in, nil
}

// Role is the instance's disaggregated-serving role (config.RoleBoth,
// RolePrefill or RoleDecode).
func (i *Instance) Role() string { return i.role }

// ID is the instance's identifier, unique within its pool.
func (i *Instance) ID() string { return i.id }

// URL is the instance's base URL. Callers must not modify it.
func (i *Instance) URL() *url.URL { return i.url }

// Healthy reports whether active health checks admit the instance.
func (i *Instance) Healthy() bool { return i.healthy.Load() }

// SetHealthy forces the health state and resets the probe streaks.
func (i *Instance) SetHealthy(ok bool) {
	i.streakMu.Lock()
	i.fails, i.oks = 0, 0
	i.healthy.Store(ok)
	i.streakMu.Unlock()
}

// Eject takes a healthy instance out of routing at once, on evidence other
// than the health probes (its kvbridge reports the engine down), and
// resets the probe streaks: healthyAfter successes re-admit it as after
// probes ejected it. It reports whether the state changed.
func (i *Instance) Eject() (changed bool) {
	i.streakMu.Lock()
	defer i.streakMu.Unlock()
	if !i.healthy.Load() {
		return false
	}
	i.fails, i.oks = 0, 0
	i.healthy.Store(false)
	return true
}

// ObserveProbe records one health-probe result: unhealthyAfter consecutive
// failures eject a healthy instance, healthyAfter consecutive successes
// re-admit an ejected one. It reports whether the state changed.
func (i *Instance) ObserveProbe(ok bool, unhealthyAfter, healthyAfter int) (changed bool) {
	i.streakMu.Lock()
	defer i.streakMu.Unlock()
	if ok {
		i.fails = 0
		i.oks++
		if !i.healthy.Load() && i.oks >= healthyAfter {
			i.healthy.Store(true)
			return true
		}
		return false
	}
	i.oks = 0
	i.fails++
	if i.healthy.Load() && i.fails >= unhealthyAfter {
		i.healthy.Store(false)
		return true
	}
	return false
}

// InFlight is the number of requests the router has sent to the instance
// that have not finished.
func (i *Instance) InFlight() int { return int(i.inflight.Load()) }

// Acquire counts one more request in flight.
func (i *Instance) Acquire() { i.inflight.Add(1) }

// Release counts one request finished.
func (i *Instance) Release() { i.inflight.Add(-1) }

// Full reports whether the instance has threshold or more requests in flight.
func (i *Instance) Full(threshold int) bool { return i.InFlight() >= threshold }

// Available is Healthy and not Full.
func (i *Instance) Available(threshold int) bool { return i.Healthy() && !i.Full(threshold) }

// HasAdapter reports whether the instance holds LoRA adapter name
// (configured or discovered).
func (i *Instance) HasAdapter(name string) bool {
	_, ok := i.adapters.Load().names[name]
	return ok
}

// Adapters lists the adapters the instance holds, sorted.
func (i *Instance) Adapters() []string { return slices.Clone(i.adapters.Load().list) }

// SetDiscoveredAdapters replaces the adapters learned from the instance's
// /v1/models; configured adapters are always kept. It reports whether the
// instance gained an adapter: requests for it waiting in the pool's queue
// may fit there now (Pool.PokeQueue).
func (i *Instance) SetDiscoveredAdapters(names []string) (gained bool) {
	old := i.adapters.Load()
	s := &adapterSet{names: make(map[string]struct{}, len(names)+len(i.configured)), list: []string{}}
	for _, n := range i.configured {
		s.names[n] = struct{}{}
	}
	for _, n := range names {
		s.names[n] = struct{}{}
	}
	for n := range s.names {
		s.list = append(s.list, n)
	}
	slices.Sort(s.list)
	i.adapters.Store(s)
	if old == nil {
		return false // the instance's first set, at its creation
	}
	for n := range s.names {
		if _, ok := old.names[n]; !ok {
			return true
		}
	}
	return false
}
