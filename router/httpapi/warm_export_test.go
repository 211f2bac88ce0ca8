package httpapi

import (
	"net/http"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
)

// SendWarm exposes sendWarm to the package's external tests.
func SendWarm(s *Server, r *http.Request, pool *router.Pool, req *router.Request, path string, w *router.Warm, tk *flowcontrol.Ticket) {
	s.sendWarm(r, pool, req, path, w, tk)
}
