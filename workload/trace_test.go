package workload

import (
	"bytes"
	"compress/gzip"
	"errors"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
)

// tracePath is the bundled Mooncake conversation trace; MOONCAKE_TRACE
// overrides it.
func tracePath() string {
	if p := os.Getenv("MOONCAKE_TRACE"); p != "" {
		return p
	}
	return DefaultTracePath
}

var (
	traceOnce sync.Once
	traceRecs []TraceRecord
	traceErr  error
)

func loadTrace(t testing.TB) []TraceRecord {
	t.Helper()
	traceOnce.Do(func() { traceRecs, traceErr = OpenTrace(tracePath()) })
	if traceErr != nil {
		t.Fatalf("reading the Mooncake conversation trace: %v", traceErr)
	}
	return traceRecs
}

func near(got, want, tol float64) bool { return math.Abs(got-want) <= tol }

// TestTraceStatsMatchDATA checks the reader against the statistics in
// the trace's provenance note (traces/README.md) and the statistics
// published with it (conversation column).
func TestTraceStatsMatchDATA(t *testing.T) {
	s := Stats(loadTrace(t))
	tests := []struct {
		name      string
		got, want float64
		tol       float64
	}{
		{"requests", float64(s.Requests), 12031, 0},
		{"duration s", s.DurationSec, 3537.0, 0.05},
		{"rate", s.RatePerSec, 3.40, 0.005},
		{"input mean", s.InputMean, 12035, 0.5},
		{"input median", s.InputMedian, 6909, 0.5},
		{"input p90", s.InputP90, 27367, 0.5},
		{"input min", float64(s.InputMin), 891, 0},
		{"input max", float64(s.InputMax), 126195, 0},
		{"output mean", s.OutputMean, 342.6, 0.05},
		{"output median", s.OutputMedian, 350, 0.5},
		{"output p90", s.OutputP90, 597, 0.5},
		{"output max", float64(s.OutputMax), 2000, 0},
		{"blocks", float64(s.Blocks), 288500, 0},
		{"distinct blocks", float64(s.DistinctBlocks), 182790, 0},
	}
	for _, tc := range tests {
		if !near(tc.got, tc.want, tc.tol) {
			t.Errorf("%s = %v, traces/README.md says %v", tc.name, tc.got, tc.want)
		}
	}
}

// TestBoundsMatchDATA checks the pooled-LRU and infinite bounds against
// traces/README.md's table (3 decimals).
func TestBoundsMatchDATA(t *testing.T) {
	recs := loadTrace(t)
	inf := InfiniteBound(recs)
	if inf.HitBlocks != 105710 || !near(inf.BlockRatio(), 0.366, 0.0005) || !near(inf.TokenRatio(), 0.374, 0.0005) {
		t.Errorf("infinite bound = %d blocks, ratio %.4f / tokens %.4f; traces/README.md: 105,710, 0.366 / 0.374",
			inf.HitBlocks, inf.BlockRatio(), inf.TokenRatio())
	}
	tests := []struct {
		capacity int64
		want     float64
	}{
		{500_000, 0.044}, {1_000_000, 0.053}, {3_000_000, 0.136}, {10_000_000, 0.285}, {50_000_000, 0.364},
	}
	for _, tc := range tests {
		b, err := PooledBound(recs, tc.capacity)
		if err != nil {
			t.Fatal(err)
		}
		if !near(b.BlockRatio(), tc.want, 0.0005) {
			t.Errorf("pooled LRU %d tokens: block ratio %.4f, traces/README.md says %.3f", tc.capacity, b.BlockRatio(), tc.want)
		}
	}
}

func TestTraceReplayShape(t *testing.T) {
	recs := loadTrace(t)
	w, err := TraceReplay{Limit: 300}.Workload(recs)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 300 {
		t.Fatalf("got %d requests", len(w.Requests))
	}
	// Each request is exactly input_length tokens, at its timestamp.
	for i, r := range w.Requests {
		if r.InputTokens() != recs[i].InputLength || r.OutputTokens != recs[i].OutputLength {
			t.Fatalf("request %d: %d/%d tokens, trace %d/%d", i, r.InputTokens(), r.OutputTokens, recs[i].InputLength, recs[i].OutputLength)
		}
		if want := recs[i].Timestamp - recs[0].Timestamp; r.At.Milliseconds() != want {
			t.Fatalf("request %d at %v, want %d ms", i, r.At, want)
		}
	}
	// Equal leading hash ids mean equal leading tokens, and the first
	// differing id means different tokens from there on.
	a, b := recs[0], recs[1]
	common := 0
	for common < min(len(a.HashIDs), len(b.HashIDs)) && a.HashIDs[common] == b.HashIDs[common] {
		common++
	}
	ta, tb := w.Requests[0].Tokens(), w.Requests[1].Tokens()
	shared := 0
	for shared < min(len(ta), len(tb)) && ta[shared] == tb[shared] {
		shared++
	}
	if shared < common*TraceBlockTokens || shared > common*TraceBlockTokens+4 {
		t.Errorf("requests 0 and 1 share %d ids but %d tokens", common, shared)
	}
	// Speed 2 halves the timeline.
	w2, err := TraceReplay{Limit: 300, Speed: 2}.Workload(recs)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := w2.Duration(), w.Duration()/2; got != want {
		t.Errorf("speed 2 duration %v, want %v", got, want)
	}
}

func TestReadTraceErrors(t *testing.T) {
	tests := []struct {
		name, in string
		wantN    int
		wantErr  string
	}{
		{"ok", `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}` + "\n\n", 1, ""},
		{"not json", "{\n", 0, "line 1"},
		{"negative ts", `{"timestamp": -1, "input_length": 10, "output_length": 5, "hash_ids": [0]}`, 0, "timestamp"},
		{"too few ids", `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0]}`, 0, "exceeds"},
		{"too many ids", `{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0, 1]}`, 0, "beyond"},
		{"no ids", `{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": []}`, 0, "no hash_ids"},
		{"zero input", `{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": [1]}`, 0, "input_length"},
		{"second line bad", `{"timestamp": 0, "input_length": 1, "output_length": 5, "hash_ids": [1]}` + "\n" + `{"timestamp": "x"}`, 0, "line 2"},
		{"negative fraction", `{"timestamp": -0.4, "input_length": 10, "output_length": 5, "hash_ids": [0]}`, 0, "negative timestamp"},
		{"timestamp past range", `{"timestamp": 1e300, "input_length": 10, "output_length": 5, "hash_ids": [0]}`, 0, "past"},
		{"integer past range", `{"timestamp": 9223372036854775807, "input_length": 10, "output_length": 5, "hash_ids": [0]}`, 0, "past"},
		{"timestamp a string", `{"timestamp": "12", "input_length": 10, "output_length": 5, "hash_ids": [0]}`, 0, "line 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			recs, err := ReadTrace(strings.NewReader(tc.in))
			if tc.wantErr == "" {
				if err != nil || len(recs) != tc.wantN {
					t.Fatalf("got %d records, err %v", len(recs), err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid mentioning %q", err, tc.wantErr)
			}
		})
	}
}

// A timestamp with a fraction of a millisecond, or in exponent form, is
// read to the nearest millisecond; a missing one is the start.
func TestReadTraceFractionalTimestamps(t *testing.T) {
	in := `{"timestamp": 457.159, "input_length": 10, "output_length": 5, "hash_ids": [0]}
{"timestamp": 1.5e3, "input_length": 10, "output_length": 5, "hash_ids": [0]}
{"timestamp": 2000.5, "input_length": 10, "output_length": 5, "hash_ids": [0]}
{"timestamp": 7, "input_length": 10, "output_length": 5, "hash_ids": [0]}
{"input_length": 10, "output_length": 5, "hash_ids": [0]}
`
	recs, err := ReadTrace(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, r := range recs {
		got = append(got, r.Timestamp)
	}
	if want := []int64{457, 1500, 2001, 7, 0}; !slices.Equal(got, want) {
		t.Fatalf("timestamps %v, want %v", got, want)
	}
}

// A record of no output, 0 or none given, is replayed asking one token
// (its prompt still prefills, and engines refuse a request for none).
func TestTraceReplayNoOutput(t *testing.T) {
	in := `{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [0]}
{"timestamp": 1, "input_length": 10, "hash_ids": [0]}
{"timestamp": 2, "input_length": 10, "output_length": 9, "hash_ids": [0]}
`
	recs, err := ReadTrace(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	w, err := TraceReplay{}.Workload(recs)
	if err != nil {
		t.Fatal(err)
	}
	var got []int
	for _, r := range w.Requests {
		got = append(got, r.OutputTokens)
	}
	if want := []int{1, 1, 9}; !slices.Equal(got, want) {
		t.Fatalf("output tokens %v, want %v", got, want)
	}
}

func TestReadTraceGzip(t *testing.T) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write([]byte(`{"timestamp": 5, "input_length": 513, "output_length": 5, "hash_ids": [7, 8]}` + "\n"))
	zw.Close()
	recs, err := ReadTrace(&buf)
	if err != nil || len(recs) != 1 || recs[0].HashIDs[1] != 8 {
		t.Fatalf("recs %+v err %v", recs, err)
	}
}

func TestPooledBoundSmall(t *testing.T) {
	rec := func(ids ...int64) TraceRecord {
		return TraceRecord{InputLength: len(ids) * TraceBlockTokens, HashIDs: ids}
	}
	recs := []TraceRecord{rec(0, 1, 2), rec(0, 1, 3), rec(4), rec(0, 1, 2)}
	tests := []struct {
		capBlocks int64
		wantHits  int64
	}{
		{0, 2 + 0 + 3}, // infinite: 0,1 then 0,1,2
		{3, 2 + 0 + 0}, // after rec(4) the LRU holds 4,3,1: 0 evicted, so the last request misses at block 0
		{5, 2 + 0 + 3}, // 5 blocks: 0,1,2,3,4 all fit
		{1, 0 + 0 + 0}, // one block: only the last touched id survives
		{4, 2 + 0 + 2}, // holds 4,3,1,0 → 0,1 hit, 2 evicted
	}
	for _, tc := range tests {
		b, err := PooledBound(recs, tc.capBlocks*TraceBlockTokens)
		if err != nil {
			t.Fatal(err)
		}
		if b.HitBlocks != tc.wantHits || b.Blocks != 10 {
			t.Errorf("capacity %d blocks: %d hits of %d, want %d of 10", tc.capBlocks, b.HitBlocks, b.Blocks, tc.wantHits)
		}
	}
	if _, err := PooledBound(recs, 100); !errors.Is(err, ErrInvalid) {
		t.Errorf("sub-block capacity: err %v", err)
	}
}

func FuzzReadTrace(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}`))
	f.Add([]byte("{\"timestamp\": 1}\n\n{}"))
	f.Add([]byte{0x1f, 0x8b, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		recs, err := ReadTrace(bytes.NewReader(data))
		if err != nil {
			return
		}
		w, err := TraceReplay{}.Workload(recs)
		if err != nil {
			t.Fatalf("records the reader accepted were refused: %v", err)
		}
		for i, r := range w.Requests {
			if r.InputTokens() <= 0 {
				t.Fatalf("request %d has %d tokens", i, r.InputTokens())
			}
		}
		if _, err := PooledBound(recs, 1024); err != nil {
			t.Fatal(err)
		}
	})
}

func BenchmarkPooledBound(b *testing.B) {
	recs := loadTrace(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := PooledBound(recs, 10_000_000); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(recs)), "ns/request")
}

// TestBuiltinTrace: the bundled trace opens by name, an unknown bundled
// name is an error, and a real file still opens by path.
func TestBuiltinTrace(t *testing.T) {
	recs, err := OpenTrace(DefaultTracePath)
	if err != nil || len(recs) != 12031 {
		t.Fatalf("bundled trace: %d records, %v", len(recs), err)
	}
	if _, err := OpenTrace("builtin:nope.jsonl"); err == nil || !strings.Contains(err.Error(), "no bundled trace") {
		t.Errorf("unknown bundled trace: %v", err)
	}
	p := t.TempDir() + "/t.jsonl"
	if err := os.WriteFile(p, []byte(`{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[7]}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if recs, err := OpenTrace(p); err != nil || len(recs) != 1 || recs[0].HashIDs[0] != 7 {
		t.Errorf("file trace: %v, %v", recs, err)
	}
}

// TestRequestsBound: generated requests are cut into whole blocks named by
// their prefix, so a shared prefix hits up to its last whole block, a
// partial block never hits, nor the block holding the last token, and a
// different first segment shares nothing.
func TestRequestsBound(t *testing.T) {
	req := func(segs ...Segment) Request { return Request{Prompt: segs} }
	sys := Segment{Seed: 7, Len: 40} // 2 whole 16-token blocks + 8 tokens
	reqs := []Request{
		req(sys, Segment{Seed: 1, Len: 24}), // 64 tokens, 4 blocks: cold
		req(sys, Segment{Seed: 2, Len: 24}), // shares blocks 0,1 (block 2 mixes sys's tail with seed 2)
		req(sys, Segment{Seed: 1, Len: 24}), // the first again: 3 blocks, the last recomputed
		req(Segment{Seed: 8, Len: 40}),      // another prefix: nothing
		req(Segment{Seed: 7, Len: 15}),      // under one block: never a hit
	}
	b, hits, err := RequestsBoundPerRequest(reqs, 16, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	want := []int64{0, 32, 48, 0, 0}
	for i := range want {
		if hits[i] != want[i] {
			t.Errorf("request %d: %d hit tokens, want %d", i, hits[i], want[i])
		}
	}
	if b.HitTokens != 80 || b.InputTokens != 64*3+40+15 {
		t.Errorf("bound %+v", b)
	}
	// A one-block cache keeps only the last block touched.
	if _, hits, _ = RequestsBoundPerRequest(reqs, 16, 16, false); hits[1] != 0 || hits[2] != 0 {
		t.Errorf("one-block cache: hits %v", hits)
	}
	if _, _, err := RequestsBoundPerRequest(reqs, 0, 0, false); !errors.Is(err, ErrInvalid) {
		t.Errorf("block size 0: err %v", err)
	}
	if _, _, err := RequestsBoundPerRequest(reqs, 16, 8, false); !errors.Is(err, ErrInvalid) {
		t.Errorf("sub-block capacity: err %v", err)
	}
}
