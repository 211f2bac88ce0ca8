package flowcontrol

import (
	"slices"
	"strings"
	"time"
)

// Stats is a snapshot of one queue, for metrics, the admin API and kvctl.
type Stats struct {
	Queued            int           `json:"queued"`
	QueuedTokens      int64         `json:"queued_tokens"`
	InFlight          int           `json:"in_flight"`
	PendingPrefill    int64         `json:"pending_prefill_tokens"`
	MaxConcurrency    int           `json:"max_concurrency"`
	MaxPendingPrefill int64         `json:"max_pending_prefill_tokens"`
	MaxQueue          int           `json:"max_queue"`
	OldestWait        time.Duration `json:"oldest_wait_ns"`
	// DrainTokensPerSec is the measured rate at which waiting tokens are
	// admitted (0 until the queue has been busy).
	DrainTokensPerSec float64 `json:"drain_tokens_per_sec"`
	// ServiceTTFT is the average time from admission to first token.
	ServiceTTFT time.Duration `json:"service_ttft_ns"`
	Bands       []BandStats   `json:"bands"`
	// Tenants are the waiting tenants with the most queued tokens (at most
	// maxTenantStats).
	Tenants []TenantStats `json:"tenants"`
	// NewestFirstTenants counts the waiting tenants whose requests go
	// newest first (lifo.go: one of them was shed for its deadline or
	// wait bound while others waited), all of them, not only those listed.
	NewestFirstTenants int    `json:"newest_first_tenants"`
	Counts             Counts `json:"counts"`
	// Instances are the per-instance budgets' loads (absent without
	// per-instance budgets), with the budgets.
	InstanceConcurrency int            `json:"instance_concurrency,omitempty"`
	InstancePrefill     int64          `json:"instance_prefill_tokens,omitempty"`
	Instances           []InstanceLoad `json:"instances,omitempty"`
}

// BandStats is one priority band's queue.
type BandStats struct {
	Priority   int64         `json:"priority"`
	Queued     int           `json:"queued"`
	Tokens     int64         `json:"tokens"`
	OldestWait time.Duration `json:"oldest_wait_ns"`
}

// TenantStats is one tenant's waiting requests over all bands.
type TenantStats struct {
	Tenant string `json:"tenant"`
	Queued int    `json:"queued"`
	Tokens int64  `json:"tokens"`
	// NewestFirst: its requests go newest first in some band (lifo.go).
	NewestFirst bool `json:"newest_first,omitempty"`
}

const maxTenantStats = 10

// Stats returns a snapshot at now.
func (s *Sched) Stats(now time.Time) Stats {
	st := Stats{
		Queued: s.queued, QueuedTokens: s.cost, InFlight: s.inflight, PendingPrefill: s.pending,
		MaxConcurrency: s.conc, MaxPendingPrefill: s.prefill, MaxQueue: s.cfg.MaxQueue,
		DrainTokensPerSec: s.rate(), ServiceTTFT: s.svc, Counts: s.Counts(),
		Bands: []BandStats{}, Tenants: []TenantStats{},
		InstanceConcurrency: s.cfg.InstanceConcurrency, InstancePrefill: s.cfg.InstancePrefill, Instances: s.instanceStats(),
	}
	tenants := map[string]*TenantStats{}
	for _, l := range s.order {
		oldest := l.fifo.Front().Value.(*Item)
		w := max(now.Sub(oldest.arrived), 0)
		st.OldestWait = max(st.OldestWait, w)
		st.Bands = append(st.Bands, BandStats{Priority: l.prio, Queued: l.fifo.Len(), Tokens: l.cost, OldestWait: w})
		for name, t := range l.tenants {
			if t.queued == 0 {
				continue
			}
			ts := tenants[name]
			if ts == nil {
				ts = &TenantStats{Tenant: name}
				tenants[name] = ts
			}
			ts.Queued += t.queued
			ts.Tokens += t.cost
			ts.NewestFirst = ts.NewestFirst || t.lifo
		}
	}
	for _, ts := range tenants {
		if ts.NewestFirst {
			st.NewestFirstTenants++
		}
	}
	for _, ts := range tenants {
		st.Tenants = append(st.Tenants, *ts)
	}
	slices.SortFunc(st.Tenants, func(a, b TenantStats) int {
		if a.Tokens != b.Tokens {
			if a.Tokens > b.Tokens {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	if len(st.Tenants) > maxTenantStats {
		st.Tenants = st.Tenants[:maxTenantStats]
	}
	return st
}
