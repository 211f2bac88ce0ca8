package workload

import (
	"errors"
	"hash/fnv"
	"math"
	"reflect"
	"regexp"
	"slices"
	"testing"
	"time"
)

type generator interface {
	Generate(seed int64) (*Workload, error)
}

// small configurations of every generator, for tests.
func smallGenerators() map[string]generator {
	return map[string]generator{
		"long-context":   LongContext{Groups: 20},
		"chat":           Chat{Sessions: 40},
		"rag":            RAG{Requests: 200, Documents: 100},
		"code":           Code{Users: 5, RequestsPerUser: 10},
		"multi-tenant":   MultiTenant{Requests: 100},
		"cache-pressure": CachePressure{FleetTokens: 200_000},
		"agent":          Agent{Sessions: 30},
	}
}

func TestGeneratorsDeterministicPerSeed(t *testing.T) {
	for name, g := range smallGenerators() {
		t.Run(name, func(t *testing.T) {
			a, err := g.Generate(1)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := g.Generate(1)
			c, _ := g.Generate(2)
			if !reflect.DeepEqual(a, b) {
				t.Error("same seed, different workloads")
			}
			if reflect.DeepEqual(a.Requests, c.Requests) {
				t.Error("different seeds, same workload")
			}
			if len(a.Requests) == 0 || a.Name != name {
				t.Fatalf("workload %q with %d requests", a.Name, len(a.Requests))
			}
			for i, r := range a.Requests {
				if r.ID != i || (i > 0 && r.At < a.Requests[i-1].At) {
					t.Fatalf("request %d: id %d at %v after %v", i, r.ID, r.At, a.Requests[max(i-1, 0)].At)
				}
				if r.InputTokens() <= 0 || r.OutputTokens <= 0 {
					t.Fatalf("request %d: %d in, %d out", i, r.InputTokens(), r.OutputTokens)
				}
			}
		})
	}
}

// TestTextTokenizesToTokens: the Simple tokenizer maps every request's text
// form to exactly its token ids, which is what makes live and
// discrete-event modes see the same prompts.
func TestTextTokenizesToTokens(t *testing.T) {
	for name, g := range smallGenerators() {
		t.Run(name, func(t *testing.T) {
			w, err := g.Generate(3)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range w.Requests[:min(3, len(w.Requests))] {
				got := simpleEncode(r.Text())
				if !slices.Equal(got, r.Tokens()) {
					t.Fatalf("request %d: Simple gives %d tokens, want %d (first differ at %d)", r.ID, len(got), r.InputTokens(), firstDiff(got, r.Tokens()))
				}
				// The chat form keeps prefixes: rendering messages of a
				// request whose prompt extends another's extends its render.
				ids := simpleEncode(simpleRender(r.Messages()))
				if len(ids) < r.InputTokens() {
					t.Fatalf("chat render has %d tokens, fewer than the prompt's %d", len(ids), r.InputTokens())
				}
			}
		})
	}
}

// simpleRE and simpleEncode restate the dummy tokenizer's rule from
// events/testdata/captured/DATA.md ("Caveats → Tokenizer") — the rule
// tokenizer.Simple implements — so that this package's tests do not depend
// on the tokenizer package's build.
var simpleRE = regexp.MustCompile(`(\{|\}|:|,|-|\.|\?|\!|;|@|#|\$|%|\^|&|\*|\(|\)|\+|\-|_|~|/|\\|>|<|\[|\]|=|"|'|\w+)(\s*)`)

func simpleEncode(text string) []uint32 {
	var ids []uint32
	for _, piece := range simpleRE.FindAllString(text, -1) {
		h := fnv.New32a()
		h.Write([]byte(piece))
		ids = append(ids, h.Sum32())
	}
	return ids
}

func simpleRender(ms []Message) string {
	var s string
	for _, m := range ms {
		s += "### " + m.Role + ": " + m.Content + "\n"
	}
	return s
}

func firstDiff(a, b []uint32) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func sharedPrefix(a, b *Request) int {
	ta, tb := a.Tokens(), b.Tokens()
	return firstDiff(ta, tb)
}

func TestLongContextShape(t *testing.T) {
	w, err := LongContext{}.Generate(7)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 1000 {
		t.Fatalf("%d requests, want 200 groups × 5", len(w.Requests))
	}
	bySession := map[string][]*Request{}
	for i := range w.Requests {
		r := &w.Requests[i]
		if r.InputTokens() != 8050 || r.OutputTokens != 100 {
			t.Fatalf("request %d: %d in %d out", i, r.InputTokens(), r.OutputTokens)
		}
		bySession[r.Session] = append(bySession[r.Session], r)
	}
	if len(bySession) != 200 {
		t.Fatalf("%d groups", len(bySession))
	}
	g := bySession["g3"]
	if n := sharedPrefix(g[0], g[1]); n != 8000 {
		t.Errorf("same group shares %d tokens, want exactly 8000", n)
	}
	if n := sharedPrefix(bySession["g3"][0], bySession["g4"][0]); n > 2 {
		t.Errorf("different groups share %d tokens", n)
	}
	// Poisson at 7/s: 1000 arrivals take about 1000/7 s.
	if d := w.Duration().Seconds(); math.Abs(d-1000.0/7) > 15 {
		t.Errorf("duration %.1f s, want about %.1f", d, 1000.0/7)
	}
}

func TestChatShape(t *testing.T) {
	w, err := Chat{Sessions: 2000}.Generate(5)
	if err != nil {
		t.Fatal(err)
	}
	var q, a float64
	var nq int
	prev := map[string]*Request{}
	for i := range w.Requests {
		r := &w.Requests[i]
		last := r.Prompt[len(r.Prompt)-1]
		if last.Len < 4 || last.Len > 1024 || r.OutputTokens < 4 || last.Len+r.OutputTokens > 2048 {
			t.Fatalf("request %d: question %d, output %d out of vLLM's ShareGPT bounds", i, last.Len, r.OutputTokens)
		}
		q += float64(last.Len)
		a += float64(r.OutputTokens)
		nq++
		if p, ok := prev[r.Session]; ok {
			// History grows: the previous turn's prompt, then its reply, then a new question.
			if r.Turn != p.Turn+1 || !slices.Equal(r.Prompt[:len(p.Prompt)], p.Prompt) || len(r.Prompt) != len(p.Prompt)+2 {
				t.Fatalf("session %s turn %d does not extend turn %d", r.Session, r.Turn, p.Turn)
			}
			if r.Prompt[len(p.Prompt)].Len != p.OutputTokens || r.Prompt[len(p.Prompt)].Role != "assistant" {
				t.Fatalf("session %s: reply segment %+v, output was %d", r.Session, r.Prompt[len(p.Prompt)], p.OutputTokens)
			}
		} else if r.Turn != 0 {
			t.Fatalf("session %s starts at turn %d", r.Session, r.Turn)
		}
		prev[r.Session] = r
	}
	// Means land on docs/reference/workload-facts.md §5's 202 / 179 (the pair cap trims output a little).
	if mq := q / float64(nq); math.Abs(mq-202) > 8 {
		t.Errorf("mean question %.1f, want ≈202", mq)
	}
	if ma := a / float64(nq); math.Abs(ma-179) > 10 {
		t.Errorf("mean output %.1f, want ≈179", ma)
	}
	msgs := w.Requests[len(w.Requests)-1].Messages()
	if len(msgs) == 0 || msgs[0].Role != "user" {
		t.Errorf("messages %v", msgs)
	}
}

func TestLengthDistMean(t *testing.T) {
	tests := []LengthDist{
		{Mean: 202, Sigma: 1, Min: 4, Max: 1024},
		{Mean: 179, Sigma: 1, Min: 4, Max: 2048},
		{Mean: 1000, Sigma: 0.5, Min: 10, Max: 1200},
	}
	for _, d := range tests {
		s := newSampler(d)
		rng := newRNG(1, "t")
		var sum float64
		const n = 200000
		for range n {
			x := s.draw(rng)
			if x < d.Min || x > d.Max {
				t.Fatalf("%+v drew %d", d, x)
			}
			sum += float64(x)
		}
		if m := sum / n; math.Abs(m-d.Mean)/d.Mean > 0.01 {
			t.Errorf("%+v: sample mean %.1f", d, m)
		}
	}
}

func TestRAGZipf(t *testing.T) {
	w, err := RAG{}.Generate(9)
	if err != nil {
		t.Fatal(err)
	}
	// The most popular document leads far more prompts than the 100th.
	first := map[uint64]int{}
	for _, r := range w.Requests {
		if len(r.Prompt) != 5 || r.InputTokens() != 300+3*1000+50 {
			t.Fatalf("request %d: %d segments, %d tokens", r.ID, len(r.Prompt), r.InputTokens())
		}
		first[r.Prompt[1].Seed]++
	}
	base := derive(9, "rag", 0)
	top, hundredth := first[derive(base, "doc", 0)], first[derive(base, "doc", 99)]
	if top < 10*max(hundredth, 1) {
		t.Errorf("doc 0 leads %d prompts, doc 99 leads %d: not Zipf-skewed", top, hundredth)
	}
}

func TestCodeShape(t *testing.T) {
	w, err := Code{SwitchProb: 1e-9}.Generate(4)
	if err != nil {
		t.Fatal(err)
	}
	last := map[string]*Request{}
	for i := range w.Requests {
		r := &w.Requests[i]
		if p, ok := last[r.Session]; ok {
			if !slices.Equal(r.Prompt[:len(p.Prompt)], p.Prompt) || r.InputTokens() != p.InputTokens()+20 {
				t.Fatalf("user %s: request %d does not extend the previous by one edit", r.Session, r.Turn)
			}
			if r.At < p.At {
				t.Fatalf("user %s goes back in time", r.Session)
			}
		}
		last[r.Session] = r
	}
	if len(last) != 40 || len(w.Requests) != 1000 {
		t.Errorf("%d users, %d requests", len(last), len(w.Requests))
	}
}

func TestMultiTenantShape(t *testing.T) {
	w, err := MultiTenant{}.Generate(2)
	if err != nil {
		t.Fatal(err)
	}
	tenants := map[string]bool{}
	for i := range w.Requests {
		tenants[w.Requests[i].Tenant] = true
		if w.Requests[i].Prompt[0] != w.Requests[0].Prompt[0] {
			t.Fatal("system prompts differ")
		}
	}
	if len(tenants) != 8 || tenants[""] {
		t.Errorf("tenants %v", tenants)
	}
}

func TestCachePressureScalesWithFleet(t *testing.T) {
	tests := []struct {
		fleet  int64
		demand float64
	}{{1_000_000, 1.5}, {10_800_000, 1.5}, {2_000_000, 0.73}}
	for _, tc := range tests {
		c := CachePressure{FleetTokens: tc.fleet, Demand: tc.demand}
		w, err := c.Generate(1)
		if err != nil {
			t.Fatal(err)
		}
		distinct := map[uint64]bool{}
		for _, r := range w.Requests {
			distinct[r.Prompt[0].Seed] = true
		}
		ws := float64(len(distinct) * 6000)
		if ws < tc.demand*float64(tc.fleet) || ws > tc.demand*float64(tc.fleet)+6000 {
			t.Errorf("fleet %d demand %.2f: working set %.0f tokens", tc.fleet, tc.demand, ws)
		}
		if len(w.Requests) != c.Groups()*5 {
			t.Errorf("%d requests for %d groups", len(w.Requests), c.Groups())
		}
	}
}

func TestScaleAndMerge(t *testing.T) {
	a, _ := LongContext{Groups: 10}.Generate(1)
	b, _ := MultiTenant{Requests: 50}.Generate(1)
	m, err := Merge("mix", a, b)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Requests) != len(a.Requests)+len(b.Requests) {
		t.Fatalf("merged %d", len(m.Requests))
	}
	for i := 1; i < len(m.Requests); i++ {
		if m.Requests[i].At < m.Requests[i-1].At || m.Requests[i].ID != i {
			t.Fatal("merge is not in arrival order")
		}
	}
	s, err := Scale{}.Apply(m)
	if err != nil {
		t.Fatal(err)
	}
	d := m.Duration()
	want := []FleetEvent{{At: d / 3, Kind: ScaleOut, Instances: 2}, {At: time.Duration(2.0 / 3 * float64(d)), Kind: ScaleIn, Instances: 2}}
	if len(s.Fleet) != 2 || s.Fleet[0].Kind != ScaleOut || s.Fleet[1].Kind != ScaleIn ||
		absDur(s.Fleet[0].At-want[0].At) > time.Millisecond || absDur(s.Fleet[1].At-want[1].At) > time.Millisecond {
		t.Errorf("fleet events %+v, want %+v", s.Fleet, want)
	}
	closed, _ := LongContext{Groups: 2, Arrivals: Arrivals{Concurrency: 4}}.Generate(1)
	if _, err := Merge("x", a, closed); !errors.Is(err, ErrInvalid) {
		t.Errorf("merging a closed-loop workload: %v", err)
	}
}

func absDur(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}

func TestInvalidConfigs(t *testing.T) {
	tests := map[string]generator{
		"negative groups":  LongContext{Groups: -1},
		"negative rate":    LongContext{Arrivals: Arrivals{Rate: -1}},
		"turns reversed":   Chat{MinTurns: 5, MaxTurns: 2},
		"bad length dist":  Chat{Input: LengthDist{Mean: 5, Sigma: 1, Min: 10, Max: 20}},
		"zipf s <= 1":      RAG{ZipfS: 0.5},
		"top k > docs":     RAG{Documents: 2, TopK: 3},
		"switch prob > 1":  Code{SwitchProb: 2},
		"negative tenants": MultiTenant{Tenants: -3},
		"negative demand":  CachePressure{Demand: -1},
		"tools reversed":   Agent{MinToolTokens: 900, MaxToolTokens: 800},
		"agent zipf <= 1":  Agent{ZipfS: 1},
		"steps reversed":   Agent{MinSteps: 4, MaxSteps: 3},
	}
	for name, g := range tests {
		if _, err := g.Generate(1); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", name, err)
		}
	}
	if _, err := (Scale{OutAt: 2}).Apply(&Workload{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("scale out_at 2: %v", err)
	}
	if _, err := (TraceReplay{Speed: -1}).Workload(nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("speed -1: %v", err)
	}
}

func BenchmarkRequestTokens(b *testing.B) {
	w, _ := LongContext{Groups: 1, RequestsPerGroup: 1}.Generate(1)
	r := &w.Requests[0]
	buf := make([]uint32, 0, r.InputTokens())
	b.ReportAllocs()
	b.SetBytes(int64(r.InputTokens()) * 4)
	for b.Loop() {
		buf = r.AppendTokens(buf[:0])
	}
}

func TestTextPrefix(t *testing.T) {
	w, _ := Chat{Sessions: 3}.Generate(1)
	for _, r := range w.Requests {
		full := r.Text()
		for _, n := range []int{0, 1, 7, 100, len(full) - 1, len(full), len(full) + 10} {
			if n < 0 {
				continue
			}
			want := full[:min(n, len(full))]
			if got := r.TextPrefix(n); got != want {
				t.Fatalf("TextPrefix(%d) = %q, want %q", n, got, want)
			}
		}
	}
}
