package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

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
