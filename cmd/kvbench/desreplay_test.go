package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/workload"
)

// TestBoundOfUnsortedTrace: a trace whose lines are not in time order is
// bounded in arrival order, request by request, as it is played.
func TestBoundOfUnsortedTrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "unsorted.jsonl")
	lines := `{"timestamp":1000,"input_length":1000,"output_length":1,"hash_ids":[1,2]}
{"timestamp":0,"input_length":1000,"output_length":1,"hash_ids":[3,4]}
{"timestamp":2000,"input_length":1000,"output_length":1,"hash_ids":[1,2]}
`
	if err := os.WriteFile(path, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	traces := map[string][]workload.TraceRecord{}
	wf := workloadFlags{name: "mooncake", trace: path, speed: 1, replicate: 1, traces: traces}
	ff := fleetFlags{instances: 1, gpuTokens: "1024", cpuTokens: "0", delay: 5 * time.Millisecond}
	s := boundRun(t, wf, ff, "round_robin")
	if s.HitRate > s.Bound+1e-9 {
		t.Fatalf("hit rate %.3f exceeded bound %.3f", s.HitRate, s.Bound)
	}
	if s.Bound == 0 {
		t.Fatalf("bound 0: the third request repeats the first's blocks and fits the cache")
	}
	if got := traces[path][0].Timestamp; got != 1000 {
		t.Fatalf("the trace cache was reordered: first record at %d ms, want 1000 (file order)", got)
	}
}

// spreadSpan is how long copy 0's first arrival epoch takes to arrive
// after --spread: from the first request to the last of the first
// timestamp's records of copy 0 (hash ids of copy 0 are those of the
// original, the first record's first id).
func spreadSpan(t *testing.T, replicate int) time.Duration {
	t.Helper()
	f := workloadFlags{name: "mooncake", trace: workload.DefaultTracePath, speed: 1, replicate: replicate, limit: 200, spread: true}
	b, err := f.buildAll()
	if err != nil {
		t.Fatal(err)
	}
	one := workloadFlags{name: "mooncake", trace: workload.DefaultTracePath, speed: 1, replicate: 1, limit: 200}
	ob, err := one.buildAll()
	if err != nil {
		t.Fatal(err)
	}
	// Copy 0's first epoch: the records at the original's first timestamp.
	first := map[int64]bool{}
	for _, r := range ob.recs {
		if r.Timestamp != ob.recs[0].Timestamp {
			break
		}
		first[r.HashIDs[0]] = true
	}
	var lo, hi time.Duration = -1, 0
	for i, r := range b.recs {
		if len(r.HashIDs) == 0 || !first[r.HashIDs[0]] || r.Timestamp != ob.recs[0].Timestamp {
			continue
		}
		at := b.w.Requests[i].At
		if lo < 0 || at < lo {
			lo = at
		}
		hi = max(hi, at)
	}
	return hi - lo
}

// TestSpreadKeepsBurstUnderReplicate: --spread spreads a copy's epoch over
// the gap to its own next epoch, however many copies play.
func TestSpreadKeepsBurstUnderReplicate(t *testing.T) {
	one, four := spreadSpan(t, 1), spreadSpan(t, 4)
	if one == 0 || four != one {
		t.Fatalf("copy 0's first batch spans %v alone vs %v with --replicate 4", one, four)
	}
}

// TestScaleUnderReplicate: --scale with --replicate N adds and removes 2N
// instances, trace or generated.
func TestScaleUnderReplicate(t *testing.T) {
	for _, name := range []string{"chat", "mooncake"} {
		f := workloadFlags{name: name, seed: 1, trace: workload.DefaultTracePath, speed: 1, replicate: 4, limit: 200, scale: true}
		b, err := f.buildAll()
		if err != nil {
			t.Fatal(err)
		}
		out, in := 0, 0
		for _, ev := range b.w.Fleet {
			switch ev.Kind {
			case workload.ScaleOut:
				out += ev.Instances
			case workload.ScaleIn:
				in += ev.Instances
			}
		}
		if out != 8 || in != 8 {
			t.Errorf("%s --replicate 4 --scale: scale-out %d, scale-in %d instances, want 8 and 8", name, out, in)
		}
	}
}
