// Package tracing builds kvrouter's OpenTelemetry tracer provider from the
// router's tracing: section: an OTLP exporter over gRPC or HTTP behind a
// batching span processor, a parent-based ratio sampler and the service's
// resource. Fields the section leaves empty fall back to the standard
// OTEL_* environment variables, which the SDK reads itself. It sets no
// OpenTelemetry globals except through SetErrorHandler, which the binary
// calls.
package tracing

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc/credentials"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/pemfile"
)

// ErrConfig wraps errors in building the provider from its configuration.
var ErrConfig = errors.New("tracing: config")

// DefaultServiceName is service.name when neither the tracing: section nor
// OTEL_SERVICE_NAME gives one.
const DefaultServiceName = "kvrouter"

// New builds the tracer provider of cfg (which must be enabled and valid).
// getenv reads the OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL variables (the
// exporters do not: choosing one is the caller's job); nil = os.Getenv.
// The exporter connects lazily: an unreachable collector fails exports,
// reported to otel's error handler, not New. Call Shutdown on the result
// to flush the spans still queued.
func New(ctx context.Context, cfg config.TracingConfig, getenv func(string) string) (*sdktrace.TracerProvider, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	exp, err := newExporter(ctx, cfg.Exporter, getenv)
	if err != nil {
		return nil, err
	}
	res, err := newResource(ctx, cfg.ServiceName)
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, err
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithBatcher(exp), sdktrace.WithResource(res)}
	if r := cfg.SamplerRatio; r != nil {
		// Parent-based: a caller's sampled trace is always continued (and an
		// unsampled one never), so a trace is whole or absent; the ratio
		// applies to the traces the router starts.
		opts = append(opts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(*r))))
	}
	return sdktrace.NewTracerProvider(opts...), nil
}

// SDKDisabled reports OTEL_SDK_DISABLED=true, the specification's switch
// that turns the SDK off whatever the configuration says (the Go SDK does
// not read it itself).
func SDKDisabled(getenv func(string) string) bool {
	return strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true")
}

// Protocol is the exporter protocol cfg selects, after the environment.
func Protocol(cfg config.TracingExporterConfig, getenv func(string) string) (string, error) {
	p := cfg.Protocol
	for _, v := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if p == "" {
			if p = getenv(v); p != "" && p != config.TracingProtocolGRPC && p != config.TracingProtocolHTTP {
				return "", fmt.Errorf("%w: %s=%q: want %s or %s", ErrConfig, v, p, config.TracingProtocolGRPC, config.TracingProtocolHTTP)
			}
		}
	}
	if p == "" {
		p = config.TracingProtocolHTTP // the specification's default
	}
	return p, nil
}

func newExporter(ctx context.Context, cfg config.TracingExporterConfig, getenv func(string) string) (sdktrace.SpanExporter, error) {
	proto, err := Protocol(cfg, getenv)
	if err != nil {
		return nil, err
	}
	var tlsCfg *tls.Config
	if cfg.TLS != nil {
		if tlsCfg, err = clientTLS(*cfg.TLS); err != nil {
			return nil, err
		}
	}
	var u *url.URL // nil: endpoint empty or host:port
	if cfg.Endpoint != "" {
		if parsed, err := url.Parse(cfg.Endpoint); err == nil && parsed.Scheme != "" && parsed.Host != "" {
			u = parsed
		}
	}
	if proto == config.TracingProtocolGRPC {
		var opts []otlptracegrpc.Option
		switch {
		case u != nil:
			opts = append(opts, otlptracegrpc.WithEndpointURL(u.String())) // http: plaintext
		case cfg.Endpoint != "":
			opts = append(opts, otlptracegrpc.WithEndpoint(cfg.Endpoint))
		}
		if cfg.Insecure {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		if tlsCfg != nil {
			opts = append(opts, otlptracegrpc.WithTLSCredentials(credentials.NewTLS(tlsCfg)))
		}
		if cfg.Headers != nil {
			opts = append(opts, otlptracegrpc.WithHeaders(cfg.Headers))
		}
		if cfg.Timeout > 0 {
			opts = append(opts, otlptracegrpc.WithTimeout(cfg.Timeout))
		}
		if cfg.Compression != "" {
			opts = append(opts, otlptracegrpc.WithCompressor(cfg.Compression))
		}
		exp, err := otlptracegrpc.New(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("tracing: otlp grpc exporter: %w", err)
		}
		return exp, nil
	}
	var opts []otlptracehttp.Option
	switch {
	case u != nil:
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/traces" // as OTEL_EXPORTER_OTLP_ENDPOINT is read
		}
		opts = append(opts, otlptracehttp.WithEndpointURL(u.String()))
	case cfg.Endpoint != "":
		opts = append(opts, otlptracehttp.WithEndpoint(cfg.Endpoint))
	}
	if cfg.Insecure {
		opts = append(opts, otlptracehttp.WithInsecure())
	}
	if tlsCfg != nil {
		opts = append(opts, otlptracehttp.WithTLSClientConfig(tlsCfg))
	}
	if cfg.Headers != nil {
		opts = append(opts, otlptracehttp.WithHeaders(cfg.Headers))
	}
	if cfg.Timeout > 0 {
		opts = append(opts, otlptracehttp.WithTimeout(cfg.Timeout))
	}
	switch cfg.Compression {
	case "gzip":
		opts = append(opts, otlptracehttp.WithCompression(otlptracehttp.GzipCompression))
	case "none":
		opts = append(opts, otlptracehttp.WithCompression(otlptracehttp.NoCompression))
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("tracing: otlp http exporter: %w", err)
	}
	return exp, nil
}

// clientTLS builds the exporter's TLS settings: the CA bundle that
// verifies the collector and the client certificate it may ask for.
func clientTLS(c config.TLSConfig) (*tls.Config, error) {
	cfg, err := pemfile.ClientTLS(c.CAFile, c.CertFile, c.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("%w: exporter.tls: %w", ErrConfig, err)
	}
	return cfg, nil
}

// newResource describes the process: service.name (the section's, else
// OTEL_SERVICE_NAME, else kvrouter), OTEL_RESOURCE_ATTRIBUTES, the SDK and
// the host. Later sources override earlier ones.
func newResource(ctx context.Context, serviceName string) (*resource.Resource, error) {
	opts := []resource.Option{
		resource.WithAttributes(attribute.String("service.name", DefaultServiceName)),
		resource.WithFromEnv(),
		resource.WithTelemetrySDK(),
		resource.WithHost(),
	}
	if serviceName != "" {
		opts = append(opts, resource.WithAttributes(attribute.String("service.name", serviceName)))
	}
	res, err := resource.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: resource: %w", ErrConfig, err)
	}
	return res, nil
}

// ErrorHandler reports the SDK's errors (mostly failed exports, each
// losing its batch of spans): each is counted in kvrouter_tracing_errors_total, and logged at
// most once per interval with the number since the last log, so that a
// collector that is down cannot flood the log.
type ErrorHandler struct {
	log   *slog.Logger
	every time.Duration
	count prometheus.Counter

	mu     sync.Mutex // guards last and quiet
	last   time.Time
	quiet  int // errors not logged since last
	nowFor func() time.Time
}

var _ otel.ErrorHandler = (*ErrorHandler)(nil)

// NewErrorHandler registers the error counter on reg (nil = none) and
// returns the handler; install it with otel.SetErrorHandler.
func NewErrorHandler(log *slog.Logger, reg prometheus.Registerer, every time.Duration) (*ErrorHandler, error) {
	h := &ErrorHandler{log: log, every: every, nowFor: time.Now, count: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvrouter_tracing_errors_total",
		Help: "OpenTelemetry SDK errors, mostly failed span exports (each loses its batch of spans); logged at most once a minute.",
	})}
	if reg != nil {
		if err := reg.Register(h.count); err != nil {
			return nil, fmt.Errorf("tracing: register metrics: %w", err)
		}
	}
	return h, nil
}

// Handle implements otel.ErrorHandler.
func (h *ErrorHandler) Handle(err error) {
	h.count.Inc()
	h.mu.Lock()
	now := h.nowFor()
	if !h.last.IsZero() && now.Sub(h.last) < h.every {
		h.quiet++
		h.mu.Unlock()
		return
	}
	quiet := h.quiet
	h.last, h.quiet = now, 0
	h.mu.Unlock()
	h.log.Warn("tracing: OpenTelemetry SDK error (a failed export loses its spans)", "err", err, "errors_not_logged", quiet)
}
