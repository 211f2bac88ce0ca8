package tiermetrics

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/metricset"
	"github.com/kvrouter/kvrouter/tiers"
)

// Metric names exported by Accounting.
const (
	MetricBlocksHeld     = "kvrouter_tier_blocks"
	MetricBlocksStored   = "kvrouter_tier_blocks_stored_total"
	MetricBlocksEvicted  = "kvrouter_tier_blocks_evicted_total"
	MetricUnknownMediums = "kvrouter_tier_unknown_medium_total"
)

// maxMediumLabels bounds the medium label of the unknown-medium counter:
// the medium string comes from the wire, and an unbounded label would let a
// misbehaving engine grow the metric set without limit.
const maxMediumLabels = 16

// Accounting keeps, per instance and tier, the number of blocks held and
// the number stored and evicted, and exports them as Prometheus metrics.
// It is safe for concurrent use. The caller reports what its index actually
// did (after deduplication), so the figures describe the router's view.
type Accounting struct {
	held    *prometheus.GaugeVec
	stored  *prometheus.CounterVec
	evicted *prometheus.CounterVec
	unknown *prometheus.CounterVec

	// mu guards instances and mediums.
	mu        sync.Mutex
	instances map[string]*instanceAccount
	mediums   map[string]struct{} // unknown media given their own label
}

// instanceAccount caches one instance's metric handles so the hot path does
// no label lookups.
type instanceAccount struct {
	held    [tiers.Count]int64
	gHeld   [tiers.Count]prometheus.Gauge
	cStored [tiers.Count]prometheus.Counter
	cEvict  [tiers.Count]prometheus.Counter
}

// NewAccounting creates the metrics and registers them on reg; a nil reg
// keeps them unregistered (still counted, readable through Held).
func NewAccounting(reg prometheus.Registerer) (*Accounting, error) {
	var ms metricset.Set
	a := &Accounting{
		held: ms.GaugeVec(MetricBlocksHeld,
			"KV blocks each instance holds per storage tier, as the router's index knows them.",
			"instance", "tier"),
		stored: ms.CounterVec(MetricBlocksStored,
			"KV blocks stored, per instance and tier (from BlockStored events).",
			"instance", "tier"),
		evicted: ms.CounterVec(MetricBlocksEvicted,
			"KV blocks evicted, per instance and tier (BlockRemoved events and cache clears).",
			"instance", "tier"),
		unknown: ms.CounterVec(MetricUnknownMediums,
			"Events whose medium is not in the tier table; mapped to the unknown-medium tier. Medium label bounded; the rest are \"other\".",
			"medium"),
		instances: make(map[string]*instanceAccount),
		mediums:   make(map[string]struct{}),
	}
	if err := ms.Register(reg); err != nil {
		return nil, fmt.Errorf("tiermetrics: register accounting metrics: %w", err)
	}
	return a, nil
}

func (a *Accounting) account(instance string) *instanceAccount {
	ia := a.instances[instance]
	if ia == nil {
		ia = &instanceAccount{}
		for _, t := range tiers.All {
			ia.gHeld[t] = a.held.WithLabelValues(instance, t.String())
			ia.cStored[t] = a.stored.WithLabelValues(instance, t.String())
			ia.cEvict[t] = a.evicted.WithLabelValues(instance, t.String())
		}
		a.instances[instance] = ia
	}
	return ia
}

// Stored records n blocks newly held by instance in tier t.
func (a *Accounting) Stored(instance string, t tiers.Tier, n int) {
	if n <= 0 || int(t) >= tiers.Count {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	ia := a.account(instance)
	ia.held[t] += int64(n)
	ia.gHeld[t].Set(float64(ia.held[t]))
	ia.cStored[t].Add(float64(n))
}

// Evicted records n blocks that instance no longer holds in tier t. The
// held count never goes below zero (removals of blocks stored before the
// router started are counted as evictions all the same).
func (a *Accounting) Evicted(instance string, t tiers.Tier, n int) {
	if n <= 0 || int(t) >= tiers.Count {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	ia := a.account(instance)
	ia.held[t] = max(0, ia.held[t]-int64(n))
	ia.gHeld[t].Set(float64(ia.held[t]))
	ia.cEvict[t].Add(float64(n))
}

// Cleared records that instance dropped its whole cache (AllBlocksCleared):
// every block it held counts as evicted.
func (a *Accounting) Cleared(instance string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ia := a.account(instance)
	for _, t := range tiers.All {
		ia.cEvict[t].Add(float64(ia.held[t]))
		ia.held[t] = 0
		ia.gHeld[t].Set(0)
	}
}

// Forget drops an instance's series (it left the pool), so metrics of dead
// instances do not accumulate.
func (a *Accounting) Forget(instance string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.instances[instance]; !ok {
		return
	}
	delete(a.instances, instance)
	for _, t := range tiers.All {
		a.held.DeleteLabelValues(instance, t.String())
		a.stored.DeleteLabelValues(instance, t.String())
		a.evicted.DeleteLabelValues(instance, t.String())
	}
}

// Held returns the blocks instance holds per tier.
func (a *Accounting) Held(instance string) [tiers.Count]int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	if ia := a.instances[instance]; ia != nil {
		return ia.held
	}
	return [tiers.Count]int64{}
}

// Medium maps an engine medium string to a tier like FromMedium, counting
// media that are not in the table.
func (a *Accounting) Medium(medium string) tiers.Tier {
	t, ok := tiers.FromMedium(medium)
	if ok {
		return t
	}
	a.mu.Lock()
	label := medium
	if _, seen := a.mediums[medium]; !seen {
		if len(a.mediums) < maxMediumLabels {
			a.mediums[medium] = struct{}{}
		} else {
			label = "other"
		}
	}
	a.mu.Unlock()
	a.unknown.WithLabelValues(label).Inc()
	return t
}
