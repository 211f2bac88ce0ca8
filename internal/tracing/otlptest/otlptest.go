// Package otlptest is a real OTLP trace receiver for tests: the
// collector's protobuf trace service over gRPC, and OTLP/HTTP with binary
// protobuf (optionally gzip) at /v1/traces. It keeps what it receives.
package otlptest

import (
	"compress/gzip"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// Collector receives OTLP trace exports. Safe for concurrent use.
type Collector struct {
	collectorpb.UnimplementedTraceServiceServer

	mu      sync.Mutex // guards got and headers
	got     []*tracepb.ResourceSpans
	headers []http.Header // per export: HTTP headers or gRPC metadata
}

// Span is a received span with its resource's service.name.
type Span struct {
	Service string
	*tracepb.Span
}

func (c *Collector) keep(req *collectorpb.ExportTraceServiceRequest, hdr http.Header) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.got = append(c.got, req.ResourceSpans...)
	c.headers = append(c.headers, hdr)
}

// Export implements the OTLP gRPC trace service.
func (c *Collector) Export(ctx context.Context, req *collectorpb.ExportTraceServiceRequest) (*collectorpb.ExportTraceServiceResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	hdr := http.Header{}
	for k, vs := range md {
		for _, v := range vs {
			hdr.Add(k, v)
		}
	}
	c.keep(req, hdr)
	return &collectorpb.ExportTraceServiceResponse{}, nil
}

// ServeHTTP implements OTLP/HTTP with binary protobuf at /v1/traces.
func (c *Collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want POST /v1/traces application/x-protobuf", http.StatusNotFound)
		return
	}
	var body io.Reader = r.Body
	if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
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
	c.keep(&req, r.Header.Clone())
	out, _ := proto.Marshal(&collectorpb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// Spans returns every span received so far.
func (c *Collector) Spans() []Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []Span
	for _, rs := range c.got {
		svc := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.Key == "service.name" {
				svc = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				out = append(out, Span{Service: svc, Span: s})
			}
		}
	}
	return out
}

// Headers returns the headers (or metadata) of each export so far.
func (c *Collector) Headers() []http.Header {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]http.Header(nil), c.headers...)
}

// StartGRPC serves the collector over gRPC on a free loopback port until
// the test ends, and returns its host:port.
func StartGRPC(t testing.TB, c *Collector) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	collectorpb.RegisterTraceServiceServer(gs, c)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return ln.Addr().String()
}

// StartHTTP serves the collector over HTTP (tls: HTTPS with httptest's
// certificate) until the test ends.
func StartHTTP(t testing.TB, c *Collector, tls bool) *httptest.Server {
	var ts *httptest.Server
	if tls {
		ts = httptest.NewTLSServer(c)
	} else {
		ts = httptest.NewServer(c)
	}
	t.Cleanup(ts.Close)
	return ts
}
