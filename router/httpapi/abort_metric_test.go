package httpapi_test

import (
	"bytes"
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// requestsWithStatus sums kvrouter_requests_total over series with status.
func (h *harness) requestsWithStatus(status string) float64 {
	h.t.Helper()
	return servertest.Metric(h.t, h.srv.Registry(), "kvrouter_requests_total", map[string]string{"status": status})
}

// A client that goes away mid-stream aborts the proxy (http.ErrAbortHandler):
// the request must still be counted, as 499, and the instance released.
func TestClientAbortMidStreamIsCounted(t *testing.T) {
	tests := []struct {
		name       string
		readEvents int // events the client reads before going away
	}{
		{"after the first event", 1},
		{"after three events", 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, 1, nil)
			u := h.ups[0]
			u.SetStream(200, 20*time.Millisecond)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.ts.URL+"/v1/chat/completions", bytes.NewReader(chatBody(model, "abort", true)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			got := 0
			if tt.readEvents > 0 {
				testenv.EachSSEData(resp.Body, func(string) bool { got++; return got < tt.readEvents })
			}
			cancel()
			resp.Body.Close()
			p, _ := h.srv.Pool("llama")
			waitFor(t, "in-flight released", func() bool { return p.Instances()[0].InFlight() == 0 })
			waitFor(t, "aborted request counted as 499", func() bool { return h.requestsWithStatus("499") == 1 })
			if n := h.requestsWithStatus("200"); n != 0 {
				t.Fatalf("%v requests counted as 200, want 0 (the stream never finished)", n)
			}
		})
	}
}
