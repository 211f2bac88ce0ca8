package httpapi_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
)

// stageEngine is an engine for one stage of TestClientLeavesAtEachStage:
// it answers as okCompletion with kv, after hold (nil: at once) returns,
// and calls after (when not nil) once the answer is flushed;
// hold gets the request's context, which ends when the router closes the
// connection (the engine's abort: vLLM's OpenAI server aborts a request
// whose client disconnects). closed is sent to when it saw that.
type stageEngine struct {
	srv      *httptest.Server
	received chan struct{}
	closed   chan struct{}
}

func newStageEngine(t *testing.T, kv string, hold func(ctx context.Context), after func()) *stageEngine {
	e := &stageEngine{received: make(chan struct{}, 16), closed: make(chan struct{}, 16)}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // read whole: the server then watches the connection
		e.received <- struct{}{}
		if hold != nil {
			hold(r.Context())
			if r.Context().Err() != nil {
				e.closed <- struct{}{}
				return
			}
		}
		okCompletion(w, kv)
		if after != nil {
			w.(http.Flusher).Flush()
			after()
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// TestClientLeavesAtEachStage: a client that leaves a disaggregated
// request at any stage — while its prefill runs, once the prefill answered
// and before the decode, while its decode runs — leaves no router state
// behind on either instance (in-flight counts, the flow-control slot and
// per-instance pending prefill, kv_aware's pending prefill), the engine
// working on it sees its connection closed (vLLM aborts the request: a
// prefill aborted before it finished frees its blocks at once), and it is
// counted once, 499; one gone during the prefill is not routed to a decode
// instance.
func TestClientLeavesAtEachStage(t *testing.T) {
	waitClosed := func(ctx context.Context) {
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Second): // the test fails on it; the engine goes on
		}
	}
	for _, stage := range []string{"prefill", "between", "decode"} {
		t.Run(stage, func(t *testing.T) {
			ctx, leave := context.WithCancel(context.Background())
			defer leave()
			var pHold, dHold func(context.Context)
			var pAfter func()
			switch stage {
			case "prefill":
				pHold = func(c context.Context) { leave(); waitClosed(c) }
			case "between":
				// The client leaves once the prefill answered: the router
				// sees a client gone before the decode (or, when it notices
				// before the answer's end, a prefill cut short).
				pAfter = leave
			case "decode":
				dHold = func(c context.Context) { leave(); waitClosed(c) }
			}
			p, d := newStageEngine(t, goodKV, pHold, pAfter), newStageEngine(t, "", dHold, nil)
			ts, srv := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyKVAware,
				[]*fakeEngine{{srv: p.srv}}, []*fakeEngine{{srv: d.srv}}, func(pc *config.PoolConfig) {
					pc.FlowControl = &config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 100000}
				})
			body := []byte(fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":3,"stream":true}`, sim.DefaultModel, jsonInts(tokenPrompt(7, 300))))
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/v1/completions", bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
				t.Fatalf("answered %d before the client left", resp.StatusCode)
			}
			pool, _ := srv.Pool("pd")
			requests := func(labels map[string]string) float64 {
				return testenv.Metric(t, srv.Registry(), "kvrouter_requests_total", labels)
			}
			waitFor(t, "the request counted", func() bool { return requests(nil) == 1 })
			switch stage {
			case "prefill":
				select {
				case <-p.closed:
				case <-time.After(10 * time.Second):
					t.Fatal("the prefill engine's connection stayed open after the client left")
				}
			case "decode":
				select {
				case <-d.closed:
				case <-time.After(10 * time.Second):
					t.Fatal("the decode engine's connection stayed open after the client left")
				}
			}
			switch stage {
			case "prefill":
				if n := len(d.received); n != 0 {
					t.Fatalf("the decode instance received %d requests of a client that left", n)
				}
				if n := requests(map[string]string{"status": "499", "instance": "p0"}); n != 1 {
					t.Fatalf("%v requests counted 499 on p0; all: 499 on d0 %v", n, requests(map[string]string{"status": "499", "instance": "d0"}))
				}
				if n := testenv.Metric(t, srv.Registry(), "kvrouter_disagg_requests_total", nil); n != 0 {
					t.Fatalf("kvrouter_disagg_requests_total %v for a request whose client left before its decode", n)
				}
			case "between":
				// The router learns that its client left only when its server
				// reads the connection's end, which may come after the prefill
				// answer was read and the decode sent: then the decode is cut
				// short (its engine sees the connection close) and counted there,
				// or, this decode engine answering at once, served (200).
				if n := requests(map[string]string{"status": "499"}) + requests(map[string]string{"status": "200", "instance": "d0"}); n != 1 {
					t.Fatalf("%v requests counted 499 or served, want 1", n)
				}
			case "decode":
				if n := requests(map[string]string{"status": "499", "instance": "d0"}); n != 1 {
					t.Fatalf("%v requests counted 499 on d0", n)
				}
			}
			st := kvaware.Of(pool)
			waitFor(t, "the router's state released", func() bool {
				q := pool.QueueStatus().Queue
				if q.InFlight != 0 || q.PendingPrefill != 0 {
					return false
				}
				for _, l := range q.Instances {
					if l.InFlight != 0 || l.PendingPrefill != 0 {
						return false
					}
				}
				for _, in := range pool.Instances() {
					if in.InFlight() != 0 {
						return false
					}
					if tok, n := st.PendingPrefill(in.ID()); tok != 0 || n != 0 {
						return false
					}
				}
				return true
			})
		})
	}
}

func jsonInts(v []int) string {
	var b bytes.Buffer
	b.WriteByte('[')
	for i, x := range v {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, x)
	}
	b.WriteByte(']')
	return b.String()
}
