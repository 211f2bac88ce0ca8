package httpapi_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// X-Kvrouter-Overhead-Us is the router's own time before a request was
// sent (parse, routing text, decision: docs/configuration.md), which
// kvbench reports as decision time. The engines' time is not in it: not a
// flow-control queue's wait, nor an attempt that failed on another
// instance (before, a request queued 602 ms read 602,885 µs, and one
// retried after a 600 ms 503 601,658 µs).

// overheadUS reads the header, failing when it is missing.
func overheadUS(t *testing.T, h http.Header) int {
	t.Helper()
	v, err := strconv.Atoi(h.Get(httpapi.HeaderOverheadUS))
	if err != nil {
		t.Fatalf("%s = %q", httpapi.HeaderOverheadUS, h.Get(httpapi.HeaderOverheadUS))
	}
	return v
}

func TestOverheadExcludesQueueWait(t *testing.T) {
	up, upTS := newOrderUpstream(t)
	srv, ts := flowServer(t, upTS.URL, &config.FlowControlConfig{Enabled: true})
	ctx := context.Background()
	first, queued := make(chan flowReply, 1), make(chan flowReply, 1)
	go func() { first <- postCompletion(ctx, ts.URL, "first", nil, "") }()
	<-up.started
	go func() { queued <- postCompletion(ctx, ts.URL, "queued", nil, "") }()
	waitQueue(t, srv, 1)
	time.Sleep(1500 * time.Millisecond)
	up.releaseFirst()
	<-first
	r := <-queued
	if r.err != nil || r.status != http.StatusOK {
		t.Fatalf("reply %+v", r)
	}
	if ms, _ := strconv.Atoi(r.header.Get(httpapi.HeaderQueuedMs)); ms < 1200 {
		t.Fatalf("%s = %d, want the ~1500 ms it waited", httpapi.HeaderQueuedMs, ms)
	}
	if us := overheadUS(t, r.header); us >= 750_000 {
		t.Fatalf("overhead %d µs includes the queue's wait", us)
	}
}

func TestOverheadExcludesFailedAttempt(t *testing.T) {
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(1500 * time.Millisecond)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(slow.Close)
	good := routertest.New(t, "good", "m")
	_, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{{
		Name: "p", Model: "m",
		Routing:   config.RoutingConfig{Strategy: config.StrategyRoundRobin},
		Health:    config.HealthConfig{Disable: true},
		Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: "slow", URL: slow.URL}, {ID: "good", URL: good.URL()}},
	}}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
	retried := false
	for range 2 { // round_robin: one of the two starts on the slow instance
		r := postCompletion(context.Background(), ts.URL, "hello", nil, "")
		if r.err != nil || r.status != http.StatusOK {
			t.Fatalf("reply %+v", r)
		}
		retried = retried || r.header.Get(httpapi.HeaderAttempts) == "2"
		if us := overheadUS(t, r.header); us >= 750_000 {
			t.Fatalf("overhead %d µs (attempts %q) includes the failed attempt", us, r.header.Get(httpapi.HeaderAttempts))
		}
	}
	if !retried {
		t.Fatal("no request was retried off the slow instance")
	}
}
