package grpcapi

import (
	"context"
	"crypto/subtle"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/internal/pemfile"
	"github.com/kvrouter/kvrouter/internal/ratelog"
	"github.com/kvrouter/kvrouter/internal/zero"
	"github.com/kvrouter/kvrouter/router"
)

// ErrInvalidConfig wraps every Config validation error.
var ErrInvalidConfig = errors.New("grpcapi: invalid config")

// Pools is what the gRPC services need of the router: its current pools.
// *httpapi.Server implements it; the pools it returns are routed with their
// own current strategy, so a runtime strategy switch applies here too.
type Pools interface {
	Pools() []*router.Pool
	Pool(name string) (*router.Pool, bool)
	// Resolve turns an inbound request into a routed Request, as the
	// HTTP data plane does (router.Table.Resolve).
	Resolve(router.Inbound) (*router.Request, *router.Pool, error)
}

// Config configures the gRPC services. The zero value is usable: no token,
// plaintext, Events.Watch unavailable, no load shedding.
type Config struct {
	// DefaultPool serves requests that name no pool and whose model matches
	// none; "" = the first pool.
	DefaultPool string
	// AdminToken, when set, is required as "authorization: Bearer <token>"
	// metadata on admin methods: Index.Lookup and Events.Watch, which reveal
	// what every tenant has cached (enough to probe another tenant's
	// prompts). Router.Pick, a data-plane call, is open unless
	// TokenForPick. Health, reflection and ext_proc never need it: Envoy
	// reaches ext_proc over a trusted link (use TLS and a network policy).
	AdminToken string
	// TokenForPick also requires AdminToken on Router.Pick.
	TokenForPick bool
	// TLS, when set, serves TLS (Serve and ServerOptions); see LoadTLS.
	TLS *tls.Config
	// NATS is the connection Events.Watch subscribes on (kv.events.<pool>.>);
	// nil = Watch answers Unavailable.
	NATS *nats.Conn
	// WatchBuffer is the number of events one watcher may lag behind before
	// events are dropped (and counted in Event.dropped). Default 4096.
	WatchBuffer int
	// MaxMessageBytes bounds a received gRPC message (an ext_proc buffered
	// body arrives in one). Default 32 MiB, the router's max_body_bytes.
	MaxMessageBytes int
	// ExtProc configures the Envoy endpoint picker.
	ExtProc ExtProcConfig
	// DrainTimeout is how long Serve lets calls in flight finish once its
	// context ends (an ext_proc stream lasts as long as Envoy's HTTP
	// request) before cutting them. Default 5s.
	DrainTimeout time.Duration
	// Logger, nil = slog.Default().
	Logger *slog.Logger
	// Registerer receives the package's metrics; nil = registered nowhere.
	Registerer prometheus.Registerer
}

// Defaults of Config.
const (
	DefaultWatchBuffer     = 4096
	DefaultMaxMessageBytes = 32 << 20
	DefaultDrainTimeout    = 5 * time.Second
)

func (c Config) withDefaults() Config {
	zero.Default(&c.WatchBuffer, DefaultWatchBuffer)
	zero.Default(&c.MaxMessageBytes, DefaultMaxMessageBytes)
	zero.Default(&c.DrainTimeout, DefaultDrainTimeout)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.ExtProc = c.ExtProc.withDefaults()
	return c
}

func (c Config) validate() error {
	if c.WatchBuffer < 0 {
		return fmt.Errorf("%w: watch_buffer %d: want > 0", ErrInvalidConfig, c.WatchBuffer)
	}
	if c.MaxMessageBytes < 0 {
		return fmt.Errorf("%w: max_message_bytes %d: want > 0", ErrInvalidConfig, c.MaxMessageBytes)
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("%w: drain_timeout %v: want > 0", ErrInvalidConfig, c.DrainTimeout)
	}
	if c.TokenForPick && c.AdminToken == "" {
		return fmt.Errorf("%w: token_for_pick needs an admin token", ErrInvalidConfig)
	}
	return c.ExtProc.validate()
}

// LoadTLS builds a server TLS config from PEM files. caFile, when set,
// makes client certificates required and verified against it (mTLS).
func LoadTLS(certFile, keyFile, caFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("grpcapi: load TLS key pair: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := pemfile.CertPool(caFile)
		if err != nil {
			return nil, fmt.Errorf("grpcapi: client CA: %w", err)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// Server holds the gRPC services over a router's pools. Build it with New,
// then either Serve it on a listener, or add ServerOptions to your own
// grpc.Server and call Register.
type Server struct {
	cfg   Config
	pools Pools
	log   *slog.Logger
	// logLimit rate-limits the per-request warnings (a misconfigured
	// filter would log one per request): 5 per key per 10 s.
	logLimit *ratelog.Limiter
	m        *metrics
	health   *health.Server
	// admin is the set of full method names that need AdminToken.
	admin map[string]bool
	// stopping is closed when Serve's context ends (or by Stop), so that
	// endless streams (Events.Watch) end and a graceful stop can finish.
	stopping chan struct{}
	stopOnce sync.Once
}

// Stop ends open Events.Watch streams (cleanly, status OK) so a graceful
// stop of a grpc.Server that Register was called on can complete. Serve
// calls it when its context ends.
func (s *Server) Stop() { s.stopOnce.Do(func() { close(s.stopping) }) }

// New validates cfg and builds the services. It starts nothing.
func New(pools Pools, cfg Config) (*Server, error) {
	if pools == nil {
		return nil, fmt.Errorf("%w: no router", ErrInvalidConfig)
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("grpcapi: register metrics: %w", err)
	}
	s := &Server{cfg: cfg, pools: pools, log: cfg.Logger, logLimit: ratelog.New(10*time.Second, 5), m: m, health: health.NewServer(), stopping: make(chan struct{})}
	s.admin = map[string]bool{
		kvrouterv1.Index_Lookup_FullMethodName: true,
		kvrouterv1.Events_Watch_FullMethodName: true,
	}
	if cfg.TokenForPick {
		s.admin[kvrouterv1.Router_Pick_FullMethodName] = true
	}
	s.health.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	s.UpdateHealth()
	return s, nil
}

// Health service names beyond the per-service ones, as the GIE endpoint
// picker protocol names them.
const (
	HealthLiveness  = "liveness"
	HealthReadiness = "readiness"
)

// UpdateHealth sets readiness ("", "readiness", the kvrouter.v1 services and
// ext_proc) to SERVING when some pool has a healthy instance, else
// NOT_SERVING; liveness is always SERVING. Serve calls it every second.
func (s *Server) UpdateHealth() {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	for _, p := range s.pools.Pools() {
		for _, in := range p.Instances() {
			if in.Healthy() {
				st = healthpb.HealthCheckResponse_SERVING
				break
			}
		}
	}
	for _, name := range []string{"", HealthReadiness, kvrouterv1.Router_ServiceDesc.ServiceName,
		kvrouterv1.Index_ServiceDesc.ServiceName, kvrouterv1.Events_ServiceDesc.ServiceName,
		extprocv3.ExternalProcessor_ServiceDesc.ServiceName} {
		s.health.SetServingStatus(name, st)
	}
}

// ServerOptions are the options a grpc.Server needs for Register's
// services: the auth interceptors, the message size limit and, when
// Config.TLS is set, TLS credentials.
func (s *Server) ServerOptions() []grpc.ServerOption {
	opts := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(s.unaryAuth),
		grpc.ChainStreamInterceptor(s.streamAuth),
		grpc.MaxRecvMsgSize(s.cfg.MaxMessageBytes),
	}
	if s.cfg.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(s.cfg.TLS)))
	}
	return opts
}

// Register adds kvrouter.v1 (Router, Index, Events), Envoy's
// ExternalProcessor, grpc.health.v1 and reflection to g. g must have been
// built with ServerOptions, or admin methods go unprotected.
func (s *Server) Register(g *grpc.Server) {
	kvrouterv1.RegisterRouterServer(g, routerService{s: s})
	kvrouterv1.RegisterIndexServer(g, indexService{s: s})
	kvrouterv1.RegisterEventsServer(g, eventsService{s: s})
	extprocv3.RegisterExternalProcessorServer(g, &extProc{s: s})
	healthpb.RegisterHealthServer(g, s.health)
	reflection.Register(g)
}

// Serve serves every service on lis until ctx ends, then stops gracefully:
// Events.Watch streams end at once, other calls get Config.DrainTimeout
// (5 s) to finish. It refreshes
// health every second while serving.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	g := grpc.NewServer(s.ServerOptions()...)
	s.Register(g)
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				s.health.Shutdown() // tell clients to go elsewhere while draining
				s.Stop()
				drained := make(chan struct{})
				go func() { g.GracefulStop(); close(drained) }()
				select {
				case <-drained:
				case <-time.After(s.cfg.DrainTimeout):
					g.Stop()
					<-drained
				}
				return
			case <-done:
				return
			case <-t.C:
				s.UpdateHealth()
			}
		}
	}()
	err := g.Serve(lis)
	close(done)
	<-stopped
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("grpcapi: serve: %w", err)
	}
	return nil
}

func (s *Server) authorize(ctx context.Context, method string) error {
	if s.cfg.AdminToken == "" || !s.admin[method] {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		// The scheme is case-insensitive (RFC 9110 §11.1).
		if len(v) < 7 || !strings.EqualFold(v[:7], "bearer ") {
			continue
		}
		if subtle.ConstantTimeCompare([]byte(strings.TrimSpace(v[7:])), []byte(s.cfg.AdminToken)) == 1 {
			return nil
		}
	}
	s.m.authFailures.WithLabelValues(method).Inc()
	return status.Error(codes.Unauthenticated, "admin method: want authorization: Bearer <token>")
}

func (s *Server) unaryAuth(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := s.authorize(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func (s *Server) streamAuth(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := s.authorize(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return h(srv, ss)
}
