package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// orderUpstream is a one-slot engine for flow-control tests: it answers
// completions in vLLM's shape, records the prompt of each request in
// arrival order, and holds the first request until release is closed.
type orderUpstream struct {
	mu      sync.Mutex
	order   []string
	release chan struct{}
	started chan struct{}
}

func newOrderUpstream(t *testing.T) (*orderUpstream, *httptest.Server) {
	u := &orderUpstream{release: make(chan struct{}), started: make(chan struct{}, 64)}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Prompt string `json:"prompt"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		u.mu.Lock()
		u.order = append(u.order, body.Prompt)
		first := len(u.order) == 1
		u.mu.Unlock()
		u.started <- struct{}{}
		if first {
			<-u.release
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}))
	t.Cleanup(ts.Close)
	t.Cleanup(u.releaseFirst)
	return u, ts
}

func (u *orderUpstream) releaseFirst() {
	select {
	case <-u.release:
	default:
		close(u.release)
	}
}

func (u *orderUpstream) arrivals() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.order...)
}

// flowServer is a router with one pool ("p", model "m") of one instance
// that takes one request at a time, behind flow control fc.
func flowServer(t *testing.T, upstream string, fc *config.FlowControlConfig) (*httpapi.Server, *httptest.Server) {
	t.Helper()
	srv, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{{
		Name: "p", Model: "m",
		Routing:     config.RoutingConfig{Strategy: config.StrategyLeastOutstanding, ConcurrencyThreshold: 1},
		Health:      config.HealthConfig{Disable: true},
		Discovery:   config.DiscoveryConfig{Disable: true},
		FlowControl: fc,
		Instances:   []config.InstanceConfig{{ID: "e0", URL: upstream}},
	}}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler), Admin: admin.Routes(nil)})
	return srv, ts
}

type flowReply struct {
	status int
	header http.Header
	err    error
}

func postCompletion(ctx context.Context, url, prompt string, header map[string]string, extra string) flowReply {
	return postCompletionBody(ctx, url, fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1%s}`, prompt, extra), header)
}

// postCompletionBody posts body to the completions endpoint.
func postCompletionBody(ctx context.Context, url, body string, header map[string]string) flowReply {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return flowReply{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return flowReply{err: err}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return flowReply{status: resp.StatusCode, header: resp.Header}
}

// waitQueue waits until the pool's queue holds n requests.
func waitQueue(t *testing.T, srv *httpapi.Server, n int) {
	t.Helper()
	p, _ := srv.Pool("p")
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if q := p.QueueStatus().Queue; q != nil && q.Queued == n {
			return
		}
	}
	t.Fatalf("the queue never held %d requests: %+v", n, p.QueueStatus().Queue)
}

// TestFlowControlAdmitsByPriority: while the pool's one slot is busy,
// requests queue; when it frees they reach the engine most urgent first
// (header over body priority, vLLM's lower-is-earlier), and FIFO within a
// priority; each carries the time it waited.
func TestFlowControlAdmitsByPriority(t *testing.T) {
	up, upTS := newOrderUpstream(t)
	srv, ts := flowServer(t, upTS.URL, &config.FlowControlConfig{Enabled: true})
	ctx := context.Background()
	replies := make(chan flowReply, 8)
	go func() { replies <- postCompletion(ctx, ts.URL, "first", nil, "") }()
	<-up.started
	send := []struct {
		prompt string
		header map[string]string
		extra  string
	}{
		{"low-1", nil, `,"priority":5`},
		{"default", nil, ""},
		{"low-2", nil, `,"priority":5`},
		{"urgent-header", map[string]string{httpapi.HeaderPriority: "-2"}, `,"priority":9`},
		{"urgent-body", nil, `,"priority":-1`},
	}
	for i, s := range send {
		go func() { replies <- postCompletion(ctx, ts.URL, s.prompt, s.header, s.extra) }()
		waitQueue(t, srv, i+1) // one at a time: arrival order is known
	}
	up.releaseFirst()
	for range len(send) + 1 {
		r := <-replies
		if r.err != nil || r.status != http.StatusOK {
			t.Fatalf("reply %+v", r)
		}
		if _, err := strconv.Atoi(r.header.Get(httpapi.HeaderQueuedMs)); err != nil {
			t.Fatalf("%s = %q", httpapi.HeaderQueuedMs, r.header.Get(httpapi.HeaderQueuedMs))
		}
	}
	want := []string{"first", "urgent-header", "urgent-body", "default", "low-1", "low-2"}
	if got := up.arrivals(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("engine saw %v, want %v", got, want)
	}
	p, _ := srv.Pool("p")
	if c := p.QueueStatus().Queue.Counts; c.AdmittedAtOnce != 1 || c.AdmittedQueued != 5 {
		t.Fatalf("counts %+v", c)
	}
	// The dashboard and the admin API show the same queue.
	for _, path := range []string{"/admin/dashboard.json", "/admin/pools/p/queue"} {
		resp, err := http.Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		var got struct {
			Pools []struct {
				Queue *flowcontrol.Stats `json:"queue"`
			} `json:"pools"`
			Queue *flowcontrol.Stats `json:"queue"`
		}
		err = json.NewDecoder(resp.Body).Decode(&got)
		resp.Body.Close()
		q := got.Queue
		if len(got.Pools) == 1 {
			q = got.Pools[0].Queue
		}
		if err != nil || q == nil || q.Counts.AdmittedQueued != 5 || q.MaxConcurrency != 1 {
			t.Fatalf("%s: %v %+v", path, err, q)
		}
	}
}

// TestFlowControlSheds: a full queue, a TTFT objective that cannot be met
// and a bad priority are answered at once (429 with Retry-After, or 400),
// counted by reason; a client that leaves while queued is removed at once
// and counted.
func TestFlowControlSheds(t *testing.T) {
	up, upTS := newOrderUpstream(t)
	srv, ts := flowServer(t, upTS.URL, &config.FlowControlConfig{Enabled: true, MaxQueue: 2})
	ctx := context.Background()
	done := make(chan flowReply, 8)
	go func() { done <- postCompletion(ctx, ts.URL, "first", nil, "") }()
	<-up.started

	// A client that goes away while it waits.
	cctx, cancel := context.WithCancel(ctx)
	gone := make(chan flowReply, 1)
	go func() { gone <- postCompletion(cctx, ts.URL, "gone", nil, "") }()
	waitQueue(t, srv, 1)
	cancel()
	if r := <-gone; r.err == nil {
		t.Fatalf("canceled request answered %d", r.status)
	}
	waitQueue(t, srv, 0)

	// A TTFT objective reached while waiting.
	r := postCompletion(ctx, ts.URL, "hurry", map[string]string{httpapi.HeaderTTFTObjective: "30"}, "")
	if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") == "" || r.header.Get(router.HeaderReason) != "deadline" {
		t.Fatalf("deadline: %d %v", r.status, r.header)
	}
	if ms, _ := strconv.Atoi(r.header.Get(httpapi.HeaderQueuedMs)); ms < 30 {
		t.Fatalf("shed after %d ms of a 30 ms objective", ms)
	}

	// Fill the queue (2), then one more of equal priority: shed on arrival.
	for i := range 2 {
		go func() { done <- postCompletion(ctx, ts.URL, fmt.Sprint("q", i), nil, "") }()
		waitQueue(t, srv, i+1)
	}
	r = postCompletion(ctx, ts.URL, "overflow", nil, "")
	if r.status != http.StatusTooManyRequests || r.header.Get(router.HeaderReason) != "queue_full" || r.header.Get(httpapi.HeaderQueuedMs) != "0" {
		t.Fatalf("queue full: %d %v", r.status, r.header)
	}
	if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra < 1 {
		t.Fatalf("Retry-After %q", r.header.Get("Retry-After"))
	}

	// Malformed flow-control fields: 400 before queueing.
	for _, bad := range []struct {
		header map[string]string
		extra  string
	}{
		{map[string]string{httpapi.HeaderPriority: "high"}, ""},
		{nil, `,"priority":1.5`},
		{map[string]string{httpapi.HeaderTTFTObjective: "0"}, ""},
	} {
		if r := postCompletion(ctx, ts.URL, "bad", bad.header, bad.extra); r.status != http.StatusBadRequest {
			t.Fatalf("%v %s: %d", bad.header, bad.extra, r.status)
		}
	}

	up.releaseFirst()
	for range 3 {
		if r := <-done; r.status != http.StatusOK {
			t.Fatalf("queued request: %+v", r)
		}
	}
	p, _ := srv.Pool("p")
	c := p.QueueStatus().Queue.Counts
	if c.Shed["canceled"] != 1 || c.Shed["deadline"] != 1 || c.Shed["queue_full"] != 1 {
		t.Fatalf("counts %+v", c)
	}
	if got := servertest.Metric(t, srv.Registry(), "kvrouter_queue_shed_total", map[string]string{"pool": "p", "priority": "0", "reason": "deadline"}); got != 1 {
		t.Fatalf("kvrouter_queue_shed_total{reason=deadline} = %v", got)
	}
	// The newest-first gauge is exported per pool (its semantics:
	// flowcontrol's TestNewestFirstOnceATenantOverruns); the deadline shed
	// above found no other request of its tenant waiting, so none is.
	mfs, err := srv.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == "kvrouter_queue_newest_first_tenants" && len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == "p" {
				found = m.GetGauge().GetValue() == 0
			}
		}
	}
	if !found {
		t.Fatal("kvrouter_queue_newest_first_tenants{pool=p} not exported as 0")
	}
}

// TestFlowControlOffKeepsBehaviour: without flow_control the request path
// is today's: no queue header, no queue in the admin status.
func TestFlowControlOffKeepsBehaviour(t *testing.T) {
	up, upTS := newOrderUpstream(t)
	up.releaseFirst()
	srv, ts := flowServer(t, upTS.URL, nil)
	r := postCompletion(context.Background(), ts.URL, "x", map[string]string{httpapi.HeaderPriority: "not-a-number"}, "")
	if r.status != http.StatusOK || r.header.Get(httpapi.HeaderQueuedMs) != "" {
		t.Fatalf("%d %v", r.status, r.header)
	}
	p, _ := srv.Pool("p")
	if qs := p.QueueStatus(); qs.Enabled || qs.Queue != nil {
		t.Fatalf("%+v", qs)
	}
}

// TestFlowControlDisplacedRetryAfter: a request displaced from a full
// queue by a more urgent one is answered 429 with a Retry-After of at
// least one second.
func TestFlowControlDisplacedRetryAfter(t *testing.T) {
	up, upTS := newOrderUpstream(t)
	srv, ts := flowServer(t, upTS.URL, &config.FlowControlConfig{Enabled: true, MaxQueue: 1})
	ctx := context.Background()
	done := make(chan flowReply, 3)
	go func() { done <- postCompletion(ctx, ts.URL, "first", nil, "") }()
	<-up.started
	low := make(chan flowReply, 1)
	go func() { low <- postCompletion(ctx, ts.URL, "low", map[string]string{httpapi.HeaderPriority: "5"}, "") }()
	waitQueue(t, srv, 1)
	go func() { done <- postCompletion(ctx, ts.URL, "urgent", nil, "") }()
	r := <-low
	up.releaseFirst()
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != http.StatusTooManyRequests || ra < 1 {
		t.Fatalf("displaced: status %d, reason %q, Retry-After %q; want 429 with Retry-After >= 1", r.status, r.header.Get("X-Kvrouter-Reason"), r.header.Get("Retry-After"))
	}
	<-done
	<-done
}

// TestFlowControlRaisedThresholdAdmits: raising the pool's
// concurrency_threshold (its queue's budget) admits a waiting request at
// once, not at its expiry or the next completion.
func TestFlowControlRaisedThresholdAdmits(t *testing.T) {
	up, upTS := newOrderUpstream(t)
	srv, ts := flowServer(t, upTS.URL, &config.FlowControlConfig{Enabled: true, MaxWait: time.Hour})
	ctx := context.Background()
	done := make(chan flowReply, 2)
	go func() { done <- postCompletion(ctx, ts.URL, "first", nil, "") }()
	<-up.started
	go func() { done <- postCompletion(ctx, ts.URL, "second", nil, "") }()
	waitQueue(t, srv, 1)
	p, _ := srv.Pool("p")
	rc, _ := p.Routing()
	rc.ConcurrencyThreshold = 2
	if err := p.SetRouting(rc); err != nil {
		t.Fatal(err)
	}
	select {
	case <-up.started:
	case <-time.After(20 * time.Second):
		t.Error("the waiting request did not reach the engine within 20 s of the threshold's rise")
	}
	up.releaseFirst()
	<-done
	<-done
}
