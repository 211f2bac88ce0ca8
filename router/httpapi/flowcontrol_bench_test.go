package httpapi_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

// BenchmarkFlowControl is one completions request through the handler to
// a fast upstream on loopback, side by side: without flow control, with it
// and admitted at once, and shed (429, the queue full behind a held
// request). cpu-ns/op is the whole process (router, upstream, client).
func BenchmarkFlowControl(b *testing.B) {
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), "hold") {
			<-release
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"cmpl-1","object":"text_completion","choices":[]}`))
	}))
	defer up.Close()
	handler := func(fc *config.FlowControlConfig) http.Handler {
		pc := config.PoolConfig{Name: "p", Model: "m", FlowControl: fc,
			Routing: config.RoutingConfig{ConcurrencyThreshold: 1},
			Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "e0", URL: up.URL}}}
		srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			b.Fatal(err)
		}
		return srv.Handler()
	}
	body := `{"model":"m","prompt":"` + strings.Repeat("a short question ", 50) + `","max_tokens":16}`
	do := func(h http.Handler, body string) int {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("POST", "/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	run := func(b *testing.B, h http.Handler, want int) {
		b.ReportAllocs()
		report, n := cputime.Report(b), 0
		defer func() { report(n) }()
		for b.Loop() {
			n++
			if code := do(h, body); code != want {
				b.Fatalf("status %d, want %d", code, want)
			}
		}
	}
	off := handler(nil)
	on := handler(&config.FlowControlConfig{Enabled: true})
	// The held requests must outlast the runs before "shed": no max_wait.
	full := handler(&config.FlowControlConfig{Enabled: true, MaxQueue: 1, MaxWait: time.Hour})
	// Fill full's one slot and its one-place queue with held requests; let
	// them finish before the upstream closes. A probe that finds room in
	// the queue waits there until it gives up (a client gone while queued
	// leaves the queue); then another held request goes in. Held requests
	// beyond the slot and the queue are shed and return at once.
	var held sync.WaitGroup
	defer held.Wait()
	defer close(release)
	probe := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		rec := httptest.NewRecorder()
		req := httptest.NewRequestWithContext(ctx, "POST", "/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		full.ServeHTTP(rec, req)
		return rec.Code
	}
	for {
		held.Go(func() { do(full, strings.Replace(body, "short", "hold", 1)) })
		time.Sleep(10 * time.Millisecond)
		if probe() == http.StatusTooManyRequests {
			break
		}
	}
	b.Run("off", func(b *testing.B) { run(b, off, http.StatusOK) })
	b.Run("admitted", func(b *testing.B) { run(b, on, http.StatusOK) })
	b.Run("shed", func(b *testing.B) { run(b, full, http.StatusTooManyRequests) })
}
