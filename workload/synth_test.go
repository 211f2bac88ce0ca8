package workload

import (
	"errors"
	"math"
	"os"
	"reflect"
	"sort"
	"testing"
	"time"
)

func rel(got, want float64) float64 { return math.Abs(got-want) / math.Abs(want) }

// TestSynthCalibrated: a trace drawn from the conversation trace's fitted
// profile has the original's rate, burst size, lengths, follow-up share
// and cache-hit bounds, within sampling noise.
func TestSynthCalibrated(t *testing.T) {
	recs := loadTrace(t)
	orig, err := Fit(recs)
	if err != nil {
		t.Fatal(err)
	}
	syn, err := Synthesise(recs, "calibrated", nil, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Fit(syn)
	if err != nil {
		t.Fatal(err)
	}
	so, ss := Stats(recs), Stats(syn)
	pbo, _ := PooledBound(recs, 10_800_000)
	pbs, _ := PooledBound(syn, 10_800_000)
	checks := []struct {
		name      string
		got, want float64
		tol       float64 // relative
	}{
		{"requests", float64(ss.Requests), float64(so.Requests), 0},
		{"rate", ss.RatePerSec, so.RatePerSec, 0.03},
		{"requests per burst", got.Batch.Mean(), orig.Batch.Mean(), 0.05},
		{"input mean", ss.InputMean, so.InputMean, 0.06},
		{"input median", ss.InputMedian, so.InputMedian, 0.06},
		{"output mean", ss.OutputMean, so.OutputMean, 0.03},
		{"follow-up share", got.FollowUp, orig.FollowUp, 0.08},
		// Fit tells turns apart by hash ids alone, so a little of either
		// kind is misread both in the original and in the synthesised trace.
		{"first-turn length", got.FirstLen.Mean(), orig.FirstLen.Mean(), 0.08},
		{"infinite-cache hit rate", InfiniteBound(syn).TokenRatio(), InfiniteBound(recs).TokenRatio(), 0.12},
		{"pooled 10.8M hit rate", pbs.TokenRatio(), pbo.TokenRatio(), 0.08},
	}
	for _, c := range checks {
		if rel(c.got, c.want) > c.tol {
			t.Errorf("%s: synthesised %.4g, original %.4g (tolerance %.0f%%)", c.name, c.got, c.want, 100*c.tol)
		}
	}
	if len(got.RootWeights) != 1 || syn[0].HashIDs[0] != 0 {
		t.Errorf("the conversation trace has one root; synthesised %d", len(got.RootWeights))
	}
	for i := 1; i < len(syn); i++ {
		if syn[i].Timestamp < syn[i-1].Timestamp {
			t.Fatalf("record %d goes back in time", i)
		}
	}
}

// TestSynthShapes: each named shape moves the profile along its axes.
func TestSynthShapes(t *testing.T) {
	recs := loadTrace(t)[:4000]
	base, err := Fit(recs)
	if err != nil {
		t.Fatal(err)
	}
	fit := func(shape string) SynthProfile {
		syn, err := Synthesise(recs, shape, nil, 0, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(syn) != len(recs) {
			t.Fatalf("%s: %d records", shape, len(syn))
		}
		p, err := Fit(syn)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	sp := fit("shared-prompts")
	if len(sp.RootWeights) < 48 || sp.RootDepth.Mean() < 3*base.RootDepth.Mean() {
		t.Errorf("shared-prompts: %d roots, depth %.2f (base %d, %.2f)", len(sp.RootWeights), sp.RootDepth.Mean(), len(base.RootWeights), base.RootDepth.Mean())
	}
	if sp.Batch.Mean() > 1.3 || rel(sp.meanRate(), base.meanRate()) > 0.08 {
		t.Errorf("shared-prompts: %.2f per epoch at %.2f req/s; want Poisson at %.2f", sp.Batch.Mean(), sp.meanRate(), base.meanRate())
	}
	// Follow-ups: the shape sets the probability that a request has a next
	// turn. (Fit cannot measure it back on this shape: a first turn that
	// extends the whole of a deep shared prompt reads as a follow-up of the
	// request that first computed that prompt.)
	if p, _ := SynthShapes["shared-prompts"].Apply(base); rel(p.FollowUp, base.FollowUp/2) > 1e-9 {
		t.Errorf("shared-prompts: follow-up %.3f, want half of %.3f", p.FollowUp, base.FollowUp)
	}
	bl := fit("bursty-long")
	if r := bl.Batch.Mean() / base.Batch.Mean(); r < 3.4 || r > 4.6 {
		t.Errorf("bursty-long: bursts %.1f× the base, want 4×", r)
	}
	if r := bl.FirstLen.Mean() / base.FirstLen.Mean(); r < 1.35 || r > 1.65 {
		t.Errorf("bursty-long: first turns %.2f× longer, want 1.5×", r)
	}
	// 0.6 of requests schedule a next turn; those that would pass the
	// longest prompt measured, or fall after the trace's end, do not happen.
	if bl.FollowUp < 0.45 || bl.FollowUp > 0.6 {
		t.Errorf("bursty-long: follow-up %.3f, want a little under 0.6", bl.FollowUp)
	}
}

func TestSynthDeterministicAndErrors(t *testing.T) {
	recs := loadTrace(t)[:1500]
	a, _ := Synthesise(recs, "bursty-long", nil, 500, 7)
	b, _ := Synthesise(recs, "bursty-long", nil, 500, 7)
	c, _ := Synthesise(recs, "bursty-long", nil, 500, 8)
	if !reflect.DeepEqual(a, b) || reflect.DeepEqual(a, c) || len(a) != 500 {
		t.Errorf("same seed must give the same trace, another seed another (%d records)", len(a))
	}
	for _, r := range a {
		if err := r.validate(); err != nil {
			t.Fatalf("synthesised record invalid: %v", err)
		}
	}
	if _, err := Synthesise(recs, "nope", nil, 0, 1); !errors.Is(err, ErrInvalid) {
		t.Errorf("unknown shape: %v", err)
	}
	if _, err := Fit(recs[:1]); !errors.Is(err, ErrInvalid) {
		t.Errorf("one record: %v", err)
	}
	if _, err := (SynthShape{Name: "x", BurstScale: -1}).Apply(SynthProfile{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("negative scale: %v", err)
	}
}

// TestReplicateTrace: N copies share no block, keep the original's hit
// bounds per copy, arrive in order, and each is shifted by under one gap.
func TestReplicateTrace(t *testing.T) {
	recs := loadTrace(t)[:2000]
	rep, err := ReplicateTrace(recs, 4)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep) != 4*len(recs) {
		t.Fatalf("%d records", len(rep))
	}
	if !sort.SliceIsSorted(rep, func(i, j int) bool { return rep[i].Timestamp < rep[j].Timestamp }) {
		t.Error("not sorted by time")
	}
	if got, want := InfiniteBound(rep).TokenRatio(), InfiniteBound(recs).TokenRatio(); math.Abs(got-want) > 1e-12 {
		t.Errorf("infinite bound %.6f, original %.6f", got, want)
	}
	p1, _ := PooledBound(recs, 10_800_000)
	p4, _ := PooledBound(rep, 4*10_800_000)
	if math.Abs(p1.TokenRatio()-p4.TokenRatio()) > 0.01 {
		t.Errorf("pooled bound of 4 copies on 4× the cache %.4f, original %.4f", p4.TokenRatio(), p1.TokenRatio())
	}
	span := rep[len(rep)-1].Timestamp - recs[len(recs)-1].Timestamp
	if span < 0 || span >= 3000 {
		t.Errorf("last copy ends %d ms after the original: want within one gap (3 s)", span)
	}
	if _, err := ReplicateTrace(recs, 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("replicate 0: %v", err)
	}
}

func TestReplicateWorkload(t *testing.T) {
	w, err := MultiTenant{Requests: 200}.Generate(3)
	if err != nil {
		t.Fatal(err)
	}
	w.Fleet = []FleetEvent{{At: time.Second, Kind: ScaleOut, Instances: 2}}
	rep, err := Replicate(w, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Requests) != 600 || rep.Fleet[0].Instances != 6 {
		t.Fatalf("%d requests, fleet %+v", len(rep.Requests), rep.Fleet)
	}
	// Copies share no first-segment seed and no tenant key.
	seeds := map[uint64]map[string]bool{}
	for _, r := range rep.Requests {
		copyOf := "r0"
		if len(r.Tenant) > 2 && r.Tenant[0] == 'r' && r.Tenant[2] == '/' {
			copyOf = r.Tenant[:2]
		}
		if seeds[r.Prompt[0].Seed] == nil {
			seeds[r.Prompt[0].Seed] = map[string]bool{}
		}
		seeds[r.Prompt[0].Seed][copyOf] = true
	}
	for s, copies := range seeds {
		if len(copies) != 1 {
			t.Errorf("seed %x shared by copies %v", s, copies)
		}
	}
	if _, err := Replicate(&Workload{ClosedLoop: 2}, 2); !errors.Is(err, ErrInvalid) {
		t.Errorf("closed loop: %v", err)
	}
}

// TestParseSynthShapes: shapes from a file draw like the built-in ones
// (the probe file's bursty shape makes bursts as a built-in shape with the
// same fields does), and every kind of bad file is refused with
// ErrInvalid rather than partly read.
func TestParseSynthShapes(t *testing.T) {
	shapes, err := ParseSynthShapes([]byte(`{"wave": {"burst_scale": 4, "length_scale": 1.5, "follow_up": 0.6}, "deep-2": {"roots": 4, "min_root_depth": 64}}`))
	if err != nil {
		t.Fatal(err)
	}
	if len(shapes) != 2 || shapes["wave"].Name != "wave" || shapes["deep-2"].MinRootDepth != 64 {
		t.Fatalf("shapes %+v", shapes)
	}
	recs := loadTrace(t)[:1500]
	// The same fields as the built-in bursty-long: the same trace.
	got, err := Synthesise(recs, "wave", shapes, 300, 3)
	if err != nil {
		t.Fatal(err)
	}
	want, err := Synthesise(recs, "bursty-long", nil, 300, 3)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Error("a file shape with bursty-long's fields drew another trace")
	}
	deep, err := Synthesise(recs, "deep-2", shapes, 300, 3)
	if err != nil {
		t.Fatal(err)
	}
	roots := map[int64]bool{}
	for _, r := range deep {
		roots[r.HashIDs[0]] = true
	}
	if len(roots) > 4 {
		t.Errorf("deep-2: %d distinct first blocks, want at most 4 roots", len(roots))
	}
	for _, bad := range []string{
		``, `[]`, `{"x": 1}`, `{"x": {"burst": 2}}`, `{"x": {"burst_scale": -1}}`,
		`{"x": {"follow_up": 0.99}}`, `{"x": {"roots": 2000000}}`, `{"x": {"min_root_depth": 300}}`, `{"x": {"burst_scale": 65}}`, `{"x": {"root_zipf": 1e9}}`,
		`{"X": {}}`, `{"": {}}`, `{"bursty-long": {}}`, `{"x": {"name": "y"}}`, `{"x": {}} {"y": {}}`,
		`{"x": {}} ]`, `{"x": {}} }`, `null`, `{}`, `{"x": null}`, `{"x": {"burst_scale": 2}, "x": {"roots": 3}}`,
		`{"x": {"BURST_SCALE": 2}}`, `{"x": {"burst_scale": 2, "burst_scale": 3}}`, `{"x": {"root_zipf": 1.2}}`,
	} {
		if _, err := ParseSynthShapes([]byte(bad)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%q: err %v, want ErrInvalid", bad, err)
		}
	}
}

// FuzzParseSynthShapes: whatever the file, the parser errs or returns
// shapes that validate and draw a trace of the asked size.
func FuzzParseSynthShapes(f *testing.F) {
	f.Add([]byte(`{"a": {"burst_scale": 8, "follow_up": 0.8}}`))
	f.Add([]byte(`{"b": {"roots": 16, "root_zipf": 1.2, "min_root_depth": 32, "poisson": true}}`))
	f.Add([]byte(`{"c": {"follow_up": -1, "length_scale": 0}}`))
	probe, err := os.ReadFile("../docs/benchmarks/shapes-probe.json")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(probe)
	prof, err := Fit(loadTrace(f)[:400])
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		shapes, err := ParseSynthShapes(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error without ErrInvalid: %v", err)
			}
			return
		}
		for name, s := range shapes {
			if s.Name != name || s.Validate() != nil {
				t.Fatalf("shape %q accepted but invalid: %+v", name, s)
			}
			p, err := s.Apply(prof)
			if err != nil {
				t.Fatalf("shape %q accepted but not applied: %v", name, err)
			}
			syn, err := p.Generate(50, 1)
			if err != nil || len(syn) != 50 {
				t.Fatalf("shape %q: %d records, want 50: %v", name, len(syn), err)
			}
			for _, r := range syn {
				if err := r.validate(); err != nil {
					t.Fatalf("shape %q drew an invalid record: %v", name, err)
				}
			}
		}
	})
}
