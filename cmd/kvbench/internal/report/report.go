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
	// Trace, Speed and Replicate record how a trace workload was played
	// (empty for generated workloads).
	Trace     string  `json:"trace,omitempty"`
	Speed     float64 `json:"speed,omitempty"`
	Replicate int     `json:"replicate,omitempty"`
	Requests  int     `json:"requests"`
	Failed    int     `json:"failed"`
	// Failures counts failed requests per kind (des.Outcome.ErrKind).
	Failures map[string]int `json:"failures,omitempty"`
	// HitRate is cached prompt tokens over prompt tokens (vLLM's
	// prefix_cache_hits / prefix_cache_queries), over completed requests.
	HitRate float64 `json:"hit_rate"`
	// Bound is the pooled-cache bound's hit rate over the same requests as
	// HitRate (those that completed); BoundFraction is HitRate / Bound.
	Bound         float64 `json:"bound,omitempty"`
	BoundFraction float64 `json:"bound_fraction,omitempty"`
	TTFTMeanMs    float64 `json:"ttft_mean_ms"`
	TTFTP50Ms     float64 `json:"ttft_p50_ms"`
	TTFTP90Ms     float64 `json:"ttft_p90_ms"`
	TTFTP99Ms     float64 `json:"ttft_p99_ms"`
	// FloorP90Ms and FloorP99Ms are the same percentiles of the completed
	// requests' TTFT alone on an idle engine with the pooled-cache bound's
	// cached tokens (sim.Config.AloneTTFT): what the percentile would be
	// with no queueing at all and the bound's hits. Where a strategy's
	// percentile is near its floor, the tail is the requests' own prefill
	// and no placement can lower it much (a strategy can beat the pooled
	// LRU bound on a request, so the floor is not strict). 0: not computed.
	FloorP90Ms float64 `json:"ttft_floor_p90_ms,omitempty"`
	FloorP99Ms float64 `json:"ttft_floor_p99_ms,omitempty"`
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
	// DecisionCPUMeanUs and DecisionCPUP99Us are the CPU time the driver's
	// thread spent in Pick (des on Linux; NaN elsewhere): what a decision
	// costs, without the time the thread waited for a core.
	DecisionCPUMeanUs float64 `json:"decision_cpu_mean_us"`
	DecisionCPUP99Us  float64 `json:"decision_cpu_p99_us"`
	// Busy is the fleet's busy fraction: engine time spent in steps over
	// engine lifetime; PrefillBusy the part in steps carrying prompt tokens
	// (0 when the engines do not report it).
	Busy        float64 `json:"busy,omitempty"`
	PrefillBusy float64 `json:"prefill_busy,omitempty"`
	// Warms is the warm-up copies the router asked for (router.Warm);
	// Computed the prompt tokens the fleet prefilled per prompt token of
	// the completed requests, the copies' included: 1 − HitRate without
	// copies. A copy is work that the hit rate, read alone, does not show.
	Warms    int     `json:"warms"`
	Computed float64 `json:"computed"`
	// Reasons counts decisions per stated reason.
	Reasons map[string]int `json:"reasons,omitempty"`
	// VirtualSec is the simulated duration, WallSec what it took to run.
	VirtualSec float64 `json:"virtual_sec"`
	WallSec    float64 `json:"wall_sec"`
}

// SummarizeBound is Summarize with the pooled-cache bound given per request
// (boundHits[i]: request i's hit tokens in the bound): the bound's hit rate
// is taken over the requests that completed, the hit rate's own
// denominator, so that failed requests count in neither. floor, when not
// nil, is a request's TTFT alone on an idle engine (prompt and cached
// tokens; sim.Config.AloneTTFT), for FloorP90Ms and FloorP99Ms.
func SummarizeBound(res *des.Result, boundHits []int64, floor func(prompt, cached int) time.Duration) Summary {
	var hit, prompt int64
	var floors []float64
	for _, o := range res.Outcomes {
		if o.Err != "" || o.ID < 0 || o.ID >= len(boundHits) {
			continue
		}
		hit += boundHits[o.ID]
		prompt += int64(o.PromptTokens)
		if floor != nil {
			floors = append(floors, ms(floor(o.PromptTokens, int(boundHits[o.ID]))))
		}
	}
	b := 0.0
	if prompt > 0 {
		b = float64(hit) / float64(prompt)
	}
	s := Summarize(res, b)
	if len(floors) > 0 {
		sort.Float64s(floors)
		s.FloorP90Ms, s.FloorP99Ms = workload.Quantile(floors, 0.9), workload.Quantile(floors, 0.99)
	}
	return s
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Summarize computes a run's summary; bound (0 = none) is the pooled-cache
// hit-rate bound for BoundFraction.
func Summarize(res *des.Result, bound float64) Summary {
	s := Summary{Workload: res.Workload, Strategy: res.Strategy, Instances: len(res.Instances),
		Requests: len(res.Outcomes), Reasons: map[string]int{}, WallSec: res.Wall.Seconds()}
	var ttft, dec, cpu []float64
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
			if o.DecisionCPU > 0 {
				cpu = append(cpu, float64(o.DecisionCPU)/float64(time.Microsecond))
			}
			if o.Overflow {
				overflow++
			}
		}
		if o.Err != "" {
			s.Failed++
			if s.Failures == nil {
				s.Failures = map[string]int{}
			}
			k := o.ErrKind
			if k == "" {
				k = o.Err
			}
			s.Failures[k]++
			continue
		}
		ttft = append(ttft, ms(o.TTFT))
		cached += int64(o.CachedTokens)
		prompt += int64(o.PromptTokens)
		out += int64(o.OutputTokens)
	}
	if prompt > 0 {
		s.HitRate = float64(cached) / float64(prompt)
		s.Computed = float64(prompt-cached+res.WarmComputed) / float64(prompt)
	}
	s.Warms = res.Warms
	if bound > 0 {
		s.Bound = bound
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
	sort.Float64s(cpu)
	s.DecisionCPUMeanUs = mean(cpu)
	s.DecisionCPUP99Us = workload.Quantile(cpu, 0.99)
	var life, busy, pre time.Duration
	for _, u := range res.Utilisation {
		life += u.Life
		busy += u.Busy
		pre += u.PrefillBusy
	}
	if life > 0 {
		s.Busy, s.PrefillBusy = busy.Seconds()/life.Seconds(), pre.Seconds()/life.Seconds()
	}
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

// column is a table and CSV column: header, and how to print a summary's value.
type column struct {
	head string
	val  func(s *Summary) string
}

// columns of the table and CSV.
var columns = []column{
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
	{"ttft_floor_p90_ms", func(s *Summary) string { return optional(s.FloorP90Ms) }},
	{"ttft_floor_p99_ms", func(s *Summary) string { return optional(s.FloorP99Ms) }},
	{"req_per_s", func(s *Summary) string { return f2(s.ReqPerSec) }},
	{"out_tok_per_s", func(s *Summary) string { return f1(s.OutTokPerSec) }},
	{"share_min", func(s *Summary) string { return f3(s.ShareMin) }},
	{"share_max", func(s *Summary) string { return f3(s.ShareMax) }},
	{"overflow_rate", func(s *Summary) string { return f3(s.OverflowRate) }},
	{"busy", func(s *Summary) string { return f3(s.Busy) }},
	{"prefill_busy", func(s *Summary) string { return f3(s.PrefillBusy) }},
	{"warms", func(s *Summary) string { return strconv.Itoa(s.Warms) }},
	{"computed", func(s *Summary) string { return f3(s.Computed) }},
	{"decision_cpu_us", func(s *Summary) string { return f1(s.DecisionCPUMeanUs) }},
	{"decision_cpu_p99_us", func(s *Summary) string { return f1(s.DecisionCPUP99Us) }},
	{"decision_wall_p50_us", func(s *Summary) string { return f1(s.DecisionP50Us) }},
}

func f1(x float64) string { return num(x, 1) }

// optional is f1, empty for 0 (not computed).
func optional(x float64) string {
	if x == 0 {
		return ""
	}
	return f1(x)
}
func f2(x float64) string { return num(x, 2) }
func f3(x float64) string { return num(x, 3) }

func num(x float64, prec int) string {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return ""
	}
	return strconv.FormatFloat(x, 'f', prec, 64)
}

// WriteMarkdown writes the summaries as a Markdown table, every column.
func WriteMarkdown(w io.Writer, sums []Summary) error {
	return writeMarkdown(w, sums, columns)
}

// compactHeads are the columns of WriteCompact: what a reader compares
// first, narrow enough for an 80–100 column terminal.
var compactHeads = []string{"strategy", "requests", "failed", "hit_rate", "of_bound", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "req_per_s"}

// WriteCompact writes the summaries as a narrow Markdown table (the
// columns in compactHeads; of_bound only when some summary has a bound).
// The report files keep every column.
func WriteCompact(w io.Writer, sums []Summary) error {
	bound := false
	for i := range sums {
		bound = bound || sums[i].BoundFraction > 0
	}
	var cols []column
	for _, h := range compactHeads {
		if h == "of_bound" && !bound {
			continue
		}
		for _, c := range columns {
			if c.head == h {
				cols = append(cols, c)
			}
		}
	}
	return writeMarkdown(w, sums, cols)
}

func writeMarkdown(w io.Writer, sums []Summary, cols []column) error {
	var b strings.Builder
	b.WriteString("|")
	for _, c := range cols {
		b.WriteString(" " + c.head + " |")
	}
	b.WriteString("\n|")
	for _, c := range cols {
		if c.head == "workload" || c.head == "strategy" {
			b.WriteString("---|")
		} else {
			b.WriteString("---:|")
		}
	}
	b.WriteString("\n")
	for i := range sums {
		b.WriteString("|")
		for _, c := range cols {
			b.WriteString(" " + strings.ReplaceAll(c.val(&sums[i]), "|", `\|`) + " |")
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteFailures writes, for every summary with failed requests, one line
// saying why they failed (counts per kind, most frequent first).
func WriteFailures(w io.Writer, sums []Summary) error {
	var b strings.Builder
	for i := range sums {
		writeFailures(&b, &sums[i])
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func writeFailures(b *strings.Builder, s *Summary) {
	if len(s.Failures) == 0 {
		return
	}
	kinds := make([]string, 0, len(s.Failures))
	for k := range s.Failures {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool {
		if s.Failures[kinds[i]] != s.Failures[kinds[j]] {
			return s.Failures[kinds[i]] > s.Failures[kinds[j]]
		}
		return kinds[i] < kinds[j]
	})
	fmt.Fprintf(b, "%s/%s: %d failed:", s.Workload, s.Strategy, s.Failed)
	for i, k := range kinds {
		if i > 0 {
			b.WriteString(";")
		}
		fmt.Fprintf(b, " %d × %s", s.Failures[k], k)
	}
	b.WriteString("\n")
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
			"decision_cpu_mean_us": s.DecisionCPUMeanUs, "decision_cpu_p99_us": s.DecisionCPUP99Us,
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
		&s.DecisionP99Us, &s.DecisionCPUMeanUs, &s.DecisionCPUP99Us, &s.HitRate, &s.BoundFraction, &s.ReqPerSec, &s.OutTokPerSec, &s.ShareMin, &s.ShareMax, &s.OverflowRate} {
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
