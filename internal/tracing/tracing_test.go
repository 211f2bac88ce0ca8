package tracing

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/pem"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel"
	collectorpb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/router"
)

// collector is a real OTLP trace receiver (the collector's protobuf
// service) over gRPC or HTTP: it keeps what it is sent.
type collector struct {
	collectorpb.UnimplementedTraceServiceServer

	mu      sync.Mutex // guards got and headers
	got     []*tracepb.ResourceSpans
	headers []map[string]string // per export: the headers/metadata tested
}

func (c *collector) keep(req *collectorpb.ExportTraceServiceRequest, hdr map[string]string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.got = append(c.got, req.ResourceSpans...)
	c.headers = append(c.headers, hdr)
}

// Export implements the OTLP gRPC trace service.
func (c *collector) Export(ctx context.Context, req *collectorpb.ExportTraceServiceRequest) (*collectorpb.ExportTraceServiceResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	c.keep(req, map[string]string{"x-tenant": strings.Join(md.Get("x-tenant"), ",")})
	return &collectorpb.ExportTraceServiceResponse{}, nil
}

// ServeHTTP implements OTLP/HTTP (binary protobuf) at /v1/traces.
func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want POST /v1/traces application/x-protobuf", http.StatusNotFound)
		return
	}
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = zr
	}
	b, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req collectorpb.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	c.keep(&req, map[string]string{"x-tenant": r.Header.Get("X-Tenant"), "encoding": r.Header.Get("Content-Encoding")})
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&collectorpb.ExportTraceServiceResponse{})
	_, _ = w.Write(out)
}

// spans lists the received spans by name with their resource's
// service.name.
func (c *collector) spans() map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]string{}
	for _, rs := range c.got {
		svc := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.Key == "service.name" {
				svc = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				out[s.Name] = svc
			}
		}
	}
	return out
}

func startGRPCCollector(t *testing.T) (*collector, string) {
	c := &collector{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	collectorpb.RegisterTraceServiceServer(gs, c)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return c, ln.Addr().String()
}

func noEnv(string) string { return "" }

// emit makes one span named name through a provider of cfg and flushes it.
func emit(t *testing.T, cfg router.TracingConfig, getenv func(string) string, name string) {
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
	c, addr := startGRPCCollector(t)
	for _, tc := range []struct {
		name     string
		endpoint string
		insecure bool
	}{
		{"host_port_insecure", addr, true},
		{"http_url", "http://" + addr, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := router.TracingConfig{Enabled: true, Exporter: router.TracingExporterConfig{
				Protocol: router.TracingProtocolGRPC, Endpoint: tc.endpoint, Insecure: tc.insecure,
				Headers: map[string]string{"x-tenant": "team-a"}, Compression: "gzip", Timeout: 15 * time.Second,
			}}
			emit(t, cfg, noEnv, "grpc-"+tc.name)
			if svc, ok := c.spans()["grpc-"+tc.name]; !ok || svc != DefaultServiceName {
				t.Fatalf("collector got %v, want span grpc-%s of service %s", c.spans(), tc.name, DefaultServiceName)
			}
			c.mu.Lock()
			h := c.headers[len(c.headers)-1]
			c.mu.Unlock()
			if h["x-tenant"] != "team-a" {
				t.Errorf("metadata %v: want x-tenant team-a", h)
			}
		})
	}
}

func TestExportHTTP(t *testing.T) {
	c := &collector{}
	ts := httptest.NewServer(c)
	defer ts.Close()
	// The protocol comes from the environment when the file leaves it
	// empty; the URL without a path gets /v1/traces.
	env := func(k string) string {
		if k == "OTEL_EXPORTER_OTLP_PROTOCOL" {
			return "http/protobuf"
		}
		return ""
	}
	cfg := router.TracingConfig{Enabled: true, ServiceName: "router-eu", Exporter: router.TracingExporterConfig{
		Endpoint: ts.URL, Headers: map[string]string{"X-Tenant": "team-b"}, Compression: "gzip",
	}}
	emit(t, cfg, env, "http-span")
	if svc := c.spans()["http-span"]; svc != "router-eu" {
		t.Fatalf("collector got %v, want http-span of service router-eu", c.spans())
	}
	if h := c.headers[0]; h["x-tenant"] != "team-b" || h["encoding"] != "gzip" {
		t.Errorf("headers %v: want X-Tenant team-b, gzip", h)
	}
}

// TestExportHTTPTLS verifies the collector with tls.ca_file.
func TestExportHTTPTLS(t *testing.T) {
	c := &collector{}
	ts := httptest.NewTLSServer(c)
	defer ts.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := router.TracingConfig{Enabled: true, Exporter: router.TracingExporterConfig{
		Protocol: router.TracingProtocolHTTP, Endpoint: ts.URL, TLS: &router.TLSConfig{CAFile: ca},
	}}
	emit(t, cfg, noEnv, "tls-span")
	if _, ok := c.spans()["tls-span"]; !ok {
		t.Fatalf("collector got %v over TLS", c.spans())
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
	if _, ok := c.spans()["untrusted"]; ok {
		t.Error("a span reached the untrusted collector")
	}
}

// TestSamplerRatioZero: ratio 0 exports nothing the router starts.
func TestSamplerRatioZero(t *testing.T) {
	c := &collector{}
	ts := httptest.NewServer(c)
	defer ts.Close()
	zero := 0.0
	cfg := router.TracingConfig{Enabled: true, SamplerRatio: &zero, Exporter: router.TracingExporterConfig{Endpoint: ts.URL}}
	emit(t, cfg, noEnv, "sampled-out")
	if got := c.spans(); len(got) != 0 {
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

func TestProtocol(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	for _, tc := range []struct {
		file, traces, all, want string
		err                     bool
	}{
		{want: router.TracingProtocolHTTP},
		{all: "grpc", want: "grpc"},
		{traces: "http/protobuf", all: "grpc", want: "http/protobuf"},
		{file: "grpc", traces: "http/protobuf", want: "grpc"},
		{all: "http/json", err: true},
	} {
		env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"], env["OTEL_EXPORTER_OTLP_PROTOCOL"] = tc.traces, tc.all
		got, err := Protocol(router.TracingExporterConfig{Protocol: tc.file}, getenv)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("%+v: got %q, %v", tc, got, err)
		}
	}
	if _, err := New(t.Context(), router.TracingConfig{Enabled: true}, func(string) string { return "http/json" }); err == nil {
		t.Error("New accepted protocol http/json")
	}
}

func TestClientTLSErrors(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []router.TLSConfig{
		{CAFile: filepath.Join(dir, "missing.pem")},
		{CAFile: notPEM},
		{CertFile: notPEM, KeyFile: notPEM},
	} {
		if _, err := New(t.Context(), router.TracingConfig{Enabled: true, Exporter: router.TracingExporterConfig{TLS: &c}}, noEnv); err == nil {
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
