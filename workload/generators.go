package workload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// seg makes a segment whose seed is derived from the run seed, a label and numbers.
func seg(base uint64, label string, n uint64, length int, role string) Segment {
	return Segment{Seed: derive(base, label, n), Len: length, Role: role}
}

func positive(what string, vals map[string]int) error {
	for k, v := range vals {
		if v <= 0 {
			return fmt.Errorf("%w: %s: %s = %d must be positive", ErrInvalid, what, k, v)
		}
	}
	return nil
}

// genRun is what every generator starts from: its random source, the base
// its segment seeds derive from, and the workload it fills.
type genRun struct {
	rng  *rand.Rand
	base uint64
	w    *Workload
}

// startRun checks what every generator checks, in this order: the counts
// that must be positive, the generator's own checks (each nil when met),
// the arrivals; then seeds the run from seed and the generator's name.
func startRun(name string, seed int64, a Arrivals, counts map[string]int, checks ...error) (*genRun, error) {
	if err := positive(name, counts); err != nil {
		return nil, err
	}
	for _, err := range checks {
		if err != nil {
			return nil, err
		}
	}
	if err := a.validate(name); err != nil {
		return nil, err
	}
	return &genRun{
		rng:  newRNG(seed, name),
		base: derive(uint64(seed), name, 0),
		w:    &Workload{Name: name, ClosedLoop: a.Concurrency},
	}, nil
}

// invalidIf is a generator's error for a constraint between its fields
// that does not hold (nil when bad is false).
func invalidIf(bad bool, name, msg string) error {
	if !bad {
		return nil
	}
	return fmt.Errorf("%w: %s: %s", ErrInvalid, name, msg)
}

// poisson is a Poisson arrival process at rate per second on the run's
// random source.
func (run *genRun) poisson(rate float64) *poisson { return &poisson{rng: run.rng, rate: rate} }

// seg is a segment whose seed derives from the run's.
func (run *genRun) seg(label string, n uint64, length int, role string) Segment {
	return seg(run.base, label, n, length, role)
}

// prefixGroups adds groups × perGroup requests in a random order, each a
// group's shared prefix then a question of its own: the shape LongContext
// and CachePressure share.
func (run *genRun) prefixGroups(groups, perGroup, prefixTokens, questionTokens, outputTokens int, rate float64) {
	order := run.rng.Perm(groups * perGroup)
	arr := run.poisson(rate)
	for k, i := range order {
		g := i / perGroup
		run.ask(Request{At: arr.next(), Session: fmt.Sprintf("g%d", g), OutputTokens: outputTokens},
			run.seg("prefix", uint64(g), prefixTokens, "system"), uint64(k), questionTokens)
	}
}

// ask adds r with a prompt of shared (a system part other requests send
// too) then question q of its own, questionTokens long: the request
// LongContext, CachePressure, MultiTenant and Overload send.
func (run *genRun) ask(r Request, shared Segment, q uint64, questionTokens int) {
	r.Prompt = []Segment{shared, run.seg("question", q, questionTokens, "user")}
	run.w.Requests = append(run.w.Requests, r)
}

// turn adds turn t of session s (named prefix+s) whose prompt is its whole
// history: the turn's input (label, in tokens) joins hist, the request sends
// the history so far and asks for out tokens, and the reply joins the history
// as the engine would see it in the next turn's prompt. The shape Chat and
// Agent share; it returns the history after the turn.
func (run *genRun) turn(hist []Segment, at time.Duration, prefix string, s, t int, label string, in, out int) []Segment {
	id := uint64(s)<<16 | uint64(t)
	hist = append(hist, run.seg(label, id, in, "user"))
	run.w.Requests = append(run.w.Requests, Request{
		At: at, Session: fmt.Sprintf("%s%d", prefix, s), Turn: t,
		Prompt: append([]Segment(nil), hist...), OutputTokens: out,
	})
	return append(hist, run.seg("assistant", id, out, "assistant"))
}

// sessions adds n sessions that start as a Poisson process at rate per
// second: begin sets session s up and says how many steps it takes, step
// adds its step t at time at, and a session's steps are an exponential gap
// of mean think apart. The shape Chat, Code and Agent share.
func (run *genRun) sessions(n int, rate float64, think time.Duration, begin func(s int) (steps int), step func(s, t int, at time.Duration)) {
	starts := run.poisson(rate)
	for s := 0; s < n; s++ {
		at := starts.next()
		steps := begin(s)
		for t := 0; t < steps; t++ {
			step(s, t, at)
			at += expDur(run.rng, think)
		}
	}
}

// uniform draws an integer uniformly from [lo, hi].
func (run *genRun) uniform(lo, hi int) int { return lo + run.rng.IntN(hi-lo+1) }

// LongContext is SageMaker's long-context benchmark shape: groups of
// requests that share a long prefix (a document, a system prompt) and each
// ask a short question. The zero value means the defaults documented on each
// field.
type LongContext struct {
	// Groups is the number of distinct shared prefixes (default 200).
	Groups int `json:"groups,omitempty" yaml:"groups"`
	// RequestsPerGroup (default 5). With 7 instances, random placement of 5
	// requests per prefix gives an expected hit rate of about 25% and sticky
	// placement 80% (4 of 5) — the published shape; see docs/kvbench.md.
	RequestsPerGroup int `json:"requests_per_group,omitempty" yaml:"requests_per_group"`
	// PrefixTokens is the shared prefix length (default 8,000, as SageMaker).
	PrefixTokens int `json:"prefix_tokens,omitempty" yaml:"prefix_tokens"`
	// QuestionTokens is the per-request suffix (default 50, as SageMaker).
	QuestionTokens int `json:"question_tokens,omitempty" yaml:"question_tokens"`
	// OutputTokens per request (default 100; not published, our choice).
	OutputTokens int `json:"output_tokens,omitempty" yaml:"output_tokens"`
	// Arrivals: Poisson, default 7 req/s (one per instance per second on 7).
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c LongContext) withDefaults() LongContext {
	zero.Default(&c.Groups, 200)
	zero.Default(&c.RequestsPerGroup, 5)
	zero.Default(&c.PrefixTokens, 8000)
	zero.Default(&c.QuestionTokens, 50)
	zero.Default(&c.OutputTokens, 100)
	c.Arrivals = c.Arrivals.withDefault(7)
	return c
}

// Generate builds the workload; the same seed gives the same workload.
func (c LongContext) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "long-context"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"groups": c.Groups, "requests_per_group": c.RequestsPerGroup,
		"prefix_tokens": c.PrefixTokens, "question_tokens": c.QuestionTokens, "output_tokens": c.OutputTokens})
	if err != nil {
		return nil, err
	}
	run.prefixGroups(c.Groups, c.RequestsPerGroup, c.PrefixTokens, c.QuestionTokens, c.OutputTokens, c.Arrivals.Rate)
	return run.w.finish(), nil
}

// Chat is multi-turn chat in the style of ShareGPT: each session's prompt
// is its whole history (every earlier question and answer) plus the new
// question, so it grows turn by turn.
type Chat struct {
	// Sessions (default 300).
	Sessions int `json:"sessions,omitempty" yaml:"sessions"`
	// MinTurns and MaxTurns bound the turns per session, drawn uniformly
	// (default 2 and 6; vLLM's ShareGPT sampler keeps conversations of at
	// least two turns).
	MinTurns int `json:"min_turns,omitempty" yaml:"min_turns"`
	MaxTurns int `json:"max_turns,omitempty" yaml:"max_turns"`
	// SystemTokens is a system prompt shared by every session (default 0,
	// as ShareGPT conversations have none).
	SystemTokens int `json:"system_tokens,omitempty" yaml:"system_tokens"`
	// Input is each user turn's length (default: mean 202, sigma 1, in
	// [4, 1024] — vLLM's ShareGPT sample, docs/reference/workload-facts.md §5).
	Input LengthDist `json:"input" yaml:"input"`
	// Output is each reply's length (default: mean 179, sigma 1, in [4, 2048]).
	Output LengthDist `json:"output" yaml:"output"`
	// MaxPairTokens drops and redraws a question/answer pair longer than
	// this in total (default 2,048, vLLM's is_valid_sequence).
	MaxPairTokens int `json:"max_pair_tokens,omitempty" yaml:"max_pair_tokens"`
	// ThinkTime is the mean (exponential) gap between a session's turns
	// (default 10 s).
	ThinkTime time.Duration `json:"think_time,omitempty" yaml:"think_time"`
	// Arrivals: the request rate (default 5 req/s); sessions start as a
	// Poisson process at Rate / mean turns.
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c Chat) withDefaults() Chat {
	zero.Default(&c.Sessions, 300)
	zero.Default(&c.MinTurns, 2)
	zero.Default(&c.MaxTurns, 6)
	zero.Default(&c.Input, LengthDist{Mean: 202, Sigma: 1, Min: 4, Max: 1024})
	zero.Default(&c.Output, LengthDist{Mean: 179, Sigma: 1, Min: 4, Max: 2048})
	zero.Default(&c.MaxPairTokens, 2048)
	zero.Default(&c.ThinkTime, 10*time.Second)
	c.Arrivals = c.Arrivals.withDefault(5)
	return c
}

// Generate builds the workload; the same seed gives the same workload.
func (c Chat) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "chat"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"sessions": c.Sessions, "min_turns": c.MinTurns,
		"max_turns": c.MaxTurns, "max_pair_tokens": c.MaxPairTokens},
		invalidIf(c.MaxTurns < c.MinTurns || c.SystemTokens < 0 || c.ThinkTime < 0, name,
			"need min_turns <= max_turns, system_tokens >= 0, think_time >= 0"),
		c.Input.validate(name+" input"), c.Output.validate(name+" output"))
	if err != nil {
		return nil, err
	}
	rng := run.rng
	in, out := newSampler(c.Input), newSampler(c.Output)
	meanTurns := float64(c.MinTurns+c.MaxTurns) / 2
	var hist []Segment
	run.sessions(c.Sessions, c.Arrivals.Rate/meanTurns, c.ThinkTime, func(int) int {
		turns := run.uniform(c.MinTurns, c.MaxTurns)
		hist = nil
		if c.SystemTokens > 0 {
			hist = append(hist, run.seg("system", 0, c.SystemTokens, "system"))
		}
		return turns
	}, func(s, t int, at time.Duration) {
		q, a := in.draw(rng), out.draw(rng)
		for q+a > c.MaxPairTokens {
			q, a = in.draw(rng), out.draw(rng)
		}
		hist = run.turn(hist, at, "s", s, t, "user", q, a)
	})
	return run.w.finish(), nil
}

// RAG is retrieval-augmented generation over a document set whose
// popularity follows a Zipf law: each prompt is a shared system prompt, the
// TopK retrieved documents in retrieval order (most relevant first), and a
// question. Requests share a prefix as far as their leading documents agree.
type RAG struct {
	// Documents in the corpus (default 2,000).
	Documents int `json:"documents,omitempty" yaml:"documents"`
	// DocumentTokens per retrieved chunk (default 1,000).
	DocumentTokens int `json:"document_tokens,omitempty" yaml:"document_tokens"`
	// TopK documents per prompt (default 3).
	TopK int `json:"top_k,omitempty" yaml:"top_k"`
	// ZipfS is the Zipf exponent of document popularity, > 1 (default 1.1).
	ZipfS float64 `json:"zipf_s,omitempty" yaml:"zipf_s"`
	// SystemTokens (default 300), QuestionTokens (default 50), OutputTokens (default 200).
	SystemTokens   int `json:"system_tokens,omitempty" yaml:"system_tokens"`
	QuestionTokens int `json:"question_tokens,omitempty" yaml:"question_tokens"`
	OutputTokens   int `json:"output_tokens,omitempty" yaml:"output_tokens"`
	// Requests (default 3,000).
	Requests int `json:"requests,omitempty" yaml:"requests"`
	// Arrivals: Poisson, default 8 req/s.
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c RAG) withDefaults() RAG {
	zero.Default(&c.Documents, 2000)
	zero.Default(&c.DocumentTokens, 1000)
	zero.Default(&c.TopK, 3)
	zero.Default(&c.ZipfS, 1.1)
	zero.Default(&c.SystemTokens, 300)
	zero.Default(&c.QuestionTokens, 50)
	zero.Default(&c.OutputTokens, 200)
	zero.Default(&c.Requests, 3000)
	c.Arrivals = c.Arrivals.withDefault(8)
	return c
}

// Generate builds the workload; the same seed gives the same workload.
func (c RAG) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "rag"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"documents": c.Documents, "document_tokens": c.DocumentTokens,
		"top_k": c.TopK, "system_tokens": c.SystemTokens, "question_tokens": c.QuestionTokens,
		"output_tokens": c.OutputTokens, "requests": c.Requests},
		invalidIf(c.TopK > c.Documents || !(c.ZipfS > 1) || math.IsInf(c.ZipfS, 0), name, "need top_k <= documents and zipf_s > 1"))
	if err != nil {
		return nil, err
	}
	w := run.w
	zipf := newZipf(run.rng, c.ZipfS, c.Documents)
	arr := run.poisson(c.Arrivals.Rate)
	for i := 0; i < c.Requests; i++ {
		p := []Segment{run.seg("system", 0, c.SystemTokens, "system")}
		seen := map[int]bool{}
		for len(seen) < c.TopK {
			d := zipf.draw()
			if seen[d] {
				continue
			}
			seen[d] = true
			p = append(p, run.seg("doc", uint64(d), c.DocumentTokens, "user"))
		}
		p = append(p, run.seg("question", uint64(i), c.QuestionTokens, "user"))
		w.Requests = append(w.Requests, Request{At: arr.next(), Prompt: p, OutputTokens: c.OutputTokens})
	}
	return w.finish(), nil
}

// Code is code completion over open files: each user's prompt is a shared
// system prompt, the user's other open files, then the file being edited up
// to the cursor. Each request appends an edit to that file; now and then the
// user moves to a fresh file.
type Code struct {
	// Users (default 40), each a session.
	Users int `json:"users,omitempty" yaml:"users"`
	// RequestsPerUser (default 25).
	RequestsPerUser int `json:"requests_per_user,omitempty" yaml:"requests_per_user"`
	// OpenFiles other than the edited one (default 3), each FileTokens long (default 1,500).
	OpenFiles  int `json:"open_files,omitempty" yaml:"open_files"`
	FileTokens int `json:"file_tokens,omitempty" yaml:"file_tokens"`
	// SystemTokens (default 500), EditTokens appended per request (default 20),
	// OutputTokens (default 48).
	SystemTokens int `json:"system_tokens,omitempty" yaml:"system_tokens"`
	EditTokens   int `json:"edit_tokens,omitempty" yaml:"edit_tokens"`
	OutputTokens int `json:"output_tokens,omitempty" yaml:"output_tokens"`
	// SwitchProb is the chance per request that the user starts editing a
	// fresh file (default 0.1).
	SwitchProb float64 `json:"switch_prob,omitempty" yaml:"switch_prob"`
	// ThinkTime is the mean gap between a user's requests (default 4 s).
	ThinkTime time.Duration `json:"think_time,omitempty" yaml:"think_time"`
	// Arrivals: the request rate (default 6 req/s); users start as a Poisson
	// process at Rate / RequestsPerUser.
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c Code) withDefaults() Code {
	zero.Default(&c.Users, 40)
	zero.Default(&c.RequestsPerUser, 25)
	zero.Default(&c.OpenFiles, 3)
	zero.Default(&c.FileTokens, 1500)
	zero.Default(&c.SystemTokens, 500)
	zero.Default(&c.EditTokens, 20)
	zero.Default(&c.OutputTokens, 48)
	zero.Default(&c.SwitchProb, 0.1)
	zero.Default(&c.ThinkTime, 4*time.Second)
	c.Arrivals = c.Arrivals.withDefault(6)
	return c
}

// Generate builds the workload; the same seed gives the same workload.
func (c Code) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "code"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"users": c.Users, "requests_per_user": c.RequestsPerUser,
		"open_files": c.OpenFiles, "file_tokens": c.FileTokens, "system_tokens": c.SystemTokens,
		"edit_tokens": c.EditTokens, "output_tokens": c.OutputTokens},
		invalidIf(c.SwitchProb < 0 || c.SwitchProb > 1 || c.ThinkTime < 0, name, "need 0 <= switch_prob <= 1 and think_time >= 0"))
	if err != nil {
		return nil, err
	}
	w := run.w
	var ctx, active []Segment // the user's other open files; the edited one so far
	file := 0
	run.sessions(c.Users, c.Arrivals.Rate/float64(c.RequestsPerUser), c.ThinkTime, func(u int) int {
		ctx = []Segment{run.seg("system", 0, c.SystemTokens, "system")}
		for f := 0; f < c.OpenFiles; f++ {
			ctx = append(ctx, run.seg("file", uint64(u)<<16|uint64(f), c.FileTokens, "user"))
		}
		file = 0
		active = []Segment{run.seg("active", uint64(u)<<16, c.FileTokens, "user")}
		return c.RequestsPerUser
	}, func(u, r int, at time.Duration) {
		if r > 0 && run.rng.Float64() < c.SwitchProb {
			file++
			active = []Segment{run.seg("active", uint64(u)<<16|uint64(file), c.FileTokens, "user")}
		}
		active = append(active, run.seg("edit", uint64(u)<<32|uint64(r), c.EditTokens, "user"))
		p := append(append([]Segment(nil), ctx...), active...)
		w.Requests = append(w.Requests, Request{At: at, Session: fmt.Sprintf("u%d", u), Turn: r,
			Prompt: p, OutputTokens: c.OutputTokens})
	})
	return w.finish(), nil
}

// MultiTenant has tenants that send the same system prompt under different
// tenant keys: a router that isolates tenants keeps their prefixes apart,
// and with a per-tenant cache salt the engines do too.
type MultiTenant struct {
	// Tenants (default 8), keyed "tenant-0".."tenant-N-1".
	Tenants int `json:"tenants,omitempty" yaml:"tenants"`
	// SystemTokens is the system prompt every tenant sends (default 4,000).
	SystemTokens int `json:"system_tokens,omitempty" yaml:"system_tokens"`
	// QuestionTokens (default 100), OutputTokens (default 100), Requests (default 2,000).
	QuestionTokens int `json:"question_tokens,omitempty" yaml:"question_tokens"`
	OutputTokens   int `json:"output_tokens,omitempty" yaml:"output_tokens"`
	Requests       int `json:"requests,omitempty" yaml:"requests"`
	// Arrivals: Poisson, default 8 req/s; tenants drawn uniformly.
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c MultiTenant) withDefaults() MultiTenant {
	zero.Default(&c.Tenants, 8)
	zero.Default(&c.SystemTokens, 4000)
	zero.Default(&c.QuestionTokens, 100)
	zero.Default(&c.OutputTokens, 100)
	zero.Default(&c.Requests, 2000)
	c.Arrivals = c.Arrivals.withDefault(8)
	return c
}

// Generate builds the workload; the same seed gives the same workload.
func (c MultiTenant) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "multi-tenant"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"tenants": c.Tenants, "system_tokens": c.SystemTokens,
		"question_tokens": c.QuestionTokens, "output_tokens": c.OutputTokens, "requests": c.Requests})
	if err != nil {
		return nil, err
	}
	arr := run.poisson(c.Arrivals.Rate)
	for i := 0; i < c.Requests; i++ {
		t := run.rng.IntN(c.Tenants)
		run.ask(Request{At: arr.next(), Tenant: fmt.Sprintf("tenant-%d", t), OutputTokens: c.OutputTokens},
			run.seg("system", 0, c.SystemTokens, "system"), uint64(i), c.QuestionTokens)
	}
	return run.w.finish(), nil
}

// DefaultFleetTokens is the GPU KV capacity of 8 instances of Llama 3.1 70B
// BF16 on one 8×H100 node each: 8 × 1.35M tokens (docs/reference/workload-facts.md §3, derived).
const DefaultFleetTokens = 8 * 1_350_000

// CachePressure makes a working set larger than the fleet's GPU cache, in
// the shape of llm-d's capacity benchmark (groups of users sharing a long
// prompt, a long question, a long answer): Groups = ceil(Demand ×
// FleetTokens / PrefixTokens).
type CachePressure struct {
	// FleetTokens is the whole fleet's GPU KV capacity in tokens (default DefaultFleetTokens).
	FleetTokens int64 `json:"fleet_tokens,omitempty" yaml:"fleet_tokens"`
	// Demand is the distinct shared-prefix tokens over FleetTokens (default 1.5).
	Demand float64 `json:"demand,omitempty" yaml:"demand"`
	// PrefixTokens (default 6,000), QuestionTokens (default 1,200),
	// OutputTokens (default 1,000): llm-d's 73-capacity shape (docs/reference/workload-facts.md §6).
	PrefixTokens   int `json:"prefix_tokens,omitempty" yaml:"prefix_tokens"`
	QuestionTokens int `json:"question_tokens,omitempty" yaml:"question_tokens"`
	OutputTokens   int `json:"output_tokens,omitempty" yaml:"output_tokens"`
	// RequestsPerGroup (default 5, llm-d's users per group; each sends once).
	RequestsPerGroup int `json:"requests_per_group,omitempty" yaml:"requests_per_group"`
	// Arrivals: Poisson, default 10 req/s; groups drawn uniformly.
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c CachePressure) withDefaults() CachePressure {
	zero.Default(&c.FleetTokens, DefaultFleetTokens)
	zero.Default(&c.Demand, 1.5)
	zero.Default(&c.PrefixTokens, 6000)
	zero.Default(&c.QuestionTokens, 1200)
	zero.Default(&c.OutputTokens, 1000)
	zero.Default(&c.RequestsPerGroup, 5)
	c.Arrivals = c.Arrivals.withDefault(10)
	return c
}

// Groups is the number of prefix groups the configuration makes.
func (c CachePressure) Groups() int {
	c = c.withDefaults()
	return int(math.Ceil(c.Demand * float64(c.FleetTokens) / float64(c.PrefixTokens)))
}

// Generate builds the workload; the same seed gives the same workload.
func (c CachePressure) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "cache-pressure"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"prefix_tokens": c.PrefixTokens, "question_tokens": c.QuestionTokens,
		"output_tokens": c.OutputTokens, "requests_per_group": c.RequestsPerGroup},
		invalidIf(c.FleetTokens <= 0 || !(c.Demand > 0) || math.IsInf(c.Demand, 0), name, "need fleet_tokens > 0 and demand > 0"))
	if err != nil {
		return nil, err
	}
	groups := c.Groups()
	if groups > 10_000_000 {
		return nil, fmt.Errorf("%w: %s: %d groups is too many", ErrInvalid, name, groups)
	}
	run.prefixGroups(groups, c.RequestsPerGroup, c.PrefixTokens, c.QuestionTokens, c.OutputTokens, c.Arrivals.Rate)
	return run.w.finish(), nil
}

// Scale adds a scale-out and a scale-in to a workload, at fractions of its
// duration. The zero value means: add 2 instances at 1/3, remove 2 at 2/3.
type Scale struct {
	OutAt float64 `json:"out_at,omitempty" yaml:"out_at"`
	OutBy int     `json:"out_by,omitempty" yaml:"out_by"`
	InAt  float64 `json:"in_at,omitempty" yaml:"in_at"`
	InBy  int     `json:"in_by,omitempty" yaml:"in_by"`
}

// Apply returns a copy of w with the scale events added (a value < 0 for
// OutBy or InBy leaves that event out).
func (s Scale) Apply(w *Workload) (*Workload, error) {
	zero.Default(&s.OutAt, 1.0/3)
	zero.Default(&s.InAt, 2.0/3)
	zero.Default(&s.OutBy, 2)
	zero.Default(&s.InBy, 2)
	if s.OutAt < 0 || s.OutAt > 1 || s.InAt < 0 || s.InAt > 1 {
		return nil, fmt.Errorf("%w: scale: out_at and in_at must be fractions in [0, 1]", ErrInvalid)
	}
	out := *w
	out.Name = w.Name + "+scale"
	out.Fleet = append([]FleetEvent(nil), w.Fleet...)
	d := w.Duration()
	if s.OutBy > 0 {
		out.Fleet = append(out.Fleet, FleetEvent{At: time.Duration(s.OutAt * float64(d)), Kind: ScaleOut, Instances: s.OutBy})
	}
	if s.InBy > 0 {
		out.Fleet = append(out.Fleet, FleetEvent{At: time.Duration(s.InAt * float64(d)), Kind: ScaleIn, Instances: s.InBy})
	}
	out.finish()
	return &out, nil
}
