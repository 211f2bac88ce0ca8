package kvstate

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/metricset"
	"github.com/kvrouter/kvrouter/internal/ratelog"
)

// Heartbeat discovery adds the URL a heartbeat announces to its pool, so a
// heartbeat decides where users' prompts go. Where NATS does not
// authenticate publishers, two defences decide which heartbeats count
// (docs/security.md): a per-pool allow-list of the URLs instances may
// have (pools[].allowed_instance_urls), and heartbeats signed with a key
// shared with the bridges (KVROUTER_HEARTBEAT_KEY). A refused heartbeat
// creates no instance record, is logged (rate-limited) and counted.

// HeartbeatKeyEnv holds the hex key heartbeats must be signed with.
const HeartbeatKeyEnv = "KVROUTER_HEARTBEAT_KEY"

// MaxHeartbeatSkew bounds how far a signed heartbeat's time may be from
// the router's clock: a captured heartbeat cannot be replayed later to
// bring back an instance that left. Two minutes is 24 default heartbeat
// periods, and far above the skew of NTP-synchronised hosts.
const MaxHeartbeatSkew = 2 * time.Minute

// Admission is what decides, for the current configuration, which names
// and heartbeats get instance records; swapped whole on reload.
type Admission struct {
	configured map[string]map[string]bool  // pool -> configured instance ids
	allow      map[string]config.AllowList // pool -> allowed_instance_urls
	key        []byte                      // heartbeat key; nil = unsigned accepted
}

// newAdmission reads cfg (validated: the allow-lists parse).
func newAdmission(cfg config.Config) *Admission {
	a := &Admission{configured: map[string]map[string]bool{}, allow: map[string]config.AllowList{}, key: cfg.HeartbeatKey}
	for _, p := range cfg.Pools {
		ids := map[string]bool{}
		for _, in := range p.Instances {
			ids[in.ID] = true
		}
		a.configured[p.Name] = ids
		a.allow[p.Name], _ = config.ParseAllowList(p.AllowedInstanceURLs)
	}
	return a
}

// errHeartbeatRefused carries the reason label of a refused heartbeat.
type errHeartbeatRefused struct {
	reason string
	err    error
}

func (e *errHeartbeatRefused) Error() string { return e.reason + ": " + e.err.Error() }

// check vets a heartbeat of instance received on m for pool. The URL
// allow-list does not apply to configured instances: their URL comes from
// the file, a heartbeat only keeps them live.
func (a *Admission) check(pool, instance string, m *nats.Msg, hb *kvstream.Heartbeat, now time.Time) error {
	if a.key != nil {
		if err := kvstream.VerifyHeartbeat(a.key, m.Subject, m.Data, m.Header); err != nil {
			reason := "bad_signature"
			if errors.Is(err, kvstream.ErrUnsigned) {
				reason = "unsigned"
			}
			return &errHeartbeatRefused{reason, err}
		}
		if d := now.Sub(hb.Time); d > MaxHeartbeatSkew || d < -MaxHeartbeatSkew {
			return &errHeartbeatRefused{"stale", fmt.Errorf("heartbeat time %s is %v from now (max %v)", hb.Time.Format(time.RFC3339), d.Round(time.Second), MaxHeartbeatSkew)}
		}
	}
	if hb.URL != "" && !a.configured[pool][instance] && !a.allow[pool].Allows(hb.URL) {
		return &errHeartbeatRefused{"url_not_allowed", fmt.Errorf("url %q is outside pools[%s].allowed_instance_urls", hb.URL, pool)}
	}
	return nil
}

// discoveryMetrics count what heartbeat discovery admits and refuses.
type discoveryMetrics struct {
	refused *prometheus.CounterVec
	joins   *prometheus.CounterVec
	leaves  *prometheus.CounterVec
}

func newDiscoveryMetrics(reg prometheus.Registerer) (*discoveryMetrics, error) {
	var ms metricset.Set
	m := &discoveryMetrics{
		refused: ms.CounterVec("kvrouter_discovery_heartbeats_refused_total",
			"Heartbeats refused before they could create or refresh an instance, by pool and reason (unsigned, bad_signature, stale, url_not_allowed).", "pool", "reason"),
		joins: ms.CounterVec("kvrouter_discovery_joins_total",
			"Instances added to a pool from heartbeats.", "pool"),
		leaves: ms.CounterVec("kvrouter_discovery_leaves_total",
			"Heartbeat-discovered instances removed from a pool (purged for silence, or no longer allowed).", "pool"),
	}
	if err := ms.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}

// refusedLog bounds the log lines of refused heartbeats: a flood of junk
// is counted in full but logged a few lines per reason per interval.
func newRefusedLog() *ratelog.Limiter { return ratelog.New(10*time.Second, 5) }

// logRefused logs a refused heartbeat, rate-limited per pool and reason.
func logRefused(log *slog.Logger, lim *ratelog.Limiter, pool, instance string, hb *kvstream.Heartbeat, r *errHeartbeatRefused) {
	if ok, suppressed := lim.Allow(pool + "/" + r.reason); ok {
		log.Warn("heartbeat refused", "pool", pool, "instance", instance, "url", hb.URL, "reason", r.reason, "err", r.err, "suppressed", suppressed)
	}
}
