package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// syncFreshness is the pool's event-stream freshness (always fresh) with
// its replica sync, as router/kvstate's PeerFreshness gives kv_aware.
type syncFreshness struct {
	kvindex.FreshnessFuncs
	*replicasync.Syncer
}

// sendAndLeave posts body to url as JSON; its client goes away when leave
// is called, which fails the test if the request was answered by then.
func sendAndLeave(t *testing.T, url string, body []byte) (leave func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	gone := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		gone <- err
	}()
	return func() {
		t.Helper()
		cancel()
		if err := <-gone; err == nil {
			t.Fatal("the request was answered before its client left")
		}
	}
}

// A client that goes away while kv_aware holds its request for its
// sequencing epoch (replica sync with a live peer) is a client that left:
// counted 499 with no instance, as the proxy counts one, not as "no
// eligible instance" (503) and, in a disaggregating pool whose prefill
// pick was held, not as a failed prefill; nothing is sent to an engine.
// The next request is served (the epoch loop went on without it).
func TestClientLeavesSequencingHold(t *testing.T) {
	for _, disagg := range []bool{false, true} {
		name := "aggregated"
		if disagg {
			name = "disaggregated"
		}
		t.Run(name, func(t *testing.T) {
			url := testenv.NATSURL(t)
			pool := testenv.UniqueName(t)
			// The grace holds each request about two seconds: long enough
			// for the client's leave to reach the handler on a loaded
			// machine before its turn comes.
			const seq, grace = 20 * time.Millisecond, 2 * time.Second
			mine := servertest.Syncer(t, url, pool, "a", seq, grace)
			servertest.Syncer(t, url, pool, "b", seq, grace)
			idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: kvBS})
			if err != nil {
				t.Fatal(err)
			}
			pc := config.PoolConfig{Name: "p", Model: kvModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
				Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
			if disagg {
				pc.Disaggregation = &config.DisaggregationConfig{Mode: config.DisaggAlways}
			}
			var engines []*kvEngine
			for i := range 2 {
				e := newKVEngine(t, fmt.Sprintf("vllm-%d", i), idx)
				engines = append(engines, e)
				ic := config.InstanceConfig{ID: e.id, URL: e.srv.URL}
				if disagg {
					ic.Role = []string{config.RolePrefill, config.RoleDecode}[i]
				}
				pc.Instances = append(pc.Instances, ic)
			}
			srv, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{
				Logger: slog.New(slog.DiscardHandler),
				KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
					return idx, syncFreshness{Syncer: mine}
				}),
			})
			servertest.WaitFor(t, "the peer live", func() bool { return mine.Live() == 1 })
			// Past the partial epoch the pool's sequencer started in
			// (built with the server), whose requests are not held.
			time.Sleep(seq)
			p, _ := srv.Pool("p")
			held := func() int64 { return kvaware.Of(p).SequenceStats().Held }
			requests := func(labels map[string]string) float64 {
				return servertest.Metric(t, srv.Registry(), "kvrouter_requests_total", labels)
			}
			body, _ := json.Marshal(map[string]any{"model": kvModel, "prompt": tokenPrompt(1, 4*kvBS)})

			leave := sendAndLeave(t, ts.URL+"/v1/completions", body)
			servertest.WaitFor(t, "the request held for its epoch", func() bool { return held() == 1 })
			leave()
			servertest.WaitFor(t, "the request counted", func() bool { return requests(nil) == 1 })
			if n := requests(map[string]string{"status": "499", "instance": "", "strategy": config.StrategyKVAware}); n != 1 {
				t.Fatalf("%v requests counted 499 with no instance; by status: 503 %v, 499 %v, 200 %v", n,
					requests(map[string]string{"status": "503"}), requests(map[string]string{"status": "499"}), requests(map[string]string{"status": "200"}))
			}
			if n := servertest.Metric(t, srv.Registry(), "kvrouter_disagg_requests_total", nil); n != 0 {
				t.Fatalf("%v disaggregation outcomes counted for a request whose client left", n)
			}
			for _, e := range engines {
				if got := e.lastSalt(); got != "<no request>" {
					t.Fatalf("%s received a request whose client left", e.id)
				}
			}

			// The next request is held for its own epoch and served.
			if r := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": kvModel, "prompt": tokenPrompt(2, 4*kvBS)}); r.Status != http.StatusOK {
				t.Fatalf("the next request: %d %s", r.Status, r.Body)
			}
			if n := requests(map[string]string{"status": "200"}); n != 1 {
				t.Fatalf("%v requests counted 200, want the next one", n)
			}
		})
	}
}

// A client that goes away while its request is being prefilled on a
// prefill instance is a client that left: counted 499 on that instance,
// not as a failed prefill served aggregated, and not routed on to a
// decode instance.
func TestClientLeavesDuringPrefill(t *testing.T) {
	h := servertest.New(t, 2, func(c *config.Config) {
		p := &c.Pools[0]
		p.Disaggregation = &config.DisaggregationConfig{Mode: config.DisaggAlways}
		p.Instances[0].Role, p.Instances[1].Role = config.RolePrefill, config.RoleDecode
	})
	prefill, decode := h.Ups[0], h.Ups[1]
	release := prefill.Hold()
	defer release()
	leave := sendAndLeave(t, h.TS.URL+"/v1/chat/completions", servertest.ChatBody(servertest.Model, "leave", false))
	<-prefill.Started
	leave()
	requests := func(labels map[string]string) float64 {
		return servertest.Metric(t, h.Srv.Registry(), "kvrouter_requests_total", labels)
	}
	servertest.WaitFor(t, "the request counted", func() bool { return requests(nil) == 1 })
	if n := requests(map[string]string{"status": "499", "instance": prefill.ID}); n != 1 {
		t.Fatalf("%v requests counted 499 on the prefill instance; 499 on %s: %v", n, decode.ID,
			requests(map[string]string{"status": "499", "instance": decode.ID}))
	}
	for _, m := range []string{"kvrouter_disagg_requests_total", "kvrouter_disagg_prefill_errors_total"} {
		if n := servertest.Metric(t, h.Srv.Registry(), m, nil); n != 0 {
			t.Fatalf("%s: %v for a request whose client left", m, n)
		}
	}
	if n := decode.Requests.Load(); n != 0 {
		t.Fatalf("the decode instance received %d requests", n)
	}
}
