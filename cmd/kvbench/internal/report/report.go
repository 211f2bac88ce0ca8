// Package report turns kvbench runs into per-strategy summaries and writes
// them as a Markdown table, CSV, JSON and SVG bar charts; it also draws the
// progress bar long runs show on a terminal.
package report

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/workload"
)

// Summary is one strategy's figures on one workload.
type Summary struct {
	Workload  string `json:"workload"`
	Strategy  string `json:"strategy"`
	Instances int    `json:"instances"`
	Requests  int    `json:"requests"`
	Failed    int    `json:"failed"`
	// HitRate is cached prompt tokens over prompt tokens (vLLM's
	// prefix_cache_hits / prefix_cache_queries), over completed requests.
	HitRate float64 `json:"hit_rate"`
	// BoundFraction is HitRate over the pooled-cache bound, when one is known.
	BoundFraction float64 `json:"bound_fraction,omitempty"`
	TTFTMeanMs    float64 `json:"ttft_mean_ms"`
	TTFTP50Ms     float64 `json:"ttft_p50_ms"`
	TTFTP90Ms     float64 `json:"ttft_p90_ms"`
	TTFTP99Ms     float64 `json:"ttft_p99_ms"`
	// Throughput over the makespan (first arrival to last completion).
	ReqPerSec    float64 `json:"req_per_sec"`
	OutTokPerSec float64 `json:"out_tok_per_sec"`
	// ShareMin and ShareMax are the smallest and largest fraction of
	// requests any instance received.
	ShareMin float64 `json:"share_min"`
	ShareMax float64 `json:"share_max"`
	// OverflowRate is the fraction of decisions that could not use the
	// strategy's first choice.
	OverflowRate float64 `json:"overflow_rate"`
	// DecisionMeanUs, DecisionP50Us and DecisionP99Us are the wall-clock
	// cost of Pick (the median is the robust one on a shared machine, where
	// a GC cycle or a preemption lands on a few decisions).
	DecisionMeanUs float64 `json:"decision_mean_us"`
	DecisionP50Us  float64 `json:"decision_p50_us"`
	DecisionP99Us  float64 `json:"decision_p99_us"`
	// Reasons counts decisions per stated reason.
	Reasons map[string]int `json:"reasons,omitempty"`
	// VirtualSec is the simulated duration, WallSec what it took to run.
	VirtualSec float64 `json:"virtual_sec"`
	WallSec    float64 `json:"wall_sec"`
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Summarize computes a run's summary; bound (0 = none) is the pooled-cache
// hit-rate bound for BoundFraction.
func Summarize(res *des.Result, bound float64) Summary {
	s := Summary{Workload: res.Workload, Strategy: res.Strategy, Instances: len(res.Instances),
		Requests: len(res.Outcomes), Reasons: map[string]int{}, WallSec: res.Wall.Seconds()}
	var ttft, dec []float64
	var cached, prompt, out int64
	per := map[string]int{}
	routed, overflow := 0, 0
	first := time.Duration(math.MaxInt64)
	for _, o := range res.Outcomes {
		first = min(first, o.Arrival)
		if o.Instance != "" {
			routed++
			per[o.Instance]++
			s.Reasons[o.Reason]++
			dec = append(dec, float64(o.Decision)/float64(time.Microsecond))
			if o.Overflow {
				overflow++
			}
		}
		if o.Err != "" {
			s.Failed++
			continue
		}
		ttft = append(ttft, ms(o.TTFT))
		cached += int64(o.CachedTokens)
		prompt += int64(o.PromptTokens)
		out += int64(o.OutputTokens)
	}
	if prompt > 0 {
		s.HitRate = float64(cached) / float64(prompt)
	}
	if bound > 0 {
		s.BoundFraction = s.HitRate / bound
	}
	sort.Float64s(ttft)
	sort.Float64s(dec)
	s.TTFTMeanMs = mean(ttft)
	s.TTFTP50Ms = workload.Quantile(ttft, 0.5)
	s.TTFTP90Ms = workload.Quantile(ttft, 0.9)
	s.TTFTP99Ms = workload.Quantile(ttft, 0.99)
	s.DecisionMeanUs = mean(dec)
	s.DecisionP50Us = workload.Quantile(dec, 0.5)
	s.DecisionP99Us = workload.Quantile(dec, 0.99)
	if span := (res.End - first).Seconds(); span > 0 && len(ttft) > 0 {
		s.ReqPerSec = float64(len(ttft)) / span
		s.OutTokPerSec = float64(out) / span
	}
	if routed > 0 {
		s.ShareMin = 1
		for _, in := range res.Instances {
			f := float64(per[in]) / float64(routed)
			s.ShareMin, s.ShareMax = min(s.ShareMin, f), max(s.ShareMax, f)
		}
		s.OverflowRate = float64(overflow) / float64(routed)
	}
	s.VirtualSec = res.End.Seconds()
	return s
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	t := 0.0
	for _, x := range v {
		t += x
	}
	return t / float64(len(v))
}

// columns of the table and CSV: header, and how to print a summary's value.
var columns = []struct {
	head string
	val  func(s *Summary) string
}{
	{"workload", func(s *Summary) string { return s.Workload }},
	{"strategy", func(s *Summary) string { return s.Strategy }},
	{"instances", func(s *Summary) string { return strconv.Itoa(s.Instances) }},
	{"requests", func(s *Summary) string { return strconv.Itoa(s.Requests) }},
	{"failed", func(s *Summary) string { return strconv.Itoa(s.Failed) }},
	{"hit_rate", func(s *Summary) string { return f3(s.HitRate) }},
	{"of_bound", func(s *Summary) string {
		if s.BoundFraction == 0 {
			return ""
		}
		return f3(s.BoundFraction)
	}},
	{"ttft_p50_ms", func(s *Summary) string { return f1(s.TTFTP50Ms) }},
	{"ttft_p90_ms", func(s *Summary) string { return f1(s.TTFTP90Ms) }},
	{"ttft_p99_ms", func(s *Summary) string { return f1(s.TTFTP99Ms) }},
	{"req_per_s", func(s *Summary) string { return f2(s.ReqPerSec) }},
	{"out_tok_per_s", func(s *Summary) string { return f1(s.OutTokPerSec) }},
	{"share_min", func(s *Summary) string { return f3(s.ShareMin) }},
	{"share_max", func(s *Summary) string { return f3(s.ShareMax) }},
	{"overflow_rate", func(s *Summary) string { return f3(s.OverflowRate) }},
	{"decision_mean_us", func(s *Summary) string { return f1(s.DecisionMeanUs) }},
	{"decision_p50_us", func(s *Summary) string { return f1(s.DecisionP50Us) }},
	{"decision_p99_us", func(s *Summary) string { return f1(s.DecisionP99Us) }},
}

func f1(x float64) string { return num(x, 1) }
func f2(x float64) string { return num(x, 2) }
func f3(x float64) string { return num(x, 3) }

func num(x float64, prec int) string {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return ""
	}
	return strconv.FormatFloat(x, 'f', prec, 64)
}

// WriteMarkdown writes the summaries as a Markdown table.
func WriteMarkdown(w io.Writer, sums []Summary) error {
	var b strings.Builder
	b.WriteString("|")
	for _, c := range columns {
		b.WriteString(" " + c.head + " |")
	}
	b.WriteString("\n|")
	for i := range columns {
		if i < 2 {
			b.WriteString("---|")
		} else {
			b.WriteString("---:|")
		}
	}
	b.WriteString("\n")
	for i := range sums {
		b.WriteString("|")
		for _, c := range columns {
			b.WriteString(" " + strings.ReplaceAll(c.val(&sums[i]), "|", `\|`) + " |")
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteCSV writes the summaries as CSV with a header row.
func WriteCSV(w io.Writer, sums []Summary) error {
	cw := csv.NewWriter(w)
	row := make([]string, len(columns))
	for i, c := range columns {
		row[i] = c.head
	}
	if err := cw.Write(row); err != nil {
		return err
	}
	for i := range sums {
		for j, c := range columns {
			row[j] = c.val(&sums[i])
		}
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteJSON writes the summaries as an indented JSON array. A figure that
// does not exist (no request completed) is null rather than NaN, which JSON
// cannot carry.
func WriteJSON(w io.Writer, sums []Summary) error {
	out := make([]map[string]any, len(sums))
	for i, s := range sums {
		b, err := json.Marshal(clean(s))
		if err != nil {
			return err
		}
		if err := json.Unmarshal(b, &out[i]); err != nil {
			return err
		}
		for k, v := range map[string]float64{
			"ttft_mean_ms": s.TTFTMeanMs, "ttft_p50_ms": s.TTFTP50Ms, "ttft_p90_ms": s.TTFTP90Ms,
			"ttft_p99_ms": s.TTFTP99Ms, "decision_mean_us": s.DecisionMeanUs, "decision_p50_us": s.DecisionP50Us, "decision_p99_us": s.DecisionP99Us,
		} {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				out[i][k] = nil
			}
		}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

// clean zeroes NaN and infinite figures so that the summary marshals.
func clean(s Summary) Summary {
	for _, p := range []*float64{&s.TTFTMeanMs, &s.TTFTP50Ms, &s.TTFTP90Ms, &s.TTFTP99Ms, &s.DecisionMeanUs, &s.DecisionP50Us,
		&s.DecisionP99Us, &s.HitRate, &s.BoundFraction, &s.ReqPerSec, &s.OutTokPerSec, &s.ShareMin, &s.ShareMax, &s.OverflowRate} {
		if math.IsNaN(*p) || math.IsInf(*p, 0) {
			*p = 0
		}
	}
	return s
}

// String renders a duration-free one-line description, for logs.
func (s Summary) String() string {
	return fmt.Sprintf("%s/%s: hit %.3f, ttft p50 %.1f ms p90 %.1f ms, %.2f req/s", s.Workload, s.Strategy, s.HitRate, s.TTFTP50Ms, s.TTFTP90Ms, s.ReqPerSec)
}
