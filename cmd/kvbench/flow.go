package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// flowAdmission is the router's flow-control queue (router/flowcontrol's
// Sched, the core the HTTP data plane's Gate wraps) on the driver's
// virtual clock.
type flowAdmission struct {
	s     *flowcontrol.Sched
	items map[uint64]*flowcontrol.Item
	drop  []des.Dropped
	buf   []*flowcontrol.Item
	// For Item.Cached: the workload's requests, the router whose cache
	// view answers (nil: none), and the live instances.
	w      *workload.Workload
	rt     *strategyRouter
	kv     *kvaware.KVAware
	live   []string
	tokBuf []uint32
	held   []int
}

// cached is Item.Cached for request id, as the router computes it when a
// request arrives (router/httpapi's cachedHolds): kv_aware's tokens held
// by each live instance, without committing a pick.
func (a *flowAdmission) cached(req *workload.Request) []flowcontrol.Hold {
	if a.kv == nil {
		return nil
	}
	cands := make([]*router.Instance, 0, len(a.live))
	for _, name := range a.live {
		in, err := a.rt.instance(name)
		if err != nil {
			return nil
		}
		cands = append(cands, in)
	}
	a.tokBuf = req.AppendTokens(a.tokBuf[:0])
	rq := &router.Request{Endpoint: router.EndpointCompletions, Model: a.rt.model, Adapter: req.Adapter,
		RoutingText: req.TextPrefix(8192), TenantKey: req.Tenant, PromptTokens: a.tokBuf}
	per, _, ok := a.kv.HeldBy(context.Background(), rq, cands, a.held[:0])
	a.held = per
	if !ok {
		return nil
	}
	var out []flowcontrol.Hold
	for i, h := range per {
		if h > 0 {
			out = append(out, flowcontrol.Hold{Instance: a.live[i], Tokens: int64(h)})
		}
	}
	return out
}

var (
	_ des.Admission = (*flowAdmission)(nil)
	_ des.Placer    = (*flowAdmission)(nil)
)

// newFlowAdmission is the queue of cfg over w's requests. With rt a
// kv_aware router each request carries, from its arrival, the tokens each
// instance holds (Item.Cached, as kv_aware's index, fresh and speculative
// entries, sees them then): the per-instance budget charges only the
// tokens an instance must prefill, and with cfg.PreferCached a freed slot
// goes to the due request that holds most on an instance with room.
func newFlowAdmission(cfg flowcontrol.Config, w *workload.Workload, rt *strategyRouter) (*flowAdmission, error) {
	a := &flowAdmission{items: map[uint64]*flowcontrol.Item{}, w: w, rt: rt}
	if rt != nil {
		a.kv, _ = rt.s.(*kvaware.KVAware)
	}
	s, err := flowcontrol.New(cfg)
	if err != nil {
		return nil, err
	}
	a.s = s
	return a, nil
}

func vt(d time.Duration) time.Time { return epoch.Add(d) }

func (a *flowAdmission) Arrive(id uint64, req *workload.Request, now time.Duration) (bool, string) {
	it := &flowcontrol.Item{Tenant: req.Tenant, Priority: req.Priority, Value: id,
		Prefill: int64(req.InputTokens()), Cost: int64(req.InputTokens() + req.OutputTokens), Cached: a.cached(req)}
	if req.TTFTObjective > 0 {
		it.Deadline = vt(now + req.TTFTObjective)
	}
	out := a.s.Offer(it, vt(now))
	if d := out.Displaced; d != nil {
		did := d.Value.(uint64)
		delete(a.items, did)
		a.drop = append(a.drop, des.Dropped{ID: did, Reason: string(flowcontrol.ShedDisplaced)})
	}
	switch out.Verdict {
	case flowcontrol.Shed:
		return false, string(out.Reason)
	case flowcontrol.Admitted:
		a.items[id] = it
		return true, ""
	}
	a.items[id] = it
	return false, ""
}

func (a *flowAdmission) Admitted(now time.Duration, dst []uint64) []uint64 {
	for it := a.s.Next(vt(now)); it != nil; it = a.s.Next(vt(now)) {
		dst = append(dst, it.Value.(uint64))
	}
	return dst
}

func (a *flowAdmission) Shed(now time.Duration, dst []des.Dropped) []des.Dropped {
	dst = append(dst, a.drop...)
	a.drop = a.drop[:0]
	a.buf = a.s.Expire(vt(now), a.buf[:0])
	for _, it := range a.buf {
		id := it.Value.(uint64)
		delete(a.items, id)
		dst = append(dst, des.Dropped{ID: id, Reason: string(it.ExpiredReason())})
	}
	return dst
}

func (a *flowAdmission) NextExpiry() (time.Duration, bool) {
	t, ok := a.s.NextExpiry()
	return t.Sub(epoch), ok
}

func (a *flowAdmission) FirstToken(id uint64, now time.Duration) {
	if it := a.items[id]; it != nil {
		a.s.FirstToken(it, vt(now))
	}
}

func (a *flowAdmission) Fleet(live []string) {
	a.live = append(a.live[:0], live...)
	a.s.SetInstances(live)
}

func (a *flowAdmission) Candidates(id uint64, cands, dst []string) []string {
	it := a.items[id]
	if it == nil {
		return dst
	}
	room := a.s.RoomFor(it)
	for _, c := range cands {
		if room.Has(c) {
			dst = append(dst, c)
		}
	}
	return dst
}

func (a *flowAdmission) KeptFree(id uint64, dst []string) []string {
	if it := a.items[id]; it != nil {
		return a.s.KeptFree(it, dst)
	}
	return dst
}

func (a *flowAdmission) Placed(id uint64, instance string) {
	if it := a.items[id]; it != nil {
		a.s.Bind(it, instance)
	}
}

// Companion counts a warm-up copy of admitted request of on instance, as
// the HTTP data plane does (flowcontrol.Ticket.Companion).
func (a *flowAdmission) Companion(of uint64, instance string, now time.Duration) {
	it := a.items[of]
	if it == nil {
		return
	}
	c := &flowcontrol.Item{Value: of | des.WarmTag}
	if a.s.Companion(it, c, instance, vt(now)) {
		a.items[of|des.WarmTag] = c
	}
}

func (a *flowAdmission) Finished(id uint64, now time.Duration) {
	if it := a.items[id]; it != nil {
		a.s.Done(it, vt(now))
		delete(a.items, id)
	}
}

// flowRun is one run of the overload workload, with or without the queue.
type flowRun struct {
	load float64
	flow bool
	w    *workload.Workload
	res  *des.Result
	// window is the arrival window (the burst), over which rates are taken.
	window time.Duration
}

func runFlow(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("flow", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench flow [--instances N] [--strategy S] [--loads 0.5,1.5,2,4] [flags]",
		"Flow control under overload, on the discrete-event driver: measures the fleet's capacity on\n"+
			"the overload workload (one heavy tenant sending --heavy-factor times the tokens of each of nine\n"+
			"light tenants, a quarter of requests at priority 0, the rest at 1), its unloaded TTFT, then\n"+
			"runs bursts at each load (a multiple of capacity) with and without the router's admission\n"+
			"queue. Prints TTFT percentiles, goodput (requests that met the TTFT objective per second of\n"+
			"the burst) and shed rates per class, and Jain's index over tenants' token throughput.",
		[]string{"kvbench flow", "kvbench flow --instances 8 --loads 2,4 --burst 120s"})
	instances := fs.Int("instances", 4, "instances (default simulated engine: Llama 3.1 70B on 8×H100)")
	strategy := fs.String("strategy", config.StrategyPrefixAware, "routing strategy")
	loadsFlag := fs.String("loads", "0.5,1.5,2,4", "burst arrival rates as multiples of the measured capacity")
	burst := fs.Duration("burst", 60*time.Second, "length of each burst (Poisson arrivals)")
	objective := fs.Duration("ttft-objective", 0, "TTFT objective of every request (0 = twice the unloaded p99 of its tenant class, light or heavy)")
	threshold := fs.Int("concurrency-threshold", config.DefaultConcurrencyThresh, "routing.concurrency_threshold; the queue's budget is this × instances")
	heavy := fs.Float64("heavy-factor", 10, "the heavy tenant's tokens over one light tenant's")
	urgent := fs.Float64("urgent-share", 0.25, "share of requests at priority 0 (the rest at 1)")
	prefill := fs.Int64("prefill-budget", sim.DefaultMaxNumBatchedTokens, "the queue's prefill_tokens_per_instance (default: one step of the engine's max_num_batched_tokens; 0 = none)")
	scope := fs.String("budget-scope", "instance", "instance: the budgets hold per instance and a request goes to an instance with room; pool: pool-wide (budget × instances)")
	affinity := fs.Bool("affinity", true, "with kv_aware, a freed slot goes to the waiting request with the most cached tokens on an instance with room, among those fair queuing considers due together (flowcontrol.Config.PreferCached)")
	cachedTokens := fs.Bool("cached-tokens", true, "with kv_aware, each request carries from its arrival the tokens each instance holds (flowcontrol.Item.Cached), as the router's HTTP path computes them, and --affinity reads them; false: no preference")
	chargeUncached := fs.Bool("charge-uncached", false, "with --cached-tokens, the per-instance budget charges an instance only the tokens it does not hold, and the reservation's demand and the service-time line count those (flowcontrol.Config.ChargeUncached; the router leaves it off)")
	reserve := fs.Bool("reserve-instance", true, "with --budget-scope instance, prompts larger than the prefill budget leave as many instances to the requests that fit it as those need for their measured demand (flowcontrol.Config.ReserveInstance; the router always reserves)")
	seed := fs.Int64("seed", 1, "seed")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var loads []float64
	for _, s := range splitList(*loadsFlag) {
		l, err := strconv.ParseFloat(s, 64)
		if err != nil || !(l > 0) {
			return fmt.Errorf("--loads: %q is not a positive number", s)
		}
		loads = append(loads, l)
	}
	if !(*urgent >= 0 && *urgent <= 1) {
		return fmt.Errorf("--urgent-share %v: want 0..1", *urgent)
	}
	if *urgent == 0 {
		*urgent = -1 // the generator's zero means its default
	}
	if *instances < 1 || *threshold < 1 || *burst <= 0 {
		return fmt.Errorf("--instances, --concurrency-threshold and --burst must be positive")
	}
	shape := workload.Overload{HeavyFactor: *heavy, UrgentShare: *urgent}
	var prefillBudget int64
	run := func(w *workload.Workload, flow bool) (*des.Result, error) {
		rt, err := newStrategyRouter(*strategy, config.RoutingConfig{ConcurrencyThreshold: *threshold}, uint64(*seed), sim.DefaultModel)
		if err != nil {
			return nil, err
		}
		dc := rt.desConfig(*instances, sim.Config{})
		if flow {
			fc := flowcontrol.Config{MaxConcurrency: *instances * *threshold, MaxPendingPrefill: int64(*instances) * prefillBudget}
			if *scope == "instance" {
				// As the router configures it (router/poolqueue.go): the
				// concurrency budget pool-wide, the prefill budget per instance.
				fc = flowcontrol.Config{MaxConcurrency: *instances * *threshold, InstancePrefill: prefillBudget, ReserveInstance: *reserve}
			}
			fc.PreferCached, fc.ChargeUncached = *affinity, *chargeUncached
			var view *strategyRouter
			if *cachedTokens {
				view = rt
			}
			a, err := newFlowAdmission(fc, w, view)
			if err != nil {
				return nil, err
			}
			dc.Admission = a
		}
		return des.Run(ctx, dc, w)
	}

	// Capacity: completions per second with the router's budget of
	// requests in flight on every instance, all the time.
	cw, err := workload.Overload{HeavyFactor: *heavy, UrgentShare: *urgent, Requests: 20 * *instances * *threshold,
		Arrivals: workload.Arrivals{Concurrency: *instances * *threshold}}.Generate(*seed)
	if err != nil {
		return err
	}
	cres, err := run(cw, false)
	if err != nil {
		return fmt.Errorf("capacity: %w", err)
	}
	capacity := steadyRate(cres)
	capTokens := capacity * shape.MeanTokens()
	rate := prefillRate(cres)
	fmt.Fprintf(stdout, "fleet: %d instances, strategy %s, budget %d in flight (%d per instance)\n", *instances, *strategy, *instances**threshold, *threshold)
	fmt.Fprintf(stdout, "capacity: %.1f req/s (%.0f tokens/s) with %d in flight; mean request %.0f tokens\n",
		capacity, capacity*shape.MeanTokens(), *instances**threshold, shape.MeanTokens())

	var objLight, objHeavy time.Duration
	burstOf := func(load float64) (*workload.Workload, time.Duration, error) {
		rate := load * capacity
		n := max(int(rate*burst.Seconds()), 1)
		w, err := workload.Overload{HeavyFactor: *heavy, UrgentShare: *urgent, Requests: n, Arrivals: workload.Arrivals{Rate: rate}}.Generate(*seed)
		if err != nil {
			return nil, 0, err
		}
		for i := range w.Requests {
			r := &w.Requests[i]
			r.TTFTObjective = objLight
			if r.Tenant == workload.HeavyTenant {
				r.TTFTObjective = objHeavy
			}
		}
		return w, time.Duration(float64(n) / rate * float64(time.Second)), err
	}
	// Unloaded: a quarter of capacity, no queue.
	uw, uwin, err := burstOf(0.25)
	if err != nil {
		return err
	}
	ures, err := run(uw, false)
	if err != nil {
		return fmt.Errorf("unloaded: %w", err)
	}
	base := flowRun{load: 0.25, w: uw, res: ures, window: uwin}
	objLight, objHeavy = *objective, *objective
	if *objective == 0 {
		objLight, objHeavy = 2*flowPct(base.ttfts(classLight), 0.99), 2*flowPct(base.ttfts(classHeavy), 0.99)
	}
	prefillBudget = *prefill
	fmt.Fprintf(stdout, "prefill: %.0f tokens/s per instance measured; queue budget %d pending prefill tokens per instance\n", rate, prefillBudget)
	// A run without urgent requests (--urgent-share 0) has no priority-0
	// figures to show: say so rather than print zeros.
	hasUrgent := len(base.ttfts(classHigh)) > 0
	p0 := "no priority-0 requests"
	if hasUrgent {
		p0 = "priority 0 p99 " + ms(flowPct(base.ttfts(classHigh), 0.99))
	}
	fmt.Fprintf(stdout, "unloaded (0.25× capacity): TTFT p50 %s p90 %s p99 %s (light tenants p90 %s, %s); objectives: light %s, heavy %s\n\n",
		ms(flowPct(base.ttfts(classAll), 0.5)), ms(flowPct(base.ttfts(classAll), 0.9)), ms(flowPct(base.ttfts(classAll), 0.99)),
		ms(flowPct(base.ttfts(classLight), 0.9)), p0, ms(objLight), ms(objHeavy))

	fmt.Fprintln(stdout, "| load | queue | class | requests | shed | TTFT p50 | p90 | p99 | queued p90 | goodput req/s |")
	fmt.Fprintln(stdout, "|---|---|---|---|---|---|---|---|---|---|")
	var notes []string
	for _, load := range loads {
		w, win, err := burstOf(load)
		if err != nil {
			return err
		}
		var pair [2]flowRun
		for i, flow := range []bool{false, true} {
			start := time.Now()
			res, err := run(w, flow)
			if err != nil {
				return fmt.Errorf("load %g: %w", load, err)
			}
			fr := flowRun{load: load, flow: flow, w: w, res: res, window: win}
			pair[i] = fr
			for _, c := range []flowClass{classAll, classHigh, classLow, classLight, classHeavy} {
				fmt.Fprintln(stdout, fr.row(c))
			}
			fmt.Fprintf(stderr, "load %g queue %v: %d requests in %.1f s wall\n", load, flow, len(w.Requests), time.Since(start).Seconds())
		}
		off, on := pair[0], pair[1]
		// The light tenants alone: the same burst without the heavy
		// tenant's requests, through the same queue.
		lw := lightOnly(w)
		lres, err := run(lw, true)
		if err != nil {
			return fmt.Errorf("load %g, light alone: %w", load, err)
		}
		alone := flowRun{load: load, flow: true, w: lw, res: lres, window: win}
		lp90, ap90 := flowPct(on.ttfts(classLight), 0.9), flowPct(alone.ttfts(classLight), 0.9)
		p0 := "no priority-0 requests"
		if hasUrgent {
			p0 = fmt.Sprintf("priority 0 p99 %s → %s (unloaded %s; %.2f×), priority 0 shed %.1f%%",
				ms(flowPct(off.ttfts(classHigh), 0.99)), ms(flowPct(on.ttfts(classHigh), 0.99)), ms(flowPct(base.ttfts(classHigh), 0.99)),
				float64(flowPct(on.ttfts(classHigh), 0.99))/float64(max(flowPct(base.ttfts(classHigh), 0.99), 1)), 100*on.shedShare(classHigh))
		}
		notes = append(notes, fmt.Sprintf("load %g×: goodput %.1f → %.1f req/s (%.2f×); Jain over tenants' goodput tokens %.3f → %.3f; "+
			"light tenants alone (%.2f× capacity in tokens): p90 %s, beside the heavy tenant %s (%.2f×), shed %.1f%%; "+
			"light p90 %s → %s (unloaded %s); %s; %s",
			load, off.goodput(classAll), on.goodput(classAll), on.goodput(classAll)/max(off.goodput(classAll), 1e-9),
			off.jain(), on.jain(),
			alone.tokenRate()/capTokens, ms(ap90), ms(lp90), float64(lp90)/float64(max(ap90, 1)), 100*on.shedShare(classLight),
			ms(flowPct(off.ttfts(classLight), 0.9)), ms(flowPct(on.ttfts(classLight), 0.9)), ms(flowPct(base.ttfts(classLight), 0.9)),
			p0, on.shedSummary()))
	}
	fmt.Fprintln(stdout)
	for _, n := range notes {
		fmt.Fprintln(stdout, "- "+n)
	}
	return nil
}

// lightOnly is w without the heavy tenant's requests.
func lightOnly(w *workload.Workload) *workload.Workload {
	out := *w
	out.Requests = nil
	for _, r := range w.Requests {
		if r.Tenant != workload.HeavyTenant {
			out.Requests = append(out.Requests, r)
		}
	}
	return &out
}

// tokenRate is the tokens the run's requests asked for per second of the
// burst.
func (f flowRun) tokenRate() float64 {
	t := 0
	for i := range f.w.Requests {
		t += f.w.Requests[i].InputTokens() + f.w.Requests[i].OutputTokens
	}
	return float64(t) / f.window.Seconds()
}

// shedShare is the share of the class's requests shed.
func (f flowRun) shedShare(c flowClass) float64 {
	n, shed := 0, 0
	f.each(c, func(o *des.Outcome, _ *workload.Request) {
		n++
		if o.Shed != "" {
			shed++
		}
	})
	return float64(shed) / float64(max(n, 1))
}

// steadyRate is the completion rate between the first and the last
// quarter of completions: a closed loop's ramp-up and drain left out.
func steadyRate(res *des.Result) float64 {
	var ends []time.Duration
	for _, o := range res.Outcomes {
		if o.Err == "" {
			ends = append(ends, o.Finish)
		}
	}
	slices.Sort(ends)
	a, b := len(ends)/4, 3*len(ends)/4
	if b <= a || ends[b] <= ends[a] {
		return float64(len(ends)) / res.End.Seconds()
	}
	return float64(b-a) / (ends[b] - ends[a]).Seconds()
}

// prefillRate is one engine's prefill throughput as measured over a run:
// prompt tokens not served from cache per second of steps that carried
// prefill, averaged over the fleet.
func prefillRate(res *des.Result) float64 {
	var toks float64
	for _, o := range res.Outcomes {
		if o.Err == "" {
			toks += float64(o.PromptTokens - o.CachedTokens)
		}
	}
	var busy time.Duration
	for _, u := range res.Utilisation {
		busy += u.PrefillBusy
	}
	if busy <= 0 {
		return 0
	}
	return toks / busy.Seconds()
}

// flowClass selects requests of the overload workload.
type flowClass string

const (
	classAll   flowClass = "all"
	classHigh  flowClass = "priority 0"
	classLow   flowClass = "priority 1"
	classLight flowClass = "light tenants"
	classHeavy flowClass = "heavy tenant"
)

func (c flowClass) has(r *workload.Request) bool {
	switch c {
	case classHigh:
		return r.Priority == 0
	case classLow:
		return r.Priority == 1
	case classLight:
		return r.Tenant != workload.HeavyTenant
	case classHeavy:
		return r.Tenant == workload.HeavyTenant
	}
	return true
}

// each calls fn with the outcomes of class c, with their requests.
func (f flowRun) each(c flowClass, fn func(o *des.Outcome, r *workload.Request)) {
	w := f.res.Outcomes
	for i := range w {
		if r := f.req(i); c.has(r) {
			fn(&w[i], r)
		}
	}
}

// req is the request of outcome i; the runs keep the workload's order.
func (f flowRun) req(i int) *workload.Request { return &f.w.Requests[i] }

// ttfts are the TTFTs of the class's requests that got a first token.
func (f flowRun) ttfts(c flowClass) []time.Duration {
	var out []time.Duration
	f.each(c, func(o *des.Outcome, _ *workload.Request) {
		if o.Err == "" && o.TTFT > 0 {
			out = append(out, o.TTFT)
		}
	})
	return out
}

// met reports whether the request got its first token within its objective.
func met(o *des.Outcome, r *workload.Request) bool {
	return o.Err == "" && o.TTFT > 0 && o.TTFT <= r.TTFTObjective
}

// goodput is the class's requests that met their objective, per second of
// the burst.
func (f flowRun) goodput(c flowClass) float64 {
	n := 0
	f.each(c, func(o *des.Outcome, r *workload.Request) {
		if met(o, r) {
			n++
		}
	})
	return float64(n) / f.window.Seconds()
}

func (f flowRun) row(c flowClass) string {
	n, shed := 0, 0
	var waits []time.Duration
	f.each(c, func(o *des.Outcome, _ *workload.Request) {
		n++
		if o.Shed != "" {
			shed++
		} else if o.Err == "" {
			waits = append(waits, o.Queued)
		}
	})
	t := f.ttfts(c)
	q := "off"
	if f.flow {
		q = "on"
	}
	return fmt.Sprintf("| %g× | %s | %s | %d | %.1f%% | %s | %s | %s | %s | %.1f |", f.load, q, c, n, 100*float64(shed)/float64(max(n, 1)),
		ms(flowPct(t, 0.5)), ms(flowPct(t, 0.9)), ms(flowPct(t, 0.99)), ms(flowPct(waits, 0.9)), f.goodput(c))
}

// jain is Jain's fairness index over the tenants' goodput in tokens
// (prompt and output tokens of their requests that met the TTFT
// objective), each normalised by its max-min fair share of the goodput
// delivered: x_i = got_i / fair_i (Jain, Chiu and Hawe, DEC-TR-301, 1984,
// define the index over allocations normalised by the optimal ones). A
// tenant that asks for less than an equal share is owed what it asks.
func (f flowRun) jain() float64 {
	got, want := map[string]float64{}, map[string]float64{}
	f.each(classAll, func(o *des.Outcome, r *workload.Request) {
		t := float64(r.InputTokens() + r.OutputTokens)
		want[r.Tenant] += t
		if met(o, r) {
			got[r.Tenant] += t
		}
	})
	total := 0.0
	for _, g := range got {
		total += g
	}
	fair := maxMinShares(want, total)
	var sum, sq float64
	for t, share := range fair {
		if share <= 0 {
			continue
		}
		x := got[t] / share
		sum += x
		sq += x * x
	}
	if sq == 0 {
		return 0
	}
	return sum * sum / (float64(len(fair)) * sq)
}

// maxMinShares divides capacity between demands max-min fairly (water
// filling): every tenant gets its demand or an equal share of what is
// left, whichever is less.
func maxMinShares(demand map[string]float64, capacity float64) map[string]float64 {
	names := slices.Sorted(maps.Keys(demand))
	slices.SortStableFunc(names, func(a, b string) int {
		switch {
		case demand[a] < demand[b]:
			return -1
		case demand[a] > demand[b]:
			return 1
		}
		return 0
	})
	out := make(map[string]float64, len(names))
	left := capacity
	for i, n := range names {
		share := min(demand[n], left/float64(len(names)-i))
		out[n] = share
		left -= share
	}
	return out
}

// shedSummary counts sheds by reason and how soon they were answered.
func (f flowRun) shedSummary() string {
	by := map[string]int{}
	atOnce, n := 0, 0
	var waits []time.Duration
	var sum time.Duration
	f.each(classAll, func(o *des.Outcome, _ *workload.Request) {
		if o.Shed == "" {
			return
		}
		n++
		by[o.Shed]++
		if o.Queued == 0 {
			atOnce++
		}
		waits = append(waits, o.Queued)
		sum += o.Queued
	})
	if n == 0 {
		return "nothing shed"
	}
	var parts []string
	for _, r := range slices.Sorted(maps.Keys(by)) {
		parts = append(parts, fmt.Sprintf("%s %d", r, by[r]))
	}
	return fmt.Sprintf("shed %d (%s), %.0f%% on arrival, wait before a shed mean %s p50 %s p90 %s longest %s", n, strings.Join(parts, ", "),
		100*float64(atOnce)/float64(n), ms(sum/time.Duration(n)), ms(flowPct(waits, 0.5)), ms(flowPct(waits, 0.9)), ms(slices.Max(waits)))
}

// flowPct is the q-quantile of ds (nearest rank), 0 for none.
func flowPct(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond)) }
