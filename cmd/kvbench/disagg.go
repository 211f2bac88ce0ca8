package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
)

// kvBytesPerToken is Llama-3.1-70B's KV per token over a TP8 instance
// (8 GPUs × 40,960 B; docs/reference/workload-facts.md §3), for "KV moved".
const kvBytesPerToken = 8 * 40960

// disaggSetup is one fleet layout `kvbench disagg` compares.
type disaggSetup struct {
	name        string
	prefill     int // 0 = aggregated
	conditional bool
}

// disaggRow is one setup's figures.
type disaggRow struct {
	setup                    string
	requests, failed         int
	ttft50, ttft90, ttft99   float64 // ms
	tpot50, tpot99           float64 // ms per output token after the first
	reqPerSec, outTokPerSec  float64
	disaggregated            int
	kvMovedGB                float64
	hitRate                  float64
	decisionCPU50, decCPUp99 float64 // µs per request (both picks)
	prefillBusy, decodeBusy  float64 // busy fraction of each set
}

func runDisagg(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("disagg", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench disagg [--workload W | --trace FILE] [--instances N] [--ratios 1:1,1:3,3:1] [flags]",
		"Aggregated versus disaggregated prefill/decode on the same total instances, on the discrete-event\ndriver with kv_aware picking both stages: aggregated, each P:D ratio, and conditional\ndisaggregation (--min-prefill-tokens) at the first ratio. Prints TTFT, time per output token,\nthroughput, KV moved between instances, hit rate and decision CPU per request.",
		[]string{"kvbench disagg --workload long-context --instances 8", "kvbench disagg --trace workload/traces/conversation_trace.jsonl.gz --instances 8 --ratios 1:1,1:3"})
	var wf workloadFlags
	var ff fleetFlags
	wf.register(fs)
	ff.register(fs, 8)
	ratios := fs.String("ratios", "1:1,1:3,3:1", "prefill:decode ratios to compare (each rounded to at least one instance per set)")
	minPrefill := fs.Int("min-prefill-tokens", 256, "conditional disaggregation's threshold (pools[].disaggregation.min_prefill_tokens)")
	handoff := fs.Duration("handoff", time.Millisecond, "time between the prefill's answer and the decode request reaching its instance")
	if err := fs.Parse(args); err != nil {
		return err
	}
	scfg, gpuTokens, err := ff.simConfig()
	if err != nil {
		return err
	}
	if ff.instances < 2 {
		return fmt.Errorf("disagg: --instances %d: need at least 2", ff.instances)
	}
	wf.fleetToks = gpuTokens * int64(ff.instances)
	b, err := wf.buildAll()
	if err != nil {
		return err
	}
	setups := []disaggSetup{{name: "aggregated"}}
	var first int
	for i, r := range splitList(*ratios) {
		p, d, err := parseRatio(r)
		if err != nil {
			return err
		}
		n := max(1, min(ff.instances-1, (ff.instances*p+(p+d)/2)/(p+d)))
		setups = append(setups, disaggSetup{name: fmt.Sprintf("disagg %d:%d (%dP+%dD)", p, d, n, ff.instances-n), prefill: n})
		if i == 0 {
			first = n
		}
	}
	if first > 0 {
		setups = append(setups, disaggSetup{name: fmt.Sprintf("conditional %dP+%dD (min %d)", first, ff.instances-first, *minPrefill), prefill: first, conditional: true})
	}
	fmt.Fprintf(stdout, "workload %s: %d requests, %d prompt tokens, %.0f s; %d instances × %d GPU tokens%s\n",
		b.w.Name, len(b.w.Requests), b.w.InputTokens(), b.w.Duration().Seconds(), ff.instances, gpuTokens, b.describe())
	var rows []disaggRow
	for _, su := range setups {
		row, err := runDisaggSetup(ctx, su, &ff, scfg, &b, *minPrefill, *handoff)
		if err != nil {
			return err
		}
		fmt.Fprintf(stderr, "%s: ttft p50 %.1f ms, p99 %.1f ms, tpot p50 %.2f ms\n", row.setup, row.ttft50, row.ttft99, row.tpot50)
		rows = append(rows, row)
	}
	writeDisaggTable(stdout, rows)
	return nil
}

func parseRatio(s string) (p, d int, err error) {
	a, c, ok := strings.Cut(s, ":")
	if ok {
		p, err = strconv.Atoi(a)
		if err == nil {
			d, err = strconv.Atoi(c)
		}
	}
	if !ok || err != nil || p < 1 || d < 1 {
		return 0, 0, fmt.Errorf("--ratios %q: want P:D with positive integers, e.g. 1:3", s)
	}
	return p, d, nil
}

// runDisaggSetup plays the workload on one layout with kv_aware.
func runDisaggSetup(ctx context.Context, su disaggSetup, ff *fleetFlags, scfg sim.Config, b *built, minPrefill int, handoff time.Duration) (disaggRow, error) {
	rt, err := newStrategyRouterSized("kv_aware", ff.routing(), 1, sim.DefaultModel, indexCapacity(ff.instances, scfg))
	if err != nil {
		return disaggRow{}, err
	}
	dc := rt.desConfig(ff.instances, scfg)
	ff.configure(&dc)
	if su.prefill > 0 {
		dc.Disagg = &des.Disagg{Prefill: su.prefill, Conditional: su.conditional, MinPrefillTokens: minPrefill, Handoff: handoff,
			Uncached: rt.uncached}
	}
	res, err := des.Run(ctx, dc, b.w)
	if err != nil {
		return disaggRow{}, fmt.Errorf("%s: %w", su.name, err)
	}
	return summarizeDisagg(su, res), nil
}

// uncached is how much of req the best decode candidate does not hold, as
// the router's conditional disaggregation asks kv_aware.
func (r *strategyRouter) uncached(ctx context.Context, req *des.RouteRequest, decode []string) (int, bool) {
	kv, ok := r.s.(*kvaware.KVAware)
	if !ok {
		return 0, false
	}
	cands := make([]*router.Instance, 0, len(decode))
	for _, c := range decode {
		in, err := r.instance(c)
		if err != nil {
			return 0, false
		}
		cands = append(cands, in)
	}
	rq := &router.Request{Endpoint: router.EndpointCompletions, Model: r.model, Adapter: req.Adapter,
		RoutingText: req.RoutingText, TenantKey: req.Tenant, PromptTokens: req.Tokens}
	held, prompt, ok := kv.Held(ctx, rq, cands)
	if !ok {
		return 0, false
	}
	return max(prompt-held, 0), true
}

func summarizeDisagg(su disaggSetup, res *des.Result) disaggRow {
	row := disaggRow{setup: su.name, requests: len(res.Outcomes)}
	var ttft, tpot, cpu []float64
	var cached, prompt, out int64
	first := time.Duration(1<<63 - 1)
	for _, o := range res.Outcomes {
		first = min(first, o.Arrival)
		if o.Err != "" {
			row.failed++
			continue
		}
		if o.PrefillInstance != "" {
			row.disaggregated++
		}
		ttft = append(ttft, float64(o.TTFT)/1e6)
		if o.OutputTokens > 1 {
			gen := o.Finish - (o.Arrival + o.TTFT)
			tpot = append(tpot, float64(gen)/1e6/float64(o.OutputTokens-1))
		}
		cpu = append(cpu, float64(o.DecisionCPU)/1e3)
		cached += int64(o.CachedTokens)
		prompt += int64(o.PromptTokens)
		out += int64(o.OutputTokens)
	}
	row.ttft50, row.ttft90, row.ttft99 = pct(ttft, 0.5), pct(ttft, 0.9), pct(ttft, 0.99)
	row.tpot50, row.tpot99 = pct(tpot, 0.5), pct(tpot, 0.99)
	row.decisionCPU50, row.decCPUp99 = pct(cpu, 0.5), pct(cpu, 0.99)
	if span := (res.End - first).Seconds(); span > 0 {
		row.reqPerSec = float64(len(ttft)) / span
		row.outTokPerSec = float64(out) / span
	}
	if prompt > 0 {
		row.hitRate = float64(cached) / float64(prompt)
	}
	row.kvMovedGB = float64(res.RemoteTokens) * kvBytesPerToken / 1e9
	var pb, pl, db, dl float64
	for i, u := range res.Utilisation {
		if i < su.prefill {
			pb, pl = pb+u.Busy.Seconds(), pl+u.Life.Seconds()
		} else {
			db, dl = db+u.Busy.Seconds(), dl+u.Life.Seconds()
		}
	}
	if pl > 0 {
		row.prefillBusy = pb / pl
	}
	if dl > 0 {
		row.decodeBusy = db / dl
	}
	return row
}

func pct(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

func writeDisaggTable(w io.Writer, rows []disaggRow) {
	fmt.Fprintln(w, "| setup | requests | failed | disaggregated | ttft p50 / p90 / p99 ms | tpot p50 / p99 ms | req/s | out tok/s | KV moved GB | hit | busy P / D | decision CPU p50 / p99 µs |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|---|")
	for _, r := range rows {
		busy := fmt.Sprintf("— / %.2f", r.decodeBusy)
		if r.prefillBusy > 0 {
			busy = fmt.Sprintf("%.2f / %.2f", r.prefillBusy, r.decodeBusy)
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %.1f / %.1f / %.1f | %.2f / %.2f | %.2f | %.0f | %.1f | %.3f | %s | %.1f / %.1f |\n",
			r.setup, r.requests, r.failed, r.disaggregated, r.ttft50, r.ttft90, r.ttft99, r.tpot50, r.tpot99,
			r.reqPerSec, r.outTokPerSec, r.kvMovedGB, r.hitRate, busy, r.decisionCPU50, r.decCPUp99)
	}
}
