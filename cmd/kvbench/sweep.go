package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/workload"
)

// defaultRates are the generated workloads' default arrival rates (req/s;
// workload/generators.go and mixWorkload), the 1× load of a sweep.
var defaultRates = map[string]float64{
	"long-context": 7, "chat": 5, "rag": 8, "code": 6, "multi-tenant": 8, "cache-pressure": 10, "mix": 8, "agent": 4,
}

// sweepRow is one run of a sweep.
type sweepRow struct {
	Fleet int            `json:"fleet"`
	Load  float64        `json:"load"`
	S     report.Summary `json:"summary"`
}

// cell is the row's fleet size and load: the runs of one workload compared
// with each other.
func (r sweepRow) cell() [2]float64 { return [2]float64{float64(r.Fleet), r.Load} }

// prefixAwareRows is a workload's prefix_aware row of each cell, which
// kv_aware's row is read against.
func prefixAwareRows(rows []sweepRow) map[[2]float64]sweepRow {
	ref := map[[2]float64]sweepRow{}
	for _, r := range rows {
		if r.S.Strategy == "prefix_aware" {
			ref[r.cell()] = r
		}
	}
	return ref
}

// runSweep runs strategies × loads × fleet sizes × workloads and writes,
// (a workload name ending in "+scale" adds the scale-out and scale-in of
// --scale),
// per workload, a Markdown table (<workload>.md) and a chart of TTFT p90
// (<workload>.svg) into --out. Load k is speed k for a trace and k × the
// default rate for a generated workload; fleet n is --base-instances
// instances playing the workload with n/base disjoint copies
// (--replicate), so every fleet size sees the same per-instance load.
func runSweep(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sweep", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench sweep [--fleets 8,32] [--loads 1,2,4] [--workloads a,b] [--out DIR]", "Runs des over strategies × loads × fleet sizes × workloads and writes one table and one chart\nper workload (docs/benchmarks/sweep.md shows the output).", []string{"kvbench sweep --fleets 8 --loads 1,2 --limit 2000 --out sweep8"})
	var ff fleetFlags
	ff.register(fs, 8)
	workloads := fs.String("workloads", "mooncake,synth-calibrated,synth-shared-prompts,synth-bursty-long,long-context,chat,rag,code,multi-tenant,agent,cache-pressure,mix,long-context+scale,chat+scale", "comma-separated workloads (NAME+scale: with a scale-out at 1/3 and a scale-in at 2/3)")
	strategies := fs.String("strategies", "prefix_aware,kv_aware", "comma-separated strategies")
	loads := fs.String("loads", "1,1.5,2,3,4", "comma-separated load multipliers")
	fleets := fs.String("fleets", "8,32,128", "comma-separated fleet sizes (multiples of --instances)")
	limit := fs.Int("limit", 0, "requests per copy of the workload (0 = all)")
	limit128 := fs.Int("limit-large", 0, "requests per copy for fleets over --instances (0 = --limit): keeps large fleets affordable")
	seed := fs.Int64("seed", 1, "seed")
	trace := fs.String("trace", workload.DefaultTracePath, "trace for mooncake and synth-* workloads")
	shapesFile := fs.String("synth-shapes", "", synthShapesUsage)
	quick := fs.Bool("quick", false, "a small sweep for a quick look: loads 1,2,4, fleet 8, 1,500 requests per workload")
	out := fs.String("out", "", "directory for <workload>.md and <workload>.svg (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" {
		return fmt.Errorf("--out is required")
	}
	if *quick {
		*loads, *fleets = "1,2,4", strconv.Itoa(ff.instances)
		if *limit == 0 {
			*limit = 1500
		}
	}
	ls, err := parseFloats(*loads)
	if err != nil {
		return fmt.Errorf("--loads: %w", err)
	}
	fl, err := parseInts(*fleets)
	if err != nil {
		return fmt.Errorf("--fleets: %w", err)
	}
	base := ff.instances
	for _, n := range fl {
		if n < base || n%base != 0 {
			return fmt.Errorf("--fleets: %d is not a multiple of --instances %d", n, base)
		}
	}
	scfg, gpuTokens, err := ff.simConfig()
	if err != nil {
		return err
	}
	if *shapesFile != "" && !slices.ContainsFunc(splitList(*workloads), func(w string) bool { return strings.HasPrefix(w, synthPrefix) }) {
		return fmt.Errorf("--synth-shapes applies to synth-* workloads only, and --workloads names none")
	}
	shapes, err := readSynthShapes(*shapesFile)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	traces := map[string][]workload.TraceRecord{}
	byWorkload := map[string][]sweepRow{}
	for _, wname := range splitList(*workloads) {
		var rows []sweepRow
		for _, n := range fl {
			for _, load := range ls {
				name, scale := strings.CutSuffix(wname, "+scale")
				wf := workloadFlags{name: name, seed: *seed, trace: *trace, speed: 1, replicate: n / base, limit: *limit, scale: scale, traces: traces, shapes: shapes}
				if n > base && *limit128 > 0 {
					wf.limit = *limit128
				}
				if isTrace(name) {
					wf.speed = load
				} else {
					r, ok := defaultRates[name]
					if !ok {
						return fmt.Errorf("unknown workload %q", name)
					}
					wf.rate = r * load
				}
				wf.fleetToks = gpuTokens * int64(n)
				b, err := wf.buildAll()
				if err != nil {
					return fmt.Errorf("%s: %w", wname, err)
				}
				_, hits, err := b.pooledBound(boundTokens(gpuTokens, scfg, n), ff.salt)
				if err != nil {
					return err
				}
				fleet := ff
				fleet.instances = n
				for _, st := range splitList(*strategies) {
					s, err := runStrategy(ctx, st, &fleet, scfg, &b, hits, uint64(*seed), nil)
					if err != nil {
						return fmt.Errorf("%s %d×%g: %w", wname, n, load, err)
					}
					fmt.Fprintf(stderr, "%s fleet %d load %g: %s, busy %.2f (%.1f s wall)\n", wname, n, load, s, s.Busy, s.WallSec)
					rows = append(rows, sweepRow{Fleet: n, Load: load, S: s})
				}
			}
		}
		if err := writeSweep(*out, wname, rows, splitList(*strategies)); err != nil {
			return err
		}
		byWorkload[wname] = rows
		fmt.Fprintf(stdout, "%s: %s\n", wname, filepath.Join(*out, wname+".md"))
	}
	if err := writeTargets(*out, splitList(*workloads), byWorkload); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "targets: %s\n", filepath.Join(*out, "targets.md"))
	return nil
}

// writeSweep writes a workload's table and chart. When the strategies
// include prefix_aware and kv_aware, each kv_aware row also gives its TTFT
// percentiles over prefix_aware's and its hit rate minus prefix_aware's.
func writeSweep(dir, wname string, rows []sweepRow, strategies []string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s\n\n", wname)
	if len(rows) > 0 {
		s := rows[0].S
		fmt.Fprintf(&b, "%d requests per run at fleet %d", s.Requests, rows[0].Fleet)
		if s.Trace != "" {
			fmt.Fprintf(&b, "; trace %s", s.Trace)
		}
		b.WriteString("\n\n")
	}
	b.WriteString("| fleet | load | strategy | busy | prefill busy | hit | of bound | computed | warm copies | TTFT p50 ms | p90 ms | p99 ms | floor p90 | p99 | failed | kv/prefix p50 | p90 | p99 | hit − prefix |\n")
	b.WriteString("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	ref := prefixAwareRows(rows)
	for _, r := range rows {
		s := r.S
		ob := ""
		if s.BoundFraction > 0 {
			ob = f3s(s.BoundFraction)
		}
		fmt.Fprintf(&b, "| %d | %g× | %s | %s | %s | %s | %s | %s | %d | %.0f | %.0f | %.0f | %s | %s | %d |", r.Fleet, r.Load, s.Strategy, f3s(s.Busy), f3s(s.PrefillBusy),
			f3s(s.HitRate), ob, f3s(s.Computed), s.Warms, s.TTFTP50Ms, s.TTFTP90Ms, s.TTFTP99Ms, msOrBlank(s.FloorP90Ms), msOrBlank(s.FloorP99Ms), s.Failed)
		if pr, ok := ref[r.cell()]; ok && s.Strategy == "kv_aware" {
			p := pr.S
			fmt.Fprintf(&b, " %s | %s | %s | %+.2f pt |\n", ratio(s.TTFTP50Ms, p.TTFTP50Ms), ratio(s.TTFTP90Ms, p.TTFTP90Ms), ratio(s.TTFTP99Ms, p.TTFTP99Ms), 100*(s.HitRate-p.HitRate))
		} else {
			b.WriteString("  |  |  |  |\n")
		}
	}
	if err := os.WriteFile(filepath.Join(dir, wname+".md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	c := report.BarChart{Title: wname + ": TTFT p90 by fleet size and load", Unit: "TTFT p90 (ms)", Series: strategies}
	idx := map[string]int{}
	for i, st := range strategies {
		idx[st] = i
	}
	group := map[string]int{}
	for _, r := range rows {
		g := fmt.Sprintf("%d @%g×", r.Fleet, r.Load)
		gi, ok := group[g]
		if !ok {
			gi = len(c.Groups)
			group[g] = gi
			c.Groups = append(c.Groups, g)
			row := make([]float64, len(strategies))
			for i := range row {
				row[i] = math.NaN()
			}
			c.Values = append(c.Values, row)
		}
		c.Values[gi][idx[r.S.Strategy]] = r.S.TTFTP90Ms
	}
	f, err := os.Create(filepath.Join(dir, wname+".svg"))
	if err != nil {
		return err
	}
	if err := c.WriteSVG(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func f3s(x float64) string { return strconv.FormatFloat(x, 'f', 3, 64) }

// ratio is a/b to three decimals, and the hit rate's difference is
// printed to 0.01 point: the targets (≤ 1.05×, ≤ 0.75×, ≥ −0.5
// point) have cells on their line that two decimals, or one, leave
// ambiguous.
func ratio(a, b float64) string {
	if b <= 0 || math.IsNaN(a) || math.IsNaN(b) {
		return ""
	}
	return strconv.FormatFloat(a/b, 'f', 3, 64)
}

func parseFloats(s string) ([]float64, error) {
	var out []float64
	for _, f := range splitList(s) {
		v, err := strconv.ParseFloat(f, 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("%q: want numbers > 0", f)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return out, nil
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range splitList(s) {
		v, err := strconv.Atoi(f)
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%q: want integers >= 1", f)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return out, nil
}

// msOrBlank is a whole number of ms, blank for 0 (not computed).
func msOrBlank(x float64) string {
	if x == 0 {
		return ""
	}
	return fmt.Sprintf("%.0f", x)
}
