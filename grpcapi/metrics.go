package grpcapi

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	authFailures *prometheus.CounterVec // method
	extproc      *prometheus.CounterVec // pool, outcome (routed, 400, 413, 404, 429, 503, error)
	watchDropped *prometheus.CounterVec // pool
	watchBad     *prometheus.CounterVec // pool: undecodable payloads skipped
	picks        *prometheus.CounterVec // pool, code
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		authFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_grpc_auth_failures_total",
			Help: "gRPC admin calls refused for a missing or wrong bearer token.",
		}, []string{"method"}),
		extproc: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_extproc_requests_total",
			Help: "Envoy ext_proc endpoint-picker requests by outcome: routed, or the immediate response status.",
		}, []string{"pool", "outcome"}),
		watchDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_grpc_watch_dropped_total",
			Help: "Events.Watch events dropped because a watcher read too slowly.",
		}, []string{"pool"}),
		watchBad: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_grpc_watch_undecodable_total",
			Help: "kv.events messages Events.Watch skipped because they did not decode.",
		}, []string{"pool"}),
		picks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_grpc_picks_total",
			Help: "Router.Pick calls by pool and gRPC status code.",
		}, []string{"pool", "code"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.authFailures, m.extproc, m.watchDropped, m.watchBad, m.picks} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
