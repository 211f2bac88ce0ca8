package kvaware

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/prometheus/client_golang/prometheus"
)

var (
	_ router.Observer        = (*kvObserver)(nil)
	_ router.PrefillReleaser = (*kvObserver)(nil)
)

// kvObserver releases the request's pending prefill at its first response
// byte (or at its predicted end, for non-streamed requests) and compares the predicted hit with the engine's reported
// usage.prompt_tokens_details.cached_tokens.
type kvObserver struct {
	st        *KVState
	inst      string
	pc        *pendingCounter
	pendTok   int64
	listed    bool          // in pc.pl (replica sync)
	committed bool          // made by a committed kv_aware decision (newDrainingObserver): its end times the busy share
	at        int64         // routing time, Unix ns
	predicted int           // matched tokens predicted at routing
	shadow    *shadowRecord // nil outside shadow mode
	released  atomic.Bool   // the pending prefill was given back (once)
	finished  atomic.Bool

	timerMu sync.Mutex  // guards timer
	timer   *time.Timer // releases the pending prefill of a non-streamed request

	drain drainSample // what the first byte measures of the prefill rate (kvaware_drain.go)
}

// newObserver counts recompute tokens as pending on inst until the
// request's first byte, and reports whether the request is the only one
// pending there (from its own increment: two concurrent commits cannot
// both miss it, as a later read of the counter could).
func (st *KVState) newObserver(inst string, recompute, predicted int) (*kvObserver, bool) {
	o := &kvObserver{st: st, inst: inst, pc: st.pendingFor(inst), pendTok: int64(max(recompute, 0)), predicted: predicted}
	first := o.pc.add(o.pendTok)
	o.at = st.now().UnixNano()
	if st.peers.ps != nil {
		o.listed = true
		o.pc.pl.add(o, o.at)
	}
	st.m.pending.track(st.pool, inst, o.pc)
	return o, first
}

// release gives the pending prefill back; only the first call counts (the
// first byte, the timer and Finish may all call it, the timer on its own
// goroutine).
func (o *kvObserver) release() {
	if o.released.CompareAndSwap(false, true) {
		if o.listed {
			o.pc.pl.remove(o, o.st.now().UnixNano())
		}
		o.pc.sub(o.pendTok)
	}
}

// ReleasePrefillAfter implements router.PrefillReleaser.
func (o *kvObserver) ReleasePrefillAfter(d time.Duration) {
	if d <= 0 {
		o.release()
		return
	}
	o.timerMu.Lock()
	defer o.timerMu.Unlock()
	if o.timer != nil || o.finished.Load() || o.released.Load() {
		return
	}
	o.timer = time.AfterFunc(d, o.release)
}

// FirstByte implements Observer: the prefill is over (firstByte,
// kvaware_drain.go, also measures its rate).
func (o *kvObserver) FirstByte() { o.firstByte() }

// Done implements Observer.
func (o *kvObserver) Done(status, cached int) {
	if !o.finished.CompareAndSwap(false, true) {
		return
	}
	o.timerMu.Lock()
	if o.timer != nil {
		o.timer.Stop()
	}
	o.timerMu.Unlock()
	o.release()
	if o.committed {
		o.pc.lastEnd.Store(o.st.now().UnixNano())
	}
	o.ended(status)
	o.st.changed()
	found := cached >= 0
	if !found {
		cached = -1
	}
	o.st.recordOutcome(o, status, cached, found)
}

func (st *KVState) recordOutcome(o *kvObserver, status, cached int, found bool) {
	ok := status >= 200 && status < 300
	if ok {
		if found {
			st.m.usage.WithLabelValues(st.pool, "reported").Inc()
			st.m.reportedCached.WithLabelValues(st.pool).Add(float64(cached))
			st.m.predictedCached.WithLabelValues(st.pool).Add(float64(o.predicted))
			st.m.predictionError.WithLabelValues(st.pool).Observe(float64(abs(o.predicted - cached)))
		} else {
			st.m.usage.WithLabelValues(st.pool, "missing").Inc()
		}
	}
	st.cmp.addOutcome(o, ok, cached, found, st.now())
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// pendingCollector exports kvrouter_kv_pending_prefill_tokens by reading
// the pending counters at scrape time. Setting a gauge after each atomic
// update would race: two requests updating one counter could Set their
// values in the opposite order, leaving the gauge stale until the next
// request there.
type pendingCollector struct {
	desc     *prometheus.Desc
	counters sync.Map // pendingKey -> *pendingCounter
}

var _ prometheus.Collector = (*pendingCollector)(nil)

type pendingKey struct{ pool, inst string }

func newPendingCollector() *pendingCollector {
	return &pendingCollector{desc: prometheus.NewDesc(
		"kvrouter_kv_pending_prefill_tokens",
		"Router-local prefill tokens routed to an instance whose first response byte (non-streamed: predicted end of prefill) has not arrived.",
		[]string{"pool", "instance"}, nil,
	)}
}

// track exports pc as pool's pending prefill on inst. A pool's KVState
// keeps one counter per instance while the instance is in the pool, so
// after the first request this is a lookup; a replaced KVState's counter
// replaces the old.
func (c *pendingCollector) track(pool, inst string, pc *pendingCounter) {
	k := pendingKey{pool, inst}
	if v, ok := c.counters.Load(k); ok && v.(*pendingCounter) == pc {
		return
	}
	c.counters.Store(k, pc)
}

// forget deletes pool's series for inst (the instance left the pool).
func (c *pendingCollector) forget(pool, inst string) {
	c.counters.Delete(pendingKey{pool, inst})
}

// Describe implements prometheus.Collector.
func (c *pendingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *pendingCollector) Collect(ch chan<- prometheus.Metric) {
	c.counters.Range(func(k, v any) bool {
		key := k.(pendingKey)
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(pendingTokens(v.(*pendingCounter))), key.pool, key.inst)
		return true
	})
}

// compareCounts is a comparison's counters over some span of time.
type compareCounts struct {
	reasons  map[router.Reason]int64
	compared int64
	agreed   int64
	sides    map[string]*sideStats // by strategy name
	finished int64
	reported int64
	cached   int64 // engine-reported cached tokens (requests with a report)
	predRep  int64 // predicted matched tokens of those same requests
	absErr   int64
	// by agreement: reported cached tokens where the strategies agreed or not
	repAgree, repDisagree   int64
	repAgreeN, repDisagreeN int64
}

type sideStats struct {
	n       int64
	matched int64
	ttft    float64 // seconds, summed
}

func (a *compareCounts) side(name string) *sideStats {
	if a.sides == nil {
		a.sides = map[string]*sideStats{}
	}
	s := a.sides[name]
	if s == nil {
		s = &sideStats{}
		a.sides[name] = s
	}
	return s
}

// add sums b into a.
func (a *compareCounts) add(b *compareCounts) {
	for r, n := range b.reasons {
		if a.reasons == nil {
			a.reasons = map[router.Reason]int64{}
		}
		a.reasons[r] += n
	}
	for name, s := range b.sides {
		d := a.side(name)
		d.n += s.n
		d.matched += s.matched
		d.ttft += s.ttft
	}
	a.compared += b.compared
	a.agreed += b.agreed
	a.finished += b.finished
	a.reported += b.reported
	a.cached += b.cached
	a.predRep += b.predRep
	a.absErr += b.absErr
	a.repAgree += b.repAgree
	a.repDisagree += b.repDisagree
	a.repAgreeN += b.repAgreeN
	a.repDisagreeN += b.repDisagreeN
}

// The comparison keeps its totals since it began and per-minute buckets for
// the last CompareMinutes minutes, so an operator can ask for a recent
// window (GET ...?window=5m) instead of everything since start.
const (
	compareRecent = 32
	// CompareMinutes is the longest comparison window kept, in minutes.
	CompareMinutes = 60
)

type minuteCounts struct {
	minute int64 // Unix minute; 0 = empty
	c      compareCounts
}

// compareStats accumulates a pool's heuristic-versus-exact comparison. A
// comparison holds one routing mode (the strategy in use and whether
// shadow scoring is on): a switch of mode, or an explicit reset, starts a
// new one, so figures of two strategies are never mixed.
type compareStats struct {
	mu      sync.Mutex // guards everything below
	mode    string     // strategy in use + shadow flag of this comparison
	since   time.Time  // when this comparison began (zero until the first record)
	resetBy string     // why it began: "start", "reset", "strategy changed from X to Y"
	total   compareCounts
	minutes [CompareMinutes]minuteCounts

	recent              [compareRecent]CompareSample
	recentNext, recentN int
}

// bucket returns the counters of now's minute, clearing a slot last used
// an hour or more ago. Callers hold mu.
func (c *compareStats) bucket(now time.Time) *compareCounts {
	if c.since.IsZero() {
		c.since = now
		if c.resetBy == "" {
			c.resetBy = "start"
		}
	}
	m := now.Unix() / 60
	b := &c.minutes[m%CompareMinutes]
	if b.minute != m {
		*b = minuteCounts{minute: m}
	}
	return &b.c
}

// both applies f to the totals and to now's minute. Callers hold mu.
func (c *compareStats) both(now time.Time, f func(*compareCounts)) {
	f(&c.total)
	f(c.bucket(now))
}

// setMode starts a new comparison when the routing mode changes (not for
// the first mode, which the comparison begins with).
func (c *compareStats) setMode(strategy string, shadow bool, now time.Time) {
	mode := strategy
	if shadow {
		mode += "+shadow"
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.mode {
	case mode:
	case "":
		c.mode = mode
	default:
		c.resetLocked(now, fmt.Sprintf("strategy changed from %s to %s", c.mode, mode))
		c.mode = mode
	}
}

// reset starts a new comparison now.
func (c *compareStats) reset(now time.Time, why string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.resetLocked(now, why)
}

func (c *compareStats) resetLocked(now time.Time, why string) {
	c.since, c.resetBy = now, why
	c.total, c.minutes = compareCounts{}, [CompareMinutes]minuteCounts{}
	c.recent, c.recentNext, c.recentN = [compareRecent]CompareSample{}, 0, 0
}

func (c *compareStats) countReason(r router.Reason, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.both(now, func(k *compareCounts) {
		if k.reasons == nil {
			k.reasons = map[router.Reason]int64{}
		}
		k.reasons[r]++
	})
}

func (c *compareStats) addShadow(r *shadowRecord, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.both(now, func(k *compareCounts) {
		k.compared++
		if r.agree {
			k.agreed++
		}
		for _, sd := range []struct {
			name string
			p    shadowPick
		}{{r.inUse, r.inUsePick}, {r.other, r.otherPick}} {
			s := k.side(sd.name)
			s.n++
			s.matched += int64(sd.p.matched)
			s.ttft += sd.p.ttft
		}
	})
}

func (c *compareStats) addOutcome(o *kvObserver, ok bool, cached int, found bool, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.both(now, func(k *compareCounts) {
		k.finished++
		if !ok || !found {
			return
		}
		k.reported++
		k.cached += int64(cached)
		k.predRep += int64(o.predicted)
		k.absErr += int64(abs(o.predicted - cached))
		if r := o.shadow; r != nil {
			if r.agree {
				k.repAgree += int64(cached)
				k.repAgreeN++
			} else {
				k.repDisagree += int64(cached)
				k.repDisagreeN++
			}
		}
	})
	if r := o.shadow; r != nil {
		s := CompareSample{
			Time:   now,
			Status: 0,
			Agree:  r.agree,
			InUse:  SamplePick{Strategy: r.inUse, Instance: r.inUsePick.inst, MatchedTokens: r.inUsePick.matched, PredictedTTFTMs: r.inUsePick.ttft * 1e3},
			Other:  SamplePick{Strategy: r.other, Instance: r.otherPick.inst, MatchedTokens: r.otherPick.matched, PredictedTTFTMs: r.otherPick.ttft * 1e3},
		}
		if ok {
			s.Status = 200
		}
		if found {
			v := cached
			s.ReportedCachedTokens = &v
		}
		c.recent[c.recentNext] = s
		c.recentNext = (c.recentNext + 1) % compareRecent
		c.recentN = min(c.recentN+1, compareRecent)
	}
}

// window sums the counters of the last window (rounded up to whole
// minutes, at most CompareMinutes) ending now; window <= 0 means every
// record since the comparison began. It returns the window's start too.
// Callers hold mu.
func (c *compareStats) window(now time.Time, window time.Duration) (compareCounts, time.Time) {
	if window <= 0 {
		return c.total, c.since
	}
	n := min(int64((window+time.Minute-1)/time.Minute), CompareMinutes)
	cur := now.Unix() / 60
	var out compareCounts
	for m := cur - n + 1; m <= cur; m++ {
		if b := &c.minutes[((m%CompareMinutes)+CompareMinutes)%CompareMinutes]; b.minute == m {
			out.add(&b.c)
		}
	}
	from := time.Unix((cur-n+1)*60, 0)
	if from.Before(c.since) {
		from = c.since
	}
	return out, from
}

// CompareSummary is GET /admin/pools/{pool}/compare: how exact routing
// compares with the heuristic on this pool's live traffic.
type CompareSummary struct {
	Pool     string `json:"pool"`
	Strategy string `json:"strategy"`
	Shadow   bool   `json:"shadow"`
	// Since is when the figures start: the comparison's start (router
	// start, a reset, a strategy switch) or the window's start, if later.
	Since time.Time `json:"since"`
	// Window is the span asked for ("all" = since the comparison began).
	Window string `json:"window"`
	// StartedBy says why the comparison began: "start", "reset", or
	// "strategy changed from X to Y".
	StartedBy string `json:"started_by"`
	// Verdict says which strategy did better in the window, by the index's
	// predictions for both strategies' picks of the same requests.
	Verdict CompareVerdict `json:"verdict"`
	// KVDecisions counts kv_aware decisions by reason (in use or shadow).
	KVDecisions map[string]int64 `json:"kv_decisions"`
	// Compared is the number of shadow-scored requests; Agreed how many
	// picked the same instance under both strategies.
	Compared      int64   `json:"compared"`
	Agreed        int64   `json:"agreed"`
	AgreementRate float64 `json:"agreement_rate"`
	// Predicted summarises, per strategy, what the index predicted for its
	// picks: mean matched tokens and mean predicted TTFT.
	Predicted map[string]StrategyPrediction `json:"predicted"`
	// Reported compares predictions with the engines' own cached-token reports.
	Reported ReportedUsage `json:"reported"`
	// Recent are the last shadow comparisons, newest first.
	Recent []CompareSample `json:"recent"`
	// Instances is the load kv_aware sees per instance now.
	Instances []InstanceLoad `json:"instances"`
}

// CompareVerdict is the comparison's conclusion.
type CompareVerdict struct {
	// Better is the strategy whose picks were predicted to start sooner,
	// or "" when there is no verdict (see Why).
	Better string `json:"better"`
	Why    string `json:"why"`
}

// Below compareMinSamples shadow-scored requests per strategy there is no
// verdict: a mean of fewer samples of a long-tailed quantity like TTFT
// moves by more than the differences it would be asked to show (30 is the
// usual floor for treating a sample mean as normal). Means within
// compareTieRatio of each other are a tie: the TTFT model's own error is
// of that order (docs/kv-aware.md).
const (
	compareMinSamples = 30
	compareTieRatio   = 0.05
)

func verdict(k *compareCounts, shadow bool) CompareVerdict {
	if !shadow {
		return CompareVerdict{Why: "shadow scoring is off: only one strategy is scored (routing.shadow: true compares both)"}
	}
	type side struct {
		name          string
		n             int64
		ttft, matched float64
	}
	var ss []side
	for name, s := range k.sides {
		if s.n > 0 {
			ss = append(ss, side{name, s.n, s.ttft / float64(s.n) * 1e3, float64(s.matched) / float64(s.n)})
		}
	}
	if len(ss) != 2 || min(ss[0].n, ss[1].n) < compareMinSamples {
		return CompareVerdict{Why: fmt.Sprintf("fewer than %d shadow-scored requests in the window", compareMinSamples)}
	}
	if ss[0].ttft > ss[1].ttft {
		ss[0], ss[1] = ss[1], ss[0]
	}
	a, b := ss[0], ss[1]
	detail := fmt.Sprintf("over %d requests: mean predicted TTFT %.1f ms (%s) vs %.1f ms (%s); mean matched tokens %.0f vs %.0f",
		a.n, a.ttft, a.name, b.ttft, b.name, a.matched, b.matched)
	if b.ttft <= a.ttft*(1+compareTieRatio) {
		return CompareVerdict{Why: "a tie " + detail}
	}
	return CompareVerdict{Better: a.name, Why: a.name + " better " + detail}
}

// InstanceLoad is the queue input of kv_aware's scoring for one instance.
type InstanceLoad struct {
	ID                   string `json:"id"`
	InFlight             int    `json:"in_flight"`
	PendingPrefillTokens int64  `json:"pending_prefill_tokens"`
	PendingRequests      int64  `json:"pending_requests"`
	// Peer* are the other router replicas' counters (replica sync), added
	// to this router's in scoring.
	PeerInFlight             int64 `json:"peer_in_flight,omitempty"`
	PeerPendingPrefillTokens int64 `json:"peer_pending_prefill_tokens,omitempty"`
	PeerPendingRequests      int64 `json:"peer_pending_requests,omitempty"`
	// Waiting and Running are the engine's last scraped gauges; nil when
	// no sample is fresh (scraping off or failing).
	Waiting *float64 `json:"engine_waiting"`
	Running *float64 `json:"engine_running"`
}

// StrategyPrediction is the index's prediction for one strategy's picks.
type StrategyPrediction struct {
	Requests            int64   `json:"requests"`
	MatchedTokens       int64   `json:"matched_tokens"`
	MeanMatchedTokens   float64 `json:"mean_matched_tokens"`
	MeanPredictedTTFTMs float64 `json:"mean_predicted_ttft_ms"`
}

// ReportedUsage compares predicted matched tokens with the engines'
// usage.prompt_tokens_details.cached_tokens (vLLM reports it with
// --enable-prompt-tokens-details; streams need stream_options.include_usage).
type ReportedUsage struct {
	Finished             int64   `json:"finished"`
	WithUsage            int64   `json:"with_usage"`
	CachedTokens         int64   `json:"cached_tokens"`
	PredictedTokens      int64   `json:"predicted_tokens"`
	MeanAbsErrorTokens   float64 `json:"mean_abs_error_tokens"`
	MeanCachedWhenAgree  float64 `json:"mean_cached_when_agree"`
	MeanCachedWhenDiffer float64 `json:"mean_cached_when_differ"`
}

// CompareSample is one shadow comparison.
type CompareSample struct {
	Time                 time.Time  `json:"time"`
	Status               int        `json:"status"`
	Agree                bool       `json:"agree"`
	InUse                SamplePick `json:"in_use"`
	Other                SamplePick `json:"other"`
	ReportedCachedTokens *int       `json:"reported_cached_tokens"`
}

// SamplePick is one strategy's pick in a CompareSample.
type SamplePick struct {
	Strategy        string  `json:"strategy"`
	Instance        string  `json:"instance"`
	MatchedTokens   int     `json:"matched_tokens"`
	PredictedTTFTMs float64 `json:"predicted_ttft_ms"`
}

// Compare summarises the pool's comparison over the last window (0 = since
// it began), and the current load of insts as scoring sees it.
func (st *KVState) Compare(strategy string, shadow bool, insts []*router.Instance, window time.Duration) CompareSummary {
	loads := make([]InstanceLoad, 0, len(insts))
	now := st.now()
	for _, in := range insts {
		l := InstanceLoad{ID: in.ID(), InFlight: in.InFlight()}
		l.PendingPrefillTokens, l.PendingRequests = st.PendingPrefill(in.ID())
		l.PeerInFlight, l.PeerPendingPrefillTokens, l.PeerPendingRequests = st.PeerLoad(in.ID())
		if ls, ok := st.loads.get(in.ID(), now, 3*DefaultScrapeInterval); ok {
			l.Waiting, l.Running = &ls.waiting, &ls.running
		}
		loads = append(loads, l)
	}
	c := &st.cmp
	c.mu.Lock()
	defer c.mu.Unlock()
	k, since := c.window(now, window)
	out := CompareSummary{
		Pool: st.pool, Strategy: strategy, Shadow: shadow, Since: since, Window: "all", StartedBy: c.resetBy,
		KVDecisions: map[string]int64{}, Predicted: map[string]StrategyPrediction{},
		Compared: k.compared, Agreed: k.agreed, Recent: []CompareSample{}, Instances: loads,
		Verdict: verdict(&k, shadow),
	}
	if window > 0 {
		out.Window = window.String()
	}
	for r, n := range k.reasons {
		out.KVDecisions[string(r)] = n
	}
	if k.compared > 0 {
		out.AgreementRate = float64(k.agreed) / float64(k.compared)
	}
	for name, s := range k.sides {
		p := StrategyPrediction{Requests: s.n, MatchedTokens: s.matched}
		if s.n > 0 {
			p.MeanMatchedTokens = float64(s.matched) / float64(s.n)
			p.MeanPredictedTTFTMs = s.ttft / float64(s.n) * 1e3
		}
		out.Predicted[name] = p
	}
	out.Reported = ReportedUsage{Finished: k.finished, WithUsage: k.reported, CachedTokens: k.cached, PredictedTokens: k.predRep}
	if k.reported > 0 {
		out.Reported.MeanAbsErrorTokens = float64(k.absErr) / float64(k.reported)
	}
	if k.repAgreeN > 0 {
		out.Reported.MeanCachedWhenAgree = float64(k.repAgree) / float64(k.repAgreeN)
	}
	if k.repDisagreeN > 0 {
		out.Reported.MeanCachedWhenDiffer = float64(k.repDisagree) / float64(k.repDisagreeN)
	}
	for i := 1; i <= c.recentN; i++ {
		s := c.recent[(c.recentNext-i+compareRecent)%compareRecent]
		if s.Time.Before(since) {
			break
		}
		out.Recent = append(out.Recent, s)
	}
	return out
}

// ResetCompare starts the pool's comparison afresh.
func (st *KVState) ResetCompare() { st.cmp.reset(st.now(), "reset") }

// pendingTokens is pc's pending tokens.
func pendingTokens(pc *pendingCounter) int64 {
	tokens, _ := pc.load()
	return tokens
}
