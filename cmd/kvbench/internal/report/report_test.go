package report

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
)

func result() *des.Result {
	res := &des.Result{Strategy: "prefix_aware", Workload: "long-context", Instances: []string{"i00", "i01", "i02", "i03"}, End: 10 * time.Second}
	// 10 requests; instance i00 gets 4, i01 3, i02 3, i03 none; one fails.
	insts := []string{"i00", "i00", "i00", "i00", "i01", "i01", "i01", "i02", "i02", "i02"}
	for i := range 10 {
		o := des.Outcome{ID: i, Instance: insts[i], Reason: "hash", Arrival: time.Duration(i) * time.Second,
			TTFT: time.Duration(i+1) * 100 * time.Millisecond, PromptTokens: 1000, CachedTokens: 500, OutputTokens: 10,
			Decision: time.Duration(i+1) * time.Microsecond, DecisionCPU: time.Duration(i+1) * time.Microsecond / 2}
		if i == 9 {
			o.Err = "aborted by engine"
		}
		if i == 8 {
			o.Overflow, o.Reason = true, "overflow"
		}
		res.Outcomes = append(res.Outcomes, o)
	}
	for i, in := range res.Instances {
		res.Utilisation = append(res.Utilisation, des.Utilisation{Instance: in, Life: 10 * time.Second,
			Busy: time.Duration(i+1) * time.Second, PrefillBusy: time.Duration(i+1) * time.Second / 2})
	}
	return res
}

func TestSummarize(t *testing.T) {
	s := Summarize(result(), 0.8)
	tests := []struct {
		name      string
		got, want float64
	}{
		{"requests", float64(s.Requests), 10},
		{"failed", float64(s.Failed), 1},
		{"hit rate", s.HitRate, 0.5},
		{"bound fraction", s.BoundFraction, 0.625},
		{"ttft p50", s.TTFTP50Ms, 500},
		{"ttft p90", s.TTFTP90Ms, 820},
		{"ttft mean", s.TTFTMeanMs, 500},
		{"req/s", s.ReqPerSec, 0.9},
		{"out tok/s", s.OutTokPerSec, 9},
		{"share min", s.ShareMin, 0},
		{"share max", s.ShareMax, 0.4},
		{"overflow", s.OverflowRate, 0.1},
		{"decision mean", s.DecisionMeanUs, 5.5},
		{"decision p50", s.DecisionP50Us, 5.5},
		{"decision cpu mean", s.DecisionCPUMeanUs, 2.75},
		{"busy", s.Busy, 0.25},
		{"prefill busy", s.PrefillBusy, 0.125},
		{"failures", float64(s.Failures["aborted by engine"]), 1},
	}
	for _, tc := range tests {
		if math.Abs(tc.got-tc.want) > 1e-9 {
			t.Errorf("%s = %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	if s.Reasons["hash"] != 9 || s.Reasons["overflow"] != 1 {
		t.Errorf("reasons %v", s.Reasons)
	}
}

func sums() []Summary {
	a := Summarize(result(), 0.8)
	b := a
	b.Strategy = "random, with | and \"quotes\""
	empty := Summarize(&des.Result{Strategy: "none", Workload: "w"}, 0)
	return []Summary{a, b, empty}
}

func TestWriteCSV(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteCSV(&buf, sums()); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil {
		t.Fatalf("invalid CSV: %v", err)
	}
	if len(rows) != 4 || len(rows[0]) != len(columns) || rows[0][5] != "hit_rate" {
		t.Fatalf("rows %v", rows)
	}
	if rows[2][1] != `random, with | and "quotes"` || rows[1][5] != "0.500" {
		t.Errorf("row values %v / %v", rows[1], rows[2])
	}
	if rows[3][7] != "" {
		t.Errorf("TTFT of a run with no requests should be empty, got %q", rows[3][7])
	}
}

func TestWriteJSON(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteJSON(&buf, sums()); err != nil {
		t.Fatal(err)
	}
	var got []map[string]any
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("invalid JSON: %v\n%s", err, buf.String())
	}
	if len(got) != 3 || got[0]["hit_rate"] != 0.5 || got[0]["strategy"] != "prefix_aware" {
		t.Errorf("got %v", got[0])
	}
	if v, ok := got[2]["ttft_p50_ms"]; !ok || v != nil {
		t.Errorf("empty run ttft_p50_ms = %v (present %v), want null", v, ok)
	}
}

func TestWriteMarkdown(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteMarkdown(&buf, sums()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 5 {
		t.Fatalf("%d lines:\n%s", len(lines), buf.String())
	}
	// Every row has as many cells as the header (escaped pipes do not split).
	cells := func(l string) int { return strings.Count(strings.ReplaceAll(l, `\|`, ""), "|") }
	for i, l := range lines {
		if cells(l) != len(columns)+1 {
			t.Errorf("line %d has %d separators: %s", i, cells(l), l)
		}
	}
}

func TestSVGWellFormed(t *testing.T) {
	charts := []BarChart{
		HitRateChart(sums(), 0.8),
		TTFTChart(sums()),
		{Title: "empty <chart> & co"},
		{Title: "nan", Groups: []string{"a"}, Series: []string{"x"}, Values: [][]float64{{math.NaN()}}},
	}
	for _, c := range charts {
		var buf bytes.Buffer
		if err := c.WriteSVG(&buf); err != nil {
			t.Fatal(err)
		}
		dec := xml.NewDecoder(&buf)
		rects := 0
		root := ""
		for {
			tok, err := dec.Token()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("%s: invalid XML: %v", c.Title, err)
			}
			if se, ok := tok.(xml.StartElement); ok {
				if root == "" {
					root = se.Name.Local
				}
				if se.Name.Local == "rect" {
					rects++
				}
			}
		}
		if root != "svg" {
			t.Errorf("%s: root element %q", c.Title, root)
		}
		bars := 0
		for _, row := range c.Values {
			for _, v := range row {
				if !math.IsNaN(v) {
					bars++
				}
			}
		}
		// background + bars + legend swatches
		if want := 1 + bars + len(c.Series); rects != want {
			t.Errorf("%s: %d rects, want %d", c.Title, rects, want)
		}
	}
}

// TestWriteCompact: the terminal table keeps the columns a reader compares
// first, of_bound only when a summary has a bound.
func TestWriteCompact(t *testing.T) {
	sums := []Summary{{Workload: "mix", Strategy: "kv_aware", Requests: 10, HitRate: 0.5, TTFTP50Ms: 1, TTFTP90Ms: 2, TTFTP99Ms: 3, ReqPerSec: 4, ShareMax: 0.5}}
	var b strings.Builder
	if err := WriteCompact(&b, sums); err != nil {
		t.Fatal(err)
	}
	head := strings.SplitN(b.String(), "\n", 2)[0]
	if head != "| strategy | requests | failed | hit_rate | ttft_p50_ms | ttft_p90_ms | ttft_p99_ms | req_per_s |" {
		t.Errorf("compact header %q", head)
	}
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		if len(line) > 100 {
			t.Errorf("line of %d characters: %q", len(line), line)
		}
	}
	sums[0].BoundFraction = 0.9
	b.Reset()
	_ = WriteCompact(&b, sums)
	if !strings.Contains(strings.SplitN(b.String(), "\n", 2)[0], "| of_bound |") {
		t.Errorf("no of_bound column with a bound: %q", b.String())
	}
}

func TestProgress(t *testing.T) {
	var buf bytes.Buffer
	p := NewProgressTo(&buf, false, "x")
	p.Update(1, 2)
	p.Done()
	if buf.Len() != 0 {
		t.Errorf("disabled bar wrote %q", buf.String())
	}
	p = NewProgressTo(&buf, true, "run")
	p.Update(5, 10)
	p.Update(6, 10) // within 100 ms: skipped
	p.Update(10, 10)
	p.Done()
	out := buf.String()
	if !strings.Contains(out, " 50% 5/10") || strings.Contains(out, "6/10") || !strings.Contains(out, "100% 10/10") || !strings.HasSuffix(out, "\n") {
		t.Errorf("bar output %q", out)
	}

	// Not a terminal: a plain line once PlainEvery has passed, no \r.
	buf.Reset()
	p = &Progress{w: &buf, plain: true, label: "live kv_aware", start: time.Now().Add(-PlainEvery - time.Second)}
	p.Update(3, 12)
	p.Update(4, 12) // within PlainEvery of the last line: skipped
	p.Done()
	if out := buf.String(); out != "live kv_aware: 3/12 requests (25%), 6s\n" {
		t.Errorf("plain progress %q", out)
	}
}

func TestNiceCeil(t *testing.T) {
	for _, tc := range []struct{ in, want float64 }{{0, 1}, {0.83, 1}, {1.2, 2}, {3, 5}, {7, 10}, {420, 500}, {1000, 1000}} {
		if got := niceCeil(tc.in); got != tc.want {
			t.Errorf("niceCeil(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestWriteFailures(t *testing.T) {
	var buf bytes.Buffer
	ss := sums()
	ss[0].Failures = map[string]int{"submit: too long": 3, "aborted by engine": 1}
	if err := WriteFailures(&buf, ss); err != nil {
		t.Fatal(err)
	}
	want := "long-context/prefix_aware: 1 failed: 3 × submit: too long; 1 × aborted by engine\n" +
		"long-context/random, with | and \"quotes\": 1 failed: 1 × aborted by engine\n"
	if buf.String() != want {
		t.Errorf("got\n%s\nwant\n%s", buf.String(), want)
	}
}

// The floor percentiles are taken over the completed requests' floors,
// each from its prompt and its hits in the bound, and left at 0 without a
// floor function.
func TestSummarizeBoundFloor(t *testing.T) {
	res := &des.Result{Strategy: "kv_aware", Instances: []string{"i00"}, End: time.Second}
	bound := make([]int64, 100)
	for i := range 100 {
		o := des.Outcome{ID: i, Instance: "i00", TTFT: time.Second, PromptTokens: 1000 * (i + 1), CachedTokens: 0}
		bound[i] = int64(500 * (i + 1)) // the bound hits half of each prompt
		if i == 99 {
			o.Err, o.TTFT = "refused", 0 // the longest fails: not in the floor
		}
		res.Outcomes = append(res.Outcomes, o)
	}
	// A floor of 1 ms per uncached token: request i's is 500·(i+1) ms.
	floor := func(prompt, cached int) time.Duration { return time.Duration(prompt-cached) * time.Millisecond }
	s := SummarizeBound(res, bound, floor)
	// 99 completed floors 500, 1000, …, 49,500 ms; p90 and p99 interpolated.
	if want := 500 * (1 + 0.9*98); math.Abs(s.FloorP90Ms-want) > 1e-6 {
		t.Errorf("floor p90 %v, want %v", s.FloorP90Ms, want)
	}
	if want := 500 * (1 + 0.99*98); math.Abs(s.FloorP99Ms-want) > 1e-6 {
		t.Errorf("floor p99 %v, want %v", s.FloorP99Ms, want)
	}
	if s := SummarizeBound(res, bound, nil); s.FloorP90Ms != 0 || s.FloorP99Ms != 0 {
		t.Errorf("no floor function: %v / %v", s.FloorP90Ms, s.FloorP99Ms)
	}
}
