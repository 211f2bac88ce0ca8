package httpapi

import (
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
)

// SendWarm exposes sendWarm to the package's external tests.
func SendWarm(s *Server, r *http.Request, pool *router.Pool, req *router.Request, path string, w *router.Warm, tk *flowcontrol.Ticket) {
	s.sendWarm(r, pool, req, path, w, tk)
}

// RouteForTest runs the data plane's route for req with strat on the
// server's current table, with flow-control ticket tk (nil: none).
func RouteForTest(s *Server, w http.ResponseWriter, r *http.Request, pool *router.Pool, strat router.Strategy, req *router.Request, tk *flowcontrol.Ticket, path string) {
	s.route(w, r, s.table.Load(), pool, strat, req, tk, path, time.Now())
}
