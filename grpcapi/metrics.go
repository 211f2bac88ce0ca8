package grpcapi

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/metricset"
)

// outcomeClientLeft is the ext_proc outcome of a stream Envoy ended, its
// client gone, during the pick: 499, the status the HTTP edge counts such
// a request under in kvrouter_requests_total.
const outcomeClientLeft = "499"

type metrics struct {
	authFailures *prometheus.CounterVec // method
	extproc      *prometheus.CounterVec // pool, outcome (routed, 400, 404, 413, 429, 500, 503, 499)
	watchDropped *prometheus.CounterVec // pool
	watchBad     *prometheus.CounterVec // pool: undecodable payloads skipped
	picks        *prometheus.CounterVec // pool, code
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	var ms metricset.Set
	m := &metrics{
		authFailures: ms.CounterVec("kvrouter_grpc_auth_failures_total",
			"gRPC admin calls refused for a missing or wrong bearer token.",
			"method"),
		extproc: ms.CounterVec("kvrouter_extproc_requests_total",
			"Envoy ext_proc endpoint-picker requests by outcome: routed, the immediate response status, or 499 when Envoy ended the stream during the pick (the client left).",
			"pool", "outcome"),
		watchDropped: ms.CounterVec("kvrouter_grpc_watch_dropped_total",
			"Events.Watch events dropped because a watcher read too slowly.",
			"pool"),
		watchBad: ms.CounterVec("kvrouter_grpc_watch_undecodable_total",
			"kv.events messages Events.Watch skipped because they did not decode.",
			"pool"),
		picks: ms.CounterVec("kvrouter_grpc_picks_total",
			"Router.Pick calls by pool and gRPC status code.",
			"pool", "code"),
	}
	if err := ms.Register(reg); err != nil {
		return nil, err
	}
	return m, nil
}
