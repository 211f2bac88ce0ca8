package kvaware

import (
	"math"
	"sync"
	"time"
)

// The pending-prefill counter says how much prompt work the router has sent
// an instance that has not had its first response byte: it drops only when
// a request's first byte arrives. While an instance works through a long
// prompt (a 100,000-token prefill takes ~4 s at 25,000 tokens/s), the
// counter keeps the whole prompt until its end, although the engine has
// already done part of it: a request deciding half way would see twice the
// wait there really is, and leave a holder of its prefix for nothing.
//
// So each counter also keeps the time its routed work is predicted done:
// the work is served first come, first served at the prefill rate P, so
// adding d seconds of prefill at now moves that time to max(done, now) + d
// (the finishing time of a work-conserving FIFO queue). The queue then
// counts min(pending tokens, P × (done − now)): both bound the work left —
// the first ignores what the engine has done since, the second ignores
// requests that started sooner than predicted (more of the prompt cached,
// a faster engine) — so the smaller is the better estimate.

// addWork records that a request bringing d of prefill was routed to the
// instance at now. first says the counter had no pending request before it
// (the instance's prefill queue was empty as the router saw it): the work
// starts now, whatever an earlier prediction said.
func (pc *pendingCounter) addWork(now time.Time, d time.Duration, first bool) {
	n := now.UnixNano()
	for {
		old := pc.doneAt.Load()
		start := max(old, n)
		if first {
			start = n
		}
		next := start + int64(d)
		if next < start { // overflow: saturate
			next = math.MaxInt64
		}
		if pc.doneAt.CompareAndSwap(old, next) {
			return
		}
	}
}

// drainedTokens is the prefill work left on the instance at now, in
// tokens: the smaller of the pending tokens and what the FIFO prediction
// says is left at rate prefill (tokens/s).
func (pc *pendingCounter) drainedTokens(now time.Time, pending, prefill float64) float64 {
	left := float64(pc.doneAt.Load()-now.UnixNano()) / 1e9 * prefill
	return max(0, min(pending, left))
}

// The prediction needs the rate at which an engine works off routed
// prefill. The configured P is the engine's rate on an otherwise idle step;
// a loaded engine is slower (decode tokens share each step's budget,
// attention over long contexts costs more per token), and draining at P
// would then understate the wait. So the rate is measured, as the router
// sees it: a request's first byte arrives when the engine has done the work
// that was ahead of it plus its own, so over recent requests
//
//	rate = Σ (work ahead + own work) / Σ (first byte − routing time)
//
// (a ratio of sums: long prefills, where the rate matters, weigh most). It
// is the engine's real throughput including everything the router cannot
// see (decode interference, network, other routers' requests in between);
// until enough first bytes have been seen, P.

// drainSampleHalfLife is how many first bytes the measured rate averages
// over, as the half-life of an exponential weight: 64 samples put one
// unusual request at under 2% of the estimate and, on a fleet doing a few
// requests a second per instance, follow a change of load within seconds.
const drainSampleHalfLife = 64

// drainMinSamples is the weight of evidence below which the measured rate
// is not used (P is): eight first bytes.
const drainMinSamples = 8

// prefillRate is the measured prefill throughput (tokens/s) of a pool's
// engines.
type prefillRate struct {
	mu       sync.Mutex
	tok, sec float64 // exponentially weighted sums
	n        int     // samples seen
}

var drainDecay = math.Exp2(-1.0 / drainSampleHalfLife)

// observe folds one request's first byte in: tok tokens were done in sec
// seconds.
func (r *prefillRate) observe(tok, sec float64) {
	if !(tok > 0) || !(sec > 0) || math.IsInf(tok, 0) || math.IsInf(sec, 0) {
		return
	}
	r.mu.Lock()
	r.tok = r.tok*drainDecay + tok
	r.sec = r.sec*drainDecay + sec
	r.n++
	r.mu.Unlock()
}

// rate is the measured rate, or def before there is enough evidence.
func (r *prefillRate) rate(def float64) float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n < drainMinSamples || !(r.sec > 0) {
		return def
	}
	return r.tok / r.sec
}

// drainSample is what a request's first byte measures: the time it was
// routed and the work (tokens) that had to be done before it.
type drainSample struct {
	at   time.Time
	work float64
}

// newDrainingObserver is newObserver for the chosen candidate ce, also
// advancing the instance's predicted end of work by the request's
// recompute (at the measured rate) and remembering what its first byte
// will measure.
func (st *KVState) newDrainingObserver(ce *candEval, recompute, predicted int, prefill float64) *kvObserver {
	o, first := st.newObserver(ce.inst.ID(), recompute, predicted)
	o.committed = true
	now := st.now()
	st.prefillDef.Store(math.Float64bits(prefill))
	rate := st.drainRate.rate(prefill)
	o.pc.addWork(now, seconds(float64(o.pendTok)/rate), first)
	if first {
		o.pc.period.Store(0)
	}
	st.behind.add(float64(o.pc.period.Add(1) - 1))
	o.drain = drainSample{at: now, work: ce.ahead + float64(o.pendTok)}
	return o
}

// firstByte is the response's first byte: the request's prefill is done.
// It measures the prefill rate (once, before the pending work is given
// back) and releases the pending prefill.
func (o *kvObserver) firstByte() {
	if !o.released.Load() && !o.drain.at.IsZero() {
		o.st.drainRate.observe(o.drain.work, o.st.now().Sub(o.drain.at).Seconds())
	}
	o.release()
}

// sampleMean is an exponentially weighted mean over samples (half-life
// drainSampleHalfLife samples).
type sampleMean struct {
	mu     sync.Mutex
	sum, w float64 // weighted sum and weight
	n      int     // samples seen
}

func (m *sampleMean) add(v float64) {
	m.mu.Lock()
	m.sum = m.sum*drainDecay + v
	m.w = m.w*drainDecay + 1
	m.n++
	m.mu.Unlock()
}

// mean is the weighted mean, 0 before drainMinSamples samples.
func (m *sampleMean) mean() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.n < drainMinSamples {
		return 0
	}
	return m.sum / m.w
}
