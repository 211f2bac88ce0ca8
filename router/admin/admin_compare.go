package admin

import (
	"fmt"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/router/openai"
)

// serveCompare is GET /admin/pools/{pool}/compare[?window=5m].
func (s *api) serveCompare(w http.ResponseWriter, r *http.Request) {
	p, st := s.comparePool(w, r)
	if st == nil {
		return
	}
	var window time.Duration
	if v := r.URL.Query().Get("window"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > kvaware.CompareMinutes*time.Minute {
			openai.WriteError(w, http.StatusBadRequest, fmt.Sprintf("window %q: want a duration in 1m..%dm (e.g. 5m); leave it out for everything since the comparison began", v, kvaware.CompareMinutes))
			return
		}
		window = d
	}
	rc, strat := p.Routing()
	writeJSON(w, st.Compare(strat.Name(), rc.Shadow, p.Instances(), window))
}

// serveCompareReset is POST /admin/pools/{pool}/compare/reset: the
// comparison starts again now; the answer is the fresh (empty) summary.
func (s *api) serveCompareReset(w http.ResponseWriter, r *http.Request) {
	p, st := s.comparePool(w, r)
	if st == nil {
		return
	}
	st.ResetCompare()
	rc, strat := p.Routing()
	writeJSON(w, st.Compare(strat.Name(), rc.Shadow, p.Instances(), 0))
}

func (s *api) comparePool(w http.ResponseWriter, r *http.Request) (*router.Pool, *kvaware.KVState) {
	p := s.poolFromPath(w, r)
	if p == nil {
		return nil, nil
	}
	st := kvaware.Of(p)
	if st == nil {
		openai.WriteError(w, http.StatusConflict, fmt.Sprintf("pool %q has no KV index: kv_aware and shadow mode are unavailable", p.Name()))
		return nil, nil
	}
	return p, st
}
