package workload

import (
	"time"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// Agent is tool-using agents: each session is one task run by an agent
// whose prompt starts with a long toolset (instructions and tool
// definitions) shared by every session of that agent, then the task so far;
// each step appends what the tool returned, and the model's reply joins the
// history as in Chat. A few toolsets carry most sessions (Zipf popularity),
// so a hot toolset is one long prefix that many concurrent sessions share:
// the shape where one holder takes a prefix's whole traffic unless the
// router replicates it, and where a copy costs one long recompute.
type Agent struct {
	// Toolsets is the number of distinct agents (default 30).
	Toolsets int `json:"toolsets,omitempty" yaml:"toolsets"`
	// MinToolTokens and MaxToolTokens bound a toolset's length, drawn
	// uniformly (default 5,000 and 20,000).
	MinToolTokens int `json:"min_tool_tokens,omitempty" yaml:"min_tool_tokens"`
	MaxToolTokens int `json:"max_tool_tokens,omitempty" yaml:"max_tool_tokens"`
	// ZipfS is the Zipf exponent of toolset popularity, > 1 (default 1.2).
	ZipfS float64 `json:"zipf_s,omitempty" yaml:"zipf_s"`
	// Sessions (default 600); MinSteps and MaxSteps bound the steps per
	// session, drawn uniformly (default 2 and 10).
	Sessions int `json:"sessions,omitempty" yaml:"sessions"`
	MinSteps int `json:"min_steps,omitempty" yaml:"min_steps"`
	MaxSteps int `json:"max_steps,omitempty" yaml:"max_steps"`
	// Observation is what each step appends before the model's turn (the
	// task, then each tool result; default: mean 1,200, sigma 0.6, in
	// [128, 4,096]).
	Observation LengthDist `json:"observation" yaml:"observation"`
	// Output is each reply's length (default: mean 150, sigma 0.6, in
	// [16, 600]: a tool call or a short answer).
	Output LengthDist `json:"output" yaml:"output"`
	// StepTime is the mean (exponential) gap between a session's steps,
	// the tool's run time (default 3 s).
	StepTime time.Duration `json:"step_time,omitempty" yaml:"step_time"`
	// Arrivals: the request rate (default 4 req/s); sessions start as a
	// Poisson process at Rate / mean steps.
	Arrivals Arrivals `json:"arrivals" yaml:"arrivals"`
}

func (c Agent) withDefaults() Agent {
	zero.Default(&c.Toolsets, 30)
	zero.Default(&c.MinToolTokens, 5000)
	zero.Default(&c.MaxToolTokens, 20000)
	zero.Default(&c.ZipfS, 1.2)
	zero.Default(&c.Sessions, 600)
	zero.Default(&c.MinSteps, 2)
	zero.Default(&c.MaxSteps, 10)
	zero.Default(&c.Observation, LengthDist{Mean: 1200, Sigma: 0.6, Min: 128, Max: 4096})
	zero.Default(&c.Output, LengthDist{Mean: 150, Sigma: 0.6, Min: 16, Max: 600})
	zero.Default(&c.StepTime, 3*time.Second)
	c.Arrivals = c.Arrivals.withDefault(4)
	return c
}

// Generate builds the workload; the same seed gives the same workload.
func (c Agent) Generate(seed int64) (*Workload, error) {
	c = c.withDefaults()
	const name = "agent"
	run, err := startRun(name, seed, c.Arrivals, map[string]int{"toolsets": c.Toolsets, "min_tool_tokens": c.MinToolTokens,
		"max_tool_tokens": c.MaxToolTokens, "sessions": c.Sessions, "min_steps": c.MinSteps, "max_steps": c.MaxSteps},
		invalidIf(c.MaxToolTokens < c.MinToolTokens || c.MaxSteps < c.MinSteps || !(c.ZipfS > 1) || c.ZipfS > 1e6 || c.StepTime < 0, name,
			"need min_tool_tokens <= max_tool_tokens, min_steps <= max_steps, zipf_s > 1, step_time >= 0"),
		c.Observation.validate(name+" observation"), c.Output.validate(name+" output"))
	if err != nil {
		return nil, err
	}
	rng := run.rng
	tools := make([]int, c.Toolsets)
	for i := range tools {
		tools[i] = run.uniform(c.MinToolTokens, c.MaxToolTokens)
	}
	zipf := newZipf(rng, c.ZipfS, c.Toolsets)
	obs, out := newSampler(c.Observation), newSampler(c.Output)
	var hist []Segment
	run.sessions(c.Sessions, c.Arrivals.Rate/(float64(c.MinSteps+c.MaxSteps)/2), c.StepTime, func(int) int {
		tool := zipf.draw()
		hist = []Segment{run.seg("toolset", uint64(tool), tools[tool], "system")}
		return run.uniform(c.MinSteps, c.MaxSteps)
	}, func(s, t int, at time.Duration) {
		o := obs.draw(rng)
		hist = run.turn(hist, at, "a", s, t, "observation", o, out.draw(rng))
	})
	return run.w.finish(), nil
}
