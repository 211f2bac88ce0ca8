package workload

import (
	"bytes"
	"container/heap"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"reflect"
	"sort"
	"strings"
)

// A trace synthesiser: Fit measures a Mooncake-format trace's shape — its
// prefix tree, lengths, arrival burstiness and multi-turn order — as a
// SynthProfile, and SynthProfile.Generate draws new traces with that
// shape (same format, fresh hash ids), so routing can be tested on many
// workloads of a known kind rather than on one recording. A SynthShape
// moves a fitted profile along one axis at a time (deeper or shallower
// shared prefixes, more or fewer of them, burstier arrivals, longer
// prompts, more or fewer follow-up turns), keeping everything else as
// measured.
//
// The model. Requests arrive in epochs (distinct arrival times): the gap
// between epochs and the number of requests per epoch are drawn from the
// trace's own distributions, so a trace quantised to 3 s in bursts of ten
// stays so, and a Poisson trace stays Poisson. Each request is either a
// follow-up turn of an earlier request or the first turn of a
// conversation:
//
//   - a first turn picks a root (a shared prompt: the trace's distinct
//     first blocks, with their measured popularity) and shares the root's
//     first d blocks, d drawn from the measured shared depth of first
//     turns; the rest of its prompt (its length drawn from first-turn
//     lengths) is new;
//   - each request schedules, with the measured follow-up probability, a
//     next turn after a delay drawn from the measured turn gaps; that turn
//     carries every full block of its parent's prompt and appends new
//     tokens (drawn from the measured appends), as a chat history does. A
//     turn that would exceed the longest prompt measured ends the
//     conversation.
//
// Output lengths are drawn from the measured output lengths.

// Empirical is a distribution given by its quantiles (inverse-CDF sampling
// with linear interpolation between them).
type Empirical struct {
	// Q are the values at evenly spaced probabilities 0, 1/(n-1), ..., 1.
	Q []float64 `json:"q"`
}

// empiricalQuantiles is the resolution of a fitted Empirical: 1/200 of
// probability per step resolves the p99 and the tail beyond it.
const empiricalQuantiles = 201

// newEmpirical summarises values (nil for none).
func newEmpirical(vals []float64) Empirical {
	if len(vals) == 0 {
		return Empirical{}
	}
	s := append([]float64(nil), vals...)
	sort.Float64s(s)
	q := make([]float64, empiricalQuantiles)
	for i := range q {
		q[i] = Quantile(s, float64(i)/float64(len(q)-1))
	}
	return Empirical{Q: q}
}

// Sample draws a value (0 for an empty distribution).
func (e Empirical) Sample(rng *rand.Rand) float64 {
	if len(e.Q) == 0 {
		return 0
	}
	if len(e.Q) == 1 {
		return e.Q[0]
	}
	pos := rng.Float64() * float64(len(e.Q)-1)
	i := int(pos)
	return e.Q[i] + (pos-float64(i))*(e.Q[i+1]-e.Q[i])
}

// Mean of the distribution (trapezoids between quantiles).
func (e Empirical) Mean() float64 {
	if len(e.Q) < 2 {
		if len(e.Q) == 1 {
			return e.Q[0]
		}
		return 0
	}
	t := 0.0
	for i := 1; i < len(e.Q); i++ {
		t += (e.Q[i-1] + e.Q[i]) / 2
	}
	return t / float64(len(e.Q)-1)
}

func (e Empirical) scaled(f float64) Empirical {
	out := Empirical{Q: make([]float64, len(e.Q))}
	for i, v := range e.Q {
		out.Q[i] = v * f
	}
	return out
}

// SynthProfile is a trace's shape, as Fit measures it.
type SynthProfile struct {
	// EpochGapMs: time between consecutive distinct arrival times, ms.
	EpochGapMs Empirical `json:"epoch_gap_ms"`
	// Batch: requests per distinct arrival time.
	Batch Empirical `json:"batch"`
	// RootWeights: popularity of each root (a distinct first block among
	// first turns), most popular first; RootDepth: blocks a first turn
	// shares with its root's chain (at least 1).
	RootWeights []float64 `json:"root_weights"`
	RootDepth   Empirical `json:"root_depth"`
	// FirstLen: input tokens of first turns.
	FirstLen Empirical `json:"first_len"`
	// FollowUp: probability that a request has a next turn; TurnGapMs: its
	// delay after the previous turn's arrival; TurnAppend: tokens a turn
	// adds to its parent's full blocks.
	FollowUp   float64   `json:"follow_up"`
	TurnGapMs  Empirical `json:"turn_gap_ms"`
	TurnAppend Empirical `json:"turn_append"`
	// MaxInput: the longest prompt (tokens); Output: output tokens.
	MaxInput int       `json:"max_input"`
	Output   Empirical `json:"output"`
	// Requests in the trace fitted (Generate's default count).
	Requests int `json:"requests"`
}

// maxRoots bounds the roots a profile keeps (the rest share the last
// weight's tail): popularity beyond the thousandth prefix is noise.
const maxRoots = 1000

// Fit measures a trace's shape. A request is a follow-up turn of an
// earlier one (its parent) when its leading blocks contain every full
// block of the parent's prompt, the last of them the parent's own — the
// parent's last block, partial in a chat history, changes as the next
// turn appends to it; otherwise it is a
// first turn, whose leading blocks already seen are its shared depth.
func Fit(recs []TraceRecord) (SynthProfile, error) {
	if len(recs) < 2 {
		return SynthProfile{}, fmt.Errorf("%w: fit: need at least 2 records, have %d", ErrInvalid, len(recs))
	}
	for i := range recs {
		if err := recs[i].validate(); err != nil {
			return SynthProfile{}, fmt.Errorf("fit: record %d: %w", i, err)
		}
	}
	order := make([]int, len(recs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return recs[order[a]].Timestamp < recs[order[b]].Timestamp })

	p := SynthProfile{Requests: len(recs)}
	var gaps, batch, depth, first, turnGap, appendTok, out []float64
	seen := map[int64]struct{}{}
	// endsAt[id]: the latest request whose last full block is id.
	endsAt := map[int64]int{}
	roots := map[int64]int{}
	follow := 0
	prevT, n := recs[order[0]].Timestamp, 0
	for _, i := range order {
		r := &recs[i]
		if r.Timestamp != prevT {
			gaps = append(gaps, float64(r.Timestamp-prevT))
			batch = append(batch, float64(n))
			prevT, n = r.Timestamp, 0
		}
		n++
		out = append(out, float64(r.OutputLength))
		p.MaxInput = max(p.MaxInput, r.InputLength)
		m := 0
		for _, h := range r.HashIDs {
			if _, ok := seen[h]; !ok {
				break
			}
			m++
		}
		parent := -1
		for k := m; k >= 1 && parent < 0; k-- {
			if j, ok := endsAt[r.HashIDs[k-1]]; ok && fullBlocks(&recs[j]) == k {
				parent = j
			}
		}
		if parent >= 0 {
			follow++
			turnGap = append(turnGap, float64(r.Timestamp-recs[parent].Timestamp))
			appendTok = append(appendTok, float64(r.InputLength-fullBlocks(&recs[parent])*TraceBlockTokens))
		} else {
			roots[r.HashIDs[0]]++
			depth = append(depth, float64(max(m, 1)))
			first = append(first, float64(r.InputLength))
		}
		for _, h := range r.HashIDs {
			seen[h] = struct{}{}
		}
		if fb := fullBlocks(r); fb > m {
			// Only a prompt whose last full block is its own (new when it
			// arrived) can be a parent: one that ends inside a shared
			// prefix is indistinguishable from that prefix.
			endsAt[r.HashIDs[fb-1]] = i
		}
	}
	batch = append(batch, float64(n))
	if len(gaps) == 0 {
		gaps = []float64{0}
	}
	p.EpochGapMs, p.Batch = newEmpirical(gaps), newEmpirical(batch)
	p.RootDepth, p.FirstLen, p.Output = newEmpirical(depth), newEmpirical(first), newEmpirical(out)
	p.TurnGapMs, p.TurnAppend = newEmpirical(turnGap), newEmpirical(appendTok)
	// Followed requests over all requests: each follow-up has one parent.
	p.FollowUp = float64(follow) / float64(len(recs))
	counts := make([]float64, 0, len(roots))
	for _, c := range roots {
		counts = append(counts, float64(c))
	}
	sort.Sort(sort.Reverse(sort.Float64Slice(counts)))
	if len(counts) > maxRoots {
		tail := 0.0
		for _, c := range counts[maxRoots-1:] {
			tail += c
		}
		counts = append(counts[:maxRoots-1], tail)
	}
	p.RootWeights = counts
	return p, nil
}

// fullBlocks is the number of the record's blocks that are whole 512-token
// blocks.
func fullBlocks(r *TraceRecord) int { return r.InputLength / TraceBlockTokens }

// SynthShape moves a fitted profile along named axes; zero fields keep
// the profile's value.
type SynthShape struct {
	// Name of the shape (reports).
	Name string `json:"name"`
	// DepthScale multiplies the shared depth of first turns (deeper shared
	// system prompts or documents).
	DepthScale float64 `json:"depth_scale,omitempty"`
	// MinRootDepth raises every first turn's shared depth to at least this
	// many blocks (e.g. a long fixed system prompt per root).
	MinRootDepth int `json:"min_root_depth,omitempty"`
	// Roots replaces the roots by this many, with Zipf popularity of
	// exponent RootZipf (default 1).
	Roots    int     `json:"roots,omitempty"`
	RootZipf float64 `json:"root_zipf,omitempty"`
	// BurstScale multiplies requests per arrival epoch and the gap between
	// epochs alike: the same mean rate in bursts BurstScale times larger.
	BurstScale float64 `json:"burst_scale,omitempty"`
	// Poisson replaces the arrival epochs by a Poisson process at the
	// profile's mean rate (one request per epoch).
	Poisson bool `json:"poisson,omitempty"`
	// LengthScale multiplies first-turn lengths and turn appends.
	LengthScale float64 `json:"length_scale,omitempty"`
	// FollowUp replaces the follow-up probability (negative = 0);
	// FollowUpScale multiplies it.
	FollowUp      float64 `json:"follow_up,omitempty"`
	FollowUpScale float64 `json:"follow_up_scale,omitempty"`
}

// Apply returns the profile moved by the shape.
func (s SynthShape) Apply(p SynthProfile) (SynthProfile, error) {
	if err := s.Validate(); err != nil {
		return p, err
	}
	if s.DepthScale > 0 {
		p.RootDepth = p.RootDepth.scaled(s.DepthScale)
	}
	if s.MinRootDepth > 0 {
		q := Empirical{Q: make([]float64, len(p.RootDepth.Q))}
		for i, v := range p.RootDepth.Q {
			q.Q[i] = max(v, float64(s.MinRootDepth))
		}
		p.RootDepth = q
	}
	if s.Roots > 0 {
		z := s.RootZipf
		if z == 0 {
			z = 1
		}
		p.RootWeights = make([]float64, s.Roots)
		for i := range p.RootWeights {
			p.RootWeights[i] = math.Pow(float64(i+1), -z)
		}
	}
	if s.Poisson {
		rate := p.meanRate()
		// Exponential gaps of mean 1/rate, as quantiles; one request each.
		q := make([]float64, empiricalQuantiles)
		for i := range q {
			u := float64(i) / float64(len(q)-1)
			q[i] = -math.Log(1-min(u, 0.9999)) * 1000 / rate
		}
		p.EpochGapMs, p.Batch = Empirical{Q: q}, Empirical{Q: []float64{1}}
	}
	if s.BurstScale > 0 {
		p.EpochGapMs, p.Batch = p.EpochGapMs.scaled(s.BurstScale), p.Batch.scaled(s.BurstScale)
	}
	if s.LengthScale > 0 {
		p.FirstLen, p.TurnAppend = p.FirstLen.scaled(s.LengthScale), p.TurnAppend.scaled(s.LengthScale)
	}
	switch {
	case s.FollowUp < 0:
		p.FollowUp = 0
	case s.FollowUp > 0:
		p.FollowUp = s.FollowUp
	}
	if s.FollowUpScale > 0 {
		p.FollowUp = min(p.FollowUp*s.FollowUpScale, 0.95)
	}
	return p, nil
}

// Validate reports a shape whose values Apply cannot use.
func (s SynthShape) Validate() error {
	for _, v := range []float64{s.DepthScale, s.RootZipf, s.BurstScale, s.LengthScale, s.FollowUpScale} {
		if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%w: synth shape %q: scales must be finite and >= 0", ErrInvalid, s.Name)
		}
	}
	if s.Roots < 0 || s.MinRootDepth < 0 || s.FollowUp > 0.95 || math.IsNaN(s.FollowUp) || math.IsInf(s.FollowUp, 0) {
		return fmt.Errorf("%w: synth shape %q: roots and min depth >= 0, follow-up <= 0.95", ErrInvalid, s.Name)
	}
	// Bounds that keep a drawn trace meaningful and its drawing cheap.
	for _, v := range []float64{s.DepthScale, s.BurstScale, s.LengthScale, s.FollowUpScale} {
		if v > maxSynthScale {
			return fmt.Errorf("%w: synth shape %q: scales must be <= %g", ErrInvalid, s.Name, float64(maxSynthScale))
		}
	}
	if s.RootZipf > maxSynthScale || s.Roots > maxSynthRoots || s.MinRootDepth > maxSynthRootDepth {
		return fmt.Errorf("%w: synth shape %q: root zipf <= %g, roots <= %d, min root depth <= %d blocks", ErrInvalid, s.Name, float64(maxSynthScale), maxSynthRoots, maxSynthRootDepth)
	}
	return nil
}

// Bounds on a shape. A scale moves an axis by at most 64× (six doublings:
// a 3 s burst epoch becomes at most 3 min; beyond that a trace is a
// different workload, not a moved one). 2^16 roots is more shared prompts
// than the bundled trace's 12,031 requests can use. 256 blocks of 512
// tokens is 131,072 tokens, the longest context the simulated engine
// takes (Llama 3.1's, sim.DefaultMaxModelLen).
const (
	maxSynthScale     = 64
	maxSynthRoots     = 1 << 16
	maxSynthRootDepth = 256
)

// ParseSynthShapes reads shapes beyond the built-in ones from JSON: an
// object from name to SynthShape (its JSON fields, e.g.
// {"bursty": {"burst_scale": 8, "follow_up": 0.8}}). A name is lower-case
// letters, digits and '-', at most 64 bytes, and not a built-in shape's;
// names and fields are spelled exactly and given once, and the file holds
// one object with at least one shape. An unknown field, a value Apply
// cannot use, or root_zipf without roots is an error, not ignored.
func ParseSynthShapes(data []byte) (map[string]SynthShape, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: synth shapes: "+format, append([]any{ErrInvalid}, args...)...)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, bad("want a JSON object of name to shape")
	}
	out := map[string]SynthShape{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, bad("%v", err)
		}
		name, _ := t.(string)
		if !validShapeName(name) {
			return nil, bad("name %q: want 1-64 of [a-z0-9-]", name)
		}
		if _, ok := out[name]; ok {
			return nil, bad("%q given twice", name)
		}
		if _, ok := SynthShapes[name]; ok {
			return nil, bad("%q is built in", name)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, bad("%q: %v", name, err)
		}
		sh, err := decodeShape(raw)
		if err != nil {
			return nil, bad("%q: %v", name, err)
		}
		if sh.Name != "" && sh.Name != name {
			return nil, bad("%q names itself %q", name, sh.Name)
		}
		sh.Name = name
		if err := sh.Validate(); err != nil {
			return nil, err
		}
		if sh.RootZipf != 0 && sh.Roots == 0 {
			return nil, bad("%q: root_zipf applies with roots only", name)
		}
		out[name] = sh
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, bad("%v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, bad("more than one JSON value")
	}
	if len(out) == 0 {
		return nil, bad("no shapes")
	}
	return out, nil
}

// shapeFields are SynthShape's JSON member names.
var shapeFields = func() map[string]bool {
	f := map[string]bool{}
	st := reflect.TypeFor[SynthShape]()
	for i := range st.NumField() {
		tag, _, _ := strings.Cut(st.Field(i).Tag.Get("json"), ",")
		f[tag] = true
	}
	return f
}()

// decodeShape reads one shape object: its members named exactly as
// SynthShape's JSON fields (encoding/json alone would match any case and
// keep the last of two equal names), each once.
func decodeShape(raw json.RawMessage) (SynthShape, error) {
	var sh SynthShape
	dec := json.NewDecoder(bytes.NewReader(raw))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return sh, fmt.Errorf("want an object of shape fields")
	}
	seen := map[string]bool{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return sh, err
		}
		k, _ := t.(string)
		if !shapeFields[k] {
			return sh, fmt.Errorf("unknown field %q", k)
		}
		if seen[k] {
			return sh, fmt.Errorf("field %q given twice", k)
		}
		seen[k] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return sh, err
		}
	}
	if err := json.Unmarshal(raw, &sh); err != nil {
		return sh, err
	}
	return sh, nil
}

func validShapeName(name string) bool {
	if name == "" || len(name) > 64 {
		return false
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// meanRate is the profile's mean arrival rate, requests per second.
func (p SynthProfile) meanRate() float64 {
	g := p.EpochGapMs.Mean()
	if g <= 0 {
		return 1
	}
	return max(p.Batch.Mean(), 1) / g * 1000
}

// SynthShapes are the named shapes kvbench offers, each moving the fitted
// profile along one or two axes:
//
//   - "calibrated": the profile as measured;
//   - "shared-prompts": 64 roots (Zipf 1) each a long fixed prompt of at
//     least 16 blocks (8,192 tokens, the llm-d and SageMaker shared-prefix
//     benchmarks' size, docs/reference/workload-facts.md §6), Poisson arrivals, half the
//     follow-ups: tool-and-agent-like traffic, where the hot prefixes are
//     many and deep;
//   - "bursty-long": bursts 4× larger at the same mean rate, prompts 1.5×
//     longer, more follow-ups (0.6): long multi-turn sessions arriving in
//     waves.
var SynthShapes = map[string]SynthShape{
	"calibrated":     {Name: "calibrated"},
	"shared-prompts": {Name: "shared-prompts", Roots: 64, MinRootDepth: 16, Poisson: true, FollowUpScale: 0.5},
	"bursty-long":    {Name: "bursty-long", BurstScale: 4, LengthScale: 1.5, FollowUp: 0.6},
}

// Generate draws a trace of n requests (0 = the fitted trace's count) with
// the profile's shape; the same seed gives the same trace. Hash ids are
// fresh (from 0), timestamps start at 0 ms.
func (p SynthProfile) Generate(n int, seed uint64) ([]TraceRecord, error) {
	if n == 0 {
		n = p.Requests
	}
	if n < 1 || len(p.FirstLen.Q) == 0 || len(p.Batch.Q) == 0 || len(p.RootWeights) == 0 {
		return nil, fmt.Errorf("%w: synth: need n >= 1 and a fitted profile", ErrInvalid)
	}
	rng := rand.New(rand.NewPCG(seed, derive(seed, "synth", 0)))
	g := synthGen{p: p, rng: rng, chains: make([][]int64, len(p.RootWeights))}
	total := 0.0
	g.cum = make([]float64, len(p.RootWeights))
	for i, w := range p.RootWeights {
		total += w
		g.cum[i] = total
	}
	recs := make([]TraceRecord, 0, n)
	t := 0.0
	for len(recs) < n {
		if len(recs) > 0 {
			t += max(p.EpochGapMs.Sample(rng), 0)
		}
		b := max(int(math.Round(p.Batch.Sample(rng))), 1)
		for range b {
			if len(recs) == n {
				break
			}
			recs = append(recs, g.next(int64(t)))
		}
	}
	return recs, nil
}

type synthGen struct {
	p      SynthProfile
	rng    *rand.Rand
	cum    []float64 // cumulative root weights
	chains [][]int64 // each root's shared block chain, grown on demand
	nextID int64
	due    turnHeap
}

// pendingTurn is a follow-up waiting for its time.
type pendingTurn struct {
	at     float64
	parent TraceRecord
}

type turnHeap []pendingTurn

func (h turnHeap) Len() int           { return len(h) }
func (h turnHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h turnHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *turnHeap) Push(x any)        { *h = append(*h, x.(pendingTurn)) }
func (h *turnHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

func (g *synthGen) id() int64 { g.nextID++; return g.nextID - 1 }

// next makes the request arriving at t ms: the earliest due follow-up, or
// a first turn.
func (g *synthGen) next(t int64) TraceRecord {
	var r TraceRecord
	made := false
	if len(g.due) > 0 && g.due[0].at <= float64(t) {
		pt := heap.Pop(&g.due).(pendingTurn)
		r, made = g.followUp(pt.parent)
	}
	if !made {
		r = g.firstTurn()
	}
	r.Timestamp = t
	r.OutputLength = max(int(math.Round(g.p.Output.Sample(g.rng))), 1)
	if g.rng.Float64() < g.p.FollowUp {
		heap.Push(&g.due, pendingTurn{at: float64(t) + max(g.p.TurnGapMs.Sample(g.rng), 1), parent: r})
	}
	return r
}

func (g *synthGen) firstTurn() TraceRecord {
	u := g.rng.Float64() * g.cum[len(g.cum)-1]
	root := sort.SearchFloat64s(g.cum, u)
	root = min(root, len(g.cum)-1)
	n := max(int(math.Round(g.p.FirstLen.Sample(g.rng))), 1)
	n = min(n, max(g.p.MaxInput, 1))
	blocks := (n + TraceBlockTokens - 1) / TraceBlockTokens
	d := max(int(math.Round(g.p.RootDepth.Sample(g.rng))), 1)
	// The shared blocks must be whole blocks of the prompt: a prompt of
	// n tokens shares at most its full blocks (and at least its first).
	d = min(d, max(n/TraceBlockTokens, 1), blocks)
	for len(g.chains[root]) < d {
		g.chains[root] = append(g.chains[root], g.id())
	}
	ids := make([]int64, blocks)
	copy(ids, g.chains[root][:d])
	for j := d; j < blocks; j++ {
		ids[j] = g.id()
	}
	return TraceRecord{InputLength: n, HashIDs: ids}
}

// followUp extends parent by a turn; ok is false when the turn would be
// longer than any prompt measured (the conversation ends).
func (g *synthGen) followUp(parent TraceRecord) (TraceRecord, bool) {
	keep := fullBlocks(&parent)
	n := keep*TraceBlockTokens + max(int(math.Round(g.p.TurnAppend.Sample(g.rng))), 1)
	if n > g.p.MaxInput || keep == 0 {
		return TraceRecord{}, false
	}
	blocks := (n + TraceBlockTokens - 1) / TraceBlockTokens
	ids := make([]int64, blocks)
	copy(ids, parent.HashIDs[:keep])
	for j := keep; j < blocks; j++ {
		ids[j] = g.id()
	}
	return TraceRecord{InputLength: n, HashIDs: ids}, true
}

// Synthesise fits recs and draws a trace of n requests (0 = as many as
// recs) with the named shape: one of extra (ParseSynthShapes; may be nil)
// or of SynthShapes.
func Synthesise(recs []TraceRecord, shape string, extra map[string]SynthShape, n int, seed uint64) ([]TraceRecord, error) {
	s, ok := extra[shape]
	if !ok {
		s, ok = SynthShapes[shape]
	}
	if !ok {
		names := make([]string, 0, len(SynthShapes)+len(extra))
		for k := range SynthShapes {
			names = append(names, k)
		}
		for k := range extra {
			names = append(names, k)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("%w: unknown synth shape %q: want one of %v", ErrInvalid, shape, names)
	}
	p, err := Fit(recs)
	if err != nil {
		return nil, err
	}
	if p, err = s.Apply(p); err != nil {
		return nil, err
	}
	return p.Generate(n, seed)
}
