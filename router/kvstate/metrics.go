package kvstate

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events/consumer"
)

// kvEventsCollector exports, at scrape time, what the consumers know per
// instance and whether each pool's stream is consumed: the consumers keep
// that state already, so reading it on scrape costs nothing on the event
// path and is never stale (unlike a gauge set on requests).
type kvEventsCollector struct {
	k         *Pipeline
	state     *prometheus.Desc
	lastEvent *prometheus.Desc
	healthy   *prometheus.Desc
}

var _ prometheus.Collector = (*kvEventsCollector)(nil)

func newKVEventsCollector(k *Pipeline) *kvEventsCollector {
	return &kvEventsCollector{
		k: k,
		state: prometheus.NewDesc("kvrouter_events_instance_state",
			"1 for the instance's current state as the events consumer sees it (live, stale, purged), 0 for the others.",
			[]string{"pool", "instance", "state"}, nil),
		lastEvent: prometheus.NewDesc("kvrouter_events_instance_last_event_age_seconds",
			"Seconds since the instance's last applied event or heartbeat, whichever is newer.",
			[]string{"pool", "instance"}, nil),
		healthy: prometheus.NewDesc("kvrouter_events_stream_healthy",
			"1 while the pool's event stream is consumed and caught up (kv_aware routes exactly), 0 otherwise.",
			[]string{"pool"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *kvEventsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.state
	ch <- c.lastEvent
	ch <- c.healthy
}

// Collect implements prometheus.Collector.
func (c *kvEventsCollector) Collect(ch chan<- prometheus.Metric) {
	c.k.mu.Lock()
	pools := make(map[string]*consumer.Consumer, len(c.k.pools))
	for name, p := range c.k.pools {
		pools[name] = p.cons
	}
	c.k.mu.Unlock()
	now := time.Now()
	for pool, cons := range pools {
		h := 0.0
		if cons.Healthy() {
			h = 1
		}
		ch <- prometheus.MustNewConstMetric(c.healthy, prometheus.GaugeValue, h, pool)
		for _, st := range cons.Instances() {
			for _, s := range []consumer.State{consumer.StateLive, consumer.StateStale, consumer.StatePurged} {
				v := 0.0
				if st.State == s {
					v = 1
				}
				ch <- prometheus.MustNewConstMetric(c.state, prometheus.GaugeValue, v, pool, st.Instance, s.String())
			}
			last := st.LastEvent
			if st.LastHeartbeat.After(last) {
				last = st.LastHeartbeat
			}
			if !last.IsZero() {
				ch <- prometheus.MustNewConstMetric(c.lastEvent, prometheus.GaugeValue, now.Sub(last).Seconds(), pool, st.Instance)
			}
		}
	}
}
