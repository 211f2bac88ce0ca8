package browser_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
	"github.com/kvrouter/kvrouter/test/browser"
)

const (
	model      = "sim-llama"
	adminToken = "dash-secret-token"
	instances  = 3
)

// fleet is the real pipeline in this process, wired as cmd/kvrouter wires
// it: kvsim instances publishing KV events over ZMQ, a kvbridge each into a
// real (embedded) NATS server with JetStream, and the router's own events
// pipeline (kvstate.Start: consumer, memory index, eviction stream
// at /v1/kv/evictions behind the admin token) feeding kv_aware with shadow
// comparison.
type fleet struct {
	url string
}

func startFleet(t *testing.T, ctx context.Context) *fleet {
	t.Helper()
	log := slog.New(slog.DiscardHandler)
	name := testenv.UniqueName(t)
	pool, streamName, bucketName := "dash", "EV_"+name, "SN_"+name
	ns := testenv.StartNATS(t)
	// The eviction stream drops records for a slow SSE client by design
	// (EvictionSSEConfig.Buffer); nats.go would print each drop.
	nc, err := nats.Connect(ns.URL(), nats.MaxReconnects(-1), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	if err != nil {
		t.Fatalf("nats: %v", err)
	}
	t.Cleanup(nc.Close)

	// The fleet's goroutines stop with this context, cancelled by the last
	// cleanup registered below (cleanups run last-first).
	ctx, cancel := context.WithCancel(ctx)
	var bg sync.WaitGroup
	stream := kvstream.StreamConfig{Name: streamName, Memory: true}
	bucket := kvstream.BucketConfig{Name: bucketName, Memory: true}
	pc := config.PoolConfig{Name: pool, Model: model,
		Routing:   config.RoutingConfig{Strategy: config.StrategyKVAware, Shadow: true},
		Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
		Discovery: config.DiscoveryConfig{Disable: true}}
	var bridges []*bridge.Bridge
	for i := range instances {
		id := fmt.Sprintf("sim%d", i)
		cfg := simserver.Config{
			// A small GPU cache (64 blocks of 16 tokens) and a CPU tier, so
			// the workload below evicts and offloads within seconds.
			Engine:    sim.Config{Model: model, GPUBlocks: 64, CPUBlocks: 256, CPUWriteThrough: true, HashSeed: uint64(i + 1)},
			TimeScale: 20,
			Logger:    log,
			Events: simserver.EventsConfig{
				Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)),
				ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)),
			},
		}
		in, err := simserver.Start(ctx, cfg)
		if err != nil {
			t.Fatalf("kvsim %s: %v", id, err)
		}
		t.Cleanup(func() { _ = in.Close() })
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: id, URL: in.URL()})
		src := bridge.Source{Instance: id, Endpoint: cfg.Events.Endpoint, ReplayEndpoint: cfg.Events.ReplayEndpoint, URL: in.URL(), FirstSeq: simserver.FirstSeq}
		b, err := bridge.New(bridge.Config{Pool: pool, Model: model, BlockSize: sim.DefaultBlockSize, Sources: []bridge.Source{src},
			Conn: nc, Stream: stream, Bucket: bucket, Logger: log})
		if err != nil {
			t.Fatalf("bridge %s: %v", id, err)
		}
		bridges = append(bridges, b)
	}
	cfg := config.Config{
		AdminToken: adminToken, DefaultPool: pool, Pools: []config.PoolConfig{pc},
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: streamName}, Bucket: bucketName},
	}
	reg := prometheus.NewRegistry()
	kve, err := kvstate.Start(ctx, cfg, kvstate.Options{Registerer: reg, Logger: log, Conn: nc, Stream: stream, Bucket: bucket})
	if err != nil {
		t.Fatalf("router events pipeline: %v", err)
	}
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: log, Registry: reg, KV: kvaware.NewSource(kve.KV), KVEvents: kve, Admin: admin.Routes(kve)})
	if err != nil {
		t.Fatalf("router: %v", err)
	}
	for _, b := range bridges {
		bg.Go(func() { _ = b.Run(ctx) })
	}
	bg.Go(func() { _ = srv.Run(ctx) })
	if err := kve.WaitReady(testenv.Context(t, 20*time.Second)); err != nil {
		t.Fatalf("events pipeline not ready: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() {
		kve.StopStreams() // ends open eviction streams, so Shutdown need not wait
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
		_ = hs.Close()
		kve.Close()
	})
	t.Cleanup(func() { cancel(); bg.Wait() })
	return &fleet{url: "http://" + ln.Addr().String()}
}

// workload sends chat requests over a handful of long shared prefixes
// until ctx ends: enough distinct prefixes that a 64-block GPU cache must
// evict, and repeats so the caches hit.
func workload(ctx context.Context, url string, sent *atomic.Int64, errs chan<- error) {
	client := &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 20 * time.Second}
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				doc := (w*7 + i) % 9
				prefix := strings.Repeat(fmt.Sprintf("document %d says the quick brown fox %d jumps over the lazy dog. ", doc, doc), 40)
				body, _ := json.Marshal(map[string]any{
					"model": model, "max_tokens": 4,
					"messages": []map[string]string{{"role": "system", "content": prefix}, {"role": "user", "content": fmt.Sprintf("question %d from worker %d", i, w)}},
				})
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					if ctx.Err() == nil {
						select {
						case errs <- err:
						default:
						}
					}
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					select {
					case errs <- fmt.Errorf("chat: HTTP %d", resp.StatusCode):
					default:
					}
					continue
				}
				sent.Add(1)
				// A steady, modest load: the machine is shared.
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	wg.Wait()
}

// chromium finds Chromium, installing it through scripts/ensure-browser.sh
// (Debian's package) when it is missing; no Chromium is a failure.
func chromium(t *testing.T) string {
	t.Helper()
	if p, err := browser.Find(); err == nil {
		return p
	}
	out, err := exec.Command("../../scripts/ensure-browser.sh").CombinedOutput()
	if err != nil {
		t.Fatalf("chromium is missing and scripts/ensure-browser.sh could not install it: %v\n%s", err, out)
	}
	p, err := browser.Find()
	if err != nil {
		t.Fatalf("chromium still missing after scripts/ensure-browser.sh: %v\n%s", err, out)
	}
	return p
}

// openDashboard launches Chromium with cfg and opens the dashboard of the
// router at url in a page; both close when the test ends.
func openDashboard(t *testing.T, ctx context.Context, cfg browser.Config, url string) *browser.Page {
	t.Helper()
	b, err := browser.Launch(ctx, cfg)
	if err != nil {
		t.Fatalf("launch chromium: %v", err)
	}
	t.Cleanup(b.Close)
	page, err := b.Page(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = page.Close() })
	if err := page.Navigate(ctx, url+"/dashboard"); err != nil {
		t.Fatal(err)
	}
	return page
}

// pageState is what the dashboard shows, read from its DOM.
type pageState struct {
	Polls     int               `json:"polls"`
	Requests  string            `json:"requests"`
	HitEngine string            `json:"hitEngine"`
	HitPred   string            `json:"hitPred"`
	Agree     string            `json:"agree"`
	Compared  string            `json:"compared"`
	Evictions string            `json:"evictions"`
	EvState   string            `json:"evState"`
	Stream    string            `json:"stream"`
	Error     string            `json:"error"`
	GPU       map[string]string `json:"gpu"`
	Events    map[string]string `json:"events"`
	CPU       map[string]string `json:"cpu"`
	Reasons   []string          `json:"reasons"`
	Spark     int               `json:"spark"`
	AuthShown bool              `json:"authShown"`
	RPS       string            `json:"rps"`
	TTFBp50   string            `json:"ttfbP50"`
	TTFBp99   string            `json:"ttfbP99"`
	TTFBSpan  string            `json:"ttfbSpan"`
	Err5xx    string            `json:"err5xx"`
	EvGroups  []string          `json:"evGroups"`
	EvRows    []string          `json:"evRows"`
}

const readState = `(() => {
  const t = (id) => document.getElementById(id).textContent.trim();
  const rows = [...document.querySelectorAll('#instances tbody tr')];
  const col = (cls) => Object.fromEntries(rows.map((r) => [r.dataset.instance, r.querySelector(cls).textContent.trim()]));
  return {
    polls: Number(t('polls')), requests: t('requests-total'), hitEngine: t('hit-engine'), hitPred: t('hit-predicted'),
    agree: t('agree-rate'), compared: t('compared'), evictions: t('evictions-total'), evState: t('ev-state'),
    stream: t('stream'), error: t('error'), gpu: col('.blocks-gpu'), cpu: col('.blocks-cpu'), events: col('.events'),
    reasons: [...document.querySelectorAll('#decisions [data-reason]')].map((d) => d.dataset.reason),
    spark: document.querySelectorAll('#spark-rps path').length,
    authShown: getComputedStyle(document.getElementById('auth')).display !== 'none',
    rps: t('requests-rate'), ttfbP50: t('ttfb-p50'), ttfbP99: t('ttfb-p99'), ttfbSpan: t('ttfb-span'), err5xx: t('err-5xx'),
    evGroups: [...document.querySelectorAll('#evlist [data-evgroup]')].map((d) => d.dataset.evgroup),
    evRows: [...document.querySelectorAll('#evlist [data-evgroup]')].map((d) => d.textContent),
  };
})()`

func num(s string) int64 {
	var n int64
	for _, c := range s {
		if c >= '0' && c <= '9' {
			n = n*10 + int64(c-'0')
		}
	}
	return n
}

func TestDashboardInChromium(t *testing.T) {
	bin := chromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	f := startFleet(t, ctx)

	// The page itself needs no token; its data does.
	resp, err := (&http.Client{Transport: &http.Transport{Proxy: nil}}).Get(f.url + "/dashboard")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /dashboard: HTTP %d", resp.StatusCode)
	}

	var sent atomic.Int64
	errs := make(chan error, 1)
	wctx, stopWork := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { workload(wctx, f.url, &sent, errs) })
	defer func() { stopWork(); wg.Wait() }()

	page := openDashboard(t, ctx, browser.Config{Binary: bin, Width: 1400, Height: 1100}, f.url)

	read := func() pageState {
		t.Helper()
		var s pageState
		if err := page.Eval(ctx, readState, &s); err != nil {
			t.Fatalf("read dashboard: %v", err)
		}
		return s
	}
	waitFor := func(what string, d time.Duration, ok func(pageState) bool) pageState {
		t.Helper()
		end := time.Now().Add(d)
		for {
			s := read()
			if ok(s) {
				return s
			}
			if time.Now().After(end) {
				select {
				case err := <-errs:
					t.Logf("workload error: %v", err)
				default:
				}
				t.Fatalf("dashboard never showed %s within %v; last state %+v (requests sent %d)", what, d, s, sent.Load())
			}
			time.Sleep(250 * time.Millisecond)
		}
	}

	// A token is configured: the page asks for it before showing data.
	waitFor("the token prompt", 10*time.Second, func(s pageState) bool { return s.AuthShown && s.Polls == 0 })
	if err := page.Eval(ctx, `(() => { document.getElementById('tokeninput').value = '`+adminToken+`';
		document.getElementById('authform').requestSubmit(); return true; })()`, nil); err != nil {
		t.Fatal(err)
	}

	// First paint: the second poll follows the first within a moment, so
	// rates are there without waiting a whole interval.
	tokenGiven := time.Now()
	waitFor("a rate after the first two polls", 15*time.Second, func(s pageState) bool { return s.Polls >= 2 && s.RPS != "–" })
	t.Logf("rates shown %v after the token was given", time.Since(tokenGiven).Round(time.Millisecond))
	first := waitFor("live numbers", 30*time.Second, func(s pageState) bool {
		return s.Polls >= 2 && num(s.Requests) > 0 && len(s.GPU) == instances && s.EvState == "live" && num(s.Compared) > 0
	})
	second := waitFor("numbers that change", 60*time.Second, func(s pageState) bool {
		return s.Polls > first.Polls && num(s.Requests) > num(first.Requests) && num(s.Evictions) > 0 &&
			strings.HasSuffix(s.HitEngine, "%") && strings.HasSuffix(s.HitPred, "%") && strings.HasSuffix(s.Agree, "%") && s.Spark > 0
	})
	t.Logf("first read: %+v", first)
	t.Logf("second read: %+v", second)

	tests := []struct {
		name string
		ok   bool
	}{
		{"no auth prompt once the token is given", !second.AuthShown},
		{"no error shown", second.Error == ""},
		{"stream healthy", second.Stream == "healthy"},
		{"requests counter grew", num(second.Requests) > num(first.Requests)},
		{"evictions arrived over SSE", num(second.Evictions) > 0},
		{"some GPU blocks held", sumNums(second.GPU) > 0},
		{"some CPU blocks held", sumNums(second.CPU) > 0},
		{"decisions listed by reason", len(second.Reasons) > 0},
		{"every instance's events live", second.Events["sim0"] == "live" && second.Events["sim1"] == "live" && second.Events["sim2"] == "live"},
		{"time to first byte shown", isDuration(second.TTFBp50) && isDuration(second.TTFBp99)},
		{"ttfb over a window of requests", strings.Contains(second.TTFBSpan, "requests")},
		{"no 5xx", second.Err5xx == "0"},
		{"evictions aggregated per instance, tier and reason", evRowsAggregated(second)},
	}
	for _, tc := range tests {
		if !tc.ok {
			t.Errorf("%s: state %+v", tc.name, second)
		}
	}

	// Kept with `go test -artifacts -outputdir DIR`; DASHBOARD_SCREENSHOT
	// names a file instead (the docs' picture).
	out := filepath.Join(t.ArtifactDir(), "dashboard.png")
	if d := os.Getenv("DASHBOARD_SCREENSHOT"); d != "" {
		// For the docs: let the sparklines fill in first.
		out = d
		waitFor("a longer history", 60*time.Second, func(s pageState) bool { return s.Polls >= second.Polls+15 })
	}
	png, err := page.Screenshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(png, []byte("\x89PNG\r\n\x1a\n")) || len(png) < 10_000 {
		t.Fatalf("screenshot is not a real PNG (%d bytes)", len(png))
	}
	if err := os.WriteFile(out, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", out, len(png))
}

// isDuration says whether s reads as a latency the page prints: "12.3 ms",
// "840 ms", "1.2 s" or "> 65,536 ms".
func isDuration(s string) bool {
	return num(s) > 0 && (strings.HasSuffix(s, " ms") || strings.HasSuffix(s, " s"))
}

// evRowsAggregated: one row per instance, tier and reason (each group once),
// each saying how many blocks in how many records.
func evRowsAggregated(s pageState) bool {
	if len(s.EvGroups) == 0 || len(s.EvGroups) != len(s.EvRows) {
		return false
	}
	seen := map[string]bool{}
	for i, g := range s.EvGroups {
		if seen[g] || strings.Count(g, "/") != 2 || !strings.Contains(s.EvRows[i], " in ") || !strings.Contains(s.EvRows[i], "record") {
			return false
		}
		seen[g] = true
	}
	return true
}

func sumNums(m map[string]string) int64 {
	var n int64
	for _, v := range m {
		n += num(v)
	}
	return n
}

// TestDashboardWithoutKVInChromium: a router with no KV index, no events
// pipeline and no admin token (prefix_aware over plain engines) still gets
// a working page: request numbers, "no KV index", the eviction panel saying
// there is no stream, and no error.
func TestDashboardWithoutKVInChromium(t *testing.T) {
	bin := chromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	log := slog.New(slog.DiscardHandler)
	pc := config.PoolConfig{Name: "plain", Model: model}
	for i := range 2 {
		in, err := simserver.Start(ctx, simserver.Config{Engine: sim.Config{Model: model, HashSeed: uint64(i + 1)}, TimeScale: 20, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = in.Close() })
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("plain%d", i), URL: in.URL()})
	}
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: log, Admin: admin.Routes(nil)})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// Without the events pipeline the router answers 503 on /v1/kv/evictions.
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()
	url := "http://" + ln.Addr().String()

	var sent atomic.Int64
	errs := make(chan error, 1)
	wctx, stopWork := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { workload(wctx, url, &sent, errs) })
	defer func() { stopWork(); wg.Wait() }()

	page := openDashboard(t, ctx, browser.Config{Binary: bin}, url)
	var s pageState
	var index string
	end := time.Now().Add(30 * time.Second)
	for {
		if err := page.Eval(ctx, readState, &s); err != nil {
			t.Fatal(err)
		}
		if err := page.Eval(ctx, `document.getElementById('index-entries').textContent`, &index); err != nil {
			t.Fatal(err)
		}
		if s.Polls >= 2 && num(s.Requests) > 0 && s.EvState == "no eviction stream on this router" && len(s.GPU) == 2 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("page state %+v, index %q (requests sent %d)", s, index, sent.Load())
		}
		time.Sleep(250 * time.Millisecond)
	}
	checks := []struct {
		name string
		ok   bool
	}{
		{"no token prompt", !s.AuthShown},
		{"no error", s.Error == ""},
		{"stream shown as no index", s.Stream == "no index"},
		{"index panel says so", index == "no KV index for this pool"},
		{"hit rates unknown", s.HitEngine == "–" && s.HitPred == "–" && s.Agree == "–"},
		{"heuristic reasons", slices.Contains(s.Reasons, "hash")},
	}
	for _, c := range checks {
		if !c.ok {
			t.Errorf("%s: state %+v", c.name, s)
		}
	}
}
