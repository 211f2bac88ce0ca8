package main

import (
	"context"
	"fmt"
	"io"
	"sort"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/tiers"
)

// decisionTrace follows a KV-aware router's decisions in the driver, to
// tell where its hit rate went (kvbench des --decisions): before each pick
// it looks the prompt up in the router's index — what the engines' events
// said, speculative entries aside — and records the tokens the best
// holder and the chosen instance held on GPU; with the engines' reported
// cached tokens that splits the prompt tokens not served from cache into
// those lost by moving off the best holder and those the chosen instance
// was predicted to hold but no longer had (evicted in between).
type decisionTrace struct {
	*strategyRouter
	recs map[uint64]decisionRec
}

type decisionRec struct {
	reason       string
	best, chosen int // GPU tokens held at the decision: best holder, chosen instance
}

var _ des.Router = (*decisionTrace)(nil)

func newDecisionTrace(r *strategyRouter) *decisionTrace {
	return &decisionTrace{strategyRouter: r, recs: map[uint64]decisionRec{}}
}

// Pick implements des.Router.
func (t *decisionTrace) Pick(ctx context.Context, req *des.RouteRequest, cands []string) (des.Decision, error) {
	held := map[string]int{}
	if t.kv != nil && len(req.Tokens) >= sim.DefaultBlockSize {
		keys := kvindex.AppendKeys(nil, kvindex.Root(t.model, req.Adapter, req.CacheSalt), req.Tokens, sim.DefaultBlockSize)
		ms, err := t.kv.index.Lookup(ctx, keys)
		if err != nil {
			return des.Decision{}, err
		}
		for _, m := range ms {
			held[m.Instance] = min(m.Blocks[tiers.GPU]*sim.DefaultBlockSize, len(req.Tokens))
		}
	}
	d, err := t.strategyRouter.Pick(ctx, req, cands)
	if err != nil {
		return d, err
	}
	rec := decisionRec{reason: d.Reason, chosen: held[d.Instance]}
	for _, n := range held {
		rec.best = max(rec.best, n)
	}
	t.recs[uint64(req.ID)] = rec
	return d, nil
}

// decisionBreakdown is the per-reason account of a run.
type decisionBreakdown struct {
	Reason    string
	Requests  int
	Prompt    int64 // prompt tokens of these requests
	Cached    int64 // engine-reported cached tokens
	BestHeld  int64 // tokens the best holder held at the decisions
	LostMove  int64 // best − chosen, where the pick was not the best holder
	LostEvict int64 // chosen held − cached, where the engine had lost some
}

// breakdown sums the recorded decisions with the run's outcomes, by
// reason (most requests first).
func (t *decisionTrace) breakdown(res *des.Result) (rows []decisionBreakdown, prompt int64) {
	by := map[string]*decisionBreakdown{}
	for _, o := range res.Outcomes {
		prompt += int64(o.PromptTokens)
		rec, ok := t.recs[uint64(o.ID)]
		if !ok || o.Err != "" {
			continue
		}
		b := by[rec.reason]
		if b == nil {
			b = &decisionBreakdown{Reason: rec.reason}
			by[rec.reason] = b
		}
		b.Requests++
		b.Prompt += int64(o.PromptTokens)
		b.Cached += int64(o.CachedTokens)
		b.BestHeld += int64(rec.best)
		b.LostMove += int64(max(rec.best-rec.chosen, 0))
		b.LostEvict += int64(max(rec.chosen-o.CachedTokens, 0))
	}
	for _, b := range by {
		rows = append(rows, *b)
	}
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].Requests != rows[j].Requests {
			return rows[i].Requests > rows[j].Requests
		}
		return rows[i].Reason < rows[j].Reason
	})
	return rows, prompt
}

// writeBreakdown prints the account as a Markdown table; fractions are of
// all the run's prompt tokens, except "hit", of the reason's own.
func writeBreakdown(w io.Writer, strategy string, rows []decisionBreakdown, prompt int64) error {
	frac := func(n int64) float64 { return float64(n) / float64(max(prompt, 1)) }
	fmt.Fprintf(w, "\ndecisions of %s (fractions of all prompt tokens; hit of the reason's own):\n\n", strategy)
	fmt.Fprintln(w, "| reason | requests | prompt | hit | best holder held | lost moving off the best holder | predicted but evicted |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|")
	for _, b := range rows {
		_, err := fmt.Fprintf(w, "| %s | %d | %.3f | %.3f | %.4f | %.4f | %.4f |\n", b.Reason, b.Requests, frac(b.Prompt),
			float64(b.Cached)/float64(max(b.Prompt, 1)), frac(b.BestHeld), frac(b.LostMove), frac(b.LostEvict))
		if err != nil {
			return err
		}
	}
	return nil
}
