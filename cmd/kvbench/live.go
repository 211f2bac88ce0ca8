package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// liveConfig says how to reach a running router.
type liveConfig struct {
	// RouterURL is the data plane; AdminURL the admin API (default RouterURL).
	RouterURL, AdminURL string
	// Pool whose routing is switched (default: the first pool listed).
	Pool       string
	AdminToken string
	// Model is sent as "model" (default: the pool's model).
	Model string
	// TimeScale is the engines' virtual-time speed-up (kvsim --time-scale):
	// arrivals are compressed by it and measured durations multiplied by it,
	// so figures are in engine time, comparable with the discrete-event mode.
	TimeScale float64
	// MaxInFlight bounds concurrent requests (default 512).
	MaxInFlight int
	// Reset clears every instance's prefix cache before each strategy.
	Reset bool
	// Timeout per request (default 10 minutes).
	Timeout time.Duration
}

type liveClient struct {
	cfg  liveConfig
	http *http.Client
}

func newLiveClient(cfg liveConfig) *liveClient {
	if cfg.AdminURL == "" {
		cfg.AdminURL = cfg.RouterURL
	}
	if cfg.TimeScale <= 0 {
		cfg.TimeScale = 1
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 512
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Minute
	}
	cfg.RouterURL = strings.TrimRight(cfg.RouterURL, "/")
	cfg.AdminURL = strings.TrimRight(cfg.AdminURL, "/")
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: cfg.MaxInFlight, MaxConnsPerHost: 0}
	return &liveClient{cfg: cfg, http: &http.Client{Transport: tr}}
}

func (c *liveClient) admin(ctx context.Context, method, path string, body any, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.cfg.AdminURL+path, rd)
	if err != nil {
		return err
	}
	if c.cfg.AdminToken != "" {
		req.Header.Set("Authorization", "Bearer "+c.cfg.AdminToken)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("admin %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("admin %s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(b)))
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// pool returns the configured pool's status (the first pool when none is named).
func (c *liveClient) pool(ctx context.Context) (router.PoolStatus, error) {
	var ps []router.PoolStatus
	if err := c.admin(ctx, http.MethodGet, "/admin/pools", nil, &ps); err != nil {
		return router.PoolStatus{}, err
	}
	for _, p := range ps {
		if c.cfg.Pool == "" || p.Name == c.cfg.Pool {
			return p, nil
		}
	}
	return router.PoolStatus{}, fmt.Errorf("router has no pool %q", c.cfg.Pool)
}

// prepare switches the pool to strategy and, when asked, empties the caches.
func (c *liveClient) prepare(ctx context.Context, strategy string) (router.PoolStatus, error) {
	p, err := c.pool(ctx)
	if err != nil {
		return p, err
	}
	if strategy != "" {
		if err := c.admin(ctx, http.MethodPut, "/admin/pools/"+p.Name+"/routing", map[string]string{"strategy": strategy}, nil); err != nil {
			return p, err
		}
	}
	if c.cfg.Reset {
		for _, in := range p.Instances {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(in.URL, "/")+"/reset_prefix_cache", nil)
			resp, err := c.http.Do(req)
			if err != nil {
				return p, fmt.Errorf("reset %s: %w", in.ID, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode/100 != 2 {
				return p, fmt.Errorf("reset %s: %s", in.ID, resp.Status)
			}
		}
	}
	return p, nil
}

// completionChunk is the part of a streamed completions event kvbench reads.
type completionChunk struct {
	Choices []struct {
		Text string `json:"text"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// send runs one request through the router, streamed, and fills o.
func (c *liveClient) send(ctx context.Context, model string, r *workload.Request, o *des.Outcome, start time.Time) {
	scale := func(d time.Duration) time.Duration { return time.Duration(float64(d) * c.cfg.TimeScale) }
	body := map[string]any{
		"model": model, "prompt": r.Text(), "max_tokens": r.OutputTokens, "stream": true,
		"stream_options": map[string]any{"include_usage": true},
	}
	if r.Tenant != "" {
		body["prompt_cache_key"] = r.Tenant
	}
	b, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	sent := time.Now()
	o.Arrival = scale(sent.Sub(start))
	o.PromptTokens = r.InputTokens()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.cfg.RouterURL+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		o.Err = err.Error()
		return
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		o.Err = err.Error()
		return
	}
	defer resp.Body.Close()
	o.Instance = resp.Header.Get(router.HeaderInstance)
	o.Reason = resp.Header.Get(router.HeaderReason)
	o.Overflow = o.Reason == string(router.ReasonOverflow) || o.Reason == string(router.ReasonSaturated)
	if us, err := strconv.ParseInt(resp.Header.Get(httpapi.HeaderOverheadUS), 10, 64); err == nil {
		o.Decision = time.Duration(us) * time.Microsecond
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		o.Err = fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
		return
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	gotFirst, done := false, false
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			break
		}
		var ch completionChunk
		if err := json.Unmarshal([]byte(line), &ch); err != nil {
			o.Err = "bad stream event: " + err.Error()
			return
		}
		if !gotFirst && len(ch.Choices) > 0 {
			gotFirst = true
			o.TTFT = scale(time.Since(sent))
		}
		if ch.Usage != nil {
			o.OutputTokens = ch.Usage.CompletionTokens
			if ch.Usage.PromptTokens > 0 {
				o.PromptTokens = ch.Usage.PromptTokens
			}
			if ch.Usage.PromptTokensDetails != nil {
				o.CachedTokens = ch.Usage.PromptTokensDetails.CachedTokens
			}
		}
	}
	o.Finish = scale(time.Since(start))
	switch {
	case sc.Err() != nil:
		o.Err = "stream: " + sc.Err().Error()
	case !done || !gotFirst:
		o.Err = "stream ended early"
	}
}

// run replays w through the router under its current strategy.
func (c *liveClient) run(ctx context.Context, w *workload.Workload, strategy string, progress func(done, total int)) (*des.Result, error) {
	p, err := c.prepare(ctx, strategy)
	if err != nil {
		return nil, err
	}
	model := c.cfg.Model
	if model == "" {
		model = p.Model
	}
	if strategy == "" {
		strategy = p.Routing.Strategy
	}
	res := &des.Result{Strategy: strategy, Workload: w.Name, Outcomes: make([]des.Outcome, len(w.Requests))}
	for _, in := range p.Instances {
		res.Instances = append(res.Instances, in.ID)
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex // guards done (progress count)
		done int
	)
	sem := make(chan struct{}, c.cfg.MaxInFlight)
	if w.ClosedLoop > 0 {
		sem = make(chan struct{}, w.ClosedLoop)
	}
	start := time.Now()
	wallStart := start
	for i := range w.Requests {
		r := &w.Requests[i]
		res.Outcomes[i].ID = i
		if w.ClosedLoop == 0 {
			due := start.Add(time.Duration(float64(r.At) / c.cfg.TimeScale))
			if d := time.Until(due); d > 0 {
				select {
				case <-time.After(d):
				case <-ctx.Done():
				}
			}
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.send(ctx, model, r, &res.Outcomes[i], start)
			<-sem
			mu.Lock()
			done++
			if progress != nil {
				progress(done, len(w.Requests))
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	res.Wall = time.Since(wallStart)
	for i := range res.Outcomes {
		// Requests never sent (the run was cancelled) failed; they did not
		// finish with a zero TTFT.
		if o := &res.Outcomes[i]; o.Arrival == 0 && o.Finish == 0 && o.Err == "" && o.Instance == "" {
			o.Err = "not sent"
		}
	}
	for _, o := range res.Outcomes {
		res.End = max(res.End, o.Finish)
	}
	return res, ctx.Err()
}

func runLive(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("live", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench live --router URL [--admin URL] [--strategies a,b] [--time-scale k] [--reset]", "Replays a workload against a running kvrouter (kvsim engines, or real vLLM with\n--enable-prompt-tokens-details), switching the pool's strategy through the admin API between\nruns. --reset empties every engine's prefix cache first: destructive, never on a fleet\nserving users. The admin token comes from KVROUTER_ADMIN_TOKEN.", []string{"kvbench live --router http://127.0.0.1:8080 --admin http://127.0.0.1:8081 --strategies prefix_aware,kv_aware"})
	var wf workloadFlags
	wf.register(fs)
	var lc liveConfig
	fs.StringVar(&lc.RouterURL, "router", "", "kvrouter data-plane URL (required), e.g. http://127.0.0.1:8080")
	fs.StringVar(&lc.AdminURL, "admin", "", "kvrouter admin URL (default: --router)")
	fs.StringVar(&lc.Pool, "pool", "", "pool to switch (default: the first)")
	fs.StringVar(&lc.Model, "model", "", "model name to send (default: the pool's model)")
	fs.Float64Var(&lc.TimeScale, "time-scale", 1, "the engines' virtual-time speed-up (kvsim --time-scale): compresses arrivals, rescales timings")
	fs.IntVar(&lc.MaxInFlight, "max-in-flight", 512, "bound on concurrent requests")
	fs.BoolVar(&lc.Reset, "reset", false, "DESTRUCTIVE: reset every instance's prefix cache (POST /reset_prefix_cache) before each strategy, so each starts cold; never against a fleet serving users")
	strategies := fs.String("strategies", "", "strategies to compare, switched through the admin API (empty: the current one only)")
	out := fs.String("out", "", "directory for reports")
	fleetTokens := fs.String("fleet-tokens", "5.4M", "the fleet's GPU KV capacity, for --workload cache-pressure and, when given, for the of_bound column's pooled-cache bound (else an infinite cache's)")
	blockSize := fs.Int("block-size", sim.DefaultBlockSize, "the engines' KV block size in tokens (vLLM --block-size), for the of_bound column")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if lc.RouterURL == "" {
		return errors.New("live: --router is required")
	}
	lc.AdminToken = os.Getenv("KVROUTER_ADMIN_TOKEN")
	ft, err := parseTokens(*fleetTokens)
	if err != nil {
		return fmt.Errorf("--fleet-tokens: %w", err)
	}
	wf.fleetToks = ft
	w, err := wf.build()
	if err != nil {
		return err
	}
	// The bound is that of one cache of --fleet-tokens when the flag was
	// given (the fleet's real GPU KV capacity), else of an infinite cache.
	capacity := int64(0)
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "fleet-tokens" {
			capacity = ft
		}
	})
	b, boundHits, err := workload.RequestsBoundPerRequest(w.Requests, *blockSize, capacity, false)
	if err != nil {
		return err
	}
	sums, err := liveCompare(ctx, newLiveClient(lc), w, splitList(*strategies), boundHits, stdout, stderr)
	if err != nil {
		return err
	}
	if err := report.WriteCompact(stdout, sums); err != nil {
		return err
	}
	if *out != "" {
		return writeReports(*out, sums, b.TokenRatio())
	}
	return nil
}

// liveCompare runs w once per strategy ("" = the router's current one).
// boundHits (nil: none) is each request's hit tokens in the pooled-cache
// bound (workload.RequestsBoundPerRequest), for the of_bound column.
func liveCompare(ctx context.Context, c *liveClient, w *workload.Workload, strategies []string, boundHits []int64, stdout, stderr io.Writer) ([]report.Summary, error) {
	if len(strategies) == 0 {
		strategies = []string{""}
	}
	fmt.Fprintf(stdout, "live: workload %s, %d requests over %.0f s (engine time; time scale %.3g)\n", w.Name, len(w.Requests), w.Duration().Seconds(), c.cfg.TimeScale)
	var sums []report.Summary
	for _, s := range strategies {
		var bar *report.Progress
		if f, ok := stderr.(*os.File); ok {
			bar = report.NewProgress(f, "live "+s)
		}
		res, err := c.run(ctx, w, s, bar.Update)
		bar.Done()
		if err != nil {
			return sums, fmt.Errorf("live %s: %w", s, err)
		}
		sum := report.Summarize(res, 0)
		if boundHits != nil {
			sum = report.SummarizeBound(res, boundHits, nil) // real engines: no timing model for a floor
		}
		fmt.Fprintf(stderr, "%s (%.1f s wall)\n", sum, sum.WallSec)
		sums = append(sums, sum)
	}
	return sums, nil
}

// The model the demo's engines serve.
const demoModel = sim.DefaultModel
