package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
)

// row is a sweep row of strategy st at load with the figures given.
func row(st string, load, busy, hit, p50, p90, p99, floor90, floor99, ofBound float64) sweepRow {
	return sweepRow{Fleet: 8, Load: load, S: report.Summary{Strategy: st, Busy: busy, HitRate: hit,
		TTFTP50Ms: p50, TTFTP90Ms: p90, TTFTP99Ms: p99, FloorP90Ms: floor90, FloorP99Ms: floor99,
		Bound: 0.5, BoundFraction: ofBound}}
}

// Each target counts the cells it applies to and names the misses, at full
// precision: a cell 0.6 point under on hit rate misses never worse, one
// 0.4 under meets it; a band miss is "no room" only where the TTFT floor
// is over 0.75× prefix_aware's percentile.
func TestTallyTargets(t *testing.T) {
	rows := map[string][]sweepRow{"w": {
		// 1×, 70 % busy: hit −0.6 pt; p99 0.80× in the band with room; bound 0.96.
		row("prefix_aware", 1, 0.70, 0.300, 100, 1000, 2000, 100, 200, 0.95),
		row("kv_aware", 1, 0.71, 0.294, 100, 700, 1600, 100, 200, 0.96),
		// 2×, 95 % busy: hit −0.4 pt (met); p50 1.02× (over 90 % missed, never worse met).
		row("prefix_aware", 2, 0.95, 0.300, 100, 1000, 2000, 100, 200, 0),
		row("kv_aware", 2, 0.96, 0.296, 102, 900, 1900, 100, 200, 0),
		// 4×, 80 % busy: p90 0.80× with the floor 0.90× (no room); p99 1.06× (never worse missed).
		row("prefix_aware", 4, 0.80, 0.300, 100, 1000, 2000, 900, 200, 0),
		row("kv_aware", 4, 0.81, 0.300, 100, 800, 2120, 900, 200, 0),
	}}
	ts := tallyTargets(sweepCells([]string{"w"}, rows))
	want := []struct {
		cells          int
		missed, noRoom []string
	}{
		{3, []string{"w 8@1×"}, nil},                // never worse, hit
		{3, []string{"w 8@4×"}, nil},                // never worse, TTFT
		{2, []string{"w 8@1×"}, []string{"w 8@4×"}}, // band: 1× and 4×
		{1, []string{"w 8@2×"}, nil},                // over 90 %
		{1, []string{"w 8@1×"}, nil},                // bound at 1×
	}
	if len(ts) != len(want) {
		t.Fatalf("%d targets, want %d", len(ts), len(want))
	}
	names := func(ms []string) []string {
		var out []string
		for _, m := range ms {
			out = append(out, strings.SplitN(m, ":", 2)[0])
		}
		return out
	}
	for i, w := range want {
		got := ts[i]
		if got.Cells != w.cells || !slices.Equal(names(got.Missed), w.missed) || !slices.Equal(names(got.MissedNoRoom), w.noRoom) {
			t.Errorf("%s: %d cells, missed %q, no room %q; want %d, %q, %q", got.Target, got.Cells, got.Missed, got.MissedNoRoom, w.cells, w.missed, w.noRoom)
		}
	}
	if m := ts[0].Missed[0]; !strings.Contains(m, "-0.600 pt") {
		t.Errorf("hit miss %q: want the difference at full precision", m)
	}

	dir := t.TempDir()
	if err := writeTargets(dir, []string{"w"}, rows); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(dir, "targets.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(md), "| prefix_aware 55–85 % busy: p90, p99 ≤ 0.75× | 2 | 0 | 1 | 1 |") {
		t.Errorf("targets.md lacks the band's row:\n%s", md)
	}
	var back []sweepRow
	js, err := os.ReadFile(filepath.Join(dir, "sweep.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(js, &back); err != nil || len(back) != 6 || back[1].S.HitRate != 0.294 {
		t.Errorf("sweep.json: %v, %d rows, %+v", err, len(back), back)
	}
}
