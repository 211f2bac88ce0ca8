package kvaware

import (
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestCompareWindowsAndModes: the comparison sums a recent window from its
// minute buckets, starts afresh on reset and on a switch of routing mode
// (never mixing two strategies' figures), and gives a verdict only with
// enough shadow-scored requests on both sides.
func TestCompareWindowsAndModes(t *testing.T) {
	var c compareStats
	t0 := time.Date(2026, 12, 3, 10, 0, 30, 0, time.UTC)
	c.setMode(config.StrategyKVAware, true, t0)
	rec := func(at time.Time, agree bool, kvTTFT, paTTFT float64) {
		c.countReason(router.ReasonKVMatch, at)
		c.addShadow(&shadowRecord{inUse: config.StrategyKVAware, other: config.StrategyPrefixAware, agree: agree,
			inUsePick: shadowPick{matched: 1000, ttft: kvTTFT}, otherPick: shadowPick{matched: 200, ttft: paTTFT}}, at)
	}
	// 40 requests in minute 0, 40 in minute 10.
	for i := range 40 {
		rec(t0.Add(time.Duration(i)*time.Second/4), false, 0.100, 0.300)
		rec(t0.Add(10*time.Minute+time.Duration(i)*time.Second/4), true, 0.100, 0.102)
	}
	now := t0.Add(10*time.Minute + 20*time.Second)
	all, since := c.window(now, 0)
	if all.compared != 80 || all.agreed != 40 || !since.Equal(t0) {
		t.Fatalf("all: compared %d agreed %d since %v", all.compared, all.agreed, since)
	}
	last, from := c.window(now, 5*time.Minute)
	if last.compared != 40 || last.agreed != 40 || last.reasons[router.ReasonKVMatch] != 40 {
		t.Fatalf("5m window: %+v", last)
	}
	if want := time.Date(2026, 12, 3, 10, 6, 0, 0, time.UTC); !from.Equal(want) {
		t.Errorf("5m window from %v, want %v", from, want)
	}
	// Verdicts: everything → kv_aware better; the last 5 minutes → a tie
	// (102 ms vs 100 ms is within 5%).
	if v := verdict(&all, true); v.Better != config.StrategyKVAware || !strings.Contains(v.Why, "over 80 requests") {
		t.Errorf("verdict over all: %+v", v)
	}
	if v := verdict(&last, true); v.Better != "" || !strings.HasPrefix(v.Why, "a tie") {
		t.Errorf("verdict over 5m: %+v", v)
	}
	if v := verdict(&last, false); v.Better != "" || !strings.Contains(v.Why, "shadow scoring is off") {
		t.Errorf("verdict without shadow: %+v", v)
	}
	few := compareCounts{}
	few.add(&last)
	few.sides[config.StrategyKVAware].n = compareMinSamples - 1
	if v := verdict(&few, true); v.Better != "" || !strings.Contains(v.Why, "fewer than") {
		t.Errorf("verdict on too few: %+v", v)
	}
	// A bucket an hour old is not counted again when its slot comes round.
	later := t0.Add(60*time.Minute + 10*time.Second)
	c.countReason(router.ReasonHash, later)
	if w, _ := c.window(later, 60*time.Minute); w.compared != 40 || w.reasons[router.ReasonHash] != 1 || w.reasons[router.ReasonKVMatch] != 40 {
		t.Errorf("60m window an hour on: compared %d reasons %v", w.compared, w.reasons)
	}

	// The same mode again changes nothing; another mode starts afresh.
	c.setMode(config.StrategyKVAware, true, later)
	if a, _ := c.window(later, 0); a.compared != 80 {
		t.Fatalf("same mode reset the comparison: %d", a.compared)
	}
	switched := later.Add(time.Second)
	c.setMode(config.StrategyPrefixAware, true, switched)
	if a, s := c.window(switched, 0); a.compared != 0 || !s.Equal(switched) || c.resetBy != "strategy changed from kv_aware+shadow to prefix_aware+shadow" {
		t.Fatalf("after a switch: compared %d since %v by %q", a.compared, s, c.resetBy)
	}
	if w, _ := c.window(switched, 60*time.Minute); w.compared != 0 {
		t.Fatalf("a window after a switch still holds the old mode's figures: %d", w.compared)
	}
	rec(switched, true, 0.1, 0.1)
	c.reset(switched.Add(time.Second), "reset")
	if a, _ := c.window(switched.Add(time.Second), 0); a.compared != 0 || c.resetBy != "reset" || c.mode != "prefix_aware+shadow" {
		t.Fatalf("after reset: compared %d by %q mode %q", a.compared, c.resetBy, c.mode)
	}
}
