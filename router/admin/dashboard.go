package admin

import (
	"context"
	_ "embed"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"net/http"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/tiers"
)

// dashboardHTML is the whole dashboard: one page with inline CSS and JS,
// no external assets, so it works offline and behind strict egress.
//
//go:embed dashboard/index.html
var dashboardHTML []byte

// dashboardIndexTimeout bounds the index reads of one dashboard.json: a
// slow Redis must not pile up dashboard requests.
const dashboardIndexTimeout = 2 * time.Second

// addDashboardRoutes mounts GET /dashboard (the page, no secrets in it, so
// served without the admin token) and GET /admin/dashboard.json (behind the
// admin token like every admin route; the page asks for the token).
func (s *api) addDashboardRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /dashboard", serveDashboardPage)
	mux.HandleFunc("GET /admin/dashboard.json", s.auth(s.serveDashboardJSON))
}

func serveDashboardPage(w http.ResponseWriter, _ *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	// Inline script and style only; fetches go to this origin alone.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	_, _ = w.Write(dashboardHTML)
}

// DashboardSummary is GET /admin/dashboard.json: what the dashboard page
// shows, built from the same state as the admin API and /metrics.
// Counters are totals since the router started; the page derives rates.
type DashboardSummary struct {
	Time          time.Time       `json:"time"`
	UptimeSeconds float64         `json:"uptime_seconds"`
	Pools         []DashboardPool `json:"pools"`
}

// DashboardPool is one pool's row set.
type DashboardPool struct {
	Name     string `json:"name"`
	Model    string `json:"model"`
	Strategy string `json:"strategy"`
	Shadow   bool   `json:"shadow"`
	// KVIndex is true when the pool has a KV block index (kv_aware and
	// shadow mode possible, block counts and hit rates known).
	KVIndex bool `json:"kv_index"`
	// StreamHealthy is the KV event stream's health (nil without an index).
	StreamHealthy *bool `json:"stream_healthy"`
	// Requests answered (kvrouter_requests_total) and overflows.
	Requests  int64 `json:"requests"`
	Overflows int64 `json:"overflows"`
	// Statuses counts answered requests by HTTP status class ("2xx",
	// "4xx", "5xx", ...; the status label of kvrouter_requests_total).
	Statuses map[string]int64 `json:"statuses"`
	// TTFB is kvrouter_upstream_ttfb_seconds over the pool's instances:
	// the time to the upstream's first body byte (time to first token for
	// streams).
	TTFB DashboardHistogram `json:"ttfb"`
	// Decisions counts answered requests by decision reason (the reason
	// label of kvrouter_requests_total).
	Decisions map[string]int64 `json:"decisions"`
	// KVDecisions counts kv_aware decisions by reason
	// (kvrouter_kv_decisions_total).
	KVDecisions map[string]int64 `json:"kv_decisions"`
	HitRate     DashboardHitRate `json:"hit_rate"`
	Agreement   DashboardAgree   `json:"agreement"`
	// IndexEntries is the index's (block, instance) entry count; IndexError
	// is set when the index could not be read.
	IndexEntries int                 `json:"index_entries"`
	IndexError   string              `json:"index_error,omitempty"`
	Instances    []DashboardInstance `json:"instances"`
	// Queue is the pool's flow-control queue (nil when flow control is off).
	Queue *flowcontrol.Stats `json:"queue,omitempty"`
}

// DashboardHistogram is a cumulative histogram: Buckets[i] observations
// were at most Bounds[i] seconds; the +Inf bucket is Count. The page takes
// the difference of two polls to show quantiles of the last interval.
type DashboardHistogram struct {
	Bounds  []float64 `json:"bounds"`
	Buckets []int64   `json:"buckets"`
	Count   int64     `json:"count"`
	Sum     float64   `json:"sum"`
}

// DashboardHitRate compares prompt tokens with cached ones, as predicted at
// routing and as reported by the engines. Known only for requests scored by
// kv_aware or shadow mode (the only ones with token ids and observers).
type DashboardHitRate struct {
	// PromptTokens of kv-scored requests (kvrouter_kv_prompt_tokens_total).
	PromptTokens int64 `json:"prompt_tokens"`
	// MatchedTokens per tier predicted for the picks
	// (kvrouter_kv_matched_tokens_total).
	MatchedTokens map[string]int64 `json:"matched_tokens"`
	// Predicted = sum(MatchedTokens) / PromptTokens.
	Predicted float64 `json:"predicted"`
	// EngineCachedTokens are usage.prompt_tokens_details.cached_tokens
	// summed over the responses that carried them
	// (kvrouter_kv_engine_cached_tokens_total); Reported / Missing count
	// those responses and the ones without usage.
	EngineCachedTokens int64 `json:"engine_cached_tokens"`
	Reported           int64 `json:"reported"`
	Missing            int64 `json:"missing"`
	// Engine = EngineCachedTokens / PromptTokens, scaled by the share of
	// finished requests that reported usage (exact when all do).
	Engine float64 `json:"engine"`
}

// DashboardAgree is heuristic-versus-exact agreement (shadow mode, or
// kv_aware with its shadow comparison).
type DashboardAgree struct {
	Compared int64   `json:"compared"`
	Agreed   int64   `json:"agreed"`
	Rate     float64 `json:"rate"`
}

// DashboardInstance is one instance's row.
type DashboardInstance struct {
	ID       string `json:"id"`
	URL      string `json:"url"`
	Healthy  bool   `json:"healthy"`
	InFlight int    `json:"in_flight"`
	// Requests answered by this instance (kvrouter_requests_total).
	Requests int64 `json:"requests"`
	// Blocks held per tier name (gpu, cpu, disk, shared), per the index.
	Blocks map[string]int `json:"blocks"`
	// LastEvent is when the index last applied an event from it.
	LastEvent *time.Time `json:"last_event,omitempty"`
	// Stale is true when the events consumer considers it not live.
	Stale bool `json:"stale"`
	// EventState is the events consumer's state of the instance (live,
	// stale, ...; empty without the router's events pipeline) and Gaps the
	// sequence gaps it has seen in the instance's events.
	EventState           string   `json:"event_state,omitempty"`
	Gaps                 uint64   `json:"gaps"`
	PendingPrefillTokens int64    `json:"pending_prefill_tokens"`
	EngineWaiting        *float64 `json:"engine_waiting,omitempty"`
	EngineRunning        *float64 `json:"engine_running,omitempty"`
}

// Dashboard builds the dashboard summary of every pool.
func (s *api) Dashboard(ctx context.Context) DashboardSummary {
	now := time.Now()
	out := DashboardSummary{Time: now.UTC(), UptimeSeconds: now.Sub(s.srv.Started()).Seconds(), Pools: []DashboardPool{}}
	mv := gatherDashboardMetrics(s)
	for _, p := range s.srv.Pools() {
		out.Pools = append(out.Pools, s.dashboardPool(ctx, p, mv))
	}
	return out
}

func (s *api) serveDashboardJSON(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, s.Dashboard(r.Context()))
}

func (s *api) dashboardPool(ctx context.Context, p *router.Pool, mv *metricView) DashboardPool {
	rc, strat := p.Routing()
	name := p.Name()
	dp := DashboardPool{
		Name: name, Model: p.Model(), Strategy: strat.Name(), Shadow: rc.Shadow,
		Decisions: mv.sumBy("kvrouter_requests_total", name, "reason"), KVDecisions: map[string]int64{},
		Instances: []DashboardInstance{},
	}
	dp.Queue = p.QueueStatus().Queue
	dp.Statuses = statusClasses(mv.sumBy("kvrouter_requests_total", name, "status"))
	dp.TTFB = mv.histogram("kvrouter_upstream_ttfb_seconds", name)
	perInst := mv.sumBy("kvrouter_requests_total", name, "instance")
	for _, n := range perInst {
		dp.Requests += n
	}
	for _, n := range mv.sumBy("kvrouter_overflows_total", name, "") {
		dp.Overflows += n
	}
	// Requests answered without a pick carry reason "" or none; name it.
	if n, ok := dp.Decisions[""]; ok {
		delete(dp.Decisions, "")
		dp.Decisions["none"] += n
	}
	hr := DashboardHitRate{MatchedTokens: mv.sumBy("kvrouter_kv_matched_tokens_total", name, "tier")}
	hr.PromptTokens = mv.sumBy("kvrouter_kv_prompt_tokens_total", name, "")[""]
	hr.EngineCachedTokens = mv.sumBy("kvrouter_kv_engine_cached_tokens_total", name, "")[""]
	usage := mv.sumBy("kvrouter_kv_usage_reports_total", name, "result")
	hr.Reported, hr.Missing = usage["reported"], usage["missing"]
	if hr.PromptTokens > 0 {
		var m int64
		for _, n := range hr.MatchedTokens {
			m += n
		}
		hr.Predicted = float64(m) / float64(hr.PromptTokens)
		if hr.Reported > 0 {
			share := float64(hr.Reported) / float64(hr.Reported+hr.Missing)
			hr.Engine = min(1, float64(hr.EngineCachedTokens)/(float64(hr.PromptTokens)*share))
		}
	}
	dp.HitRate = hr

	insts := p.Instances()
	byID := map[string]int{}
	for _, in := range insts {
		byID[in.ID()] = len(dp.Instances)
		dp.Instances = append(dp.Instances, DashboardInstance{
			ID: in.ID(), URL: in.URL().String(), Healthy: in.Healthy(), InFlight: in.InFlight(),
			Requests: perInst[in.ID()], Blocks: map[string]int{},
		})
	}
	st := kvaware.Of(p)
	if st == nil {
		return dp
	}
	dp.KVIndex = true
	up := st.Freshness() == nil || st.Freshness().StreamHealthy()
	dp.StreamHealthy = &up
	cmp := st.Compare(strat.Name(), rc.Shadow, insts, 0)
	for r, n := range cmp.KVDecisions {
		dp.KVDecisions[r] = n
	}
	dp.Agreement = DashboardAgree{Compared: cmp.Compared, Agreed: cmp.Agreed, Rate: cmp.AgreementRate}
	for _, l := range cmp.Instances {
		if i, ok := byID[l.ID]; ok {
			di := &dp.Instances[i]
			di.PendingPrefillTokens, di.EngineWaiting, di.EngineRunning = l.PendingPrefillTokens, l.Waiting, l.Running
		}
	}
	ctx, cancel := context.WithTimeout(ctx, dashboardIndexTimeout)
	defer cancel()
	stats, err := st.Index().Instances(ctx)
	if err != nil {
		dp.IndexError = err.Error()
		return dp
	}
	if n, err := st.Index().Len(ctx); err == nil {
		dp.IndexEntries = n
	}
	for _, is := range stats {
		i, ok := byID[is.Instance]
		if !ok {
			// Held in the index but not configured: still worth seeing
			// (an instance removed by a reload whose blocks age out).
			i = len(dp.Instances)
			byID[is.Instance] = i
			dp.Instances = append(dp.Instances, DashboardInstance{ID: is.Instance, Blocks: map[string]int{}})
		}
		di := &dp.Instances[i]
		for t := range tiers.Count {
			di.Blocks[tiers.Tier(t).String()] = is.Blocks[t]
		}
		if !is.LastEvent.IsZero() {
			le := is.LastEvent.UTC()
			di.LastEvent = &le
		}
	}
	for i := range dp.Instances {
		di := &dp.Instances[i]
		for t := range tiers.Count {
			if _, ok := di.Blocks[tiers.Tier(t).String()]; !ok {
				di.Blocks[tiers.Tier(t).String()] = 0
			}
		}
		di.Stale = st.Freshness() != nil && st.Freshness().Stale(di.ID)
	}
	if s.kve != nil {
		if cs, ok := s.kve.KVInstances(name); ok {
			for _, c := range cs {
				if i, ok := byID[c.Instance]; ok {
					dp.Instances[i].EventState, dp.Instances[i].Gaps = c.State.String(), c.Gaps
				}
			}
		}
	}
	return dp
}

// metricView is one Gather of the server's registry, indexed by family
// name, so that a dashboard request reads every counter from one snapshot.
type metricView struct {
	fams map[string]*dto.MetricFamily
}

func gatherDashboardMetrics(s *api) *metricView {
	mv := &metricView{fams: map[string]*dto.MetricFamily{}}
	// A gather error still returns what could be gathered; the dashboard
	// shows that rather than nothing.
	fams, _ := s.srv.Registry().Gather()
	for _, f := range fams {
		mv.fams[f.GetName()] = f
	}
	return mv
}

// statusClasses folds HTTP status codes into classes: "200" → "2xx".
func statusClasses(by map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for code, n := range by {
		class := "other"
		if len(code) == 3 && code[0] >= '1' && code[0] <= '5' {
			class = code[:1] + "xx"
		}
		out[class] += n
	}
	return out
}

// histogram sums the histogram family name over pool's series (they share
// bucket bounds: one HistogramVec).
func (mv *metricView) histogram(name, pool string) DashboardHistogram {
	var h DashboardHistogram
	f := mv.fams[name]
	if f == nil {
		return h
	}
	for _, m := range f.GetMetric() {
		if m.Histogram == nil || labelValue(m, "pool") != pool {
			continue
		}
		hg := m.GetHistogram()
		if h.Bounds == nil {
			for _, b := range hg.GetBucket() {
				h.Bounds = append(h.Bounds, b.GetUpperBound())
			}
			h.Buckets = make([]int64, len(h.Bounds))
		}
		for i, b := range hg.GetBucket() {
			if i < len(h.Buckets) {
				h.Buckets[i] += int64(b.GetCumulativeCount())
			}
		}
		h.Count += int64(hg.GetSampleCount())
		h.Sum += hg.GetSampleSum()
	}
	return h
}

func labelValue(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

// sumBy sums the counter or gauge family name over the series of pool,
// grouped by the value of label by ("" = one group with key "").
func (mv *metricView) sumBy(name, pool, by string) map[string]int64 {
	out := map[string]int64{}
	f := mv.fams[name]
	if f == nil {
		return out
	}
	for _, m := range f.GetMetric() {
		var p, key string
		for _, lp := range m.GetLabel() {
			switch lp.GetName() {
			case "pool":
				p = lp.GetValue()
			case by:
				key = lp.GetValue()
			}
		}
		if p != pool {
			continue
		}
		var v float64
		switch {
		case m.Counter != nil:
			v = m.GetCounter().GetValue()
		case m.Gauge != nil:
			v = m.GetGauge().GetValue()
		default:
			continue
		}
		out[key] += int64(v)
	}
	return out
}
