package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/tick"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin/adminapi"
	"github.com/kvrouter/kvrouter/router/openai"
)

// Options are the dependencies of a Server. The zero value is usable.
type Options struct {
	// Logger receives structured logs; nil = slog.Default().
	Logger *slog.Logger
	// Registry receives the router's metrics and is served at /metrics;
	// nil = a new registry of the server's own (never the global one).
	Registry *prometheus.Registry
	// KV builds each pool's exact-routing state (kvaware.NewSource over
	// the pipeline's index per pool). nil, or no index for a pool, makes
	// kv_aware and shadow mode unavailable for it (a config selecting them
	// is rejected).
	KV ExactSource
	// KVEvents says whether the KV index has been rebuilt since start
	// (/readyz; the KV-state pipeline); nil = always. One that is also
	// EngineReports has its bridges' engine-down reports eject instances.
	KVEvents IndexReadiness
	// Admin mounts the admin API (router/admin's Routes) on the admin
	// listener, or on the data listener when admin_listen is empty; nil =
	// /metrics only.
	Admin func(mux *http.ServeMux, srv *Server)
	// TracerProvider, when set, traces data-plane requests (tracing.go,
	// docs/operations.md); nil = off, at no cost to the request path.
	TracerProvider trace.TracerProvider
}

// IndexReadiness reports whether every pool's index has been rebuilt since
// start (or the ready timeout passed); else why not.
type IndexReadiness interface {
	IndexReady() (bool, string)
}

// EngineReports is a KV pipeline whose bridges report engines down
// (kvstate.Pipeline). When Options.KVEvents is one, NewServer has it call
// EngineDown, which ejects the instance at once.
type EngineReports interface {
	OnEngineDown(fn func(pool, instance string))
}

// ExactSource builds pools' exact-routing state (kvaware.Source).
type ExactSource interface {
	// Attach registers its metrics on reg and logs to log.
	Attach(reg prometheus.Registerer, log *slog.Logger) error
	// For returns pool pc's state, reusing prev (built for prevCfg) when
	// it still fits; nil, nil when the pool has no index.
	For(pc config.PoolConfig, prev router.Exact, prevCfg config.PoolConfig) (router.Exact, error)
	// ForgetInstance drops the series of an instance that left its pool.
	ForgetInstance(pool, instance string)
}

// Server is the router: the HTTP data plane, the admin API and the
// background health checks. Build it with NewServer, serve Handler (and
// AdminHandler), and run Run for the health checks.
type Server struct {
	log      *slog.Logger
	reg      *prometheus.Registry
	m        *metrics
	kv       ExactSource    // Options.KV; nil = no pool has exact routing
	kvEvents IndexReadiness // Options.KVEvents
	admin    func(mux *http.ServeMux, srv *Server)
	proxy    *httputil.ReverseProxy
	tracer   trace.Tracer // nil = tracing off
	probe    *http.Client
	started  time.Time
	// adminToken is read on each admin request; swapped on reload.
	adminToken atomic.Pointer[string]
	// adminOnData: admin routes are served on the data listener too.
	adminOnData bool
	// body bounds the memory held by request bodies (limits.max_body_memory_bytes).
	body *bodyBudget

	// table is the pool table requests resolve against; swapped whole on
	// reload.
	table atomic.Pointer[router.Table]
	// left are the instances reloads removed, forgotten once idle
	// (sweepLeft).
	left leftInstances

	// loopMu guards runCtx, stopLoops and loopWG: the background loops of
	// the current state, restarted on reload.
	loopMu    sync.Mutex
	runCtx    context.Context
	stopLoops context.CancelFunc
	loopWG    sync.WaitGroup
}

// NewServer validates cfg and builds a Server. It starts no goroutines:
// call Run for health checks and adapter discovery.
func NewServer(cfg config.Config, opts Options) (*Server, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Server{log: opts.Logger, reg: opts.Registry, started: time.Now(), adminOnData: cfg.AdminListen == "", body: newBodyBudget(bodyMemory(cfg))}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.reg == nil {
		s.reg = prometheus.NewRegistry()
	}
	tok := cfg.AdminToken
	s.adminToken.Store(&tok)
	s.kv = opts.KV
	if opts.TracerProvider != nil {
		s.tracer = opts.TracerProvider.Tracer(TracerScope)
	}
	s.kvEvents, s.admin = opts.KVEvents, opts.Admin
	var err error
	if s.kv != nil {
		if err = s.kv.Attach(s.reg, s.log); err != nil {
			return nil, fmt.Errorf("router: register metrics: %w", err)
		}
	}
	st, commit, err := router.NewTable(cfg, nil, s.kvStateFor)
	if err != nil {
		return nil, err
	}
	s.table.Store(st)
	commit()
	if s.m, err = newMetrics(s.reg, s); err != nil {
		return nil, fmt.Errorf("router: register metrics: %w", err)
	}
	if er, ok := opts.KVEvents.(EngineReports); ok {
		er.OnEngineDown(s.EngineDown)
	}
	dialer := &net.Dialer{Timeout: cfg.Proxy.DialTimeout, KeepAlive: 30 * time.Second}
	transport := &http.Transport{
		Proxy:                 nil, // instances are addressed directly, never through an HTTP proxy from the environment
		DialContext:           dialer.DialContext,
		MaxIdleConns:          0,
		MaxIdleConnsPerHost:   cfg.Proxy.MaxIdleConnsPerHost,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: cfg.Proxy.ResponseHeaderTimeout,
		ForceAttemptHTTP2:     false, // vLLM serves HTTP/1.1; h2c is not negotiated
	}
	s.proxy = &httputil.ReverseProxy{
		Rewrite:        s.rewrite,
		Transport:      transport,
		ModifyResponse: s.modifyResponse,
		ErrorHandler:   s.errorHandler,
		// Streams (text/event-stream, or no Content-Length) are flushed per
		// write by ReverseProxy itself; other responses are small.
		FlushInterval: 0,
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		// Without a pool ReverseProxy allocates a 32 KiB copy buffer per
		// request: half of all bytes allocated on the request path.
		BufferPool: newCopyBufferPool(32 << 10),
	}
	s.probe = &http.Client{Transport: &http.Transport{Proxy: nil, DialContext: dialer.DialContext, MaxIdleConnsPerHost: 2}}
	return s, nil
}

// kvStateFor builds (or keeps across a reload) a pool's exact-routing state.
func (s *Server) kvStateFor(pc config.PoolConfig, old *router.Pool) (router.Exact, error) {
	if s.kv == nil {
		return nil, nil
	}
	if old == nil {
		return s.kv.For(pc, nil, config.PoolConfig{})
	}
	return s.kv.For(pc, old.Exact(), old.Config())
}

// Pools lists the current pools.
func (s *Server) Pools() []*router.Pool { return slices.Clone(s.table.Load().Pools()) }

// Pool returns the named pool.
func (s *Server) Pool(name string) (*router.Pool, bool) {
	return s.table.Load().Pool(name)
}

// Resolve resolves in against the current pool table
// (router.Table.Resolve): how Envoy's ext_proc and gRPC Pick turn their
// requests into the Request this data plane would route.
func (s *Server) Resolve(in router.Inbound) (*router.Request, *router.Pool, error) {
	return s.table.Load().Resolve(in)
}

// TenantCacheSalt is router.Table.TenantCacheSalt on the current table.
func (s *Server) TenantCacheSalt(pool, tenant string) (salt string, ok bool) {
	return s.table.Load().TenantCacheSalt(pool, tenant)
}

// Registry is the registry the server's metrics are on.
func (s *Server) Registry() *prometheus.Registry { return s.reg }

// Reload applies a new configuration: pools, instances, routing, limits and
// the admin token. Instances with the same pool, id and URL keep their
// in-flight counts and health. Listen addresses and proxy transport settings
// are fixed at start; a change to them is logged and ignored. On error the
// running configuration is kept.
func (s *Server) Reload(cfg config.Config) error {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	s.loopMu.Lock()
	defer s.loopMu.Unlock()
	old := s.table.Load()
	if oc := old.Config(); cfg.Listen != oc.Listen || cfg.AdminListen != oc.AdminListen {
		s.log.Warn("reload: listen addresses change only on restart", "listen", oc.Listen, "admin_listen", oc.AdminListen)
	}
	// Building the table changed nothing the running one reads: an error
	// here leaves it serving as it was.
	st, commit, err := router.NewTable(cfg, old, s.kvStateFor)
	if err != nil {
		return err
	}
	tok := cfg.AdminToken
	s.adminToken.Store(&tok)
	s.body.limit.Store(bodyMemory(cfg))
	s.left.mu.Lock() // a sweep asks "is the id back?" and forgets in one table
	s.table.Store(st)
	s.left.mu.Unlock()
	commit()
	if s.runCtx != nil {
		s.stopLoopsLocked()
		s.startLoopsLocked()
	}
	// After the old loops (the load scraper and health checks among them)
	// have stopped.
	s.left.leave(old, st)
	s.sweepLeft()
	s.log.Info("configuration reloaded", "pools", len(st.Pools()))
	return nil
}

// leftInstances are the instances reloads removed whose series and
// per-instance state are still to be forgotten: the one place where an
// instance leaves, whether a file reload removed it or a discovered
// instance was purged, so that names that come and go leave no series or
// per-instance state behind. Requests that picked an instance before it
// left still write its series when they end (and kv_aware's state for it
// at the pick): it is forgotten once nothing is in flight there, and again
// at the sweep after (sweepLeft), which catches what such a request wrote
// between its release of the instance and its end.
type leftInstances struct {
	mu   sync.Mutex
	list []leftInstance
}

type leftInstance struct {
	pool string
	in   *router.Instance
	// forgotten: seen idle and forgotten once; forgotten again, and
	// dropped, at the next sweep that finds it idle.
	forgotten bool
}

// leave notes the instances of old's pools that next does not have. An
// instance object next does not hold is ejected (Healthy false): a request
// resolved against old, still waiting in its queue or tokenizing, no
// longer picks it. Its id is remembered to be forgotten unless next's
// pool of that name still has the id (its URL, adapters or role changed:
// a new object under the same series).
func (l *leftInstances) leave(old, next *router.Table) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, op := range old.Pools() {
		np, _ := next.Pool(op.Name())
		for _, in := range op.Instances() {
			now := instanceOf(np, in.ID())
			if now == in {
				continue
			}
			in.SetHealthy(false)
			if now == nil {
				l.list = append(l.list, leftInstance{pool: op.Name(), in: in})
			}
		}
	}
}

// instanceOf is p's instance named id; nil when p (nil: no pool) has none.
func instanceOf(p *router.Pool, id string) *router.Instance {
	if p == nil {
		return nil
	}
	in, _ := p.Instance(id)
	return in
}

// sweepLeft forgets the instances that left with no request in flight
// there (ForgetInstanceSeries), and drops those forgotten at an earlier
// sweep that are still idle. One whose id is back in the current table is
// dropped unforgotten: the series are the returned instance's now. Reload
// sweeps, and so does a loop every leftSweepInterval while the server
// runs.
func (s *Server) sweepLeft() {
	s.left.mu.Lock()
	defer s.left.mu.Unlock()
	st := s.table.Load()
	kept := s.left.list[:0]
	for _, e := range s.left.list {
		p, _ := st.Pool(e.pool)
		switch {
		case instanceOf(p, e.in.ID()) != nil:
		case e.in.InFlight() > 0:
			e.forgotten = false
			kept = append(kept, e)
		default:
			s.ForgetInstanceSeries(e.pool, e.in.ID())
			if !e.forgotten {
				e.forgotten = true
				kept = append(kept, e)
			}
		}
	}
	clear(s.left.list[len(kept):])
	s.left.list = kept
}

// leftSweepInterval is how often a running server sweeps the instances
// reloads removed (sweepLeft).
const leftSweepInterval = time.Second

// Run runs health checks and adapter discovery until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	s.loopMu.Lock()
	if s.runCtx != nil {
		s.loopMu.Unlock()
		return errors.New("router: server already running")
	}
	s.runCtx = ctx
	s.startLoopsLocked()
	s.loopMu.Unlock()
	<-ctx.Done()
	s.loopMu.Lock()
	s.stopLoopsLocked()
	s.runCtx = nil
	s.loopMu.Unlock()
	return nil
}

func (s *Server) startLoopsLocked() {
	ctx, cancel := context.WithCancel(s.runCtx)
	s.stopLoops = cancel
	s.loopWG.Go(func() { _ = tick.Every(ctx, leftSweepInterval, s.sweepLeft) })
	for _, p := range s.table.Load().Pools() {
		pc := p.Config()
		if !pc.Health.Disable {
			s.loopWG.Go(func() { s.healthLoop(ctx, p) })
		}
		if !pc.Discovery.Disable {
			s.loopWG.Go(func() { s.discoveryLoop(ctx, p) })
		}
		if kv := p.Exact(); kv != nil {
			rc, _ := p.Routing()
			s.loopWG.Go(func() { kv.Run(ctx, rc, p.Instances) })
		}
	}
}

func (s *Server) stopLoopsLocked() {
	if s.stopLoops != nil {
		s.stopLoops()
		s.stopLoops = nil
	}
	s.loopWG.Wait()
}

// Handler serves the data plane (/v1/..., /invocations..., /healthz,
// /readyz) and, when admin_listen is empty, the admin API and /metrics.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	traced := func(pattern string, h http.HandlerFunc) { mux.HandleFunc(pattern, s.traced(pattern, h)) }
	traced("POST /v1/chat/completions", s.serveEndpoint(router.EndpointChatCompletions))
	traced("POST /v1/completions", s.serveEndpoint(router.EndpointCompletions))
	mux.HandleFunc("GET /v1/models", s.serveModels)
	traced("POST /invocations", s.serveEndpoint(router.EndpointInvoke))
	traced("POST /invocations-response-stream", s.serveEndpoint(router.EndpointInvokeStream))
	mux.HandleFunc("GET /healthz", s.serveHealthz)
	mux.HandleFunc("GET /readyz", s.serveReadyz)
	mux.HandleFunc("GET /ping", s.serveReadyz) // SageMaker's health path
	if s.adminOnData {
		s.addAdminRoutes(mux)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if allow := allowedMethods(mux, r); len(allow) > 0 {
			w.Header().Set("Allow", strings.Join(allow, ", "))
			openai.WriteError(w, http.StatusMethodNotAllowed, fmt.Sprintf("%s %s: method not allowed (allowed: %s)", r.Method, r.URL.Path, strings.Join(allow, ", ")))
			return
		}
		openai.WriteError(w, http.StatusNotFound, fmt.Sprintf("%s %s %s", adminapi.NoRoute, r.Method, r.URL.Path))
	})
	return s.limitInput(mux)
}

// allowedMethods lists the methods mux routes r's path with, other than
// the catch-all: a path served with another method is a 405 with Allow
// (as http.ServeMux answers by itself where no catch-all is mounted), not
// a 404. Only on that error path.
func allowedMethods(mux *http.ServeMux, r *http.Request) []string {
	var allow []string
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodPut} {
		if m == r.Method {
			continue
		}
		probe := &http.Request{Method: m, URL: r.URL, Host: r.Host, Header: http.Header{}}
		if _, pattern := mux.Handler(probe); pattern != "" && pattern != "/" {
			allow = append(allow, m)
		}
	}
	return allow
}

// AdminHandler serves the admin API, /metrics, /healthz and /readyz (for a
// separate admin listener).
func (s *Server) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	s.addAdminRoutes(mux)
	mux.HandleFunc("GET /healthz", s.serveHealthz)
	mux.HandleFunc("GET /readyz", s.serveReadyz)
	return s.limitInput(mux)
}

// addAdminRoutes mounts /metrics and the admin API (Options.Admin).
func (s *Server) addAdminRoutes(mux *http.ServeMux) {
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}))
	if s.admin != nil {
		s.admin(mux, s)
	}
}

// AdminToken is the admin API's bearer token ("" = none), as last loaded.
func (s *Server) AdminToken() string { return *s.adminToken.Load() }

// Logger is the server's logger.
func (s *Server) Logger() *slog.Logger { return s.log }

// Started is when the server was built.
func (s *Server) Started() time.Time { return s.started }

func (s *Server) serveHealthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "ok\n")
}

// serveReadyz is ready when the KV index has been rebuilt (snapshots and
// stream history applied, or events.ready_timeout passed: before that
// kv_aware would route on an empty index) and at least one pool has a
// healthy instance: a router that can serve some model should stay in its
// load balancer.
func (s *Server) serveReadyz(w http.ResponseWriter, _ *http.Request) {
	if s.kvEvents != nil {
		if ok, why := s.kvEvents.IndexReady(); !ok {
			openai.WriteError(w, http.StatusServiceUnavailable, why)
			return
		}
	}
	for _, p := range s.table.Load().Pools() {
		for _, in := range p.Instances() {
			if in.Healthy() {
				w.Header().Set("Content-Type", "text/plain; charset=utf-8")
				_, _ = io.WriteString(w, "ready\n")
				return
			}
		}
	}
	openai.WriteError(w, http.StatusServiceUnavailable, "no healthy instance in any pool")
}

// serveModels lists the union of what the pools serve, in OpenAI's shape.
func (s *Server) serveModels(w http.ResponseWriter, _ *http.Request) {
	type model struct {
		ID      string  `json:"id"`
		Object  string  `json:"object"`
		Created int64   `json:"created"`
		OwnedBy string  `json:"owned_by"`
		Root    string  `json:"root"`
		Parent  *string `json:"parent"`
	}
	st := s.table.Load()
	out := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: []model{}}
	created := s.started.Unix()
	for _, p := range st.Pools() {
		base := p.Model()
		out.Data = append(out.Data, model{ID: base, Object: "model", Created: created, OwnedBy: "kvrouter", Root: base})
		for _, a := range p.Adapters() {
			out.Data = append(out.Data, model{ID: a, Object: "model", Created: created, OwnedBy: "kvrouter", Root: a, Parent: &base})
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}
