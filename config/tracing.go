package config

import (
	"math"
	"net"
	"net/url"
	"strings"
	"time"
)

// TracingConfig is the tracing: section (docs/operations.md, "Tracing"):
// OpenTelemetry spans for each data-plane request, exported over OTLP. The
// zero value is off. Package router only holds and validates it; package
// internal/tracing builds the exporter and provider from it (router itself
// depends on the OpenTelemetry API only, not on the SDK or gRPC).
//
// Fields left empty fall back to the standard OTEL_* environment variables
// the OpenTelemetry SDK reads (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
// OTEL_TRACES_SAMPLER[_ARG], OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT,
// _PROTOCOL, _HEADERS, _INSECURE, _CERTIFICATE, _TIMEOUT, _COMPRESSION,
// OTEL_BSP_*); a field set here wins over its variable.
type TracingConfig struct {
	// Enabled turns tracing on. Off, the request path creates no spans and
	// adds no traceparent header (an incoming one is forwarded untouched).
	Enabled bool `yaml:"enabled" json:"enabled,omitempty"`
	// ServiceName is the resource's service.name. Empty = OTEL_SERVICE_NAME,
	// else "kvrouter".
	ServiceName string `yaml:"service_name" json:"service_name,omitempty"`
	// SamplerRatio samples this fraction (0..1) of the traces the router
	// starts; a request with an incoming traceparent follows its caller's
	// decision (parent-based). nil = OTEL_TRACES_SAMPLER and
	// OTEL_TRACES_SAMPLER_ARG, else 1 (every trace, the SDK's default).
	SamplerRatio *float64 `yaml:"sampler_ratio,omitempty" json:"sampler_ratio,omitempty"`
	// Exporter is where spans go.
	Exporter TracingExporterConfig `yaml:"exporter" json:"exporter"`
}

// TracingExporterConfig is tracing.exporter: an OTLP exporter.
type TracingExporterConfig struct {
	// Type: otlp (the only one). Default otlp.
	Type string `yaml:"type" json:"type,omitempty"`
	// Protocol: grpc | http/protobuf. Empty =
	// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL,
	// else http/protobuf (the OpenTelemetry specification's default).
	Protocol string `yaml:"protocol" json:"protocol,omitempty"`
	// Endpoint of the collector: a URL (http://collector:4318; the http
	// scheme means plaintext, https TLS; for http/protobuf a URL without a
	// path gets /v1/traces) or host:port (TLS unless insecure). Empty =
	// OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else localhost:4318 (HTTP) or
	// localhost:4317 (gRPC).
	Endpoint string `yaml:"endpoint" json:"endpoint,omitempty"`
	// Insecure sends spans in plaintext to a host:port endpoint.
	Insecure bool `yaml:"insecure" json:"insecure,omitempty"`
	// TLS verifies the collector with ca_file and presents cert_file and
	// key_file (mutual TLS); nil = the system roots.
	TLS *TLSConfig `yaml:"tls,omitempty" json:"tls,omitempty"`
	// Headers are sent with every export. When set they replace
	// OTEL_EXPORTER_OTLP_[TRACES_]HEADERS: keep credentials (an API key,
	// an Authorization header) in that variable, not in this file.
	Headers map[string]string `yaml:"headers,omitempty" json:"-"`
	// Timeout bounds one export. Empty = OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT,
	// else 10s.
	Timeout time.Duration `yaml:"timeout" json:"timeout,omitempty"`
	// Compression: gzip | none. Empty = OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION,
	// else none.
	Compression string `yaml:"compression" json:"compression,omitempty"`
}

// Tracing exporter protocols.
const (
	TracingProtocolGRPC = "grpc"
	TracingProtocolHTTP = "http/protobuf"
)

// validate checks the tracing: section. It is checked whether or not
// enabled, so that turning tracing on later cannot reveal an old typo.
func (t TracingConfig) validate() error {
	bad := invalidf("tracing.")
	if t.ServiceName != "" && (len(t.ServiceName) > 255 || strings.ContainsFunc(t.ServiceName, func(r rune) bool { return r < 0x20 || r == 0x7f })) {
		return bad("service_name %q: want 1-255 printable characters", t.ServiceName)
	}
	if r := t.SamplerRatio; r != nil && (math.IsNaN(*r) || *r < 0 || *r > 1) {
		return bad("sampler_ratio %v out of range 0..1", *r)
	}
	e := t.Exporter
	switch e.Type {
	case "", "otlp":
	default:
		return bad("exporter.type %q: want otlp", e.Type)
	}
	switch e.Protocol {
	case "", TracingProtocolGRPC, TracingProtocolHTTP:
	default:
		return bad("exporter.protocol %q: want %s or %s", e.Protocol, TracingProtocolGRPC, TracingProtocolHTTP)
	}
	if e.Endpoint != "" {
		if strings.Contains(e.Endpoint, "://") {
			u, err := url.Parse(e.Endpoint)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				return bad("exporter.endpoint %q: want an http(s) URL or host:port", e.Endpoint)
			}
			if u.User != nil {
				return bad("exporter.endpoint: no credentials in the URL (use OTEL_EXPORTER_OTLP_HEADERS)")
			}
			if e.Insecure && u.Scheme == "https" {
				return bad("exporter.insecure contradicts the https endpoint %q", e.Endpoint)
			}
			if e.TLS != nil && u.Scheme == "http" {
				return bad("exporter.tls with the plaintext endpoint %q: use https", e.Endpoint)
			}
		} else if _, port, err := net.SplitHostPort(e.Endpoint); err != nil || port == "" {
			return bad("exporter.endpoint %q: want an http(s) URL or host:port", e.Endpoint)
		}
	}
	if e.Insecure && e.TLS != nil {
		return bad("exporter: insecure and tls exclude each other")
	}
	if tl := e.TLS; tl != nil && (tl.CertFile == "") != (tl.KeyFile == "") {
		return bad("exporter.tls: cert_file and key_file go together")
	}
	for k, v := range e.Headers {
		if !validHeaderName(k) {
			return bad("exporter.headers: %q is not an HTTP header name", k)
		}
		if strings.ContainsAny(v, "\r\n\x00") {
			return bad("exporter.headers[%s]: value has a control character", k)
		}
	}
	if e.Timeout < 0 || e.Timeout > 10*time.Minute {
		return bad("exporter.timeout %v out of range 0..10m (0 = default)", e.Timeout)
	}
	switch e.Compression {
	case "", "gzip", "none":
	default:
		return bad("exporter.compression %q: want gzip or none", e.Compression)
	}
	return nil
}
