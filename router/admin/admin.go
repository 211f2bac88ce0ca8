package admin

import (
	"bytes"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/prometheus/client_golang/prometheus"
)

// Server is what the admin API reads and changes of the router: its pool
// table, metrics and admin token (httpapi.Server).
type Server interface {
	Pools() []*router.Pool
	Pool(name string) (*router.Pool, bool)
	// Resolve turns a request into the Request the data plane would
	// route (router.Table.Resolve on the current table).
	Resolve(in router.Inbound) (*router.Request, *router.Pool, error)
	Registry() *prometheus.Registry
	AdminToken() string
	Logger() *slog.Logger
	Started() time.Time
}

// api serves the admin routes of one server.
type api struct {
	srv Server
	kve KVEvents // nil: instances show the index only, evictions answer 503
	log *slog.Logger
	// evictions is kve's eviction stream, nil without kve.
	evictions http.Handler
}

// Routes returns the admin API's mounter for httpapi.Options.Admin: the
// pools and their routing, the comparison, the KV views, the eviction
// stream, the dashboard and the profiles, behind the admin token. kve
// (the KV-state pipeline) may be nil.
func Routes(kve KVEvents) func(mux *http.ServeMux, srv *httpapi.Server) {
	return func(mux *http.ServeMux, srv *httpapi.Server) { Mount(mux, srv, kve) }
}

// Mount mounts the admin API for srv on mux (see Routes).
func Mount(mux *http.ServeMux, srv Server, kve KVEvents) {
	s := &api{srv: srv, kve: kve, log: srv.Logger()}
	if kve != nil {
		s.evictions = kve.EvictionHandler()
	}
	s.addAdminRoutes(mux)
	s.addKVAdminRoutes(mux)
}

func (s *api) addAdminRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /admin/pools", s.auth(s.serveListPools))
	mux.HandleFunc("GET /admin/pools/{pool}", s.auth(s.serveGetPool))
	mux.HandleFunc("GET /admin/pools/{pool}/routing", s.auth(s.serveGetRouting))
	mux.HandleFunc("PUT /admin/pools/{pool}/routing", s.auth(s.servePutRouting))
	mux.HandleFunc("GET /admin/pools/{pool}/compare", s.auth(s.serveCompare))
	mux.HandleFunc("POST /admin/pools/{pool}/compare/reset", s.auth(s.serveCompareReset))
	mux.HandleFunc("GET /admin/pools/{pool}/queue", s.auth(s.serveQueue))
	s.addDashboardRoutes(mux)
	// Profiles (net/http/pprof), only with an admin token: a CPU profile
	// or trace costs the router CPU for as long as the caller asks.
	mux.HandleFunc("GET /debug/pprof/", s.authRequired(pprof.Index))
	mux.HandleFunc("GET /debug/pprof/cmdline", s.authRequired(pprof.Cmdline))
	mux.HandleFunc("GET /debug/pprof/profile", s.authRequired(pprof.Profile))
	mux.HandleFunc("GET /debug/pprof/symbol", s.authRequired(pprof.Symbol))
	mux.HandleFunc("POST /debug/pprof/symbol", s.authRequired(pprof.Symbol))
	mux.HandleFunc("GET /debug/pprof/trace", s.authRequired(pprof.Trace))
}

// authRequired is auth for endpoints that are off without an admin token.
func (s *api) authRequired(h http.HandlerFunc) http.HandlerFunc {
	authed := s.auth(h)
	return func(w http.ResponseWriter, r *http.Request) {
		if s.srv.AdminToken() == "" {
			openai.WriteError(w, http.StatusForbidden, "profiling endpoints need an admin token (KVROUTER_ADMIN_TOKEN)")
			return
		}
		authed(w, r)
	}
}

// bearerToken returns the token of an "Authorization: Bearer <token>"
// header. The scheme is matched case-insensitively and may be followed by
// any run of spaces (RFC 7235 section 2.1, RFC 6750 section 2.1).
func bearerToken(h string) (string, bool) {
	scheme, tok, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimLeft(tok, " ")
	return tok, tok != ""
}

// auth requires "Authorization: Bearer <admin token>" when a token is set.
func (s *api) auth(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if tok := s.srv.AdminToken(); tok != "" {
			got, ok := bearerToken(r.Header.Get("Authorization"))
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(tok)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="kvrouter-admin"`)
				openai.WriteError(w, http.StatusUnauthorized, "admin API: missing or wrong bearer token")
				return
			}
		}
		h(w, r)
	}
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func (s *api) serveListPools(w http.ResponseWriter, _ *http.Request) {
	out := []router.PoolStatus{}
	for _, p := range s.srv.Pools() {
		out = append(out, p.Status())
	}
	writeJSON(w, out)
}

func (s *api) poolFromPath(w http.ResponseWriter, r *http.Request) *router.Pool {
	p, ok := s.srv.Pool(r.PathValue("pool"))
	if !ok {
		openai.WriteError(w, http.StatusNotFound, fmt.Sprintf("no pool %q", r.PathValue("pool")))
		return nil
	}
	return p
}

func (s *api) serveQueue(w http.ResponseWriter, r *http.Request) {
	if p := s.poolFromPath(w, r); p != nil {
		writeJSON(w, p.QueueStatus())
	}
}

func (s *api) serveGetPool(w http.ResponseWriter, r *http.Request) {
	if p := s.poolFromPath(w, r); p != nil {
		writeJSON(w, p.Status())
	}
}

func (s *api) serveGetRouting(w http.ResponseWriter, r *http.Request) {
	if p := s.poolFromPath(w, r); p != nil {
		rc, _ := p.Routing()
		writeJSON(w, rc)
	}
}

// servePutRouting switches a pool's routing at runtime. The JSON body is
// merged onto the current routing (fields left out keep their values); the
// result is validated before it is swapped in. A SIGHUP reload replaces it
// with the file's routing again.
func (s *api) servePutRouting(w http.ResponseWriter, r *http.Request) {
	p := s.poolFromPath(w, r)
	if p == nil {
		return
	}
	body, ok := readBody(w, r, "routing", 64<<10)
	if !ok {
		return
	}
	rc, _ := p.Routing()
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rc); err != nil {
		openai.WriteError(w, http.StatusBadRequest, "routing: malformed JSON: "+err.Error())
		return
	}
	err := givenZero(rc)
	if err == nil {
		err = p.SetRouting(rc)
	}
	if err != nil {
		msg := err.Error()
		if errors.Is(err, config.ErrInvalidConfig) {
			msg = strings.TrimPrefix(msg, config.ErrInvalidConfig.Error()+": ")
		}
		openai.WriteError(w, http.StatusBadRequest, msg)
		return
	}
	nrc, _ := p.Routing()
	s.log.Info("routing changed", "pool", p.Name(), "strategy", nrc.Strategy, "prefix_length", nrc.PrefixLength, "concurrency_threshold", nrc.ConcurrencyThreshold)
	writeJSON(w, nrc)
}

// givenZero refuses the zero values a PUT gave: the current routing has
// every default applied, so a zero strategy, prefix length or concurrency
// threshold after the merge came from the body. Validation would take it
// as "the default" (as for a field left out of the file), and an empty
// variable in a script would switch a pool back to the defaults — kv_aware
// to prefix_aware — where the docs promise a 400 for a value out of range.
func givenZero(rc config.RoutingConfig) error {
	switch {
	case rc.Strategy == "":
		return fmt.Errorf("routing.strategy \"\": want one of %s", strings.Join(config.StrategyNames(), ", "))
	case rc.PrefixLength == 0:
		return fmt.Errorf("routing.prefix_length 0 out of range %d..%d", config.MinPrefixLength, config.MaxPrefixLength)
	case rc.ConcurrencyThreshold == 0:
		return fmt.Errorf("routing.concurrency_threshold 0 out of range %d..%d", config.MinConcurrencyThreshold, config.MaxConcurrencyThreshold)
	}
	return nil
}

// readBody reads an admin request's body of at most limit bytes; a longer
// one is answered 413 (not cut short, which JSON would report as an
// unexpected end), an unreadable one 400, each prefixed with what.
func readBody(w http.ResponseWriter, r *http.Request, what string, limit int) ([]byte, bool) {
	body, err := io.ReadAll(io.LimitReader(r.Body, int64(limit)+1))
	if err != nil {
		openai.WriteError(w, http.StatusBadRequest, what+": reading the body: "+err.Error())
		return nil, false
	}
	if len(body) > limit {
		openai.WriteError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("%s: body over %d bytes", what, limit))
		return nil, false
	}
	return body, true
}
