package kvaware

import (
	"math"
	"time"
)

// Placement: where a prompt's new context goes, its later requests follow.
//
// Every other term of the score is about the request being placed. But a
// request that computes context nobody holds also places that context: the
// requests that later read it (a coding assistant user's next ~24 edits
// over the ~6,000 tokens of files the first request brings) can only hit
// their cache where it went. The queue the score reads is the instance's
// state now — at light load, whether it happens to be decoding at this
// instant, which says little about how many sessions already live there —
// so the first request of each session went to whichever holder of the
// shared instructions was idle now, and sessions piled onto the few
// instances holding the instructions: on the code workload at 128
// instances, 2×, 54% of kv_aware's cache-served requests found their
// engine mid-step with the fleet no busier than under prefix_aware's hash,
// whose p50 (8.7 ms) is an idle engine's (docs/BENCHMARKS.md §7,
// "Placement").
//
// The term prices the later requests on each candidate i:
//
//	place_i = n · 2·W̄_i
//
//   - W̄_i is the instance's predicted queue (the score's own, Queue in
//     docs/kv-aware.md: prefill ahead, drained, and the residual of the
//     step in progress) averaged exponentially over DefaultUtilisationWindow
//     of the decision clock (the fleet's ρ's window, same reasons), sampled
//     at each committed decision and held until the next. Requests arriving at random moments see
//     the time average (PASTA), so W̄_i is what a later request of the
//     context is expected to wait there. It also adds its own work to i,
//     making i's other requests wait as much more: at light load the wait
//     grows in proportion to the load, the total wait λ·W with the square
//     of it, and a marginal request costs the derivative, twice the mean:
//     2·W̄_i. Only differences between candidates count.
//   - n is the number of later requests expected to read the new context,
//     the same for every candidate: the context no candidate holds,
//     T − (the best match), over the mean tokens a request computes (ū,
//     an exponential average over picks with the drain rate's half-life
//     of 64 picks, and none until 8 picks are seen), less the
//     request itself (its own wait is the score's queue). Conservation
//     of work gives it: the fleet computes ū tokens per request, so each
//     computed token is, on average, what 1/ū requests come for.
//     A follow-up that adds a short turn (about ū tokens) places nothing
//     (n ≈ 0); a request bringing 15 times the mean new context places
//     ~14 later requests. ū is floored at one block: an engine recomputes
//     at least the last, partial block of every prompt.
//
// A first version priced the wait by the instance's busy fraction ρ̄_i
// times the step S (the residual S/2, twice): it leaves out the prefill
// steps in a busy period, whose residual is longer (an arrival is more
// likely to land in a long step), and on the code workload at 128
// instances, 2×, it moved p50 1.26 → 1.16× prefix_aware's where the
// average queue gives 1.05× (docs/BENCHMARKS.md §7, "Placement").
//
// The term counts only while the adaptive weight is at most its floor of 1
// (measured even where prefill_cost_weight fixes the weight the score
// uses): the step residual is the wait a later request meets
// only while requests do not queue behind each other's prefill. Once they
// do — the weight's own estimates, ρ/(1−ρ)² and the requests measured
// behind others, past 1 — a later request's wait is the prefill queue it
// will find, which the step residual does not measure, and the queue term and the weighted recompute already price
// it. Measured: on the bundled trace at 8 instances, 1× (weight ~19) the
// first version's term, on at every weight, moved long prompts by a few ms of ρ̄ differences
// and lost 0.8 point of hit rate (0.985 → 0.958 of the pooled bound).
//
// No constant is added: S is the queue's, the window the utilisation's,
// the averaging the drain rate's, the floor the weight's. The term is not
// in the predicted TTFT (the header): it is the fleet's, like the weighted
// recompute.

// queueAverage is one instance's predicted queue (seconds) averaged
// exponentially over DefaultUtilisationWindow of the decision clock. The
// queue is sampled at committed decisions and held between them: a
// sample's weight is the time until the next one, so a queue seen once
// just before a long quiet spell counts for that spell, and a burst of
// decisions within a millisecond counts for that millisecond. A zero
// value starts at its first sample; KVState.pendingFor starts it at 0 when
// this router first routes to the instance, and predict prices an
// instance never routed to at 0 (starting at the first sample and a mean
// prior cost the code workload's p50: docs/kv-aware.md, "Placement").
//
// Every instance's average is guarded by one lock, KVState.placeMu, which
// a decision takes once for its pass over the candidates (for reading
// only, when it is not committed): a lock per
// candidate was, with two others, most of that pass's cost at 128
// candidates (docs/BENCHMARKS.md §10, "Session 19").
type queueAverage struct {
	q    float64   // the average up to at
	last float64   // the queue sampled at at, held since
	at   time.Time // the last sample's time; zero before the first
}

// read folds the queue q (predicted at now) in when update is set
// (committed decisions; shadow scoring only reads) and returns the
// average. A sample that is not a finite non-negative number is not
// folded in (one NaN would poison the average for good), and the clock
// never moves it backwards (concurrent decisions can commit out of
// order: the later sample folds in as if taken at the latest time seen).
// decay is a one-entry memo of 1 − e^(−dt/window) shared by one
// decision's candidates, which were mostly last updated together.
// Called with KVState.placeMu held.
func (b *queueAverage) read(now time.Time, q float64, update bool, decay *decayMemo) float64 {
	if !update || !(q >= 0) || math.IsInf(q, 1) {
		return b.q
	}
	switch {
	case b.at.IsZero():
		b.q, b.last, b.at = q, q, now
	case now.After(b.at):
		b.q += (b.last - b.q) * decay.of(now.Sub(b.at))
		b.last, b.at = q, now
	default:
		b.last = q
	}
	return b.q
}

// value is the average up to the last sample (what read returns without
// update). Called with KVState.placeMu held.
func (b *queueAverage) value() float64 {
	return b.q
}

// decayMemo remembers 1 − e^(−dt/window) for the last dt asked about.
type decayMemo struct {
	dt time.Duration
	f  float64
}

func (m *decayMemo) of(dt time.Duration) float64 {
	if dt != m.dt || m.f == 0 {
		m.dt, m.f = dt, -math.Expm1(-dt.Seconds()/DefaultUtilisationWindow.Seconds())
	}
	return m.f
}

// laterRequests is n: the later requests expected to read newTokens of
// context nobody holds, given ū (the mean tokens a request computes, 0
// while unmeasured: then nothing is priced) and the block size.
func laterRequests(newTokens int, meanComputed float64, blockSize int) float64 {
	if newTokens <= 0 || !(meanComputed > 0) || blockSize <= 0 {
		return 0
	}
	return max(0, float64(newTokens)/max(meanComputed, float64(blockSize))-1)
}

// notePlacement sets ev.later (n) from the best match among the
// candidates, given ū (meanComputed). ev.tokens are the prompt's tokens as
// the engine prefills them: with truncate_prompt_tokens k its last k
// (Request.TokenIDs), so the new context is the kept tail's
// (TestPlacementCountsKeptTail). The match is not capped at reusable: a
// whole-block prompt's recomputed last block is held already, so it places
// nothing, and capping would change n by at most one block where nothing
// is new, which the floor of ū at a block cancels
// (TestPlacementUnmovedByReuseCap).
func (st *KVState) notePlacement(ev *kvEval, meanComputed float64) {
	ev.later = 0
	// Whether requests queue behind each other's prefill is the measured
	// weight's to say, not a fixed one's: a fixed weight is the operator's
	// price of a recomputed token, and says nothing about load.
	if ev.tokens == 0 || ev.blockSize == 0 || ev.fallback != "" || ev.queueing {
		return
	}
	ev.later = laterRequests(ev.tokens-min(ev.best*ev.blockSize, ev.tokens), meanComputed, ev.blockSize)
}
