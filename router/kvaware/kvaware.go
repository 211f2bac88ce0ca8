package kvaware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
	"github.com/prometheus/client_golang/prometheus"
)

// maxKeyedTokens bounds the prompt tokens a decision keys and looks up
// (2^20, eight times a 128k-token context): a hostile prompt of millions
// of ids must not cost a million-key lookup.
const maxKeyedTokens = 1 << 20

// lostEpoch is the instance's cache epoch from the freshness source (0
// without one).
func (st *KVState) lostEpoch(instance string) uint64 {
	if e, ok := st.fresh.(kvindex.CacheEpochs); ok {
		return e.LostEpoch(instance)
	}
	return 0
}

// KVStateConfig is what a pool's exact routing is built from.
type KVStateConfig struct {
	// Pool and Model name the pool; Model is folded into block-key roots
	// (kvindex.Root) for requests without a LoRA adapter, as the index does.
	Pool  string
	Model string
	// Index is the pool's block map. Required.
	Index kvindex.Index
	// Freshness, nil = the stream is always healthy and no instance stale.
	Freshness kvindex.Freshness
	// Tokens produces token ids for requests that carry none; nil = such
	// requests route heuristically.
	Tokens router.TokenSource
	// Metrics, nil = metrics kept but registered nowhere.
	Metrics *KVMetrics
	// Logger, nil = slog.Default().
	Logger *slog.Logger
	// Now is the clock (speculative entries, load samples); nil = time.Now.
	// Simulations pass their virtual clock.
	Now func() time.Time
}

// KVState is a pool's long-lived exact-routing state: the index and its
// freshness, the token source, the speculative overlay, the router-local
// pending prefill per instance, engine-reported load, and the
// heuristic-versus-exact comparison. It outlives strategy switches and
// reloads, so that switching kv_aware off and on again loses nothing.
// Safe for concurrent use.
type KVState struct {
	pool, model string
	index       kvindex.Index
	fresh       kvindex.Freshness
	tokens      router.TokenSource
	m           *KVMetrics
	dm          decisionMetrics // m's per-decision children for pool
	log         *slog.Logger
	now         func() time.Time

	// seq sequences same-instant bursts with the peers (nil: off;
	// sequence_live.go).
	seq *seqState

	specMu sync.Mutex   // guards spec
	spec   *speculative // the kept overlay: replaced when a strategy committed with another TTL or capacity (keepOverlay)

	pendMu   sync.RWMutex // guards pend and pendMade (the counters themselves are atomic)
	pend     map[string]*pendingCounter
	pendMade int64 // counters ever made: a candidate index's miss stands while this does

	loads   loadStore
	endKeep endKeep // how long ended requests are remembered (loadended.go)

	// streamUp is the stream state last seen by a decision: 0 unknown, 1 up,
	// 2 down; a transition logs once and counts.
	streamUp atomic.Int32

	cmp compareStats

	util utilisation

	// placeMu guards every pendingCounter's queued average (placement.go):
	// written by committed decisions, read by dry ones (shadow scoring,
	// flow control's questions) and the replicas' publication.
	placeMu sync.RWMutex

	drainRate  prefillRate   // measured prefill throughput (kvaware_drain.go)
	prefillDef atomic.Uint64 // the configured P (float64 bits) the measured rate falls back to
	behind     sampleMean    // requests joining a prefill busy period after another (kvaware_drain.go)
	computed   sampleMean    // tokens a pick makes its instance compute, ū (placement.go)
	rent       rentTable     // hot prefixes' rent accounts (replicate.go)

	evalPool sync.Pool // *kvEval scratch

	peers kvPeers // replica sync (kvaware_peers.go)

	probe *http.Client // load scraping (Run); set by Source
}

// pendingCounter is the router-local prefill work routed to an instance
// whose first response byte has not arrived yet.
//
// Every decision reads every candidate's counter, so the fields it reads
// come first: the pending tokens and requests, doneAt and queued fill the
// first 64 bytes,
// the end list's memo (first in endList) the next line; the rest is read
// when a request is routed or ends. (At 192 bytes, a size class whose
// objects start on a cache line, that is two lines per candidate rather
// than three.)
type pendingCounter struct {
	// pend is the pending tokens and requests in one word (tokens above
	// pendReqBits, requests below), so that a reader sees both of one
	// moment: read from two words, a request could pair with none of its
	// tokens (or tokens with no request) and price a step share for a
	// moment that no state of the instance had.
	pend    atomic.Uint64
	doneAt  atomic.Int64 // when the routed work is predicted done, Unix ns (kvaware_drain.go)
	queued  queueAverage // predicted queue, averaged over time (placement.go); KVState.placeMu
	ends    endList      // requests that ended recently (loadended.go)
	period  atomic.Int64 // requests routed since the pending queue was last empty
	lastEnd atomic.Int64 // when a request of this router's last ended there, Unix ns (busyShare)
	pl      pendList     // the pending requests themselves, with replica sync (kvaware_sharedq.go)
}

// NewKVState builds a pool's exact-routing state.
func NewKVState(cfg KVStateConfig) (*KVState, error) {
	if cfg.Index == nil {
		return nil, fmt.Errorf("%w %q", router.ErrNoKVState, cfg.Pool)
	}
	st := &KVState{
		pool: cfg.Pool, model: cfg.Model, index: cfg.Index, fresh: cfg.Freshness, tokens: cfg.Tokens,
		m: cfg.Metrics, log: cfg.Logger, now: cfg.Now, pend: map[string]*pendingCounter{},
	}
	if st.m == nil {
		st.m = newKVMetrics()
	}
	if st.log == nil {
		st.log = slog.Default()
	}
	if st.now == nil {
		st.now = time.Now
	}
	st.attachPeers()
	return st, nil
}

// Index is the pool's block map.
func (st *KVState) Index() kvindex.Index { return st.index }

// speculativeFor returns the overlay for ttl and capacity: the kept one
// when they are unchanged (a routing switch must not forget the bursts in
// flight), else a new one, kept only once its strategy is committed
// (keepOverlay): a strategy built for a reload that then fails must leave
// the kept overlay, which the strategy in use writes and the next switch
// reuses, as it was. ttl < 0 or capacity < 0 disables it (nil).
func (st *KVState) speculativeFor(ttl time.Duration, capacity int) *speculative {
	if ttl < 0 || capacity < 0 {
		return nil
	}
	st.specMu.Lock()
	defer st.specMu.Unlock()
	if sp := st.spec; sp != nil && sp.ttl == ttl && sp.set.Cap() == capacity {
		return sp
	}
	return newSpeculative(ttl, capacity, st.now)
}

// keepOverlay makes the speculative overlay of s, a strategy now in use,
// the kept one (speculativeFor). A strategy without one (not kv_aware's
// over st, or with speculative entries off) leaves the kept overlay as it
// is.
func (st *KVState) keepOverlay(s router.Strategy) {
	kv := kvAwareOf(s)
	if kv == nil || kv.st != st || kv.spec == nil {
		return
	}
	st.specMu.Lock()
	st.spec = kv.spec
	st.specMu.Unlock()
}

func (st *KVState) pendingFor(inst string) *pendingCounter {
	st.pendMu.RLock()
	pc := st.pend[inst]
	st.pendMu.RUnlock()
	if pc != nil {
		return pc
	}
	st.pendMu.Lock()
	defer st.pendMu.Unlock()
	if pc = st.pend[inst]; pc == nil {
		pc = &pendingCounter{}
		pc.queued.at = st.now() // nothing of this router's queued there until now
		st.pend[inst] = pc
		st.pendMade++
	}
	return pc
}

// PendingPrefill reports the router-local prefill tokens and requests
// routed to inst that have not had their first response byte.
func (st *KVState) PendingPrefill(inst string) (tokens, requests int64) {
	st.pendMu.RLock()
	pc := st.pend[inst]
	st.pendMu.RUnlock()
	if pc == nil {
		return 0, 0
	}
	return pc.load()
}

// pendReqBits is the pending requests' part of pendingCounter.pend: a
// million requests waiting for their first byte on one instance, beyond
// any engine's queue; the tokens take the 44 bits above (17 T).
const pendReqBits = 20

// add counts one request of tokens pending, and reports whether it is the
// only one pending (its own increment: two concurrent adds cannot both
// miss it, as a later read could).
func (pc *pendingCounter) add(tokens int64) bool {
	return pc.pend.Add(uint64(tokens)<<pendReqBits+1)&(1<<pendReqBits-1) == 1
}

// sub gives back one request of tokens that add counted.
func (pc *pendingCounter) sub(tokens int64) {
	pc.pend.Add(-(uint64(tokens)<<pendReqBits + 1))
}

// load is the pending tokens and requests, of one moment.
func (pc *pendingCounter) load() (tokens, reqs int64) {
	v := pc.pend.Load()
	return int64(v >> pendReqBits), int64(v & (1<<pendReqBits - 1))
}

// SetLoad records an engine-reported load sample for inst (simulations
// call it; the scraper sets its samples itself). Counts that are not
// finite and non-negative are no load: the instance's sample is dropped,
// as after a failed scrape (a NaN load compared false with every bound).
func (st *KVState) SetLoad(inst string, waiting, running float64) {
	if !validCount(waiting) || !validCount(running) {
		st.loads.drop(inst)
		return
	}
	now := st.now()
	st.loads.set(inst, loadSample{waiting: waiting, running: running, at: now, got: now})
}

// validCount reports whether v can be a count of requests.
func validCount(v float64) bool { return v >= 0 && !math.IsInf(v, 1) }

// noteStream logs and counts a change of the stream's health.
func (st *KVState) noteStream(up bool) {
	v := int32(2)
	if up {
		v = 1
	}
	old := st.streamUp.Swap(v)
	if old == v {
		return
	}
	if old == 0 && up {
		st.m.streamUp.WithLabelValues(st.pool).Set(1) // the first decision: not a transition
		return
	}
	if up {
		st.m.streamUp.WithLabelValues(st.pool).Set(1)
		st.m.streamTransitions.WithLabelValues(st.pool, "up").Inc()
		st.log.Info("kv event stream healthy: exact routing resumed", "pool", st.pool)
	} else {
		st.m.streamUp.WithLabelValues(st.pool).Set(0)
		st.m.streamTransitions.WithLabelValues(st.pool, "down").Inc()
		st.log.Warn("kv event stream down: routing by prefix hash until it recovers", "pool", st.pool)
	}
}

// KVAware is the kv_aware strategy for one routing configuration of a
// pool: a value built per configuration, over the pool's long-lived KVState.
type KVAware struct {
	st        *KVState
	sc        kvScoring
	threshold int
	fallback  *router.PrefixAware
	rnd       func(n uint64) uint64 // the fallback's randomness, shared by the shadow's
	spec      *speculative          // nil when disabled
	loadAge   time.Duration
	cands     candIndexCache // the last candidate list's id → position
}

// NewKVAware builds the kv_aware strategy for rc (defaults applied) over
// st, in use at once: simulations call it directly, with no pool to
// commit it (a pool's, built by KVState.Strategy, is committed by
// RoutingChanged).
func NewKVAware(rc config.RoutingConfig, st *KVState) (*KVAware, error) {
	s, err := newKVAware(rc, st, rand.Uint64N)
	if err == nil {
		st.keepOverlay(s)
	}
	return s, err
}

func newKVAware(rc config.RoutingConfig, st *KVState, rnd func(uint64) uint64) (*KVAware, error) {
	if st == nil {
		return nil, router.ErrNoKVState
	}
	rc = rc.WithDefaults()
	if err := rc.KV.ValidateKV("routing.kv"); err != nil {
		return nil, err
	}
	sc := resolveScoring(rc.KV)
	loadAge := 3 * max(sc.scrape, DefaultScrapeInterval)
	st.endKeep.atLeast(int64(loadAge))
	return &KVAware{
		st:        st,
		sc:        sc,
		threshold: rc.ConcurrencyThreshold,
		fallback:  router.NewPrefixAware(rc.ConcurrencyThreshold, rnd),
		rnd:       rnd,
		spec:      st.speculativeFor(sc.specTTL, sc.specCap),
		loadAge:   loadAge,
	}, nil
}

// Name implements Strategy.
var _ router.Strategy = (*KVAware)(nil)

func (*KVAware) Name() string { return config.StrategyKVAware }

// Pick implements Strategy.
func (s *KVAware) Pick(ctx context.Context, req *router.Request, cands []*router.Instance) (router.Decision, error) {
	dec, ev, err := s.pick(ctx, req, cands, true)
	if ev != nil {
		s.st.putEval(ev)
	}
	return dec, err
}

// waitTurn waits, when sequencing with live peers, for the request's turn
// in its epoch (sequence_live.go); done ends the turn once the pick is
// made. pick calls it for every pick it commits, so no caller that picks
// for real (Pick, Shadow's, any later one) can pass the hold. kept is
// cands less those no longer healthy after a hold: a reload that removed
// an instance meanwhile ejected it (and may have forgotten its state
// already), a health check may have failed it; cands itself when none.
func (s *KVAware) waitTurn(ctx context.Context, req *router.Request, cands []*router.Instance) (kept []*router.Instance, done func(), err error) {
	q := s.st.seq
	if q == nil || len(cands) == 0 {
		return cands, func() {}, nil
	}
	w, err := q.hold(ctx, s, req, cands)
	if err != nil || w == nil {
		return cands, func() {}, err
	}
	return stillHealthy(cands), func() { close(w.done) }, nil
}

// stillHealthy is cands without the instances no longer healthy, in a new
// slice (cands is the caller's); cands itself when all are.
func stillHealthy(cands []*router.Instance) []*router.Instance {
	i := slices.IndexFunc(cands, func(in *router.Instance) bool { return !in.Healthy() })
	if i < 0 {
		return cands
	}
	kept := slices.Clone(cands[:i])
	for _, in := range cands[i+1:] {
		if in.Healthy() {
			kept = append(kept, in)
		}
	}
	return kept
}

// candEval is one candidate's score. The fields every pass over the
// candidates reads (choose's two, bounded's, leastQueue's) come first, in
// one cache line of the ~200-byte value: those passes touch one line per
// candidate rather than three.
type candEval struct {
	inst *router.Instance
	rv   uint64 // rendezvous score for the request
	// score is what the pick minimises: ttft plus the weighted prefill the
	// pick adds to the fleet (see KVScoringConfig.PrefillCostWeight).
	score float64
	// scoreStale is score had the stale blocks counted (= score when none).
	scoreStale float64
	queue      float64 // predicted wait before its prefill starts, seconds
	load       float64 // queue without the step in progress: the bounded-load rule's measure
	inflight   int     // the instance's requests in flight, read once per decision
	full       bool    // at the concurrency threshold
	// scored is false for a cold candidate predict skipped (scores +Inf,
	// see scoreCold): kvEval.find scores it when asked about it.
	scored bool
	blocks [tiers.Count]int // leading blocks held, cumulative per tier (fresh index + speculative)
	stale  [tiers.Count]int // the index's blocks, not counted: the instance is stale
	// indexed is the leading blocks the index (not the speculative
	// overlay) says it holds, in any tier.
	indexed int
	// matched is blocks in tokens per tier, each beyond faster tiers.
	matched [tiers.Count]int
	ttft    float64 // predicted, seconds
	ahead   float64 // routed prefill tokens predicted left there (kvaware_drain.go)
	// share is the requests waiting there for their first token whose
	// last prefill chunk shares a step with this request's first, room
	// the tokens of this request that step takes (kvScoring.stepShare).
	share, room float64
	place       float64 // later requests' cost of the new context here, seconds (placement.go)
	// peer is the other replicas' load on the instance (replica sync).
	peer peerCounts
}

// kvEval is what kv_aware knew about one request: pooled scratch.
type kvEval struct {
	cands     []candEval
	keys      []kvindex.Key
	scan      specScan // keys in the speculative overlay
	holders   []string
	tokens    int           // prompt tokens, 0 when unknown
	blockSize int           // tokens per block, 0 when unknown
	fallback  router.Reason // set when nobody's blocks count: why
	anyStale  bool
	best      int                 // the most leading blocks any candidate holds (blocks, every tier)
	cold      []int32             // the cold candidates' positions, for scoreCold
	commit    bool                // the decision will be committed (not shadow scoring)
	weight    float64             // prefill cost weight used
	queueing  bool                // the measured weight is past its floor: requests queue behind each other's prefill
	later     float64             // n: later requests expected to read the new context (placement.go)
	rent      rentNote            // what the pick pays or buys (kvaware_replicate.go)
	warmable  bool                // the request's edge can send a warm-up copy (router.Request.Warmable)
	warmWhole bool                // the copy bought is the whole request, not a prefix (router.Request.WarmsWhole)
	remote    bool                // a disaggregated request's decode pick (router.Request.RemotePrefill)
	keptFree  []string            // instances kept free of long prompts (router.Request.KeptFree)
	keptSet   map[string]struct{} // keptFree as a set (copyDest; kept across evaluations, cleared)
	sc        *kvScoring
	memo      scoreMemo
	shared    sharedScratch   // replica sync's shared queue (kvaware_sharedq.go)
	matches   []kvindex.Match // the lookup's answer, reused across decisions
	ci        *candIndex      // the candidate index, when the decision used one
	perm      []permEntry     // match k's candidate in the last decision over permOf
	permOf    *candIndex
}

func (st *KVState) getEval() *kvEval {
	if ev, ok := st.evalPool.Get().(*kvEval); ok {
		return ev
	}
	return &kvEval{}
}

func (st *KVState) putEval(ev *kvEval) {
	if cap(ev.keys) > 1<<16 || cap(ev.matches) > 1<<12 {
		return // don't keep a huge prompt's (or fleet's) scratch alive
	}
	ev.cands = ev.cands[:0]
	ev.keptFree = nil // the request's, not the pool's
	ev.scan.Reset()
	clear(ev.keptSet)
	st.evalPool.Put(ev)
}

// find returns inst's evaluation, nil when inst was not a candidate; a
// cold candidate the decision did not need to score is scored now.
func (ev *kvEval) find(inst *router.Instance) *candEval {
	if ci := ev.ci; ci != nil && inst != nil {
		// The candidate index holds each id's first position: when inst is
		// there, no earlier candidate is inst (it would share the id).
		if i, ok := ci.pos[inst.ID()]; ok && ev.cands[i].inst == inst {
			return ev.scoredAt(int(i))
		}
	}
	for i := range ev.cands {
		if ev.cands[i].inst == inst {
			return ev.scoredAt(i)
		}
	}
	return nil
}

// scoredAt is candidate i's evaluation, scored now if predict skipped it.
func (ev *kvEval) scoredAt(i int) *candEval {
	ce := &ev.cands[i]
	if !ce.scored && ev.sc != nil {
		ev.sc.score(ev, ce)
	}
	return ce
}

// pick decides; commit records the decision's side effects (speculative
// entries, pending prefill, metrics, observer) — shadow scoring passes
// false. The returned evaluation belongs to the caller (putEval); it is
// nil only with an error.
func (s *KVAware) pick(ctx context.Context, req *router.Request, cands []*router.Instance, commit bool) (router.Decision, *kvEval, error) {
	if len(cands) == 0 {
		return router.Decision{}, nil, router.ErrNoCandidates
	}
	if commit {
		kept, done, err := s.waitTurn(ctx, req, cands)
		if err != nil {
			return router.Decision{}, nil, err
		}
		defer done()
		if cands = kept; len(cands) == 0 {
			return router.Decision{}, nil, router.ErrNoCandidates
		}
	}
	ev := s.st.getEval()
	// A dry evaluation decides as a committed one would (the request
	// stays on the holder); only a commit asks for the copy.
	ev.warmable = req.Warmable
	ev.keptFree = req.KeptFree
	ev.remote = req.RemotePrefill
	s.evaluate(ctx, req, cands, ev, commit)
	var dec router.Decision
	switch {
	case ev.fallback != "" && s.sc.loadBound >= 0:
		// The index says nothing useful: the prompt's hash-home takes it,
		// so the first requests of a new prefix land together, unless the
		// home is over the load bound (then the next in rendezvous order
		// under it: consistent hashing with bounded loads).
		pick, reason := s.bounded(ev)
		if reason == router.ReasonKVMatch {
			reason = ev.fallback
		}
		dec = router.Decision{Instance: ev.cands[pick].inst, Reason: reason}
	case ev.fallback != "":
		dec, _ = s.fallback.Pick(ctx, req, cands)
		if dec.Reason == router.ReasonHash {
			dec.Reason = ev.fallback
		}
	default:
		pick, reason := s.decide(ev, false)
		if reason == router.ReasonKVMatch && ev.anyStale {
			if with, _ := s.decide(ev, true); with != pick {
				reason = router.ReasonStaleFallback
			}
		}
		dec = router.Decision{Instance: ev.cands[pick].inst, Reason: reason}
	}
	dec.Strategy = config.StrategyKVAware
	// Read only at a purchase: the check walks the request's messages.
	ev.warmWhole = ev.rent.warm && req.WarmsWhole()
	ce := ev.find(dec.Instance)
	if ev.tokens > 0 && ce != nil {
		dec.Explain = &router.Explanation{MatchedTokens: ce.matched, PromptTokens: ev.tokens, PredictedTTFT: seconds(ce.ttft)}
	}
	if commit {
		s.commit(&dec, ev, ce)
		s.st.changed()
	}
	return dec, ev, nil
}

func seconds(f float64) time.Duration {
	if f > float64(math.MaxInt64)/1e9 || math.IsNaN(f) {
		return math.MaxInt64
	}
	return time.Duration(f * 1e9)
}

// evaluate fills ev: token ids, block keys, one index lookup, speculative
// holds, staleness, and each candidate's predicted TTFT. Without commit
// (shadow scoring) it leaves the speculative overlay as it found it.
func (s *KVAware) evaluate(ctx context.Context, req *router.Request, cands []*router.Instance, ev *kvEval, commit bool) {
	st := s.st
	h := req.RoutingHash()
	// Filled in place: a candEval is ~200 bytes, and a composite literal
	// per candidate built and copied each one (a tenth of a 256-candidate
	// decision); clearing the list first was another pass over it. The
	// fields zeroed here are those only some candidates get: predict sets
	// queue and ahead, and score or scoreCold the score fields, matched
	// and ttft, of every candidate; predict reads in-flight and fullness.
	ev.cands = slices.Grow(ev.cands[:0], len(cands))[:len(cands)]
	for i, c := range cands {
		ce := &ev.cands[i]
		ce.inst, ce.rv = c, c.Rendezvous(h)
		ce.blocks, ce.stale, ce.indexed, ce.peer = [tiers.Count]int{}, [tiers.Count]int{}, 0, peerCounts{}
	}
	ev.best = 0
	ev.tokens, ev.blockSize, ev.fallback, ev.anyStale, ev.keys, ev.commit = 0, 0, "", false, ev.keys[:0], commit
	// ci belongs to the decision that set it: a pooled evaluation must not
	// carry the last one's (another candidate list's) into a decision that
	// returns before the lookup, where pending and find read it.
	ev.sc, ev.rent, ev.ci = &s.sc, rentNote{}, nil
	if len(cands) >= candIndexMin {
		// The candidate index's caches (pending counters, load slots)
		// spare predict a map lookup by id per candidate.
		ev.ci = s.cands.peek(cands)
	}
	defer s.predict(ev)

	if st.fresh != nil {
		up := st.fresh.StreamHealthy()
		st.noteStream(up)
		if !up {
			ev.fallback = router.ReasonStreamDown
			return
		}
	}
	// A peer's intent (sequence.go) brings its prompt's length and block
	// keys instead of its text or token ids.
	ik, _ := req.KeyMemo.(*intentKeys)
	var ids []uint32
	n := 0
	if ik != nil {
		n = ik.tokens
	} else {
		if req.Tokenizer == nil {
			req.Tokenizer = st.tokens
		}
		tctx := ctx
		if req.PromptTokens == nil && req.Tokenizer != nil {
			var cancel context.CancelFunc
			tctx, cancel = context.WithTimeout(ctx, s.sc.tokTimeout)
			defer cancel()
		}
		var err error
		ids, err = req.TokenIDs(tctx)
		if err != nil {
			if !errors.Is(err, router.ErrNoTokens) && req.TokenErrorFirst() {
				st.m.tokenErrs.WithLabelValues(st.pool).Inc()
				st.log.Debug("no token ids for request; routing heuristically", "pool", st.pool, "err", err)
			}
			ev.fallback = router.ReasonHeuristic
			return
		}
		if len(ids) > maxKeyedTokens {
			ids = ids[:maxKeyedTokens] // matches are prefixes: the head decides
		}
		n = len(ids)
	}
	ev.tokens = min(n, maxKeyedTokens)
	bs := s.sc.blockSize
	if bs <= 0 {
		bs = st.index.BlockSize()
	}
	if bs <= 0 || ev.tokens < bs || (ik != nil && len(ik.keys) == 0) {
		// No block size learned yet (no event ever arrived), or a prompt
		// shorter than one block: nothing can be cached.
		ev.fallback = router.ReasonHeuristic
		return
	}
	ev.blockSize = bs
	root := kvindex.Root(st.model, req.Adapter, req.CacheSalt())
	var matches []kvindex.Match
	var err error
	if ik != nil {
		ev.keys = append(ev.keys[:0], ik.keys...)
		matches, err = tracedLookup(ctx, st.index, ev.matches, ev.keys)
	} else if m, ok := req.KeyMemo.(*keyMemo); ok && m.root == root && m.bs == bs && m.n == len(ids) {
		ev.keys = append(ev.keys[:0], m.keys...)
		matches, err = tracedLookup(ctx, st.index, ev.matches, ev.keys)
	} else {
		matches, ev.keys, err = keyAndLookup(ctx, st.index, ev.matches, ev.keys, root, ids, bs)
		if req.ShareKeys {
			req.KeyMemo = &keyMemo{keys: slices.Clone(ev.keys), root: root, bs: bs, n: len(ids)}
		}
	}
	ev.matches = matches
	if err != nil {
		st.m.lookupErrs.WithLabelValues(st.pool, kvindex.LookupFailure(err)).Inc()
		st.log.Debug("index lookup failed; routing on speculative entries and the heuristic", "pool", st.pool, "err", err)
		matches = nil
	}
	byID := s.finder(ev, cands, len(matches))
	for k, m := range matches {
		ce := byID.find(k, m.Instance)
		if ce == nil {
			continue // not a candidate (unhealthy, full adapter set, other pool)
		}
		if st.fresh != nil && st.fresh.Stale(m.Instance) {
			ce.stale = m.Blocks
			ev.anyStale = true
			continue
		}
		ce.blocks = m.Blocks
		ce.indexed = m.Blocks[tiers.Count-1]
		ev.best = max(ev.best, ce.indexed)
	}
	if s.spec != nil && (s.spec.Len() > 0 || st.peers.ps != nil) {
		ev.scan.Reset()
		ev.holders = s.spec.holders(ev.holders[:0], &ev.scan, ev.keys)
		if st.peers.ps != nil {
			ev.holders = st.peers.ps.PeerHolders(ev.holders, ev.keys[0])
		}
		var specAt specProbe
		for i := range ev.cands {
			ce := &ev.cands[i]
			g := ce.blocks[tiers.GPU]
			if g == 0 && !containsString(ev.holders, ce.inst.ID()) {
				continue
			}
			if ce.stale != ([tiers.Count]int{}) || (g == 0 && st.fresh != nil && st.fresh.Stale(ce.inst.ID())) {
				continue // nothing vouches for a stale instance, guesses included
			}
			below, at := specAt.at(s.spec, &ev.scan, ev.keys, g)
			if commit && below && s.spec.heldBy(&ev.scan, ev.keys, g-1, ce.inst.ID()) {
				// Events confirmed the guess up to g: hand those blocks
				// over to the index, which will also see their eviction.
				s.spec.confirm(&ev.scan, ev.keys, g, ce.inst.ID())
			}
			if !at && st.peers.ps == nil {
				continue // no guess at block g: nothing to extend
			}
			if ext := st.extendSpec(s.spec, &ev.scan, ev.keys, g, ce.inst.ID()); ext > g {
				for t := range tiers.Count {
					ce.blocks[t] = max(ce.blocks[t], ext)
				}
				ev.best = max(ev.best, ce.blocks[tiers.Count-1])
			}
		}
	}
	switch {
	case ev.best > 0:
	case ev.anyStale:
		ev.fallback = router.ReasonStaleFallback
	default:
		ev.fallback = router.ReasonHeuristic
	}
}

// byID finds a candidate by instance id.
func (ev *kvEval) byID(id string) *candEval {
	for i := range ev.cands {
		if ev.cands[i].inst.ID() == id {
			return &ev.cands[i]
		}
	}
	return nil
}

func containsString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// predict computes every candidate's queue and predicted TTFT.
func (s *KVAware) predict(ev *kvEval) {
	st := s.st
	now := st.now()
	// In-flight read here, once per candidate and decision, beside the
	// pending counters read below: read before tokenizing and the index
	// lookup (up to hundreds of ms) it could be older than them, and the
	// running requests (in flight less pending) came out of two moments.
	busy := 0
	for i := range ev.cands {
		ce := &ev.cands[i]
		ce.inflight = ce.inst.InFlight()
		ce.full = ce.inflight >= s.threshold
		if ce.inflight > 0 {
			busy++
		}
	}
	if st.peers.ps != nil {
		busy = 0
		for i := range ev.cands {
			ce := &ev.cands[i]
			// Once per candidate: the queue below reads it too.
			q := ev.shared.peerQ(i)
			st.peers.ps.PeerQueue(ce.inst.ID(), q)
			ce.peer = peerCounts{inflight: int(q.InFlight), tokens: q.Tokens, reqs: q.Requests}
			if ce.inflight+ce.peer.inflight > 0 {
				busy++
			}
		}
	}
	var ownRate int64
	if st.peers.ps != nil {
		ownRate = st.publishedRate()
	}
	rho := st.util.read(now, func(since time.Time) float64 { return ev.busyShare(st, busy, since, now) }, ev.commit)
	measured := measuredWeight(rho, st.behind.mean())
	ev.weight, ev.queueing = s.sc.weight(measured), measured > DefaultPrefillCostWeight
	shared, meanComputed := st.placementShared(&ev.shared.place)
	if !shared {
		meanComputed = st.computed.mean()
	}
	st.notePlacement(ev, meanComputed)
	var decay decayMemo
	cold := coldMin{free: math.Inf(1), all: math.Inf(1), sc: &s.sc, tokens: ev.tokens}
	ev.cold = ev.cold[:0]
	st.pendMu.RLock()
	st.loads.mu.RLock()
	// A committed decision folds each candidate's queue into its average;
	// a dry one only reads them, beside other dry ones.
	lockPlace, unlockPlace := st.placeMu.RLock, st.placeMu.RUnlock
	if ev.commit {
		lockPlace, unlockPlace = st.placeMu.Lock, st.placeMu.Unlock
	}
	lockPlace()
	ev.memo = scoreMemo{}
	haveLoads := st.loads.live > 0
	// One measured drain rate per decision, not a lock per candidate.
	var drain float64
	if st.peers.ps == nil {
		drain = st.drainRate.rate(s.sc.prefill)
	}
	for i := range ev.cands {
		ce := &ev.cands[i]
		var pTok float64
		var pReq, tok int64 // this router's waiting requests and the tokens they brought, read once
		pc := ev.pending(st, i)
		if pc != nil {
			tok, pReq = pc.load()
		}
		if st.peers.ps == nil {
			if pc != nil {
				pTok = pc.drainedTokens(now, float64(tok), drain)
			}
		} else {
			// Replica sync: every replica's pending prefill drains by
			// one model from the same facts (kvaware_sharedq.go).
			sc := &ev.shared
			var started int64
			sc.own = sc.own[:0]
			if pc != nil {
				sc.own, started = pc.pl.snapshot(sc.own, replicasync.MaxPending)
				// Beyond the listed: in full, as peers count them.
				var listed int64
				for _, p := range sc.own {
					listed += p.Tokens
				}
				pTok = float64(max(tok-listed, 0))
			}
			mine := ce.inflight > 0 || pReq > 0
			pTok += sharedQueue(now.UnixNano(), sc.own, started, mine, ownRate, sc.peerQ(i), sc)
		}
		pReq += ce.peer.reqs
		ce.ahead = pTok
		// The tokens the waiting requests brought, before draining (the
		// peers' too with replica sync): stepShare counts from their
		// drained part how many are still to prefill.
		pend := float64(ce.peer.tokens + tok)
		ce.share, ce.room = s.sc.stepShare(pTok, pend, pReq)
		var ld loadSample
		ok := false
		if haveLoads {
			if sl := ev.loadSlot(st, i); sl != nil && sl.ok {
				ld, ok = sl.ls, now.Sub(sl.ls.at) <= s.loadAge
			}
			if ok {
				// Without the requests any replica saw end since the
				// sample was taken (loadended.go).
				asked, got, gone := ld.at.UnixNano(), ld.got.UnixNano(), 0
				if pc != nil {
					gone = pc.ends.inSample(asked, got)
				}
				if st.peers.ps != nil {
					gone += st.peers.ps.PeerEnded(ce.inst.ID(), asked, got)
				}
				ld = ld.less(gone)
			}
		}
		ce.queue, ce.load = s.sc.queue(pTok, int(pReq), ce.inflight+ce.peer.inflight, ld, ok)
		ce.place = 0
		var avg float64
		if pc != nil {
			avg = pc.queued.read(now, ce.queue, ev.commit, &decay)
		}
		if shared && ev.later > 0 {
			// The pool's published averages (placement_shared.go).
			avg = st.sharedQueued(ce.inst.ID(), &ev.shared.place)
		}
		if pc != nil || shared {
			ce.place = ev.later * 2 * avg
		}
		if ce.cold() {
			cold.note(ce)
			ev.cold = append(ev.cold, int32(i))
			continue
		}
		s.sc.score(ev, ce)
	}
	unlockPlace()
	st.loads.mu.RUnlock()
	st.pendMu.RUnlock()
	s.scoreCold(ev, cold)
}

// score computes a candidate's matched tokens, predicted TTFT and score
// from its queue.
func (sc *kvScoring) score(ev *kvEval, ce *candEval) {
	bs, q := ev.blockSize, ce.queue
	ce.scored = true
	m := &ev.memo
	if !m.ok || m.blocks != ce.blocks {
		// Candidates holding the same blocks (a shared prefix) differ
		// only by queue: the rest of the prediction is computed once.
		m.ok, m.blocks = true, ce.blocks
		m.matched = tierTokensUpTo(ce.blocks, bs, sc.reusable(ev.tokens, bs))
		m.prefill = sc.ttft(0, ev.tokens, m.matched)
		m.rest = recompute(ev.tokens, m.matched)
		m.cost = sc.prefillCost(ev.weight, m.rest)
	}
	ce.matched = m.matched
	ce.ttft = q + m.prefill
	ce.score = ce.ttft + m.cost + sc.shareCost(ce, m.rest) + ce.place
	ce.scoreStale = ce.score
	if ce.stale != ([tiers.Count]int{}) {
		var both [tiers.Count]int
		for t := range tiers.Count {
			both[t] = max(ce.blocks[t], ce.stale[t])
		}
		m := tierTokensUpTo(both, bs, sc.reusable(ev.tokens, bs))
		rest := recompute(ev.tokens, m)
		ce.scoreStale = sc.ttft(q, ev.tokens, m) + sc.prefillCost(ev.weight, rest) + sc.shareCost(ce, rest) + ce.place
	}
}

// decide picks for a request some instance holds: the least score
// (predicted TTFT plus the fleet's cost of the prefill it adds, at the
// weight the measured utilisation gives).
func (s *KVAware) decide(ev *kvEval, countStale bool) (int, router.Reason) {
	pick, reason := s.choose(ev, countStale)
	if countStale {
		return pick, reason
	}
	return s.replicate(ev, pick, reason)
}

// bounded is consistent hashing with bounded loads for a prompt nobody
// holds: the hash-home (first in rendezvous order) takes it while its
// load (the predicted queue without the step in progress, kvScoring.queue)
// is at most (1+ε) × the mean load of the candidates under the
// concurrency threshold, plus the tie tolerance (so that an idle fleet's
// noise moves nothing); reason kv_match. Otherwise the candidate under
// the threshold with the least predicted queue takes it: reason load_bound when
// the home was over the bound, overflow when it was full; saturated (the
// least loaded of all) when every candidate is full.
//
// Spilling to the least loaded rather than the next in rendezvous order
// (as the paper does) minimises the request's wait; the burst that
// follows it still finds its blocks there, through the speculative
// entries.
func (s *KVAware) bounded(ev *kvEval) (int, router.Reason) {
	free, sum := 0, 0.0
	home := -1
	for i := range ev.cands {
		ce := &ev.cands[i]
		if home < 0 || ce.rv > ev.cands[home].rv {
			home = i
		}
		if !ce.full {
			free++
			sum += ce.load
		}
	}
	if free == 0 {
		return s.leastQueue(ev, false, -1), router.ReasonSaturated
	}
	limit := (1+s.sc.loadBound)*sum/float64(free) + s.sc.tieTol
	h := &ev.cands[home]
	switch {
	case !h.full && h.load <= limit:
		return home, router.ReasonKVMatch
	case h.full:
		return s.leastQueue(ev, true, -1), router.ReasonOverflow
	}
	// Another takes it, even one whose queue only ties the home's: every
	// decoding instance's queue holds a step residual the bound leaves out,
	// so a home over the bound can tie an idler one's queue, and the tie
	// rule (highest rendezvous score: the home) would keep it there.
	if pick := s.leastQueue(ev, true, home); pick >= 0 {
		return pick, router.ReasonLoadBound
	}
	// None other is under the threshold, though the home is over a bound
	// it alone sets: only a load that is not a number does that.
	return home, router.ReasonKVMatch
}

// leastQueue is the candidate with the least predicted queue (among those
// under the threshold when skipFull, other than exclude when it is not
// -1), ties within the tolerance by rendezvous order.
func (s *KVAware) leastQueue(ev *kvEval, skipFull bool, exclude int) int {
	return s.leastQueueOf(ev, skipFull, exclude, nil)
}

// leastQueueOf is leastQueue among the candidates in set (all of them
// for a nil set).
func (s *KVAware) leastQueueOf(ev *kvEval, skipFull bool, exclude int, set map[string]struct{}) int {
	in := func(ce *candEval) bool {
		if skipFull && ce.full {
			return false
		}
		if set == nil {
			return true
		}
		_, ok := set[ce.inst.ID()]
		return ok
	}
	minQ := math.Inf(1)
	for i := range ev.cands {
		if ce := &ev.cands[i]; i != exclude && in(ce) {
			minQ = min(minQ, ce.queue)
		}
	}
	pick := -1
	for i := range ev.cands {
		ce := &ev.cands[i]
		if i == exclude || !in(ce) || ce.queue > minQ+s.sc.tieTol {
			continue
		}
		if pick < 0 || ce.rv > ev.cands[pick].rv {
			pick = i
		}
	}
	return pick
}

// choose returns the candidate with the least score (predicted TTFT plus
// weighted added prefill) among those
// under the threshold (all of them when every one is full), ties within the
// tolerance broken by the highest rendezvous score so replicas agree.
// countStale scores with stale instances' blocks counted (to tell whether
// ignoring them changed the pick).
func (s *KVAware) choose(ev *kvEval, countStale bool) (int, router.Reason) {
	score := func(ce *candEval) float64 {
		if countStale {
			return ce.scoreStale
		}
		return ce.score
	}
	// One pass for both minima (under the threshold, and over all), one for
	// both picks: the same answers as a min-then-pick pass pair for each
	// (NaN included: "not above", as those passes tested).
	minFree, minAll := math.Inf(1), math.Inf(1)
	for i := range ev.cands {
		ce := &ev.cands[i]
		t := score(ce)
		minAll = min(minAll, t)
		if !ce.full {
			minFree = min(minFree, t)
		}
	}
	free, top := -1, -1
	for i := range ev.cands {
		ce := &ev.cands[i]
		t := score(ce)
		if !(t > minAll+s.sc.tieTol) && (top < 0 || ce.rv > ev.cands[top].rv) {
			top = i
		}
		if !ce.full && !(t > minFree+s.sc.tieTol) && (free < 0 || ce.rv > ev.cands[free].rv) {
			free = i
		}
	}
	if free < 0 {
		return top, router.ReasonSaturated
	}
	if top != free {
		return free, router.ReasonOverflow
	}
	return free, router.ReasonKVMatch
}

// commit records a decision: metrics, speculative entries for the blocks
// the chosen instance is about to compute, pending prefill, and the
// observer that follows the request to its end.
func (s *KVAware) commit(dec *router.Decision, ev *kvEval, ce *candEval) {
	st := s.st
	st.decisionCounter(dec.Reason).Inc()
	st.cmp.countReason(dec.Reason, st.now())
	st.commitRent(ev.rent)
	if ev.tokens == 0 || ce == nil {
		return
	}
	hit := ce.held()
	if ev.remote {
		// A disaggregated request's decode pick: the instance receives the
		// prompt's KV from the prefill instance and computes none of it, so
		// it is charged no pending prefill (nor a prefill-rate sample, the
		// transfer being no prefill), and the prompt, counted at its
		// prefill pick, is not counted again. Its blocks are about to be
		// held there: speculative entries as for any pick.
		s.speculate(ev, ce, len(ev.keys))
		o := st.newDrainingObserver(ce, 0, hit, s.sc.prefill)
		o.drain = drainSample{}
		dec.Observer = o
		return
	}
	for t, n := range ce.matched {
		if n > 0 {
			st.matchedCounter(tiers.Tier(t)).Add(float64(n))
		}
	}
	st.computed.add(float64(max(ev.tokens-hit, 0)))
	st.dm.prompt.get(func() prometheus.Counter { return st.m.prompt.WithLabelValues(st.pool) }).Add(float64(ev.tokens))
	s.speculate(ev, ce, len(ev.keys))
	dec.Observer = st.newDrainingObserver(ce, ev.tokens-hit, hit, s.sc.prefill)
	if ev.rent.warm {
		// The warm-up copy: the alternative is about to compute the
		// prefix bought as a routed request would (speculative entries,
		// pending prefill until the copy's first byte).
		ac := &ev.cands[ev.rent.warmAt]
		blocks, n, held := ev.warmCopy()
		s.speculate(ev, ac, blocks)
		prefix := n
		if ev.warmWhole {
			prefix = 0 // the edge sends the client's request
		}
		dec.Warm = &router.Warm{Instance: ac.inst, Observer: st.newDrainingObserver(ac, n-held, held, s.sc.prefill), Tokens: prefix}
	}
}

// warmCopy is the extent of the warm-up copy ev.rent bought: the prompt's
// first blocks blocks, n tokens, of which the copy's instance holds held
// already (the whole prompt for a request the edge copies whole). The
// commit and a peer's dry decision of it (DecideIntent) count the same
// copy.
func (ev *kvEval) warmCopy() (blocks, n, held int) {
	ac := &ev.cands[ev.rent.warmAt]
	blocks = min(ev.rent.warmBlocks, len(ev.keys))
	n = min(blocks*ev.blockSize, ev.tokens)
	if ev.warmWhole {
		blocks, n = len(ev.keys), ev.tokens
	}
	return blocks, n, min(ac.held(), n)
}

// held is the prompt tokens the candidate holds, every tier.
func (ce *candEval) held() int {
	n := 0
	for _, m := range ce.matched {
		n += m
	}
	return n
}

// speculate records the blocks ce is about to compute, up to block end
// of the prompt, as speculative entries (and tells the replicas).
func (s *KVAware) speculate(ev *kvEval, ce *candEval, end int) {
	st := s.st
	if s.spec == nil {
		return
	}
	if g := ce.blocks[tiers.GPU]; g < end {
		s.spec.add(ev.keys[g:end], ce.inst.ID(), st.lostEpoch(ce.inst.ID()))
		if st.peers.ps != nil {
			st.peers.ps.Speculate(ce.inst.ID(), ev.keys[g:end], s.spec.ttl)
		}
		st.m.spec.track(st.pool, s.spec)
	}
}

// keyMemo keeps a request's block keys from its first pick for its second
// (router.Request.ShareKeys: a disaggregated request), under the root,
// block size and prompt length they were made for.
type keyMemo struct {
	keys  []kvindex.Key
	root  kvindex.Key
	bs, n int
}

// Strategy builds kv_aware, or shadow mode around the configured
// strategy, over st (router.Exact).
func (st *KVState) Strategy(cfg config.RoutingConfig, rnd func(uint64) uint64) (router.Strategy, error) {
	kv, err := newKVAware(cfg, st, rnd)
	if err != nil {
		return nil, err
	}
	if !cfg.Shadow {
		return kv, nil
	}
	if cfg.Strategy == config.StrategyKVAware {
		return NewShadow(kv, kv), nil
	}
	plain := cfg
	plain.Shadow = false
	inUse, err := router.NewStrategy(plain.Strategy, plain, router.WithRand(rnd))
	if err != nil {
		return nil, err
	}
	return NewShadow(inUse, kv), nil
}

// utilisation is the fleet's busy fraction as the router sees it: the
// share of candidates with a request in flight (an engine with work steps;
// one without idles), averaged exponentially over
// DefaultUtilisationWindow of the decision clock: each committed decision
// folds in the share busy over the time since the previous one
// (kvEval.busyShare), not the share at its own instant.
type utilisation struct {
	mu  sync.Mutex
	rho float64
	at  time.Time
	set bool
}

// read folds the busy share over the time since the last sample
// (share(since), observed at now) into the average when update is set
// (committed decisions; shadow scoring only reads) and returns the
// average. Before any sample, share is read over no time: the share busy
// now.
func (u *utilisation) read(now time.Time, share func(since time.Time) float64, update bool) float64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !update {
		if !u.set {
			return share(now)
		}
		return u.rho
	}
	switch dt := now.Sub(u.at).Seconds(); {
	case !u.set:
		u.rho, u.set, u.at = share(now), true, now
	case dt > 0:
		u.rho += (share(u.at) - u.rho) * (1 - math.Exp(-dt/DefaultUtilisationWindow.Seconds()))
		u.at = now
	}
	// A commit older than the last (decisions racing to commit) moves
	// neither the average nor its clock: set back, the clock would count
	// the time between the two again at the next sample.
	return u.rho
}

// Utilisation is the pool's busy fraction as kv_aware measures it (for
// tests and the compare endpoint).
func (st *KVState) Utilisation() float64 {
	st.util.mu.Lock()
	defer st.util.mu.Unlock()
	return st.util.rho
}

// TokenSource is the pool's token source for requests that carry no token
// ids (nil when the pool has none): the gRPC Index.Lookup tokenizes prompts
// with it exactly as kv_aware does.
func (st *KVState) TokenSource() router.TokenSource {
	if st == nil {
		return nil
	}
	return st.tokens
}

// Held is the most tokens of req's prompt any of cands holds (every tier,
// fresh index and speculative entries) and the prompt's length, without
// committing anything; ok is false when the prompt's tokens are unknown.
// Disaggregation asks it before choosing between one stage and two.
func (s *KVAware) Held(ctx context.Context, req *router.Request, cands []*router.Instance) (held, prompt int, ok bool) {
	var buf [32]int
	per, prompt, ok := s.HeldBy(ctx, req, cands, buf[:0])
	for _, h := range per {
		held = max(held, h)
	}
	return held, prompt, ok
}

// HeldBy appends to dst how many tokens of req's prompt each of cands
// holds (every tier, fresh index and speculative entries; dst[i] is
// cands[i]'s) and returns the prompt's length, without committing
// anything; ok is false when the prompt's tokens are unknown. Flow control
// asks it when a request arrives, before it queues: the queue charges an
// instance only what it does not hold and gives a freed slot to the
// waiting request that holds most there. With req.ShareKeys set the
// prompt's block keys are kept for the pick that follows.
func (s *KVAware) HeldBy(ctx context.Context, req *router.Request, cands []*router.Instance, dst []int) (per []int, prompt int, ok bool) {
	if len(cands) == 0 {
		return dst, 0, false
	}
	_, ev, err := s.pick(ctx, req, cands, false)
	if err != nil || ev == nil {
		return dst, 0, false
	}
	defer s.st.putEval(ev)
	if ev.tokens == 0 {
		return dst, 0, false
	}
	for i := range ev.cands {
		dst = append(dst, ev.cands[i].held())
	}
	return dst, ev.tokens, true
}

// keyAndLookup appends to keys the block keys of ids (kvindex.AppendKeys
// from root) and runs their index lookup under a lookup span: in one walk
// when the index keys as it looks up (tokenLookuper), the span then
// covering the keying too.
func keyAndLookup(ctx context.Context, ix kvindex.Index, dst []kvindex.Match, keys []kvindex.Key, root kvindex.Key, ids []uint32, bs int) ([]kvindex.Match, []kvindex.Key, error) {
	tl, ok := ix.(tokenLookuper)
	if !ok {
		keys = kvindex.AppendKeys(keys, root, ids, bs)
		m, err := tracedLookup(ctx, ix, dst, keys)
		return m, keys, err
	}
	ctx, sp := router.StartSpan(ctx, router.SpanLookup)
	m, keys, err := tl.LookupTokens(ctx, dst, keys, root, ids, bs)
	if sp.Recording() {
		sp.SetInt(router.AttrLookupBlocks, len(keys))
		sp.SetInt(router.AttrLookupHolders, len(m))
		sp.End(err)
	}
	return m, keys, err
}

// tracedLookup runs an index lookup under a lookup span.
func tracedLookup(ctx context.Context, ix kvindex.Index, dst []kvindex.Match, keys []kvindex.Key) ([]kvindex.Match, error) {
	ctx, sp := router.StartSpan(ctx, router.SpanLookup)
	var m []kvindex.Match
	var err error
	if a, ok := ix.(lookupAppender); ok {
		m, err = a.LookupAppend(ctx, dst, keys)
	} else {
		m, err = ix.Lookup(ctx, keys)
	}
	if sp.Recording() {
		sp.SetInt(router.AttrLookupBlocks, len(keys))
		sp.SetInt(router.AttrLookupHolders, len(m))
		sp.End(err)
	}
	return m, err
}

// busyShare is the share of the candidates busy over (since, now], busy
// of them having a request in flight now. A decision sees the fleet at
// its own instant, and an instance found idle may have been busy for most
// of the time since the previous decision: arrivals come in bursts, the
// first decision after a quiet gap finds the instances the last burst
// busied drained, and counting that instant's state for the whole gap put
// the router's ρ at 0.53 where the engines were busy 0.87 of the time
// (synth-probe4-2, 8 instances, 1×; docs/BENCHMARKS.md §7, "Session 25:
// cause 4 on probe4-2").
//
// So an instance idle now counts as busy from since until the last of this
// router's requests there ended (kvObserver.Done stamps it), when that is
// after since. Such a request was in flight at since: since is the last
// committed kv_aware decision, and only such a decision starts a request
// whose end is stamped (the one it picked counts from its own instant; a
// shadow-scored request routed by another strategy is not stamped), so the
// instance was busy over the whole of (since, lastEnd]. With one router
// that is the exact busy time, up to two known over-counts: the time
// between a decision's predict and its commit, and a request Envoy served
// on another instance than the one picked (grpcapi's ext_proc fallback),
// stamped on the pick. With replicas, a peer's request that started and
// ended between two of this router's decisions is not seen (no more than
// it knows). An instance busy now counts for the whole interval, as
// before: it was given its request at the previous decision or before, or
// by a peer at a moment this router does not know.
func (ev *kvEval) busyShare(st *KVState, busy int, since, now time.Time) float64 {
	n := len(ev.cands)
	if n == 0 {
		return 0
	}
	dt := now.Sub(since).Seconds()
	total := float64(busy)
	if dt > 0 && busy < n {
		from := since.UnixNano()
		st.pendMu.RLock()
		for i := range ev.cands {
			ce := &ev.cands[i]
			if ce.inflight+ce.peer.inflight > 0 {
				continue
			}
			if pc := ev.pending(st, i); pc != nil {
				if end := pc.lastEnd.Load(); end > from {
					total += min(float64(end-from)/1e9, dt) / dt
				}
			}
		}
		st.pendMu.RUnlock()
	}
	return total / float64(n)
}
