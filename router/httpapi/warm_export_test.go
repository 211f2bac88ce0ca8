package httpapi

import (
	"net/http"

	"github.com/kvrouter/kvrouter/router"
)

// SendWarm exposes sendWarm to the package's external tests.
func SendWarm(s *Server, r *http.Request, pool *router.Pool, req *router.Request, path string, w *router.Warm) {
	s.sendWarm(r, pool, req, path, w)
}
