package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/workload"
)

// tokenList is a flag of comma-separated token counts with K/M suffixes.
type tokenList []int64

func (l *tokenList) String() string {
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.FormatInt(v, 10)
	}
	return strings.Join(s, ",")
}

func (l *tokenList) Set(v string) error {
	*l = nil
	for _, f := range strings.Split(v, ",") {
		n, err := parseTokens(f)
		if err != nil {
			return err
		}
		*l = append(*l, n)
	}
	return nil
}

// parseTokens reads "1350000", "1.35M", "500K".
func parseTokens(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := 1.0
	switch {
	case strings.HasSuffix(s, "M"), strings.HasSuffix(s, "m"):
		mult, s = 1e6, s[:len(s)-1]
	case strings.HasSuffix(s, "K"), strings.HasSuffix(s, "k"):
		mult, s = 1e3, s[:len(s)-1]
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || !(f >= 0) || !(f*mult <= 1e15) {
		return 0, fmt.Errorf("token count %q: want a number >= 0, optionally with K or M", s)
	}
	return int64(f*mult + 0.5), nil
}

type boundRow struct {
	Capacity   string  `json:"capacity"`
	Tokens     int64   `json:"capacity_tokens"`
	BlockRatio float64 `json:"block_ratio"`
	TokenRatio float64 `json:"token_ratio"`
	HitBlocks  int64   `json:"hit_blocks"`
	Blocks     int64   `json:"blocks"`
}

type boundsReport struct {
	Trace string              `json:"trace"`
	Stats workload.TraceStats `json:"stats"`
	Rows  []boundRow          `json:"bounds"`
}

func runBounds(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bounds", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench bounds [--trace FILE] [--instances N] [--gpu-tokens T]", "Hit-rate bounds of a Mooncake-format trace: what a pooled LRU cache of the fleet's size, and an\ninfinite cache, would hit. No strategy can beat the pooled bound; kv_aware is judged against it.", []string{"kvbench bounds                                  # the bundled conversation trace", "kvbench bounds --trace my.jsonl.gz --instances 32"})
	trace := fs.String("trace", workload.DefaultTracePath, "Mooncake-format trace (JSON lines, plain or gzip)")
	caps := tokenList{500_000, 1_000_000, 3_000_000, 10_000_000, 50_000_000}
	fs.Var(&caps, "capacity", "pooled cache sizes in tokens, comma-separated (K/M suffixes)")
	instances := fs.Int("instances", 0, "also bound a fleet of this many instances of --gpu-tokens each")
	gpu := fs.String("gpu-tokens", "1.35M", "GPU KV capacity per instance, tokens (docs/reference/workload-facts.md §3: 8×H100, Llama 3.1 70B BF16)")
	out := fs.String("out", "", "directory for bounds.md and bounds.json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	per, err := parseTokens(*gpu)
	if err != nil {
		return fmt.Errorf("--gpu-tokens: %w", err)
	}
	recs, err := workload.OpenTrace(*trace)
	if err != nil {
		return err
	}
	rep := boundsReport{Trace: *trace, Stats: workload.Stats(recs)}
	add := func(label string, c int64) error {
		b, err := workload.PooledBound(recs, c)
		if err != nil {
			return err
		}
		rep.Rows = append(rep.Rows, boundRow{Capacity: label, Tokens: c, BlockRatio: b.BlockRatio(), TokenRatio: b.TokenRatio(), HitBlocks: b.HitBlocks, Blocks: b.Blocks})
		return nil
	}
	for _, c := range caps {
		if err := add(humanTokens(c), c); err != nil {
			return err
		}
	}
	if *instances > 0 {
		if err := add(fmt.Sprintf("fleet %d × %s", *instances, humanTokens(per)), int64(*instances)*per); err != nil {
			return err
		}
	}
	if err := add("infinite", 0); err != nil {
		return err
	}
	var md strings.Builder
	writeBoundsMarkdown(&md, rep)
	if _, err := io.WriteString(stdout, md.String()); err != nil {
		return err
	}
	if *out != "" {
		if err := os.MkdirAll(*out, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(*out, "bounds.md"), []byte(md.String()), 0o644); err != nil {
			return err
		}
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(filepath.Join(*out, "bounds.json"), append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func humanTokens(n int64) string {
	switch {
	case n >= 1_000_000:
		return strconv.FormatFloat(float64(n)/1e6, 'f', -1, 64) + "M"
	case n >= 1000:
		return strconv.FormatFloat(float64(n)/1e3, 'f', -1, 64) + "K"
	}
	return strconv.FormatInt(n, 10)
}

func writeBoundsMarkdown(w io.Writer, rep boundsReport) {
	s := rep.Stats
	fmt.Fprintf(w, "trace %s: %d requests over %.1f s (%.2f req/s); input mean %.0f, median %.0f, p90 %.0f tokens; %d blocks of %d tokens, %d distinct\n\n",
		rep.Trace, s.Requests, s.DurationSec, s.RatePerSec, s.InputMean, s.InputMedian, s.InputP90, s.Blocks, workload.TraceBlockTokens, s.DistinctBlocks)
	fmt.Fprintln(w, "| pooled cache | capacity (tokens) | hit ratio (blocks) | hit ratio (tokens) | hit blocks |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|")
	for _, r := range rep.Rows {
		c := strconv.FormatInt(r.Tokens, 10)
		if r.Tokens == 0 {
			c = "∞"
		}
		fmt.Fprintf(w, "| %s | %s | %.3f | %.3f | %d / %d |\n", r.Capacity, c, r.BlockRatio, r.TokenRatio, r.HitBlocks, r.Blocks)
	}
}
