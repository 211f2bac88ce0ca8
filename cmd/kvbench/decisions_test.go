package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// TestDecisionBreakdown: the account splits each request's uncached
// prompt tokens into those lost moving off the best holder and those the
// chosen instance no longer had, per reason.
func TestDecisionBreakdown(t *testing.T) {
	tr := newDecisionTrace(&strategyRouter{})
	tr.recs[1] = decisionRec{reason: "kv_match", best: 800, chosen: 800} // stayed, all cached
	tr.recs[2] = decisionRec{reason: "kv_match", best: 600, chosen: 200} // moved: 400 lost
	tr.recs[3] = decisionRec{reason: "kv_match", best: 500, chosen: 500} // stayed, 300 evicted since
	tr.recs[4] = decisionRec{reason: "heuristic"}
	res := &des.Result{Outcomes: []des.Outcome{
		{ID: 1, PromptTokens: 1000, CachedTokens: 800},
		{ID: 2, PromptTokens: 1000, CachedTokens: 200},
		{ID: 3, PromptTokens: 1000, CachedTokens: 200},
		{ID: 4, PromptTokens: 1000},
		{ID: 5, PromptTokens: 1000, Err: "refused"}, // counts in the total only
	}}
	rows, prompt := tr.breakdown(res)
	if prompt != 5000 || len(rows) != 2 {
		t.Fatalf("prompt %d, rows %+v", prompt, rows)
	}
	want := decisionBreakdown{Reason: "kv_match", Requests: 3, Prompt: 3000, Cached: 1200, BestHeld: 1900, LostMove: 400, LostEvict: 300}
	if rows[0] != want {
		t.Fatalf("kv_match row %+v, want %+v", rows[0], want)
	}
	if rows[1].Reason != "heuristic" || rows[1].Requests != 1 || rows[1].LostMove != 0 {
		t.Fatalf("heuristic row %+v", rows[1])
	}
	var out bytes.Buffer
	if err := writeBreakdown(&out, "kv_aware", rows, prompt); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "| kv_match | 3 | 0.600 | 0.400 | 0.3800 | 0.0800 | 0.0600 |") {
		t.Fatalf("table:\n%s", out.String())
	}
}

// TestDESDecisions: des --decisions prints the account for kv_aware (its
// reasons, from a real run) and none for a strategy without an index.
func TestDESDecisions(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"des", "--workload", "long-context", "--limit", "120", "--instances", "3",
		"--strategies", "prefix_aware,kv_aware", "--decisions", "--progress=false"}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	s := out.String()
	if strings.Count(s, "decisions of ") != 1 || !strings.Contains(s, "decisions of kv_aware") {
		t.Fatalf("want one account, of kv_aware:\n%s", s)
	}
	if !strings.Contains(s, "| kv_match | ") {
		t.Fatalf("no kv_match row:\n%s", s)
	}
}

// TestQueueProfile: the queue profile compares the router's predicted time
// to first token with the measured one for requests served from cache,
// by the chosen engine's running requests at the decision, and gives each
// instance's share of all requests.
func TestQueueProfile(t *testing.T) {
	tr := newDecisionTrace(&strategyRouter{})
	tr.recs[1] = decisionRec{reason: "kv_match", running: 0, predicted: 1 * time.Millisecond}
	tr.recs[2] = decisionRec{reason: "kv_match", running: 0, predicted: 3 * time.Millisecond}
	tr.recs[3] = decisionRec{reason: "kv_match", running: 2, waiting: 1, predicted: 5 * time.Millisecond,
		ahead: sim.Backlog{StepLeft: 3 * time.Millisecond, PrefillTokens: 9000}, budget: 8192}
	tr.recs[4] = decisionRec{reason: "heuristic", running: 4} // cold: in the share only
	res := &des.Result{Outcomes: []des.Outcome{
		{ID: 1, Instance: "a", PromptTokens: 1000, CachedTokens: 992, TTFT: 8 * time.Millisecond},
		{ID: 2, Instance: "a", PromptTokens: 1000, CachedTokens: 992, TTFT: 10 * time.Millisecond},
		{ID: 3, Instance: "b", PromptTokens: 1000, CachedTokens: 900, TTFT: 16 * time.Millisecond},
		{ID: 4, Instance: "b", PromptTokens: 1000, TTFT: 50 * time.Millisecond},
	}}
	var out bytes.Buffer
	if err := tr.writeQueueProfile(&out, res); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{
		"| 0 | 2 | 2.0 | 9.0 | 10.0 |",
		"| 1-2 | 1 | 5.0 | 16.0 | 16.0 |",
		"| a | 0.500 | 0.0 | 0.000 | 2.0 | 9.0 | 10.0 |",
		"| b | 0.500 | 3.0 | 0.500 | 5.0 | 16.0 | 16.0 |",
		// Under-predicted by 7 + 7 ms on idle engines and 11 ms behind
		// 9,000 tokens of prompt work: 14/25 and 11/25 of it.
		"| idle | 2 | 0.0 | 0 | 2.0 | 9.0 | 0.56 |",
		"| prompt work > one step's budget | 1 | 3.0 | 9000 | 5.0 | 16.0 | 0.44 |",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("no %q in:\n%s", want, s)
		}
	}
	if strings.Contains(s, "| 3-5 |") {
		t.Errorf("the cold request counted as served from cache:\n%s", s)
	}
}

// TestGapAccount: a request's deficit against the pooled bound is traced to
// the decision that placed its first missing block: still in its prefill
// ("in flight"), or evicted since, compared with the instances' turnover.
func TestGapAccount(t *testing.T) {
	tr := newDecisionTrace(&strategyRouter{})
	const B = sim.DefaultBlockSize
	tr.bound = []int64{0, 0, 4 * B, 4 * B, 2 * B}
	keys := []kvindex.Key{11, 12, 13, 14}
	s := time.Second
	mk := func(id int, now time.Duration) *des.RouteRequest {
		return &des.RouteRequest{Request: &workload.Request{ID: id}, Now: now}
	}
	tr.noteGap(mk(0, 0), keys, 0, "a", "heuristic", false)
	tr.noteGap(mk(1, s), []kvindex.Key{21, 22}, 0, "b", "kv_match", true)
	// Request 2 at 100 s finds nothing held: request 0 placed it on a,
	// finished at 10 s; a turns over in 50 s, b in 200 s.
	tr.life = &lifeTracker{ages: map[string][]time.Duration{"a": fill(50 * s), "b": fill(200 * s)}}
	tr.noteGap(mk(2, 100*s), keys, 0, "b", "heuristic", false)
	// Request 3 at 300 s: older than every turnover, placed by request 2.
	tr.noteGap(mk(3, 300*s), keys, B, "b", "kv_match", false)
	// Request 4 at 1.5 s: request 1 (moved) had not had its first token.
	tr.noteGap(mk(4, 1500*time.Millisecond), []kvindex.Key{21, 22}, 0, "a", "kv_match", false)
	res := &des.Result{Outcomes: []des.Outcome{
		{ID: 0, Arrival: 0, TTFT: s, Finish: 10 * s},
		{ID: 1, Arrival: s, TTFT: 2 * s, Finish: 5 * s},
		{ID: 2, Arrival: 100 * s, TTFT: s, Finish: 110 * s},
		{ID: 3, Arrival: 300 * s, TTFT: s, Finish: 310 * s},
		{ID: 4, Arrival: 1500 * time.Millisecond, TTFT: s, Finish: 9 * s},
	}}
	rows := tr.gapAccount(res)
	got := map[string]int64{}
	for _, r := range rows {
		got[r.Class+"/"+r.Placer] = r.Tokens
	}
	want := map[string]int64{
		"evicted, would outlive it elsewhere/heuristic":                 4 * B,
		"evicted, older than every other instance's turnover/heuristic": 3 * B,
		"in flight/kv_match (moved)":                                    2 * B,
	}
	if len(got) != len(want) {
		t.Fatalf("rows %+v, want %v", rows, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("rows %+v, want %v", rows, want)
		}
	}
}

// TestGapAccountPlacerAndIdle: the deficit goes to the request that placed
// the first block the best holder lacks (not the block before it, placed by
// another), and its idle time runs from that request's end (not its
// arrival): finished at 100 s and read again at 250 s, 150 s idle is within
// b's 200 s turnover; 250 s from its arrival would not be.
func TestGapAccountPlacerAndIdle(t *testing.T) {
	tr := newDecisionTrace(&strategyRouter{})
	const B = sim.DefaultBlockSize
	tr.bound = []int64{0, 0, 3 * B, 0}
	s := time.Second
	mk := func(id int, now time.Duration) *des.RouteRequest {
		return &des.RouteRequest{Request: &workload.Request{ID: id}, Now: now}
	}
	tr.noteGap(mk(0, 0), []kvindex.Key{31}, 0, "a", "heuristic", false)
	tr.noteGap(mk(1, s), []kvindex.Key{32}, 0, "a", "kv_match", true)
	tr.noteGap(mk(3, 2*s), []kvindex.Key{33}, 0, "a", "replicate", false)
	tr.life = &lifeTracker{ages: map[string][]time.Duration{"a": fill(20 * s), "b": fill(200 * s)}}
	// Request 2 finds block 31 still held (best = one block): its first
	// missing block, 32, was placed by request 1 (moved), not request 0
	// (31) nor request 3 (33).
	tr.noteGap(mk(2, 250*s), []kvindex.Key{31, 32, 33}, B, "b", "kv_match", false)
	res := &des.Result{Outcomes: []des.Outcome{
		{ID: 0, Arrival: 0, TTFT: s, Finish: 2 * s},
		{ID: 1, Arrival: s, TTFT: s, Finish: 100 * s},
		{ID: 2, Arrival: 250 * s, TTFT: s, Finish: 260 * s},
		{ID: 3, Arrival: 2 * s, TTFT: s, Finish: 240 * s},
	}}
	rows := tr.gapAccount(res)
	if len(rows) != 1 || rows[0].Class != "evicted, would outlive it elsewhere" || rows[0].Placer != "kv_match (moved)" || rows[0].Tokens != 2*B {
		t.Fatalf("rows %+v, want one: evicted, would outlive it elsewhere / kv_match (moved) / %d tokens", rows, 2*B)
	}
}

func fill(d time.Duration) []time.Duration {
	a := make([]time.Duration, lifeWindow)
	for i := range a {
		a[i] = d
	}
	return a
}

// TestMoveOutcomes: a move off the best holder is followed to the next
// request carrying its context's last whole trace block, and classed by
// that request's idle time against the left holder's and the target's
// turnover; a context nobody reads again is its own class.
func TestMoveOutcomes(t *testing.T) {
	tr := newDecisionTrace(&strategyRouter{})
	s := time.Second
	tr.life = &lifeTracker{ages: map[string][]time.Duration{"h": fill(100 * s), "y": fill(300 * s)}}
	per := workload.TraceBlockTokens / sim.DefaultBlockSize
	ctx := func(base, n int) []kvindex.Key {
		k := make([]kvindex.Key, n)
		for i := range k {
			k[i] = kvindex.Key(base + i)
		}
		return k
	}
	mk := func(id int, now time.Duration) *des.RouteRequest {
		return &des.RouteRequest{Request: &workload.Request{ID: id}, Now: now}
	}
	held := map[string]int{"h": 64, "y": 0}
	pick := func(id int, now time.Duration, keys []kvindex.Key, chosenHeld int) {
		tr.noteMove(mk(id, now), keys, held, 64, chosenHeld, "y")
		tr.noteGap(mk(id, now), keys, 64, "y", "kv_match", chosenHeld < 64)
	}
	a := ctx(1000, per+3) // one whole trace block and a partial one
	pick(0, 0, a, 0)
	pick(1, s, ctx(5000, per), 0) // never read again
	// Request 2 carries a's whole block (not its partial tail) 200 s after
	// request 0 finished: beyond h's 100 s, within y's 300 s.
	pick(2, 210*s, append(ctx(1000, per), ctx(9000, 2)...), 64)
	res := &des.Result{Outcomes: []des.Outcome{
		{ID: 0, TTFT: s, Finish: 10 * s}, {ID: 1, Arrival: s, TTFT: s, Finish: 5 * s},
		{ID: 2, Arrival: 210 * s, TTFT: s, Finish: 215 * s},
	}}
	var out bytes.Buffer
	if err := tr.writeMoveOutcomes(&out, res, 1000); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| beyond the holder's turnover, within the target's (the move kept it) | 1 | 0.0640 |",
		"| no later request read the context | 1 | 0.0640 |",
	} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("want %q in\n%s", want, out.String())
		}
	}
	if len(tr.moves) != 1 {
		t.Fatalf("move account %+v", tr.moves)
	}
}

// TestGapIdentity: the bound's gap closes term by term. A request whose
// prefix was in flight at its decision (no instance held it) but computed
// on the chosen instance by its prefill is served: the in-flight deficit is
// offset by the gained term, so the printed terms sum to bound − hit.
func TestGapIdentity(t *testing.T) {
	tr := newDecisionTrace(&strategyRouter{})
	const B = sim.DefaultBlockSize
	tr.bound = []int64{0, 4 * B, 4 * B, 2 * B}
	tr.recs[0] = decisionRec{reason: "heuristic"}
	tr.recs[1] = decisionRec{reason: "kv_match"}                             // in flight: 4 blocks gained by the prefill
	tr.recs[2] = decisionRec{reason: "kv_match", best: 4 * B, chosen: B}     // moved: 3 blocks lost
	tr.recs[3] = decisionRec{reason: "kv_match", best: 3 * B, chosen: 3 * B} // beyond the bound by one; one evicted since
	res := &des.Result{Outcomes: []des.Outcome{
		{ID: 0, PromptTokens: 5 * B},
		{ID: 1, PromptTokens: 5 * B, CachedTokens: 4 * B},
		{ID: 2, PromptTokens: 5 * B, CachedTokens: B},
		{ID: 3, PromptTokens: 5 * B, CachedTokens: 2 * B},
	}}
	var out bytes.Buffer
	rows, prompt := tr.breakdown(res)
	if err := writeGapIdentity(&out, rows, prompt); err != nil {
		t.Fatal(err)
	}
	// bound 10 blocks, hit 7: 3 = 4 (in flight) − 1 (beyond) + 3 (moved) + 1 (evicted) − 4 (gained).
	for _, want := range []string{
		"| bound − hit | 0.1500 |",
		"| no instance held at the decision (the gap account's all) | 0.2000 |",
		"| − best holders beyond the bound | -0.0500 |",
		"| + moves off the best holder | 0.1500 |",
		"| + held by the chosen instance at the decision, gone by its prefill | 0.0500 |",
		"| − not held at the decision, computed on the chosen instance by its prefill (in flight then) | -0.2000 |",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in:\n%s", want, out.String())
		}
	}
}

// TestInstSetPast64 checks that instances past the 64th have bits of
// their own: "held before" at 128 instances must not mean "held by any
// instance past the 64th".
func TestInstSetPast64(t *testing.T) {
	var tr decisionTrace
	for i := range 128 {
		tr.bit(fmt.Sprintf("i%03d", i))
	}
	var s instSet
	s.add(tr.bit("i064"))
	for i := range 128 {
		id := fmt.Sprintf("i%03d", i)
		if got, want := s.has(tr.bit(id)), i == 64; got != want {
			t.Fatalf("after adding i064, has(%s) = %v, want %v", id, got, want)
		}
	}
	if b := tr.bit("extra-past-all"); b != 127 {
		t.Fatalf("bit of the 129th instance = %d, want 127 (shared with the 128th)", b)
	}
}

// nopWriter is an index writer that keeps nothing.
type nopWriter struct{}

func (nopWriter) Apply(context.Context, string, []events.Event) (kvindex.ApplyResult, error) {
	return kvindex.ApplyResult{}, nil
}
func (nopWriter) Purge(context.Context, string) error { return nil }

// TestLifeTrackerGone: a GPU block removed and not stored since is gone
// (evicted); stored again, it is not; a CPU-tier removal does not count.
func TestLifeTrackerGone(t *testing.T) {
	now := time.Duration(0)
	l := newLifeTracker(nopWriter{}, func() time.Duration { return now })
	apply := func(evs ...events.Event) {
		if _, err := l.Apply(context.Background(), "a", evs); err != nil {
			t.Fatal(err)
		}
	}
	apply(events.Event{Kind: events.BlockStored, BlockHashes: []uint64{1, 2}, Medium: sim.MediumGPU})
	now = time.Second
	apply(events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{1}, Medium: sim.MediumGPU},
		events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{2}, Medium: sim.MediumCPU})
	if _, ok := l.gone["a"][1]; !ok {
		t.Fatal("block 1 removed from GPU: want gone")
	}
	if _, ok := l.gone["a"][2]; ok {
		t.Fatal("block 2 removed from the CPU tier only: want not gone")
	}
	apply(events.Event{Kind: events.BlockStored, BlockHashes: []uint64{1}, Medium: sim.MediumGPU})
	if _, ok := l.gone["a"][1]; ok {
		t.Fatal("block 1 stored again: want not gone")
	}
}
