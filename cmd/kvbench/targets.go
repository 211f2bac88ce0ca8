package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Issue 12's must-show targets for kv_aware against prefix_aware, as
// docs/BENCHMARKS.md's summary states them. A sweep tallies them over its
// cells (targets.md) so that a reader need not recount the tables.
const (
	// never worse: hit rate at most half a point under, TTFT percentiles
	// at most 5 % over.
	neverWorseHitPt = -0.5
	neverWorseTTFT  = 1.05
	bandLo, bandHi  = 0.55, 0.85 // prefix_aware's busy fraction: routing has room
	bandTTFT        = 0.75       // p90 and p99 in the band
	overBusy        = 0.90       // over it: p50, p90, p99 all ≤ prefix_aware's
	boundAt1x       = 0.97       // of the pooled-cache bound at load 1
	boundLoad       = 1.0
)

// sweepCell is one fleet size and load of a workload with both
// strategies.
type sweepCell struct {
	Workload   string
	Fleet      int
	Load       float64
	Prefix, KV sweepRow
}

func (c sweepCell) name() string { return fmt.Sprintf("%s %d@%g×", c.Workload, c.Fleet, c.Load) }

// targetTally is one target over a sweep's cells: how many it applies to,
// and the misses (in the band, split by whether the TTFT floor leaves
// room).
type targetTally struct {
	Target       string
	Cells        int
	Missed       []string
	MissedNoRoom []string // band only
	applies      func(sweepCell) bool
	// misses says whether the cell misses the target, whether the TTFT
	// floor leaves no room to meet it (band only), and the figures.
	misses func(sweepCell) (missed, noRoom bool, why string)
}

// sweepCells pairs each workload's prefix_aware and kv_aware rows by
// fleet size and load, in the sweep's order.
func sweepCells(workloads []string, rows map[string][]sweepRow) []sweepCell {
	var cells []sweepCell
	for _, w := range workloads {
		pa := prefixAwareRows(rows[w])
		for _, r := range rows[w] {
			if p, ok := pa[r.cell()]; ok && r.S.Strategy == "kv_aware" {
				cells = append(cells, sweepCell{Workload: w, Fleet: r.Fleet, Load: r.Load, Prefix: p, KV: r})
			}
		}
	}
	return cells
}

// tallyTargets evaluates the targets over cells.
func tallyTargets(cells []sweepCell) []targetTally {
	ratios := func(c sweepCell) [3]float64 {
		return [3]float64{c.KV.S.TTFTP50Ms / c.Prefix.S.TTFTP50Ms, c.KV.S.TTFTP90Ms / c.Prefix.S.TTFTP90Ms, c.KV.S.TTFTP99Ms / c.Prefix.S.TTFTP99Ms}
	}
	over := func(r [3]float64, idx []int, limit float64) (bool, bool, string) {
		var bad []string
		for _, i := range idx {
			if !(r[i] <= limit) { // NaN (a 0 percentile) counts as a miss
				bad = append(bad, fmt.Sprintf("%s %.3f×", [3]string{"p50", "p90", "p99"}[i], r[i]))
			}
		}
		return len(bad) > 0, false, strings.Join(bad, ", ")
	}
	always := func(sweepCell) bool { return true }
	ts := []targetTally{
		{Target: fmt.Sprintf("never worse: hit ≥ prefix_aware's %+.1f pt", neverWorseHitPt),
			applies: always,
			misses: func(c sweepCell) (bool, bool, string) {
				d := 100 * (c.KV.S.HitRate - c.Prefix.S.HitRate)
				return d < neverWorseHitPt, false, fmt.Sprintf("%+.3f pt", d)
			}},
		{Target: fmt.Sprintf("never worse: TTFT p50, p90, p99 ≤ %.2f×", neverWorseTTFT),
			applies: always,
			misses:  func(c sweepCell) (bool, bool, string) { return over(ratios(c), []int{0, 1, 2}, neverWorseTTFT) }},
		{Target: fmt.Sprintf("prefix_aware %.0f–%.0f %% busy: p90, p99 ≤ %.2f×", 100*bandLo, 100*bandHi, bandTTFT),
			applies: func(c sweepCell) bool { return c.Prefix.S.Busy >= bandLo && c.Prefix.S.Busy <= bandHi },
			misses: func(c sweepCell) (bool, bool, string) {
				missed, _, why := over(ratios(c), []int{1, 2}, bandTTFT)
				p := c.Prefix.S
				// A floor over the band's ratio of prefix_aware's
				// percentile: no placement meets the band.
				noRoom := p.FloorP90Ms > bandTTFT*p.TTFTP90Ms || p.FloorP99Ms > bandTTFT*p.TTFTP99Ms
				if missed && noRoom {
					why += fmt.Sprintf(" (floor p90 %.3f×, p99 %.3f× prefix_aware's)", p.FloorP90Ms/p.TTFTP90Ms, p.FloorP99Ms/p.TTFTP99Ms)
				}
				return missed, noRoom, why
			}},
		{Target: fmt.Sprintf("prefix_aware over %.0f %% busy: p50, p90, p99 ≤ 1×", 100*overBusy),
			applies: func(c sweepCell) bool { return c.Prefix.S.Busy > overBusy },
			misses:  func(c sweepCell) (bool, bool, string) { return over(ratios(c), []int{0, 1, 2}, 1) }},
		{Target: fmt.Sprintf("of the pooled-cache bound at %g× ≥ %.2f", boundLoad, boundAt1x),
			applies: func(c sweepCell) bool { return c.Load == boundLoad && c.KV.S.Bound > 0 },
			misses: func(c sweepCell) (bool, bool, string) {
				return c.KV.S.BoundFraction < boundAt1x, false, fmt.Sprintf("%.3f (prefix_aware %.3f)", c.KV.S.BoundFraction, c.Prefix.S.BoundFraction)
			}},
	}
	for i := range ts {
		t := &ts[i]
		for _, c := range cells {
			if !t.applies(c) {
				continue
			}
			t.Cells++
			missed, noRoom, why := t.misses(c)
			switch {
			case missed && noRoom:
				t.MissedNoRoom = append(t.MissedNoRoom, c.name()+": "+why)
			case missed:
				t.Missed = append(t.Missed, c.name()+": "+why)
			}
		}
	}
	return ts
}

// writeTargets writes targets.md (the tally) and sweep.json (every row at
// full precision, for tallies across sweeps) into dir.
func writeTargets(dir string, workloads []string, rows map[string][]sweepRow) error {
	var all []sweepRow
	for _, w := range workloads {
		all = append(all, rows[w]...)
	}
	js, err := json.MarshalIndent(all, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "sweep.json"), js, 0o644); err != nil {
		return err
	}
	cells := sweepCells(workloads, rows)
	if len(cells) == 0 {
		return nil // no pair of prefix_aware and kv_aware to compare
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# kv_aware against prefix_aware: issue 12's targets over %d cells\n\n", len(cells))
	b.WriteString("Each target over the cells it applies to (docs/BENCHMARKS.md's summary); a band miss is \"no room\"\nwhere the TTFT floor is over 0.75× prefix_aware's percentile.\n\n")
	b.WriteString("| target | cells | met | missed | missed, no room |\n|---|---:|---:|---:|---:|\n")
	ts := tallyTargets(cells)
	for _, t := range ts {
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %d |\n", t.Target, t.Cells, t.Cells-len(t.Missed)-len(t.MissedNoRoom), len(t.Missed), len(t.MissedNoRoom))
	}
	for _, t := range ts {
		if len(t.Missed)+len(t.MissedNoRoom) == 0 {
			continue
		}
		fmt.Fprintf(&b, "\n## %s\n\n", t.Target)
		for _, m := range t.Missed {
			fmt.Fprintf(&b, "- %s\n", m)
		}
		for _, m := range t.MissedNoRoom {
			fmt.Fprintf(&b, "- %s, no room\n", m)
		}
	}
	return os.WriteFile(filepath.Join(dir, "targets.md"), []byte(b.String()), 0o644)
}
