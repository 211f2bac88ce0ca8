package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

func TestBoundsCommand(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"bounds", "--capacity", "1M,3M", "--instances", "8", "--out", dir}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	for _, want := range []string{"| 1M | 1000000 | 0.053 |", "| 3M | 3000000 | 0.136 |", "| infinite | ∞ | 0.366 | 0.374 |", "fleet 8 × 1.35M"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "bounds.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep boundsReport
	if err := json.Unmarshal(b, &rep); err != nil || len(rep.Rows) != 4 || rep.Stats.Requests != 12031 {
		t.Fatalf("bounds.json: %v %+v", err, rep)
	}
}

func TestDESCommand(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"des", "--workload", "long-context", "--limit", "150", "--instances", "3",
		"--strategies", "random,prefix_aware", "--out", dir}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	var sums []map[string]any
	b, err := os.ReadFile(filepath.Join(dir, "report.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &sums); err != nil || len(sums) != 2 {
		t.Fatalf("report.json: %v %s", err, b)
	}
	// Sticky placement of shared prefixes must beat random placement.
	if sums[1]["hit_rate"].(float64) <= sums[0]["hit_rate"].(float64) {
		t.Errorf("prefix_aware hit %v <= random %v", sums[1]["hit_rate"], sums[0]["hit_rate"])
	}
	for _, f := range []string{"report.md", "report.csv", "hit_rate.svg", "ttft.svg"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
	// One row per request per strategy, agreeing with the summary.
	for i, name := range []string{"random", "prefix_aware"} {
		f, err := os.Open(filepath.Join(dir, "requests-"+name+".csv"))
		if err != nil {
			t.Fatal(err)
		}
		rows, err := csv.NewReader(f).ReadAll()
		f.Close()
		if err != nil || len(rows) != 151 || rows[0][8] != "ttft_ms" {
			t.Fatalf("requests-%s.csv: %v, %d rows, header %v", name, err, len(rows), rows[0])
		}
		var prompt, cached float64
		for _, r := range rows[1:] {
			p, _ := strconv.ParseFloat(r[5], 64)
			c, _ := strconv.ParseFloat(r[6], 64)
			if ttft, _ := strconv.ParseFloat(r[8], 64); !(ttft > 0) || r[2] == "" || r[11] != "" {
				t.Fatalf("requests-%s.csv row %v: want a served request with a TTFT", name, r)
			}
			prompt, cached = prompt+p, cached+c
		}
		if got, want := cached/prompt, sums[i]["hit_rate"].(float64); math.Abs(got-want) > 0.0005 {
			t.Errorf("requests-%s.csv: hit %.4f, summary %.4f", name, got, want)
		}
	}
}

func TestCommandErrors(t *testing.T) {
	tests := [][]string{
		{},
		{"nope"},
		{"des", "--workload", "nope"},
		{"des", "--strategies", "nope", "--limit", "5"},
		{"des", "--gpu-tokens", "x"},
		{"bounds", "--capacity", "-1"},
		{"bounds", "--trace", "/does/not/exist"},
		{"des", "--workload", "mooncake", "--rate", "3"},
		{"des", "--workload", "chat", "--speed", "2"},
		{"des", "--workload", "chat", "--trace", "x.jsonl"},
		{"des", "--workload", "chat", "--replicate", "0"},
	}
	for _, args := range tests {
		var out, errb bytes.Buffer
		if err := run(context.Background(), args, &out, &errb); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

func TestParseTokens(t *testing.T) {
	for in, want := range map[string]int64{"1350000": 1_350_000, "1.35M": 1_350_000, "500K": 500_000, "0": 0, "2m": 2_000_000} {
		got, err := parseTokens(in)
		if err != nil || got != want {
			t.Errorf("parseTokens(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
}

// TestDESKVAware runs the router's kv_aware strategy on the simulated
// fleet: it reads a real memory index fed by the engines' events, and on a
// shared-prefix workload it must find the cached prefixes.
func TestDESKVAware(t *testing.T) {
	ctx := context.Background()
	w, err := workload.LongContext{Groups: 30, RequestsPerGroup: 5, PrefixTokens: 2000}.Generate(2)
	if err != nil {
		t.Fatal(err)
	}
	hit := map[string]float64{}
	for _, name := range []string{"random", "kv_aware"} {
		rt, err := newStrategyRouter(name, routingDefaults(), 1, demoModel)
		if err != nil {
			t.Fatal(err)
		}
		res, err := des.Run(ctx, rt.desConfig(4, sim.Config{}), w)
		if err != nil {
			t.Fatal(err)
		}
		s := report.Summarize(res, 0)
		hit[name] = s.HitRate
		if name == "kv_aware" {
			if res.IndexDeliveries == 0 || res.IndexErrors != 0 || s.Reasons[string(router.ReasonKVMatch)] == 0 {
				t.Errorf("kv_aware: %d deliveries, %d errors, reasons %v", res.IndexDeliveries, res.IndexErrors, s.Reasons)
			}
			if n, _ := rt.kv.index.Len(ctx); n == 0 {
				t.Error("kv_aware: the index holds nothing")
			}
		}
	}
	if hit["kv_aware"] < hit["random"]+0.2 {
		t.Errorf("kv_aware hit %.3f, random %.3f", hit["kv_aware"], hit["random"])
	}
}

func FuzzParseTokens(f *testing.F) {
	for _, s := range []string{"1.35M", "500K", "0", "12", "-1", "1e400M", "NaNk", " 3m "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := parseTokens(s)
		if err != nil {
			return
		}
		if n < 0 || n > 1e15+1 {
			t.Fatalf("parseTokens(%q) = %d", s, n)
		}
		// What humanTokens prints parses back to the same count.
		if back, err := parseTokens(humanTokens(n)); err != nil || back != n {
			t.Fatalf("humanTokens(%d) = %q parses to %d, %v", n, humanTokens(n), back, err)
		}
	})
}

// TestDESKVAwareCacheSalt: with a cache salt per tenant the engines key
// their blocks with the salt, and kv_aware must fold the same salt into
// its lookups to find them. Arrivals 5 s apart outlive kv_aware's 2 s
// speculative entries, so matches must come from the index.
func TestDESKVAwareCacheSalt(t *testing.T) {
	w, err := workload.MultiTenant{Tenants: 3, Requests: 60, SystemTokens: 1000, Arrivals: workload.Arrivals{Rate: 0.2}}.Generate(1)
	if err != nil {
		t.Fatal(err)
	}
	rt, err := newStrategyRouter("kv_aware", routingDefaults(), 1, demoModel)
	if err != nil {
		t.Fatal(err)
	}
	cfg := rt.desConfig(3, sim.Config{})
	cfg.SaltByTenant = true
	res, err := des.Run(context.Background(), cfg, w)
	if err != nil {
		t.Fatal(err)
	}
	s := report.Summarize(res, 0)
	if s.Reasons[string(router.ReasonKVMatch)] < 50 || s.HitRate < 0.8 {
		t.Errorf("salted kv_aware: hit %.3f, reasons %v", s.HitRate, s.Reasons)
	}
}

// TestDESDeterministicWithRealStrategies: a seed fixes the whole run, with
// the router's strategies, the memory index and the sim engines in the loop.
func TestDESDeterministicWithRealStrategies(t *testing.T) {
	w, err := workload.Chat{Sessions: 40}.Generate(3)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"random", "kv_aware"} {
		var runs [2][]des.Outcome
		for k := range runs {
			rt, err := newStrategyRouter(name, routingDefaults(), 9, demoModel)
			if err != nil {
				t.Fatal(err)
			}
			res, err := des.Run(context.Background(), rt.desConfig(4, sim.Config{}), w)
			if err != nil {
				t.Fatal(err)
			}
			runs[k] = res.Simulated()
		}
		for i := range runs[0] {
			if runs[0][i] != runs[1][i] {
				t.Fatalf("%s: request %d differs between runs: %+v vs %+v", name, i, runs[0][i], runs[1][i])
			}
		}
	}
}

// TestRefusedPromptReleasesRouterState: prompts over the engine's context
// limit are refused at submission; kv_aware's pending prefill for them is
// released (through the driver's finish path), so the instance stays
// usable, and the report says why they failed.
func TestRefusedPromptReleasesRouterState(t *testing.T) {
	dir := t.TempDir()
	var lines []string
	for i := range 40 {
		n, ids := 2000, []int64{0, int64(1000 + i), int64(2000 + i), int64(3000 + i)}
		if i%8 == 3 {
			// Over the engine's 131,072-token context: refused.
			n = 140_000
			ids = ids[:1]
			for j := range 273 {
				ids = append(ids, int64(10_000+i*1000+j))
			}
		}
		lines = append(lines, fmt.Sprintf(`{"timestamp":%d,"input_length":%d,"output_length":4,"hash_ids":%s}`, i*200, n, jsonInts(ids)))
	}
	trace := filepath.Join(dir, "t.jsonl")
	if err := os.WriteFile(trace, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rt, err := newStrategyRouter(config.StrategyKVAware, config.RoutingConfig{}, 1, sim.DefaultModel)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := workload.OpenTrace(trace)
	if err != nil {
		t.Fatal(err)
	}
	w, err := workload.TraceReplay{}.Workload(recs)
	if err != nil {
		t.Fatal(err)
	}
	res, err := des.Run(context.Background(), rt.desConfig(2, sim.Config{GPUBlocks: 200_000 / sim.DefaultBlockSize}), w)
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range res.Instances {
		if tok, reqs := rt.kv.state.PendingPrefill(in); tok != 0 || reqs != 0 {
			t.Errorf("%s: %d pending prefill tokens in %d requests after the run", in, tok, reqs)
		}
	}
	s := report.Summarize(res, 0)
	if s.Failed != 5 || len(s.Failures) != 1 {
		t.Fatalf("failed %d: %v", s.Failed, s.Failures)
	}
	for k := range s.Failures {
		if !strings.Contains(k, "longer than the model") {
			t.Errorf("failure kind %q", k)
		}
	}
	var out, errb bytes.Buffer
	// --trace alone replays that trace (no --workload mooncake needed).
	if err := run(context.Background(), []string{"des", "--trace", trace, "--instances", "2",
		"--gpu-tokens", "200K", "--strategies", "kv_aware"}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	if !strings.Contains(out.String(), "trace:t.jsonl/kv_aware: 5 failed: 5 × submit: sim: request longer than the model or cache allows") {
		t.Errorf("output does not say why requests failed:\n%s", out.String())
	}
}

func jsonInts(v []int64) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestSynthCommand: kvbench synth writes a trace that reads back, and a
// synthesised workload runs through des.
func TestSynthCommand(t *testing.T) {
	p := filepath.Join(t.TempDir(), "s.jsonl")
	var out, errb bytes.Buffer
	if err := run(context.Background(), []string{"synth", "--shape", "bursty-long", "--requests", "300", "--out", p}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	recs, err := workload.OpenTrace(p)
	if err != nil || len(recs) != 300 {
		t.Fatalf("%d records: %v", len(recs), err)
	}
	out.Reset()
	if err := run(context.Background(), []string{"des", "--workload", "synth-shared-prompts", "--limit", "200", "--instances", "2",
		"--replicate", "2", "--strategies", "prefix_aware"}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	if !strings.Contains(out.String(), "400 requests") || !strings.Contains(out.String(), "2 disjoint copies") {
		t.Errorf("output:\n%s", out.String())
	}
}

// TestSynthShapesFile: the shapes in --synth-shapes (the committed probe
// file) run as synth-<name> through synth, des and sweep; des refuses the
// flag for a workload that is not synthesised, and a bad file is an error
// naming it.
func TestSynthShapesFile(t *testing.T) {
	const probe = "../../docs/benchmarks/shapes-probe.json"
	dir := t.TempDir()
	var out, errb bytes.Buffer
	p := filepath.Join(dir, "p.jsonl")
	if err := run(context.Background(), []string{"synth", "--synth-shapes", probe, "--shape", "probe-3", "--requests", "200", "--out", p}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	recs, err := workload.OpenTrace(p)
	if err != nil || len(recs) != 200 {
		t.Fatalf("%d records: %v", len(recs), err)
	}
	roots := map[int64]bool{}
	for _, r := range recs {
		roots[r.HashIDs[0]] = true
	}
	if len(roots) > 16 { // probe-3 has 16 roots
		t.Errorf("probe-3: %d roots, want at most 16", len(roots))
	}
	out.Reset()
	if err := run(context.Background(), []string{"des", "--workload", "synth-probe-9", "--synth-shapes", probe, "--limit", "150", "--instances", "2",
		"--strategies", "prefix_aware"}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	if !strings.Contains(out.String(), "workload synth-probe-9: 150 requests") {
		t.Errorf("des output:\n%s", out.String())
	}
	sw := filepath.Join(dir, "sweep")
	if err := run(context.Background(), []string{"sweep", "--synth-shapes", probe, "--workloads", "synth-probe-1", "--loads", "1", "--fleets", "2",
		"--instances", "2", "--limit", "30", "--out", sw}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	if _, err := os.Stat(filepath.Join(sw, "synth-probe-1.md")); err != nil {
		t.Error(err)
	}
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"x": {"burst_scale": -2}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"des", "--workload", "chat", "--synth-shapes", probe, "--limit", "5"},
		{"des", "--workload", "synth-x", "--synth-shapes", bad, "--limit", "5"},
		{"des", "--workload", "synth-probe-1", "--limit", "5"}, // no file: unknown shape
		{"sweep", "--synth-shapes", filepath.Join(dir, "missing.json"), "--workloads", "synth-probe-1", "--out", sw},
		{"sweep", "--synth-shapes", probe, "--workloads", "chat", "--out", filepath.Join(dir, "never")},
	} {
		if err := run(context.Background(), args, &out, &errb); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "never")); err == nil {
		t.Error("a sweep refused for its flags created its output folder")
	}
}

// TestSweepCommand: a small sweep writes a table and a chart per workload,
// with kv_aware's ratios to prefix_aware at each fleet size and load.
// kvRatios is the end of a sweep's kv_aware row: TTFT p50, p90, p99 over
// prefix_aware's to three decimals, hit rate minus prefix_aware's to 0.01
// point.
var kvRatios = regexp.MustCompile(`\| \d+\.\d{3} \| \d+\.\d{3} \| \d+\.\d{3} \| [+-]\d+\.\d{2} pt \|$`)

func TestSweepCommand(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"sweep", "--workloads", "mooncake,chat+scale", "--loads", "1,2", "--fleets", "2,4",
		"--instances", "2", "--limit", "20", "--gpu-tokens", "300K", "--out", dir}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	for _, w := range []string{"mooncake", "chat+scale"} {
		md, err := os.ReadFile(filepath.Join(dir, w+".md"))
		if err != nil {
			t.Fatal(err)
		}
		rows := 0
		for _, l := range strings.Split(string(md), "\n") {
			if strings.HasPrefix(l, "| 2 | ") || strings.HasPrefix(l, "| 4 | ") {
				rows++
				if strings.Contains(l, "kv_aware") && !kvRatios.MatchString(l) {
					t.Errorf("%s: kv_aware row without its ratios to three decimals and hit difference to 0.01 pt: %s", w, l)
				}
			}
		}
		if rows != 8 {
			t.Errorf("%s: %d rows, want 2 fleets × 2 loads × 2 strategies:\n%s", w, rows, md)
		}
		if st, err := os.Stat(filepath.Join(dir, w+".svg")); err != nil || st.Size() == 0 {
			t.Errorf("%s.svg: %v", w, err)
		}
	}
	// The targets over both workloads' 2 fleets × 2 loads: 8 cells for
	// never worse.
	md, err := os.ReadFile(filepath.Join(dir, "targets.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(md), "over 8 cells") || !strings.Contains(string(md), "| never worse: hit ≥ prefix_aware's -0.5 pt | 8 |") {
		t.Errorf("targets.md:\n%s", md)
	}
	for _, args := range [][]string{
		{"sweep"},
		{"sweep", "--out", dir, "--fleets", "3", "--instances", "2"},
		{"sweep", "--out", dir, "--loads", "0"},
		{"sweep", "--out", dir, "--workloads", "nope", "--loads", "1", "--fleets", "2", "--instances", "2"},
	} {
		if err := run(context.Background(), args, &out, &errb); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

// TestCommandHelp: every command's -h says what it does, with an example,
// before the flags, and asking for help is not an error exit.
func TestCommandHelp(t *testing.T) {
	for _, cmd := range []string{"bounds", "synth", "des", "sweep", "live", "demo"} {
		var out strings.Builder
		err := run(context.Background(), []string{cmd, "-h"}, io.Discard, &out)
		if !errors.Is(err, flag.ErrHelp) {
			t.Errorf("%s -h: %v, want flag.ErrHelp", cmd, err)
		}
		s := out.String()
		for _, want := range []string{"usage: kvbench " + cmd, "Examples:\n  kvbench " + cmd, "Flags:\n  -"} {
			if !strings.Contains(s, want) {
				t.Errorf("%s -h lacks %q:\n%s", cmd, want, s)
			}
		}
	}
}

// TestDESWarmCopies: on the agent workload (long toolsets shared by many
// sessions) kv_aware buys copies of hot prefixes; the driver sends them as
// warm-up requests (des.Decision.Warm) beside the requests that bought
// them, every request is served, and every copy's pending prefill is
// released by the end of the run.
func TestDESWarmCopies(t *testing.T) {
	w, rt := warmWorkload(t)
	res, err := des.Run(context.Background(), rt.desConfig(4, sim.Config{}), w)
	if err != nil {
		t.Fatal(err)
	}
	checkWarmRun(t, res, rt.kv.state)
}

// TestDESWarmCopiesUnderFlowControl: with the router's admission queue
// (per-instance prefill budget), every warm-up copy holds its instance's
// budget like a request — the queue counts it — and ends: after the run
// nothing is in flight or pending in the queue.
func TestDESWarmCopiesUnderFlowControl(t *testing.T) {
	w, rt := warmWorkload(t)
	dc := rt.desConfig(4, sim.Config{})
	a, err := newFlowAdmission(flowcontrol.Config{MaxConcurrency: 4 * 64, InstancePrefill: 1 << 16}, w, rt)
	if err != nil {
		t.Fatal(err)
	}
	dc.Admission = a
	res, err := des.Run(context.Background(), dc, w)
	if err != nil {
		t.Fatal(err)
	}
	checkWarmRun(t, res, rt.kv.state)
	if n := a.s.Counts().Companions; n != uint64(res.Warms) {
		t.Errorf("the queue counted %d warm-up copies of %d sent", n, res.Warms)
	}
	if n := a.s.InFlight(); n != 0 || len(a.items) != 0 {
		t.Errorf("after the run: %d in flight in the queue, %d items held", n, len(a.items))
	}
	for _, l := range a.s.Stats(vt(res.End)).Instances {
		if l.InFlight != 0 || l.PendingPrefill != 0 {
			t.Errorf("instance load left after the run: %+v", l)
		}
	}
}

// warmWorkload is an agent workload whose hot toolsets buy warm-up
// copies on 4 instances, and a kv_aware router for it.
func warmWorkload(t *testing.T) (*workload.Workload, *strategyRouter) {
	t.Helper()
	w, err := workload.Agent{Sessions: 160, Arrivals: workload.Arrivals{Rate: 3}}.Generate(2)
	if err != nil {
		t.Fatal(err)
	}
	rt, err := newStrategyRouter("kv_aware", routingDefaults(), 1, sim.DefaultModel)
	if err != nil {
		t.Fatal(err)
	}
	return w, rt
}

// checkWarmRun: the run sent warm-up copies, served every request, and
// left no copy's prefill pending in any router's state.
func checkWarmRun(t *testing.T, res *des.Result, states ...*kvaware.KVState) {
	t.Helper()
	if res.Warms == 0 {
		t.Fatal("no warm-up copy in the run: the workload's hot toolsets bought none")
	}
	for _, o := range res.Outcomes {
		if o.Err != "" || o.TTFT <= 0 {
			t.Fatalf("request %d: %q (TTFT %v)", o.ID, o.Err, o.TTFT)
		}
	}
	for i, st := range states {
		for _, name := range res.Instances {
			if tok, n := st.PendingPrefill(name); tok != 0 || n != 0 {
				t.Errorf("router %d, %s: %d pending prefill tokens in %d requests after the run", i, name, tok, n)
			}
		}
	}
	t.Logf("%d requests, %d warm-up copies", len(res.Outcomes), res.Warms)
}
