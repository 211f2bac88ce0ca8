package tracing

import (
	"bytes"
	"context"
	"encoding/pem"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/tracing/otlptest"
)

// service returns the service.name of the received span named name.
func service(c *otlptest.Collector, name string) (string, bool) {
	for _, s := range c.Spans() {
		if s.Name == name {
			return s.Service, true
		}
	}
	return "", false
}

func noEnv(string) string { return "" }

// emit makes one span named name through a provider of cfg and flushes it.
func emit(t *testing.T, cfg config.TracingConfig, getenv func(string) string, name string) {
	t.Helper()
	tp, err := New(t.Context(), cfg, getenv)
	if err != nil {
		t.Fatal(err)
	}
	_, sp := tp.Tracer("test").Start(t.Context(), name)
	sp.End()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown (flush): %v", err)
	}
}

func TestExportGRPC(t *testing.T) {
	c := &otlptest.Collector{}
	addr := otlptest.StartGRPC(t, c)
	for _, tc := range []struct {
		name     string
		endpoint string
		insecure bool
	}{
		{"host_port_insecure", addr, true},
		{"http_url", "http://" + addr, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.TracingConfig{Enabled: true, Exporter: config.TracingExporterConfig{
				Protocol: config.TracingProtocolGRPC, Endpoint: tc.endpoint, Insecure: tc.insecure,
				Headers: map[string]string{"x-tenant": "team-a"}, Compression: "gzip", Timeout: 15 * time.Second,
			}}
			emit(t, cfg, noEnv, "grpc-"+tc.name)
			if svc, ok := service(c, "grpc-"+tc.name); !ok || svc != DefaultServiceName {
				t.Fatalf("collector got %v, want span grpc-%s of service %s", c.Spans(), tc.name, DefaultServiceName)
			}
			hs := c.Headers()
			if h := hs[len(hs)-1]; h.Get("x-tenant") != "team-a" {
				t.Errorf("metadata %v: want x-tenant team-a", h)
			}
		})
	}
}

func TestExportHTTP(t *testing.T) {
	c := &otlptest.Collector{}
	ts := otlptest.StartHTTP(t, c, false)
	// The protocol comes from the environment when the file leaves it
	// empty; the URL without a path gets /v1/traces.
	env := func(k string) string {
		if k == "OTEL_EXPORTER_OTLP_PROTOCOL" {
			return "http/protobuf"
		}
		return ""
	}
	cfg := config.TracingConfig{Enabled: true, ServiceName: "router-eu", Exporter: config.TracingExporterConfig{
		Endpoint: ts.URL, Headers: map[string]string{"X-Tenant": "team-b"}, Compression: "gzip",
	}}
	emit(t, cfg, env, "http-span")
	if svc, _ := service(c, "http-span"); svc != "router-eu" {
		t.Fatalf("collector got %v, want http-span of service router-eu", c.Spans())
	}
	if h := c.Headers()[0]; h.Get("X-Tenant") != "team-b" || h.Get("Content-Encoding") != "gzip" {
		t.Errorf("headers %v: want X-Tenant team-b, gzip", h)
	}
}

// TestExportHTTPTLS verifies the collector with tls.ca_file.
func TestExportHTTPTLS(t *testing.T) {
	c := &otlptest.Collector{}
	ts := otlptest.StartHTTP(t, c, true)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := config.TracingConfig{Enabled: true, Exporter: config.TracingExporterConfig{
		Protocol: config.TracingProtocolHTTP, Endpoint: ts.URL, TLS: &config.TLSConfig{CAFile: ca},
	}}
	emit(t, cfg, noEnv, "tls-span")
	if _, ok := service(c, "tls-span"); !ok {
		t.Fatalf("collector got %v over TLS", c.Spans())
	}
	// Without the CA the export fails (the collector is not trusted):
	// nothing arrives, and the failure reaches otel's error handler.
	eh, err := NewErrorHandler(slog.New(slog.DiscardHandler), nil, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	otel.SetErrorHandler(eh)
	t.Cleanup(func() { otel.SetErrorHandler(otel.ErrorHandlerFunc(func(error) {})) })
	cfg.Exporter.TLS = nil
	tp, err := New(t.Context(), cfg, noEnv)
	if err != nil {
		t.Fatal(err)
	}
	_, sp := tp.Tracer("test").Start(t.Context(), "untrusted")
	sp.End()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	var m dto.Metric
	if err := eh.count.Write(&m); err != nil || m.GetCounter().GetValue() < 1 {
		t.Errorf("export errors counted: %v (%v), want the failed export", m.GetCounter().GetValue(), err)
	}
	if _, ok := service(c, "untrusted"); ok {
		t.Error("a span reached the untrusted collector")
	}
}

// TestSamplerRatioZero: ratio 0 exports nothing the router starts.
func TestSamplerRatioZero(t *testing.T) {
	c := &otlptest.Collector{}
	ts := otlptest.StartHTTP(t, c, false)
	zero := 0.0
	cfg := config.TracingConfig{Enabled: true, SamplerRatio: &zero, Exporter: config.TracingExporterConfig{Endpoint: ts.URL}}
	emit(t, cfg, noEnv, "sampled-out")
	if got := c.Spans(); len(got) != 0 {
		t.Errorf("collector got %v with sampler_ratio 0", got)
	}
}

func TestServiceNameFromEnv(t *testing.T) {
	t.Setenv("OTEL_SERVICE_NAME", "from-env")
	res, err := newResource(t.Context(), "")
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := res.Set().Value("service.name"); v.AsString() != "from-env" {
		t.Errorf("service.name %q, want OTEL_SERVICE_NAME's", v.AsString())
	}
	res, err = newResource(t.Context(), "from-file")
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := res.Set().Value("service.name"); v.AsString() != "from-file" {
		t.Errorf("service.name %q, want the file's, which wins", v.AsString())
	}
}

func TestSDKDisabled(t *testing.T) {
	for v, want := range map[string]bool{"": false, "true": true, " TRUE ": true, "false": false, "1": false} {
		if got := SDKDisabled(func(string) string { return v }); got != want {
			t.Errorf("OTEL_SDK_DISABLED=%q: %v, want %v", v, got, want)
		}
	}
}

func TestProtocol(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	for _, tc := range []struct {
		file, traces, all, want string
		err                     bool
	}{
		{want: config.TracingProtocolHTTP},
		{all: "grpc", want: "grpc"},
		{traces: "http/protobuf", all: "grpc", want: "http/protobuf"},
		{file: "grpc", traces: "http/protobuf", want: "grpc"},
		{all: "http/json", err: true},
	} {
		env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"], env["OTEL_EXPORTER_OTLP_PROTOCOL"] = tc.traces, tc.all
		got, err := Protocol(config.TracingExporterConfig{Protocol: tc.file}, getenv)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("%+v: got %q, %v", tc, got, err)
		}
	}
	if _, err := New(t.Context(), config.TracingConfig{Enabled: true}, func(string) string { return "http/json" }); err == nil {
		t.Error("New accepted protocol http/json")
	}
}

func TestClientTLSErrors(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []config.TLSConfig{
		{CAFile: filepath.Join(dir, "missing.pem")},
		{CAFile: notPEM},
		{CertFile: notPEM, KeyFile: notPEM},
	} {
		if _, err := New(t.Context(), config.TracingConfig{Enabled: true, Exporter: config.TracingExporterConfig{TLS: &c}}, noEnv); err == nil {
			t.Errorf("tls %+v accepted", c)
		}
	}
}

// TestErrorHandler: every error counted, at most one logged per interval
// with the count of those not logged.
func TestErrorHandler(t *testing.T) {
	var buf bytes.Buffer
	reg := prometheus.NewRegistry()
	h, err := NewErrorHandler(slog.New(slog.NewTextHandler(&buf, nil)), reg, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	h.nowFor = func() time.Time { return now }
	for range 5 {
		h.Handle(io.ErrUnexpectedEOF)
	}
	now = now.Add(time.Minute)
	h.Handle(io.ErrUnexpectedEOF)
	var m dto.Metric
	if err := h.count.Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetCounter().GetValue(); got != 6 {
		t.Errorf("counted %v errors, want 6", got)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], "errors_not_logged=4") {
		t.Errorf("log:\n%s\nwant 2 lines, the second counting 4 not logged", buf.String())
	}
}
