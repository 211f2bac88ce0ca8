package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// genUpstream is an engine whose prefill takes prefill and whose
// generation takes gen: a streamed request gets its first event after
// prefill, a non-streamed one its whole answer only after both, as vLLM
// sends it. Each request signals started (when there is room) as it
// arrives.
func genUpstream(t *testing.T, prefill, gen time.Duration, started chan<- struct{}) *httptest.Server {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		select {
		case started <- struct{}{}:
		default:
		}
		time.Sleep(prefill)
		if body.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"o\",\"finish_reason\":null}]}\n\n")
			w.(http.Flusher).Flush()
			time.Sleep(gen)
			fmt.Fprint(w, "data: [DONE]\n\n")
			return
		}
		time.Sleep(gen)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}))
	t.Cleanup(ts.Close)
	return ts
}

// onePool is a router with one pool ("p", model "m", least_outstanding,
// 64 requests per instance) of insts behind flow control fc.
func onePool(t *testing.T, fc *config.FlowControlConfig, insts ...config.InstanceConfig) (*httpapi.Server, *httptest.Server) {
	t.Helper()
	return servertest.Serve(t, config.Config{Pools: []config.PoolConfig{{
		Name: "p", Model: "m",
		Routing:     config.RoutingConfig{Strategy: config.StrategyLeastOutstanding, ConcurrencyThreshold: 64},
		Health:      config.HealthConfig{Disable: true},
		Discovery:   config.DiscoveryConfig{Disable: true},
		FlowControl: fc, Instances: insts,
	}}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler), Admin: admin.Routes(nil)})
}

// TestFlowControlNonStreamedGenerationIsNotTTFT: a non-streamed request's
// first byte comes after its whole generation; the queue must not learn
// that as its time to first token, or a request arriving while another
// runs is shed for a deadline it would meet (its TTFT is ~0 here).
func TestFlowControlNonStreamedGenerationIsNotTTFT(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			started := make(chan struct{}, 16)
			up := genUpstream(t, 0, 400*time.Millisecond, started)
			_, ts := onePool(t, &config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 8192, TTFTObjective: 200 * time.Millisecond},
				config.InstanceConfig{ID: "e0", URL: up.URL})
			extra := fmt.Sprintf(`,"stream":%v`, stream)
			ctx := context.Background()
			if r := postCompletion(ctx, ts.URL, "warm up the queue please", nil, extra); r.status != http.StatusOK {
				t.Fatalf("warm-up: %d %v", r.status, r.err)
			}
			<-started
			first := make(chan flowReply, 1)
			go func() { first <- postCompletion(ctx, ts.URL, "the first of two requests", nil, extra) }()
			<-started
			time.Sleep(50 * time.Millisecond)
			r := postCompletion(ctx, ts.URL, "the second of two requests", nil, extra)
			if r.status != http.StatusOK {
				t.Errorf("second request answered %d (reason %q), want 200: its TTFT would be ~0", r.status, r.header.Get("X-Kvrouter-Reason"))
			}
			<-first
		})
	}
}

// TestFlowControlNonStreamedReleasesPrefill: a non-streamed request holds
// its instance's prefill budget until its first token is predicted, not
// for its whole generation (until its first byte).
func TestFlowControlNonStreamedReleasesPrefill(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			started := make(chan struct{}, 16)
			up := genUpstream(t, 0, 400*time.Millisecond, started)
			_, ts := onePool(t, &config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 8192},
				config.InstanceConfig{ID: "e0", URL: up.URL})
			extra := fmt.Sprintf(`,"stream":%v`, stream)
			prompt := strings.Repeat("word ", 2400) // 3,000 tokens
			ctx := context.Background()
			replies := make(chan flowReply, 3)
			for range 2 {
				go func() { replies <- postCompletion(ctx, ts.URL, prompt, nil, extra) }()
				<-started
			}
			r := postCompletion(ctx, ts.URL, prompt, nil, extra)
			if q, _ := strconv.Atoi(r.header.Get(httpapi.HeaderQueuedMs)); r.status != http.StatusOK || q > 100 {
				t.Errorf("third request: status %d, queued %d ms, want 200 admitted at once (the engine has 62 free slots and nothing prefilling)", r.status, q)
			}
			<-replies
			<-replies
		})
	}
}

// TestFlowControlRoomOnEligibleInstancesOnly: a request for an adapter
// only one instance holds is admitted only while that instance has room
// under its prefill budget, not because an instance it cannot be sent to
// is idle.
func TestFlowControlRoomOnEligibleInstancesOnly(t *testing.T) {
	started := make(chan struct{}, 16)
	slow := genUpstream(t, 400*time.Millisecond, 0, started)
	idle := genUpstream(t, 0, 0, make(chan struct{}, 16))
	srv, ts := onePool(t, &config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 1000},
		config.InstanceConfig{ID: "e0", URL: idle.URL},
		config.InstanceConfig{ID: "e1", URL: slow.URL, Adapters: []string{"lx"}})
	body := fmt.Sprintf(`{"model":"lx","prompt":%q,"max_tokens":1,"stream":true}`, strings.Repeat("word ", 640)) // 800 tokens
	ctx := context.Background()
	first, second := make(chan flowReply, 1), make(chan flowReply, 1)
	go func() { first <- postCompletionBody(ctx, ts.URL, body, nil) }()
	<-started
	go func() { second <- postCompletionBody(ctx, ts.URL, body, nil) }()
	p, _ := srv.Pool("p")
	peak := int64(0)
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		for _, l := range p.QueueStatus().Queue.Instances {
			if l.Instance == "e1" {
				peak = max(peak, l.PendingPrefill)
			}
		}
	}
	r1, r2 := <-first, <-second
	if r1.status != http.StatusOK || r2.status != http.StatusOK {
		t.Fatalf("statuses %d, %d, want 200 (the second admitted once the first is prefilled)", r1.status, r2.status)
	}
	if peak > 1000 {
		t.Fatalf("e1 pending prefill reached %d tokens against its budget of 1000", peak)
	}
}
