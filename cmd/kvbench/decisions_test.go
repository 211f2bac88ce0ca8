package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
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
	tr.recs[3] = decisionRec{reason: "kv_match", running: 2, waiting: 1, predicted: 5 * time.Millisecond}
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
	} {
		if !strings.Contains(s, want) {
			t.Errorf("no %q in:\n%s", want, s)
		}
	}
	if strings.Contains(s, "| 3-5 |") {
		t.Errorf("the cold request counted as served from cache:\n%s", s)
	}
}
