package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"time"

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
	// bound is the pooled bound's hit tokens per request id (nil: no
	// bound); blocks, gaps and life follow the bound's gap (decisions_gap.go).
	bound  []int64
	blocks map[kvindex.Key]blockRec // per block ever placed: its last placement, on which instances, by how many requests
	gaps   map[uint64]gapRec
	life   *lifeTracker
	// evictSeen: per evicted deficit, idle time, own and longest other turnover
	evictSeen [][3]time.Duration
	// beyond: tokens best holders held past the pooled bound's hit, summed
	// over the decisions where they did (the bound's LRU is not a ceiling
	// per request; writeGapAccount)
	beyond int64
	bits   map[string]int
	moves  map[string]moveRow
	// moveRecs follow each move to the next request reading its context;
	// waitNext indexes them by the context's last block.
	moveRecs []moveRec
	waitNext map[kvindex.Key][]int
}

type decisionRec struct {
	reason       string
	best, chosen int // GPU tokens held at the decision: best holder, chosen instance
	// running and waiting are the chosen engine's own counts at the
	// decision (not the router's scraped view); predicted is the router's
	// predicted time to first token there; ahead is what the engine held
	// ahead of the request (the rest of its step, prompt work), and budget
	// its per-step token budget.
	running, waiting int
	predicted        time.Duration
	ahead            sim.Backlog
	budget           int
}

var _ des.Router = (*decisionTrace)(nil)

func newDecisionTrace(r *strategyRouter) *decisionTrace {
	return &decisionTrace{strategyRouter: r, recs: map[uint64]decisionRec{}, gaps: map[uint64]gapRec{},
		waitNext: map[kvindex.Key][]int{}}
}

// Pick implements des.Router.
func (t *decisionTrace) Pick(ctx context.Context, req *des.RouteRequest, cands []string) (des.Decision, error) {
	held := map[string]int{}
	var keys []kvindex.Key
	if t.kv != nil && len(req.Tokens) >= sim.DefaultBlockSize {
		keys = kvindex.AppendKeys(nil, kvindex.Root(t.model, req.Adapter, req.CacheSalt), req.Tokens, sim.DefaultBlockSize)
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
	rec := decisionRec{reason: d.Reason, chosen: held[d.Instance], predicted: t.predicted}
	if e := t.kv.engines[d.Instance]; e != nil {
		st := e.Stats()
		rec.running, rec.waiting = st.Running, st.Waiting
		rec.ahead, rec.budget = e.BacklogAt(t.kv.now), e.Config().MaxNumBatchedTokens
	}
	for _, n := range held {
		rec.best = max(rec.best, n)
	}
	t.recs[uint64(req.ID)] = rec
	t.noteMove(req, keys, held, rec.best, rec.chosen, d.Instance)
	t.noteGap(req, keys, rec.best, d.Instance, d.Reason, rec.chosen < rec.best)
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
	// GainAfter is cached − chosen held, where the engine served more than
	// it held at the decision: blocks in flight then (the router's
	// speculative entries, not yet in the index) computed on the chosen
	// instance before this request's prefill.
	GainAfter int64
	// Bound is the pooled bound's hit tokens for these requests (0 without
	// a bound); BoundShort
	// what the bound hit beyond the best holder (no instance held it at the
	// decision), BoundBeyond what the best holder held past the bound.
	Bound, BoundShort, BoundBeyond int64
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
		b.GainAfter += int64(max(o.CachedTokens-rec.chosen, 0))
		if t.bound != nil {
			bound := t.boundAt(o.ID)
			b.Bound += int64(bound)
			b.BoundShort += int64(max(bound-rec.best, 0))
			b.BoundBeyond += int64(max(rec.best-bound, 0))
		}
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

// queueProfile is what the router predicted against what happened, for
// the requests served from cache (≥ 90% of the prompt cached, so that the
// time to first token is mostly wait, not the request's own prefill):
// by the chosen engine's running requests at the decision, and per
// instance with its share of all requests.
func (t *decisionTrace) writeQueueProfile(w io.Writer, res *des.Result) error {
	type acc struct {
		n, hits     int
		pred, act   time.Duration
		acts        []time.Duration
		run, waited int
	}
	byRun := map[int]*acc{}
	byInst := map[string]*acc{}
	bucket := func(r int) int {
		switch {
		case r == 0:
			return 0
		case r <= 2:
			return 1
		case r <= 5:
			return 3
		case r <= 10:
			return 6
		}
		return 11
	}
	total := 0
	for _, o := range res.Outcomes {
		rec, ok := t.recs[uint64(o.ID)]
		if !ok || o.Err != "" {
			continue
		}
		total++
		ia := byInst[o.Instance]
		if ia == nil {
			ia = &acc{}
			byInst[o.Instance] = ia
		}
		ia.n++
		ia.run += rec.running
		if rec.waiting > 0 {
			ia.waited++
		}
		if 10*o.CachedTokens < 9*o.PromptTokens {
			continue
		}
		for _, a := range []*acc{ia, byRun[bucket(rec.running)]} {
			if a == nil {
				a = &acc{}
				byRun[bucket(rec.running)] = a
			}
			a.hits++
			a.pred += rec.predicted
			a.act += o.TTFT
			a.acts = append(a.acts, o.TTFT)
		}
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	p50 := func(a *acc) float64 {
		if len(a.acts) == 0 {
			return 0
		}
		slices.Sort(a.acts)
		return ms(a.acts[len(a.acts)/2])
	}
	fmt.Fprintln(w, "\nrequests served from cache (>= 90% cached): predicted vs measured TTFT, by the chosen engine's running requests at the decision:")
	fmt.Fprintln(w, "\n| running | requests | predicted mean ms | measured mean ms | measured p50 ms |\n|---:|---:|---:|---:|---:|")
	for _, b := range []int{0, 1, 3, 6, 11} {
		a := byRun[b]
		if a == nil {
			continue
		}
		label := map[int]string{0: "0", 1: "1-2", 3: "3-5", 6: "6-10", 11: "> 10"}[b]
		fmt.Fprintf(w, "| %s | %d | %.1f | %.1f | %.1f |\n", label, a.hits, ms(a.pred/time.Duration(a.hits)), ms(a.act/time.Duration(a.hits)), p50(a))
	}
	if err := writeAheadProfile(w, t.recs, res); err != nil {
		return err
	}
	names := make([]string, 0, len(byInst))
	for n := range byInst {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintln(w, "\n| instance | share | mean running at decision | found a queue | cache-served: predicted mean ms | measured mean ms | p50 ms |\n|---|---:|---:|---:|---:|---:|---:|")
	for _, n := range names {
		a := byInst[n]
		pm, am := 0.0, 0.0
		if a.hits > 0 {
			pm, am = ms(a.pred/time.Duration(a.hits)), ms(a.act/time.Duration(a.hits))
		}
		if _, err := fmt.Fprintf(w, "| %s | %.3f | %.1f | %.3f | %.1f | %.1f | %.1f |\n", n, float64(a.n)/float64(max(total, 1)),
			float64(a.run)/float64(max(a.n, 1)), float64(a.waited)/float64(max(a.n, 1)), pm, am, p50(a)); err != nil {
			return err
		}
	}
	return nil
}

// aheadClasses name what the chosen engine held ahead of a request at its
// decision, in writeAheadProfile's order.
var aheadClasses = [...]string{"idle", "steps, no prompt work left", "prompt work ≤ one step's budget", "prompt work > one step's budget"}

// aheadClass is rec's index in aheadClasses.
func aheadClass(rec decisionRec) int {
	switch {
	case rec.ahead.StepLeft == 0 && rec.ahead.PrefillTokens == 0:
		return 0
	case rec.ahead.PrefillTokens == 0:
		return 1
	case rec.ahead.PrefillTokens <= rec.budget:
		return 2
	}
	return 3
}

// writeAheadProfile splits the cache-served requests' prediction error by
// what their engine held ahead of them at the decision (sim.Backlog): an
// idle engine, one running steps with no prompt work left to do, one with
// prompt work of at most one step's token budget, and one with more —
// where the router's drained queue, priced at one rate per token, meets
// prefills whose later chunks, attending over a long context, run slower.
// The last column is each class's share of the summed under-prediction
// (measured − predicted, over all cache-served requests).
func writeAheadProfile(w io.Writer, recs map[uint64]decisionRec, res *des.Result) error {
	type acc struct {
		n               int
		pred, act, step time.Duration
		tokens          int64
	}
	var by [len(aheadClasses)]acc
	var under time.Duration
	for _, o := range res.Outcomes {
		rec, ok := recs[uint64(o.ID)]
		if !ok || o.Err != "" || 10*o.CachedTokens < 9*o.PromptTokens {
			continue
		}
		a := &by[aheadClass(rec)]
		a.n++
		a.pred += rec.predicted
		a.act += o.TTFT
		a.tokens += int64(rec.ahead.PrefillTokens)
		a.step += rec.ahead.StepLeft
		under += o.TTFT - rec.predicted
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	fmt.Fprintln(w, "\nthe same requests by what their engine held ahead of them at the decision (the rest of the step in progress, prompt tokens left to compute):")
	fmt.Fprintln(w, "\n| engine held | requests | step left, mean ms | prompt tokens ahead, mean | predicted mean ms | measured mean ms | share of the under-prediction |\n|---|---:|---:|---:|---:|---:|---:|")
	for c, a := range by {
		if a.n == 0 {
			continue
		}
		share := 0.0
		if under != 0 {
			share = float64(a.act-a.pred) / float64(under)
		}
		n := time.Duration(a.n)
		if _, err := fmt.Fprintf(w, "| %s | %d | %.1f | %.0f | %.1f | %.1f | %.2f |\n", aheadClasses[c], a.n, ms(a.step/n), float64(a.tokens)/float64(a.n),
			ms(a.pred/n), ms(a.act/n), share); err != nil {
			return err
		}
	}
	return nil
}
