// Command kvrouter is the KV-cache-aware request router for vLLM fleets:
// an OpenAI-compatible (and SageMaker raw-invoke) HTTP proxy that routes
// each request with a per-pool strategy. See docs/configuration.md.
//
//	kvrouter --config router.yaml [--listen :8080] [--admin-listen :8081] [--grpc-listen :9090] ...
//
// With grpc.listen (or --grpc-listen) it also serves the gRPC API
// (kvrouter.v1 Router/Index/Events, health, reflection) and Envoy's ext_proc
// endpoint picker on that address, with the same TLS and admin token as the
// HTTP listeners (docs/grpc.md, docs/envoy.md).
//
// Secrets come from the environment: KVROUTER_ADMIN_TOKEN (bearer token of
// the admin API), KVROUTER_REDIS_PASSWORD, KVROUTER_CACHE_SALT_SECRET (hex
// HMAC key of pools' cache_salt, docs/security.md), KVROUTER_HEARTBEAT_KEY
// (hex key bridge heartbeats must be signed with, KVBRIDGE_HEARTBEAT_KEY on
// the bridges). SIGHUP reloads the config file
// (the KV event consumers and indexes are kept); SIGINT/SIGTERM drain and
// stop.
//
// When a pool can use KV state (an index: section, or kv_aware/shadow) and
// events are not disabled, the router consumes KV events from NATS
// (events.nats.url), or starts an embedded NATS server with JetStream for
// kvbridges to publish to. See docs/operations.md.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"reflect"
	"sync"
	"syscall"
	"time"

	actors "github.com/oklog/run"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/internal/liblog"
	"github.com/kvrouter/kvrouter/internal/tracing"
	"github.com/kvrouter/kvrouter/internal/version"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/fleet"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/tlscert"
)

func main() {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().String("kvrouter"))
		return
	}
	if err := run(context.Background(), os.Args[1:], os.Stderr, os.Getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return // usage was printed; asking for help is not a failure
		}
		fmt.Fprintln(os.Stderr, "kvrouter:", err)
		os.Exit(1)
	}
}

const usageText = `kvrouter: a KV-cache-aware router in front of vLLM (and OpenAI-compatible) engines.
It serves the OpenAI and SageMaker APIs on listen, picks an instance per request by
what each engine's prefix cache holds (kv_aware) or a heuristic, and proxies to it.

usage: kvrouter --config router.yaml [flags]

Examples:
  kvrouter --config examples/router-kv.yaml                 # run
  kvrouter --config router.yaml --check-config              # validate and exit
  KVROUTER_ADMIN_TOKEN=s3cret kvrouter --config router.yaml --admin-listen 127.0.0.1:8081

Flags override the file's fields (docs/configuration.md lists every field):
`

const usageFooter = `
Environment (secrets are never read from the file):
  KVROUTER_ADMIN_TOKEN        bearer token required on the admin API and gRPC admin methods
  KVROUTER_REDIS_PASSWORD     password of index.redis (ACL user in the file)
  KVROUTER_CACHE_SALT_SECRET  hex HMAC key of pools' cache_salt (docs/security.md)
  KVROUTER_HEARTBEAT_KEY      hex key (>= 16 bytes) bridge heartbeats must be signed with
                              (the bridges' KVBRIDGE_HEARTBEAT_KEY); unset: not checked
  OTEL_*                      OpenTelemetry's variables fill what tracing: leaves empty;
                              collector credentials go in OTEL_EXPORTER_OTLP_HEADERS

Signals: SIGHUP reloads the file (pools, routing, limits, TLS certificates; the KV
event consumers and indexes are kept);
SIGINT/SIGTERM drain in-flight requests for --shutdown-timeout, then exit.

Endpoints: data plane /v1/chat/completions, /v1/completions, /invocations, /healthz,
/readyz; admin /admin/..., /dashboard, /metrics, /v1/kv/evictions (docs/operations.md).
`

// flags are command-line overrides; a zero value leaves the file's value.
type flags struct {
	config               string
	listen               string
	adminListen          string
	grpcListen           string
	logLevel             string
	logFormat            string
	maxBodyBytes         int64
	defaultPool          string
	strategy             string
	prefixLength         int
	concurrencyThreshold int
	checkConfig          bool
	shutdownTimeout      time.Duration
}

func parseFlags(args []string, stderr io.Writer) (flags, error) {
	var f flags
	fs := flag.NewFlagSet("kvrouter", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cli.SetUsage(fs, stderr, usageText, usageFooter)
	fs.StringVar(&f.config, "config", "", "path to the YAML configuration (required)")
	fs.StringVar(&f.listen, "listen", "", "data-plane listen address (overrides listen)")
	fs.StringVar(&f.adminListen, "admin-listen", "", "admin API and /metrics listen address (overrides admin_listen)")
	fs.StringVar(&f.grpcListen, "grpc-listen", "", "gRPC API and Envoy ext_proc listen address (overrides grpc.listen)")
	fs.StringVar(&f.logLevel, "log-level", "", "debug|info|warn|error (overrides log.level)")
	fs.StringVar(&f.logFormat, "log-format", "", "json|text (overrides log.format)")
	fs.Int64Var(&f.maxBodyBytes, "max-body-bytes", 0, "request body limit in bytes (overrides max_body_bytes)")
	fs.StringVar(&f.defaultPool, "default-pool", "", "pool for requests that name none (overrides default_pool)")
	fs.StringVar(&f.strategy, "strategy", "", "routing strategy of every pool (overrides pools[].routing.strategy)")
	fs.IntVar(&f.prefixLength, "prefix-length", 0, "prefix length of every pool (overrides pools[].routing.prefix_length)")
	fs.IntVar(&f.concurrencyThreshold, "concurrency-threshold", 0, "concurrency threshold of every pool (overrides pools[].routing.concurrency_threshold)")
	fs.BoolVar(&f.checkConfig, "check-config", false, "validate the configuration and exit")
	fs.DurationVar(&f.shutdownTimeout, "shutdown-timeout", 30*time.Second, "how long to drain in-flight requests on SIGTERM")
	if err := fs.Parse(args); err != nil {
		return f, err
	}
	if fs.NArg() > 0 {
		return f, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if f.config == "" {
		return f, errors.New("--config is required")
	}
	return f, nil
}

// loadConfig reads the file and applies flags and environment, in that order
// of precedence: environment secrets, then flags, then the file.
func loadConfig(f flags, getenv func(string) string) (config.Config, error) {
	cfg, err := config.LoadConfig(f.config)
	if err != nil {
		return cfg, err
	}
	if f.listen != "" {
		cfg.Listen = f.listen
	}
	if f.adminListen != "" {
		cfg.AdminListen = f.adminListen
	}
	if f.grpcListen != "" {
		cfg.GRPC.Listen = f.grpcListen
	}
	if f.logLevel != "" {
		cfg.Log.Level = f.logLevel
	}
	if f.logFormat != "" {
		cfg.Log.Format = f.logFormat
	}
	if f.maxBodyBytes != 0 {
		cfg.MaxBodyBytes = f.maxBodyBytes
	}
	if f.defaultPool != "" {
		cfg.DefaultPool = f.defaultPool
	}
	for i := range cfg.Pools {
		r := &cfg.Pools[i].Routing
		if f.strategy != "" {
			r.Strategy = f.strategy
		}
		if f.prefixLength != 0 {
			r.PrefixLength = f.prefixLength
		}
		if f.concurrencyThreshold != 0 {
			r.ConcurrencyThreshold = f.concurrencyThreshold
		}
	}
	cfg.AdminToken = getenv("KVROUTER_ADMIN_TOKEN")
	if cfg.CacheSaltSecret, err = config.DecodeCacheSaltSecret(getenv(config.CacheSaltSecretEnv)); err != nil {
		return cfg, err
	}
	if cfg.HeartbeatKey, err = kvstream.DecodeHeartbeatKey(getenv(kvstate.HeartbeatKeyEnv)); err != nil {
		return cfg, fmt.Errorf("%s: %w", kvstate.HeartbeatKeyEnv, err)
	}
	if cfg.Index != nil && cfg.Index.Redis != nil {
		cfg.Index.Redis.Password = getenv("KVROUTER_REDIS_PASSWORD")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("%s: %w", f.config, err)
	}
	return cfg, nil
}

func newLogger(cfg config.LogConfig, w io.Writer) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(cfg.Level))
	opts := &slog.HandlerOptions{Level: lvl}
	if cfg.Format == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

func run(ctx context.Context, args []string, stderr io.Writer, getenv func(string) string) error {
	f, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	cfg, err := loadConfig(f, getenv)
	if err != nil {
		return err
	}
	if f.checkConfig {
		fmt.Fprintln(stderr, "configuration ok")
		return nil
	}
	log := newLogger(cfg.Log, stderr)
	reg := prometheus.NewRegistry()
	// The standard Go runtime and process series (go_goroutines,
	// process_resident_memory_bytes, ...), as kvbridge exports them.
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// go-redis and nats.go write their own lines to stderr by default:
	// route them into the structured log, rate-limited and counted. The
	// go-redis logger is process-global, set here by the binary.
	libs, err := liblog.New(reg, log, "kvrouter_library_log_lines_total")
	if err != nil {
		return err
	}
	redis.SetLogger(libs.Redis())
	opts := httpapi.Options{Logger: log, Registry: reg, Admin: admin.Routes(nil)}
	// kvCtx owns the KV event pipeline (consumers, embedded NATS); it
	// outlives the signal context so that in-flight requests drain with
	// exact routing intact.
	kvCtx, cancelKV := context.WithCancel(context.Background())
	defer cancelKV()
	var kve *kvstate.Pipeline
	if config.KVEventsWanted(cfg) {
		if kve, err = kvstate.Start(kvCtx, cfg, kvstate.Options{Registerer: reg, Logger: log, NATSErrorHandler: libs.NATSErrorHandler()}); err != nil {
			return err
		}
		defer kve.Close()
		opts.KV, opts.KVEvents, opts.Admin = kvaware.NewSource(kve.KV), kve, admin.Routes(kve)
		log.Info("consuming KV events", "nats_url", kve.NATSURL())
	} else {
		log.Info("KV events off: no pool needs KV state or events.enabled is false")
	}
	if cfg.Tracing.Enabled && tracing.SDKDisabled(getenv) {
		log.Warn("tracing: enabled in the file but OTEL_SDK_DISABLED=true: off")
	} else if cfg.Tracing.Enabled {
		tp, err := startTracing(cfg.Tracing, getenv, reg, log)
		if err != nil {
			return err
		}
		// Runs when run returns, after the servers drained: the spans of
		// the drained requests are flushed too.
		defer stopTracing(tp, log)
		opts.TracerProvider = tp
	}
	srv, err := httpapi.NewServer(cfg, opts)
	if err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	dataLn, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	// Header size, header and body read deadlines and idle time come from
	// limits: (httpapi.NewHTTPServer); no WriteTimeout, streams last minutes.
	servers := []*http.Server{httpapi.NewHTTPServer(cfg.Limits, srv.Handler())}
	listeners := []net.Listener{dataLn}
	// grpcLn is the gRPC listener (nil = no gRPC); gRPC does its own TLS.
	var grpcLn net.Listener
	closeAll := func() {
		for _, ln := range listeners {
			ln.Close()
		}
		if grpcLn != nil {
			grpcLn.Close()
		}
	}
	if cfg.AdminListen != "" {
		adminLn, err := net.Listen("tcp", cfg.AdminListen)
		if err != nil {
			closeAll()
			return fmt.Errorf("listen %s: %w", cfg.AdminListen, err)
		}
		servers = append(servers, httpapi.NewHTTPServer(cfg.Limits, srv.AdminHandler()))
		listeners = append(listeners, adminLn)
	}
	if cfg.GRPC.Listen != "" {
		if grpcLn, err = net.Listen("tcp", cfg.GRPC.Listen); err != nil {
			closeAll()
			return fmt.Errorf("listen %s: %w", cfg.GRPC.Listen, err)
		}
	}
	// TLS on every listener; the certificate files are re-read on SIGHUP and
	// when they change (the file paths themselves change only on restart).
	var certs *tlscert.Reloader
	if cfg.TLS != nil {
		if certs, err = tlscert.NewReloader(*cfg.TLS, log); err != nil {
			closeAll()
			return err
		}
		for i, ln := range listeners {
			listeners[i] = tls.NewListener(ln, certs.TLSConfig())
		}
	}
	var api *grpcapi.Server
	if grpcLn != nil {
		if api, err = newGRPC(cfg, srv, kve, certs, reg, log, f.shutdownTimeout); err != nil {
			closeAll()
			return err
		}
	}
	// Print the bound addresses (":0" in tests picks a free port).
	attrs := []any{"listen", dataLn.Addr().String()}
	if len(listeners) > 1 {
		attrs = append(attrs, "admin_listen", listeners[1].Addr().String())
	}
	if grpcLn != nil {
		attrs = append(attrs, "grpc_listen", grpcLn.Addr().String())
	}
	attrs = append(attrs, "tls", certs != nil)
	log.Info("kvrouter listening", attrs...)

	var fl *fleet.Reconciler
	if kve != nil {
		fl = fleet.New(srv, kve, cfg, fleet.DefaultInterval, log)
		for _, hs := range servers {
			hs.RegisterOnShutdown(kve.StopStreams)
		}
	}
	// The background components, each run until its context ends: health
	// checks and adapter discovery, certificate rotation, heartbeat
	// discovery. They stop after the servers drained, so that requests in
	// flight keep their health view.
	var loops []func(context.Context) error
	loops = append(loops, srv.Run)
	if certs != nil {
		loops = append(loops, func(ctx context.Context) error { certs.Run(ctx); return nil })
	}
	if fl != nil {
		loops = append(loops, fl.Run)
	}
	// The reloaders a SIGHUP applies the new file to, in order (the
	// certificates are re-read before, regardless of the file).
	apply := srv.Reload
	if fl != nil {
		apply = fl.Apply
	}
	reloads := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_config_reloads_total",
		Help: "SIGHUP reloads of the configuration file, by result (ok, failed: the running configuration kept)."}, []string{"result"})
	reloadOK := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_config_last_reload_successful",
		Help: "1 when the last SIGHUP reload applied the file (or none was asked), 0 when it failed and the running configuration differs from the file."})
	reloadOK.Set(1)
	if err := reg.Register(reloads); err != nil {
		return err
	}
	if err := reg.Register(reloadOK); err != nil {
		return err
	}
	reload := func() {
		if certs != nil {
			certs.ReloadAndLog()
		}
		ncfg, err := loadConfig(f, getenv)
		if err == nil && !reflect.DeepEqual(ncfg.Tracing, cfg.Tracing) {
			log.Warn("reload: tracing: changes only on restart")
		}
		if err == nil && api != nil && (ncfg.GRPC != cfg.GRPC || ncfg.DefaultPool != cfg.DefaultPool || ncfg.AdminToken != cfg.AdminToken) {
			log.Warn("reload: grpc: and the gRPC API's default_pool and admin token change only on restart")
		}
		if err == nil {
			err = apply(ncfg)
		}
		if err != nil {
			reloads.WithLabelValues("failed").Inc()
			reloadOK.Set(0)
			log.Error("reload failed; keeping the running configuration", "err", err)
			return
		}
		reloads.WithLabelValues("ok").Inc()
		reloadOK.Set(1)
		log.Info("reloaded", "config", f.config)
	}
	return serve(ctx, f.shutdownTimeout, log, servers, listeners, api, grpcLn, loops, reload)
}

// serve runs the binary's components as one run.Group until a signal ends
// ctx or a server fails: SIGHUP calls reload; the gRPC API and the HTTP
// servers each serve their listener; loops run in the background. At the
// end gRPC stops gracefully alongside the HTTP servers' drain (both
// bounded by drain), then the loops stop. It returns the first server
// error, nil after a signal.
func serve(ctx context.Context, drain time.Duration, log *slog.Logger, servers []*http.Server, listeners []net.Listener,
	api *grpcapi.Server, grpcLn net.Listener, loops []func(context.Context) error, reload func()) error {
	var g actors.Group
	// The drain budget starts when the first component stops.
	drainCtx := sync.OnceValues(func() (context.Context, context.CancelFunc) {
		log.Info("shutting down", "drain", drain)
		return context.WithTimeout(context.Background(), drain)
	})
	defer func() {
		if _, cancel := drainCtx(); cancel != nil {
			cancel()
		}
	}()

	// SIGINT/SIGTERM (ctx) end the group.
	g.Add(func() error { <-ctx.Done(); return nil }, func(error) {})

	// SIGHUP reloads.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	hupDone := make(chan struct{})
	g.Add(func() error {
		for {
			select {
			case <-hupDone:
				return nil
			case <-hup:
				reload()
			}
		}
	}, func(error) { close(hupDone) })

	// gRPC first: its graceful stop (health NOT_SERVING, Watch streams
	// ended, calls drained) runs while the HTTP servers drain below.
	grpcDone := make(chan struct{})
	if api != nil {
		grpcCtx, stopGRPC := context.WithCancel(context.Background())
		g.Add(func() error { defer close(grpcDone); return api.Serve(grpcCtx, grpcLn) }, func(error) { stopGRPC() })
	} else {
		close(grpcDone)
	}
	for i, hs := range servers {
		g.Add(func() error {
			if err := hs.Serve(listeners[i]); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		}, func(error) {
			sctx, _ := drainCtx()
			_ = hs.Shutdown(sctx)
		})
	}
	// The loops, last: interrupted once the servers above have drained. A
	// loop that has nothing to do returns early (certificates without a
	// reload interval); that must not end the group.
	loopCtx, stopLoops := context.WithCancel(context.Background())
	defer stopLoops()
	for _, loop := range loops {
		g.Add(func() error {
			_ = loop(loopCtx)
			<-loopCtx.Done()
			return nil
		}, func(error) {
			<-grpcDone
			stopLoops()
		})
	}
	return g.Run()
}

// tracingFlushTimeout bounds flushing the queued spans at exit: a collector
// that is down must not hold the process (one export's default timeout is
// 10s; the queue is flushed in batches of up to 512 spans).
const tracingFlushTimeout = 5 * time.Second

// startTracing builds the tracer provider of the tracing: section and routes
// the OpenTelemetry SDK's errors to the log (once a minute) and a counter.
func startTracing(cfg config.TracingConfig, getenv func(string) string, reg prometheus.Registerer, log *slog.Logger) (*sdktrace.TracerProvider, error) {
	eh, err := tracing.NewErrorHandler(log, reg, time.Minute)
	if err != nil {
		return nil, err
	}
	otel.SetErrorHandler(eh)
	tp, err := tracing.New(context.Background(), cfg, getenv)
	if err != nil {
		return nil, err
	}
	proto, _ := tracing.Protocol(cfg.Exporter, getenv)
	log.Info("tracing on", "protocol", proto, "endpoint", cfg.Exporter.Endpoint)
	return tp, nil
}

// stopTracing flushes the spans still queued and stops the exporter.
func stopTracing(tp *sdktrace.TracerProvider, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), tracingFlushTimeout)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		log.Warn("tracing: flushing spans at exit failed", "err", err)
	}
}

// newGRPC builds the gRPC services of the grpc: section over srv: the admin
// token and TLS certificates of the HTTP listeners, Events.Watch on the KV
// events' NATS connection (none without KV events: Watch is UNAVAILABLE),
// metrics on reg, and drain as the graceful-stop budget.
func newGRPC(cfg config.Config, srv *httpapi.Server, kve *kvstate.Pipeline, certs *tlscert.Reloader,
	reg prometheus.Registerer, log *slog.Logger, drain time.Duration) (*grpcapi.Server, error) {
	ep := cfg.GRPC.ExtProc
	body := ep.MaxBodyBytes
	if body == 0 {
		body = int(cfg.MaxBodyBytes)
	}
	gc := grpcapi.Config{
		DefaultPool:  cfg.DefaultPool,
		AdminToken:   cfg.AdminToken,
		TokenForPick: cfg.GRPC.TokenForPick,
		// Envoy sends a buffered body in one message: leave room for its
		// headers and metadata so that a body just over the limit gets
		// ext_proc's 413 rather than a gRPC RESOURCE_EXHAUSTED.
		MaxMessageBytes: body + 1<<20,
		ExtProc: grpcapi.ExtProcConfig{
			PoolHeader:   ep.PoolHeader,
			Shed:         ep.Shed,
			MaxQueued:    ep.MaxQueued,
			MaxBodyBytes: body,
		},
		// --shutdown-timeout 0 means "do not wait" here as for HTTP; the
		// zero DrainTimeout would mean grpcapi's default.
		DrainTimeout: max(drain, time.Nanosecond),
		Logger:       log,
		Registerer:   reg,
	}
	if kve != nil {
		gc.NATS = kve.Conn()
	}
	if certs != nil {
		// The rotating config of the HTTP listeners. It offers only
		// http/1.1 in ALPN, but grpc's credentials.NewTLS adds h2, also to
		// the per-handshake configs (grpc-go credentials/tls.go, NewTLS).
		gc.TLS = certs.TLSConfig()
	}
	api, err := grpcapi.New(srv, gc)
	if err != nil {
		return nil, fmt.Errorf("grpc: %w", err)
	}
	return api, nil
}
