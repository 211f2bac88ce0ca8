package grpcapi_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// warnCounter is a slog handler counting the records whose message holds
// its text.
type warnCounter struct {
	text string
	n    *atomic.Int64
}

func (w warnCounter) Enabled(context.Context, slog.Level) bool { return true }
func (w warnCounter) WithAttrs([]slog.Attr) slog.Handler       { return w }
func (w warnCounter) WithGroup(string) slog.Handler            { return w }
func (w warnCounter) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, w.text) {
		w.n.Add(1)
	}
	return nil
}

// The warning for a streamed body that needs a rewrite is a hot-path
// warning: a misconfigured filter hits it on every such request, so it is
// rate-limited (internal/ratelog) as the other hot-path warnings are,
// while every refused request is still counted.
func TestExtProcStreamedRewriteWarningLimited(t *testing.T) {
	var warned atomic.Int64
	reg := prometheus.NewRegistry()
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) {
		g.Logger = slog.New(warnCounter{text: "several messages", n: &warned})
		g.Registerer = reg
	})
	const n = 50
	body := []byte(`{"model":"` + hashModel + `","prompt":"hello","kv_transfer_params":{"remote_host":"attacker.example"}}`)
	for range n {
		e := h.envoy(t)
		e.headers(nil, false, ":method", "POST", ":path", "/v1/completions", "content-type", "application/json")
		half := len(body) / 2
		e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body[:half]}}})
		if o := outcomeOf(t, e.body(nil, body[half:])); o.status != http.StatusInternalServerError {
			t.Fatalf("streamed body needing a rewrite: %+v, want 500", o)
		}
	}
	if got := testenv.Metric(t, reg, "kvrouter_extproc_requests_total", map[string]string{"pool": "hash", "outcome": "500"}); got != n {
		t.Fatalf("counted %v refusals, want %d", got, n)
	}
	if w := warned.Load(); w < 1 || w > 10 {
		t.Fatalf("%d warnings for %d refusals, want at least one and at most 10 (rate-limited)", w, n)
	}
}
