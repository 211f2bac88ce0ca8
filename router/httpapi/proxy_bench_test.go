package httpapi_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

// BenchmarkProxyAddedLatency1000RPS is the overhead figure: the
// same open-loop load (1,000 requests/s to each target) is sent, in the
// same run and interleaved, directly to a fast local upstream and through
// the router to it; the difference of the latency percentiles is what the
// router adds. Run it alone, once:
//
//	go test -run '^$' -bench ProxyAddedLatency -benchtime 1x ./router/
//
// KVROUTER_LOAD_SECONDS sets the measured duration (default 10) and
// KVROUTER_LOAD_RATE the rate per target (default 1000).
func BenchmarkProxyAddedLatency1000RPS(b *testing.B) {
	secs, rate := 10, 1000
	if s, err := strconv.Atoi(os.Getenv("KVROUTER_LOAD_SECONDS")); err == nil && s > 0 {
		secs = s
	}
	if r, err := strconv.Atoi(os.Getenv("KVROUTER_LOAD_RATE")); err == nil && r > 0 {
		rate = r
	}
	// A fast upstream: answers a small OpenAI-shaped JSON at once.
	reply := []byte(`{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}`)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(reply)))
		_, _ = w.Write(reply)
	}))
	defer up.Close()
	pc := config.PoolConfig{Name: "llama", Model: model, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range 8 {
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("vllm-%d", i), URL: up.URL})
	}
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	rt := httptest.NewServer(srv.Handler())
	defer rt.Close()

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512, MaxConnsPerHost: 0}}
	// A chat request with a ~2 KB system prompt, 64 distinct prefixes.
	bodies := make([][]byte, 64)
	for i := range bodies {
		bodies[i] = chatBody(model, fmt.Sprintf("question %d", i), false)
		bodies[i] = bytes.Replace(bodies[i], []byte("You are a helpful assistant."), []byte(fmt.Sprintf("Policy %d: %s", i, strings.Repeat("be helpful and concise. ", 80))), 1)
	}

	type sample struct {
		d   time.Duration
		err bool
	}
	var mu sync.Mutex // guards direct, proxied, firstErr
	var direct, proxied []sample
	var firstErr error
	var maxLag time.Duration // worst lateness of a send against its schedule
	send := func(url string, body []byte, out *[]sample, record bool) {
		t0 := time.Now()
		resp, err := client.Post(url, "application/json", bytes.NewReader(body))
		bad := err != nil
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				bad, err = true, fmt.Errorf("status %d", resp.StatusCode)
			}
		}
		d := time.Since(t0)
		if record {
			mu.Lock()
			*out = append(*out, sample{d, bad})
			if err != nil && firstErr == nil {
				firstErr = err
			}
			mu.Unlock()
		}
	}
	run := func(d time.Duration, record bool) {
		var wg sync.WaitGroup
		// Open loop on a fixed schedule: request i leaves at start + i/rate;
		// a late sender catches up instead of dropping (a Ticker would drop).
		start := time.Now()
		n := int(d.Seconds() * float64(rate))
		for i := range n {
			due := start.Add(time.Duration(i) * time.Second / time.Duration(rate))
			if wait := time.Until(due); wait > 0 {
				time.Sleep(wait)
			} else if record && -wait > maxLag {
				maxLag = -wait // the generator itself fell behind: the machine cannot sustain the rate
			}
			body := bodies[i%len(bodies)]
			// Alternate which target goes first so neither is favoured.
			first, second := up.URL+"/v1/chat/completions", rt.URL+"/v1/chat/completions"
			fo, so := &direct, &proxied
			if i%2 == 1 {
				first, second, fo, so = second, first, so, fo
			}
			wg.Go(func() { send(first, body, fo, record) })
			wg.Go(func() { send(second, body, so, record) })
		}
		wg.Wait()
	}
	for b.Loop() {
		direct, proxied, maxLag = nil, nil, 0
		run(time.Second, false) // warm connections
		start := time.Now()
		run(time.Duration(secs)*time.Second, true)
		elapsed := time.Since(start)
		pct := func(s []sample, p float64) (time.Duration, int) {
			ds := make([]time.Duration, 0, len(s))
			errs := 0
			for _, x := range s {
				ds = append(ds, x.d)
				if x.err {
					errs++
				}
			}
			slices.Sort(ds)
			return ds[int(p*float64(len(ds)-1))], errs
		}
		d50, derr := pct(direct, 0.50)
		d99, _ := pct(direct, 0.99)
		p50, perr := pct(proxied, 0.50)
		p99, _ := pct(proxied, 0.99)
		b.ReportMetric(float64(len(proxied))/elapsed.Seconds(), "proxied-req/s")
		b.ReportMetric(float64(d50.Microseconds())/1000, "direct-p50-ms")
		b.ReportMetric(float64(d99.Microseconds())/1000, "direct-p99-ms")
		b.ReportMetric(float64(p50.Microseconds())/1000, "proxied-p50-ms")
		b.ReportMetric(float64(p99.Microseconds())/1000, "proxied-p99-ms")
		b.ReportMetric(float64((p50-d50).Microseconds())/1000, "added-p50-ms")
		b.ReportMetric(float64((p99-d99).Microseconds())/1000, "added-p99-ms")
		b.ReportMetric(float64(derr+perr), "errors")
		b.ReportMetric(float64(maxLag.Microseconds())/1000, "max-send-lag-ms")
		b.Logf("%d s at %d req/s per target: direct p50 %v p99 %v; proxied p50 %v p99 %v; added p50 %v p99 %v; errors %d direct, %d proxied",
			secs, rate, d50, d99, p50, p99, p50-d50, p99-d99, derr, perr)
		if maxLag > 10*time.Millisecond {
			b.Logf("the load generator fell up to %v behind its schedule: this machine did not sustain %d req/s per target, so the percentiles include queueing", maxLag, rate)
		}
		if firstErr != nil {
			b.Logf("first error: %v", firstErr)
		}
	}
}

// BenchmarkHandlerChat is one proxied chat request through the handler
// (no client connection: an httptest.ResponseRecorder) to a fast upstream
// on loopback: the router's per-request CPU and allocations, plus one
// loopback round trip (cpu-ns/op is the whole process: router, upstream
// and client).
func BenchmarkHandlerChat(b *testing.B) { benchHandlerChat(b, httpapi.Options{}) }

// benchHandlerChat runs BenchmarkHandlerChat with the server's options
// (its logger is set here).
func benchHandlerChat(b *testing.B, opts httpapi.Options) {
	reply := []byte(`{"id":"cmpl-1","object":"chat.completion","choices":[]}`)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(reply)
	}))
	defer up.Close()
	pc := config.PoolConfig{Name: "llama", Model: model, Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range 8 {
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("vllm-%d", i), URL: up.URL})
	}
	opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, opts)
	if err != nil {
		b.Fatal(err)
	}
	h := srv.Handler()
	body := bytes.Replace(chatBody(model, "question", false), []byte("You are a helpful assistant."), []byte(strings.Repeat("be helpful and concise. ", 80)), 1)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	report, n := cputime.Report(b), 0
	defer func() { report(n) }()
	for b.Loop() {
		n++
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/chat/completions", bytes.NewReader(body)))
		if rec.Code != 200 {
			b.Fatalf("status %d: %s", rec.Code, rec.Body.Bytes())
		}
	}
}
