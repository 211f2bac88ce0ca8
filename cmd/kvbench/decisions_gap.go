package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// The bound's gap (des --decisions): the pooled-cache bound hits some
// tokens of a request that no instance held at its decision. Each such
// deficit is traced to the decision that last placed its first missing
// block (an earlier turn of the session, or the first request of a shared
// root) and split into: the placing request had not finished its prefill
// yet ("in flight": a pooled cache stores at arrival, an engine at
// prefill); the placing instance evicted it before this request came
// ("evicted"), with the instance's turnover time then, to tell a context
// placed where the cache turns over faster than elsewhere from one older
// than every instance's turnover; or nothing placed it ("not placed").

// placement is the last decision that put a block on an instance.
type placement struct {
	id     uint64
	inst   string
	reason string
	moved  bool // the pick held less than the best holder
}

// blockRec is what the trace keeps of a block: the decision that last
// placed it, the instances (bits, decisionTrace.bit) it was ever placed on,
// and how many requests carried it.
type blockRec struct {
	last placement
	ever instSet
	uses int
}

// gapRec is a request's deficit against the bound at its decision.
type gapRec struct {
	deficit int // bound − best holder's tokens (> 0)
	now     time.Duration
	placer  placement
	found   bool
	// turnover is each instance's turnover time at the decision (0 when it
	// has not evicted enough to tell).
	turnover map[string]time.Duration
}

// lifeWindow is how many of an instance's most recent GPU evictions give
// its turnover time (the median age, stored to removed, of those blocks).
// A diagnostic's choice: large enough that a median is stable (a few
// hundred blocks, a few prompts' worth at 512-token blocks), small enough
// to follow load changes within a minute of virtual time.
const lifeWindow = 256

// lifeTracker watches the engines' events on their way to the index and
// keeps each instance's recent block lifetimes (BlockStored to GPU
// BlockRemoved), the turnover time of its cache as the router could
// measure it.
type lifeTracker struct {
	des.IndexWriter
	now    func() time.Duration
	stored map[string]map[uint64]time.Duration
	// gone is, per instance, the engine hashes of the GPU blocks it
	// removed and has not stored again: a block placed there earlier and
	// not held now is evicted when it is here, still being computed (in
	// flight) when not.
	gone map[string]map[uint64]struct{}
	ages map[string][]time.Duration // ring of the last lifeWindow ages
	next map[string]int
}

func newLifeTracker(w des.IndexWriter, now func() time.Duration) *lifeTracker {
	return &lifeTracker{IndexWriter: w, now: now, stored: map[string]map[uint64]time.Duration{},
		gone: map[string]map[uint64]struct{}{}, ages: map[string][]time.Duration{}, next: map[string]int{}}
}

// Apply implements des.IndexWriter.
func (l *lifeTracker) Apply(ctx context.Context, inst string, evs []events.Event) (kvindex.ApplyResult, error) {
	now := l.now()
	st, gone := l.stored[inst], l.gone[inst]
	if st == nil {
		st, gone = map[uint64]time.Duration{}, map[uint64]struct{}{}
		l.stored[inst], l.gone[inst] = st, gone
	}
	for _, ev := range evs {
		if ev.Medium != "" && ev.Medium != sim.MediumGPU {
			continue
		}
		switch ev.Kind {
		case events.BlockStored:
			for _, h := range ev.BlockHashes {
				st[h] = now
				delete(gone, h)
			}
		case events.BlockRemoved:
			for _, h := range ev.BlockHashes {
				at, ok := st[h]
				if !ok {
					continue
				}
				delete(st, h)
				gone[h] = struct{}{}
				a := l.ages[inst]
				if len(a) < lifeWindow {
					l.ages[inst] = append(a, now-at)
				} else {
					a[l.next[inst]] = now - at
					l.next[inst] = (l.next[inst] + 1) % lifeWindow
				}
			}
		case events.AllBlocksCleared:
			clear(st)
		}
	}
	return l.IndexWriter.Apply(ctx, inst, evs)
}

// turnover is each instance's median recent block lifetime (instances
// with fewer than lifeWindow/4 evictions are left out: not turning over).
func (l *lifeTracker) turnover() map[string]time.Duration {
	out := map[string]time.Duration{}
	for inst, a := range l.ages {
		if len(a) < lifeWindow/4 {
			continue
		}
		s := slices.Clone(a)
		slices.Sort(s)
		out[inst] = s[len(s)/2]
	}
	return out
}

// moveRow accounts the tokens lost by moves off the best holder: whether
// the chosen instance had held the lost blocks before (a copy made again
// after its eviction) or never, and how many instances held the best
// holder's prefix at the decision (more than one: a shared root already
// copied).
type moveRow struct {
	Kind     string
	Requests int
	Tokens   int64
}

// noteMove classifies a move off the best holder (chosen < best tokens).
func (t *decisionTrace) noteMove(req *des.RouteRequest, keys []kvindex.Key, held map[string]int, best, chosenHeld int, chosen string) {
	if chosenHeld >= best {
		return
	}
	if len(keys) > 0 {
		var tv map[string]time.Duration
		if t.life != nil {
			tv = t.life.turnover()
		}
		// The holder the request left: of those holding best, the one
		// whose cache keeps blocks longest (the case most for staying).
		holder := ""
		for inst, n := range held {
			if n >= best && (holder == "" || tv[inst] > tv[holder] || (tv[inst] == tv[holder] && inst < holder)) {
				holder = inst
			}
		}
		t.moveRecs = append(t.moveRecs, moveRec{id: uint64(req.ID), holderTurn: tv[holder], chosenTurn: tv[chosen],
			lost: best - chosenHeld, ctx: len(keys) * sim.DefaultBlockSize})
		// The context's last block a later turn can carry: the end of its
		// last whole trace block (a trace prompt's partial last block is
		// not its follow-up's; for other workloads the last block).
		i := len(keys) - 1
		if per := workload.TraceBlockTokens / sim.DefaultBlockSize; len(keys) >= per {
			i = len(keys)/per*per - 1
		}
		t.waitNext[keys[i]] = append(t.waitNext[keys[i]], len(t.moveRecs)-1)
	}
	holders := 0
	for _, n := range held {
		if n >= best {
			holders++
		}
	}
	kind := "never held"
	if i := chosenHeld / sim.DefaultBlockSize; i < len(keys) {
		if t.blocks[keys[i]].ever.has(t.bit(chosen)) {
			// Placed there by an earlier decision, not in the index now:
			// evicted, or still being computed (the index learns a block
			// when the engine stores it).
			kind = "placed before, in flight"
			if t.evictedOn(chosen, req, i) {
				kind = "held before, evicted"
			}
			if t.bit(chosen) == len(instSet{})*64-1 && len(t.bits) > len(instSet{})*64 {
				kind += " (on any instance past the 127th)"
			}
		}
	}
	if holders > 1 {
		kind += ", prefix already on several"
	} else {
		kind += ", one holder"
	}
	// How many earlier requests carried the first lost block: 1 is a
	// session's own context (its previous turn), more a shared prefix.
	if i := chosenHeld / sim.DefaultBlockSize; i < len(keys) {
		switch n := t.blocks[keys[i]].uses; {
		case n <= 1:
			kind += ", block of 1 earlier request"
		case n <= 3:
			kind += ", of 2-3"
		default:
			kind += ", of 4+"
		}
	}
	if t.moves == nil {
		t.moves = map[string]moveRow{}
	}
	r := t.moves[kind]
	r.Kind = kind
	r.Requests++
	r.Tokens += int64(best - chosenHeld)
	t.moves[kind] = r
}

// evictedOn reports whether the chosen instance's engine removed block i
// of the request's prompt from its GPU cache and has not stored it since.
func (t *decisionTrace) evictedOn(chosen string, req *des.RouteRequest, i int) bool {
	if t.life == nil || t.kv == nil {
		return false
	}
	e := t.kv.engines[chosen]
	gone := t.life.gone[chosen]
	if e == nil || len(gone) == 0 || (i+1)*sim.DefaultBlockSize > len(req.Tokens) {
		return false
	}
	hs := e.PromptHashes(req.Tokens[:(i+1)*sim.DefaultBlockSize], req.Adapter, req.CacheSalt)
	if len(hs) <= i {
		return false
	}
	_, ok := gone[hs[i]]
	return ok
}

// instSet is a set of instances by their trace bit numbers
// (decisionTrace.bit): 128 bits, one per instance up to 128 (the largest
// fleet the sweeps run); instances past the 128th share the last, and
// their moves say so (noteMove). A single word made every instance past
// the 64th share one bit, so at 128 instances "held before" on half the
// fleet meant "held by any of that half". Two words, not more: the trace
// keeps a record per block, and each word is 8 bytes more in every one.
type instSet [2]uint64

func (s *instSet) add(b int)     { s[b>>6] |= 1 << (b & 63) }
func (s instSet) has(b int) bool { return s[b>>6]&(1<<(b&63)) != 0 }

// bit is an instance's bit number in an instSet.
func (t *decisionTrace) bit(inst string) int {
	if t.bits == nil {
		t.bits = map[string]int{}
	}
	b, ok := t.bits[inst]
	if !ok {
		b = min(len(t.bits), len(instSet{})*64-1)
		t.bits[inst] = b
	}
	return b
}

func writeMoveAccount(w io.Writer, moves map[string]moveRow, prompt int64) error {
	fmt.Fprintln(w, "\nmoves off the best holder, by what the chosen instance had held (fractions of all prompt tokens):")
	fmt.Fprintln(w, "\n| move | requests | tokens lost | per move |\n|---|---:|---:|---:|")
	rows := make([]moveRow, 0, len(moves))
	for _, r := range moves {
		rows = append(rows, r)
	}
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].Tokens != rows[j].Tokens {
			return rows[i].Tokens > rows[j].Tokens
		}
		return rows[i].Kind < rows[j].Kind
	})
	for _, r := range rows {
		if _, err := fmt.Fprintf(w, "| %s | %d | %.4f | %d |\n", r.Kind, r.Requests, float64(r.Tokens)/float64(max(prompt, 1)), r.Tokens/int64(max(r.Requests, 1))); err != nil {
			return err
		}
	}
	return nil
}

// noteGap records, at a decision, the request's deficit against the bound
// and what placed its first missing block; then marks the request's blocks
// as placed on the chosen instance.
func (t *decisionTrace) noteGap(req *des.RouteRequest, keys []kvindex.Key, best int, chosen string, reason string, moved bool) {
	if t.blocks == nil {
		t.blocks = map[kvindex.Key]blockRec{}
	}
	id := uint64(req.ID)
	for _, k := range keys {
		w, ok := t.waitNext[k]
		if !ok {
			continue
		}
		rest := w[:0]
		for _, i := range w {
			if t.moveRecs[i].id == id {
				rest = append(rest, i)
				continue
			}
			t.moveRecs[i].next, t.moveRecs[i].nextAt = true, req.Now
		}
		if len(rest) == 0 {
			delete(t.waitNext, k)
		} else {
			t.waitNext[k] = rest
		}
	}
	if b := t.boundAt(req.ID); b < best {
		t.beyond += int64(best - b)
	} else if b > best {
		g := gapRec{deficit: b - best, now: req.Now}
		if i := best / sim.DefaultBlockSize; i < len(keys) {
			var b blockRec
			b, g.found = t.blocks[keys[i]]
			g.placer = b.last
		}
		if t.life != nil {
			g.turnover = t.life.turnover()
		}
		t.gaps[id] = g
	}
	p := placement{id: id, inst: chosen, reason: reason, moved: moved}
	bit := t.bit(chosen)
	for _, k := range keys {
		b := t.blocks[k]
		b.last, b.uses = p, b.uses+1
		b.ever.add(bit)
		t.blocks[k] = b
	}
}

func (t *decisionTrace) boundAt(id int) int {
	if id < 0 || id >= len(t.bound) {
		return 0
	}
	return int(t.bound[id])
}

// gapRow is one line of the bound's gap account.
type gapRow struct {
	Class, Placer string
	Requests      int
	Tokens        int64
}

// gapAccount classifies every recorded deficit with the run's outcomes.
func (t *decisionTrace) gapAccount(res *des.Result) []gapRow {
	out := map[int]des.Outcome{}
	for _, o := range res.Outcomes {
		out[o.ID] = o
	}
	by := map[[2]string]*gapRow{}
	ids := make([]uint64, 0, len(t.gaps))
	for id := range t.gaps {
		ids = append(ids, id)
	}
	slices.Sort(ids) // evictSeen in request order: the same output every run
	for _, id := range ids {
		g := t.gaps[id]
		if o, ok := out[int(id)]; !ok || o.Err != "" {
			continue
		}
		class, placer := "not placed", "-"
		if g.found {
			placer = g.placer.reason
			if g.placer.moved {
				placer += " (moved)"
			}
			po := out[int(g.placer.id)]
			switch {
			case po.Err != "":
				class = "placer failed"
			case g.now < po.Arrival+po.TTFT:
				class = "in flight"
			default:
				gap := g.now - po.Finish
				own := g.turnover[g.placer.inst]
				longest := time.Duration(0)
				for inst, d := range g.turnover {
					if inst != g.placer.inst {
						longest = max(longest, d)
					}
				}
				if own > 0 {
					t.evictSeen = append(t.evictSeen, [3]time.Duration{gap, own, longest})
				}
				switch {
				case own == 0:
					class = "evicted (instance not yet turning over)"
				case gap <= longest:
					class = "evicted, would outlive it elsewhere"
				default:
					class = "evicted, older than every other instance's turnover"
				}
			}
		}
		k := [2]string{class, placer}
		r := by[k]
		if r == nil {
			r = &gapRow{Class: class, Placer: placer}
			by[k] = r
		}
		r.Requests++
		r.Tokens += int64(g.deficit)
	}
	rows := make([]gapRow, 0, len(by))
	for _, r := range by {
		rows = append(rows, *r)
	}
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].Tokens != rows[j].Tokens {
			return rows[i].Tokens > rows[j].Tokens
		}
		return rows[i].Class+rows[i].Placer < rows[j].Class+rows[j].Placer
	})
	return rows
}

// writeGapAccount prints the account (fractions of all prompt tokens);
// beyond is what best holders held past the bound at other decisions
// (decisionTrace.beyond): the bound's gap is the rows, less it, plus the
// moves off the best holder and what the chosen engine lost after the
// decision, less what it gained after it (writeGapIdentity).
func writeGapAccount(w io.Writer, rows []gapRow, beyond, prompt int64) error {
	fmt.Fprintln(w, "\nthe bound's gap: tokens the pooled bound hits that no instance held at the decision, by what became of the block's last placement (fractions of all prompt tokens):")
	fmt.Fprintln(w, "\n| class | placed by | requests | tokens |\n|---|---|---:|---:|")
	var sum int64
	for _, r := range rows {
		sum += r.Tokens
		if _, err := fmt.Fprintf(w, "| %s | %s | %d | %.4f |\n", r.Class, r.Placer, r.Requests, float64(r.Tokens)/float64(max(prompt, 1))); err != nil {
			return err
		}
	}
	_, err := fmt.Fprintf(w, "| all | | | %.4f |\n| best holders beyond the bound at other decisions (bound − hit = all − this + moves off the best holder + blocks lost after the decision − blocks gained after it: the next table) | | | %.4f |\n",
		float64(sum)/float64(max(prompt, 1)), float64(beyond)/float64(max(prompt, 1)))
	return err
}

// writeTurnover prints, for the evicted deficits, the time since the
// placing request finished against the placing instance's turnover and the
// longest other instance's at the decision, and each instance's turnover
// at the end of the run.
func (t *decisionTrace) writeTurnover(w io.Writer) error {
	s := func(d time.Duration) string { return fmt.Sprintf("%.1f", d.Seconds()) }
	fmt.Fprintln(w, "\nevicted deficits: idle since the placing request finished / placing instance's turnover / longest other's, s:")
	for _, e := range t.evictSeen {
		fmt.Fprintf(w, "%s/%s/%s ", s(e[0]), s(e[1]), s(e[2]))
	}
	fmt.Fprintln(w, "\nturnover (median block lifetime of the last evictions) per instance at the end, s:")
	if t.life == nil {
		return nil
	}
	tv := t.life.turnover()
	names := make([]string, 0, len(tv))
	for n := range tv {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "%s %s  ", n, s(tv[n]))
	}
	_, err := fmt.Fprintln(w)
	return err
}

// moveRec follows a move off the best holder to the next request that
// reads the moved context (its last block): was the move what kept the
// context for it?
type moveRec struct {
	id                     uint64
	holderTurn, chosenTurn time.Duration // turnover at the move (0: not evicting yet)
	lost, ctx              int           // tokens recomputed by the move; the context's tokens
	next                   bool
	nextAt                 time.Duration
}

// writeMoveOutcomes splits the moves by what the context's next reader
// found: idle (from the mover's finish to the next reader's arrival) within
// the left holder's turnover — the holder would likely have kept it, the
// move only cost its recompute — or beyond it, where the move may have
// saved the context (within the target's turnover) or not.
func (t *decisionTrace) writeMoveOutcomes(w io.Writer, res *des.Result, prompt int64) error {
	out := map[int]des.Outcome{}
	for _, o := range res.Outcomes {
		out[o.ID] = o
	}
	type acc struct {
		n          int
		lost, ctxs int64
	}
	by := map[string]*acc{}
	order := []string{}
	for _, m := range t.moveRecs {
		o := out[int(m.id)]
		class := ""
		switch {
		case o.Err != "":
			continue
		case !m.next:
			class = "no later request read the context"
		case m.holderTurn == 0:
			class = "holder not evicting yet"
		case m.nextAt-o.Finish <= m.holderTurn:
			class = "next reader within the holder's turnover (holder would have kept it)"
		case m.chosenTurn == 0 || m.nextAt-o.Finish <= m.chosenTurn:
			class = "beyond the holder's turnover, within the target's (the move kept it)"
		default:
			class = "beyond both turnovers"
		}
		a := by[class]
		if a == nil {
			a = &acc{}
			by[class] = a
			order = append(order, class)
		}
		a.n++
		a.lost += int64(m.lost)
		a.ctxs += int64(m.ctx)
	}
	sort.Strings(order)
	fmt.Fprintln(w, "\nmoves off the best holder, by when the moved context was next read (fractions of all prompt tokens):")
	fmt.Fprintln(w, "\n| when | moves | tokens recomputed | context tokens moved |\n|---|---:|---:|---:|")
	f := func(n int64) float64 { return float64(n) / float64(max(prompt, 1)) }
	for _, c := range order {
		a := by[c]
		if _, err := fmt.Fprintf(w, "| %s | %d | %.4f | %.4f |\n", c, a.n, f(a.lost), f(a.ctxs)); err != nil {
			return err
		}
	}
	return nil
}

// writeGapIdentity prints the bound's gap, bound − hit, term by term over
// the requests that completed (breakdown's rows): per request bound −
// cached = (bound − best holder) + (best holder − chosen) + (chosen held −
// cached). The first is the gap account's rows when positive, a best
// holder beyond the bound when negative; the second the moves off the best
// holder; the third is signed — blocks the chosen instance held at the
// decision and evicted before the prefill, less blocks it did not hold yet
// (in flight: the router's speculative entries) and computed before the
// prefill. Without the last term the in-flight rows read as lost although
// most of them are served.
func writeGapIdentity(w io.Writer, rows []decisionBreakdown, prompt int64) error {
	var sum decisionBreakdown
	for _, r := range rows {
		sum.Bound += r.Bound
		sum.Cached += r.Cached
		sum.BoundShort += r.BoundShort
		sum.BoundBeyond += r.BoundBeyond
		sum.LostMove += r.LostMove
		sum.LostEvict += r.LostEvict
		sum.GainAfter += r.GainAfter
	}
	f := func(n int64) float64 { return float64(n) / float64(max(prompt, 1)) }
	fmt.Fprintln(w, "\nthe bound's gap term by term (fractions of all prompt tokens; bound − hit = sum of the terms):")
	fmt.Fprintln(w, "\n| term | tokens |\n|---|---:|")
	for _, r := range []struct {
		name string
		n    int64
	}{
		{"bound − hit", sum.Bound - sum.Cached},
		{"no instance held at the decision (the gap account's all)", sum.BoundShort},
		{"− best holders beyond the bound", -sum.BoundBeyond},
		{"+ moves off the best holder", sum.LostMove},
		{"+ held by the chosen instance at the decision, gone by its prefill", sum.LostEvict},
		{"− not held at the decision, computed on the chosen instance by its prefill (in flight then)", -sum.GainAfter},
	} {
		if _, err := fmt.Fprintf(w, "| %s | %.4f |\n", r.name, f(r.n)); err != nil {
			return err
		}
	}
	return nil
}
