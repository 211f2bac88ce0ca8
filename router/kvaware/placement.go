package kvaware

import (
	"math"
	"sync"
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
// instances holding the instructions: on the code workload kv_aware's
// requests found their engine mid-step ~50% of the time against ~30% for
// prefix_aware's hash at the same fleet busy fraction (docs/BENCHMARKS.md
// §7, "Placement").
//
// The term prices the later requests on each candidate i:
//
//	place_i = n · ρ̄_i · S
//
//   - ρ̄_i is the instance's busy fraction as this router sees it (a request
//     in flight), averaged exponentially over DefaultUtilisationWindow (the
//     fleet's ρ per instance, same window, same reasons). A later request
//     arriving at i finds it mid-step with probability ρ̄_i (arrivals see
//     time averages, PASTA) and then waits the residual of the step in
//     progress, S/2 on average (S = decode_step_seconds, Queue in
//     docs/kv-aware.md). Its own busy time raises ρ̄_i, making i's other
//     requests wait as often more: the cost ρ·S/2 per request summed over
//     an instance's requests grows with the square of its load, and a
//     marginal request costs its derivative, twice the mean — ρ̄_i · S.
//     Only differences between candidates count.
//   - n is the number of later requests expected to read the new context,
//     the same for every candidate: the context no candidate holds,
//     T − (the best match), over the mean tokens a request computes (ū,
//     measured over the last ~64 picks as the drain rate is), less the
//     request itself (its own wait is the score's queue). Conservation
//     of work gives it: the fleet computes ū tokens per request, so each
//     computed token is, on average, what 1/ū requests come for.
//     A follow-up that adds a short turn (about ū tokens) places nothing
//     (n ≈ 0); a request bringing 15 times the mean new context places
//     ~14 later requests. ū is floored at one block: an engine recomputes
//     at least the last, partial block of every prompt.
//
// The term counts only while the prefill cost weight is at its floor of 1
// (adaptive or fixed): the step residual is the wait a later request meets
// only while requests do not queue behind each other's prefill. Once they
// do — the weight's own estimates, ρ/(1−ρ)² and the requests measured
// behind others, past 1 — a later request's wait is the prefill queue it
// will find, which the busy fraction does not measure (a decoding engine
// is busy), and the queue term and the weighted recompute already price
// it. Measured: on the bundled trace at 8 instances, 1× (weight ~19) the
// term on at every weight moved long prompts by a few ms of ρ̄ differences
// and lost 0.8 point of hit rate (0.985 → 0.958 of the pooled bound).
//
// No constant is added: S is the queue's, the window the utilisation's,
// the averaging the drain rate's, the floor the weight's. The term is not
// in the predicted TTFT (the header): it is the fleet's, like the weighted
// recompute.

// busyAverage is one instance's busy fraction as the router sees it,
// averaged exponentially over DefaultUtilisationWindow of the decision
// clock. An instance's average starts at 0 when the router first routes
// to it (it had nothing of this router's in flight before).
type busyAverage struct {
	mu  sync.Mutex
	rho float64
	at  time.Time
}

// read folds busy (observed at now) in when update is set (committed
// decisions; shadow scoring only reads) and returns the average. decay is
// a one-entry memo of 1 − e^(−dt/window) shared by one decision's
// candidates, which were mostly last updated together.
func (b *busyAverage) read(now time.Time, busy, update bool, decay *decayMemo) float64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	if update {
		if b.at.IsZero() {
			b.at = now
		}
		if dt := now.Sub(b.at); dt > 0 {
			v := 0.0
			if busy {
				v = 1
			}
			b.rho += (v - b.rho) * decay.of(dt)
		}
		b.at = now
	}
	return b.rho
}

// decayMemo remembers 1 − e^(−dt/window) for the last dt asked about.
type decayMemo struct {
	dt time.Duration
	f  float64
}

func (m *decayMemo) of(dt time.Duration) float64 {
	if dt != m.dt || m.f == 0 {
		m.dt, m.f = dt, 1-math.Exp(-dt.Seconds()/DefaultUtilisationWindow.Seconds())
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

// notePlacement sets ev.later (n) from the best match among the candidates.
func (st *KVState) notePlacement(ev *kvEval) {
	ev.later = 0
	if ev.tokens == 0 || ev.blockSize == 0 || ev.fallback != "" || ev.weight > DefaultPrefillCostWeight {
		return
	}
	best := 0
	for i := range ev.cands {
		best = max(best, ev.cands[i].blocks[len(ev.cands[i].blocks)-1])
	}
	ev.later = laterRequests(ev.tokens-min(best*ev.blockSize, ev.tokens), st.computed.mean(), ev.blockSize)
}
