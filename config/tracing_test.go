package config

import (
	"errors"
	"strings"
	"testing"
)

// TestTracingConfig: the tracing: section as YAML, each accepted or
// refused with the field's path.
func TestTracingConfig(t *testing.T) {
	const pools = `
pools:
  - name: p
    model: m
    instances: [{id: a, url: "http://127.0.0.1:1"}]
`
	for _, tc := range []struct {
		name, yaml string
		err        string // "" = valid; else a substring of the error
	}{
		{"absent", ``, ""},
		{"full grpc", `
tracing:
  enabled: true
  service_name: kvrouter-eu
  sampler_ratio: 0.25
  exporter: {type: otlp, protocol: grpc, endpoint: "collector:4317", insecure: true, headers: {x-scope-orgid: a}, timeout: 5s, compression: gzip}`, ""},
		{"https url with tls", `
tracing: {enabled: true, exporter: {endpoint: "https://collector:4318/v1/traces", tls: {ca_file: ca.pem, cert_file: c.pem, key_file: k.pem}}}`, ""},
		{"ratio zero", `tracing: {enabled: true, sampler_ratio: 0}`, ""},
		{"ratio above one", `tracing: {sampler_ratio: 1.5}`, "tracing.sampler_ratio 1.5 out of range 0..1"},
		{"negative ratio", `tracing: {sampler_ratio: -0.1}`, "tracing.sampler_ratio"},
		{"protocol", `tracing: {exporter: {protocol: http/json}}`, `tracing.exporter.protocol "http/json"`},
		{"type", `tracing: {exporter: {type: zipkin}}`, `tracing.exporter.type "zipkin": want otlp`},
		{"endpoint without port", `tracing: {exporter: {endpoint: collector}}`, `tracing.exporter.endpoint "collector"`},
		{"endpoint bad scheme", `tracing: {exporter: {endpoint: "grpc://collector:4317"}}`, `tracing.exporter.endpoint`},
		{"credentials in url", `tracing: {exporter: {endpoint: "https://u:p@collector:4318"}}`, "no credentials in the URL"},
		{"insecure https", `tracing: {exporter: {endpoint: "https://collector:4318", insecure: true}}`, "contradicts"},
		{"tls on http", `tracing: {exporter: {endpoint: "http://collector:4318", tls: {ca_file: ca.pem}}}`, "use https"},
		{"insecure and tls", `tracing: {exporter: {endpoint: "collector:4317", insecure: true, tls: {ca_file: ca.pem}}}`, "exclude each other"},
		{"cert without key", `tracing: {exporter: {tls: {cert_file: c.pem}}}`, "cert_file and key_file go together"},
		{"bad header name", `tracing: {exporter: {headers: {"bad header": x}}}`, "not an HTTP header name"},
		{"header value newline", "tracing: {exporter: {headers: {x-a: \"a\\nb\"}}}", "control character"},
		{"timeout", `tracing: {exporter: {timeout: 11m}}`, "tracing.exporter.timeout"},
		{"compression", `tracing: {exporter: {compression: zstd}}`, `tracing.exporter.compression "zstd"`},
		{"service name control", "tracing: {service_name: \"a\\tb\"}", "tracing.service_name"},
		{"typo", `tracing: {enabeld: true}`, `tracing.enabeld: unknown field (did you mean "enabled"?)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := ParseConfig(strings.NewReader(tc.yaml + pools))
			if err == nil {
				err = cfg.Validate()
			}
			if tc.err == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("error %v, want ErrInvalidConfig with %q", err, tc.err)
			}
		})
	}
}
