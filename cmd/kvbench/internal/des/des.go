// Package des is kvbench's discrete-event driver: a virtual clock runs a
// workload through a router and a fleet of simulated engines in-process,
// delivering the engines' KV events to the router's index after a
// configurable delay, and applying scale events mid-run. Nothing sleeps and
// no goroutine is started, so an hour of traffic on hundreds of instances
// runs in seconds, deterministically for a given seed.
//
// The driver depends only on the small Engine and Router interfaces below;
// package kvbench wires in sim.Engine and the router's strategies.
package des

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/workload"
)

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("des: invalid config")

// UpdateKind is what an engine reports about a request.
type UpdateKind uint8

const (
	// FirstToken: prefill done, first token out.
	FirstToken UpdateKind = iota + 1
	// Finished: all output tokens generated.
	Finished
	// Aborted: the engine gave up on the request.
	Aborted
)

// Update is an engine's report about one request at a virtual time.
type Update struct {
	ID           uint64
	Kind         UpdateKind
	At           time.Duration
	CachedTokens int // prompt tokens served from cache (FirstToken)
	OutputTokens int
}

// EngineRequest is a request as submitted to an engine.
type EngineRequest struct {
	ID        uint64
	Prompt    []uint32
	MaxTokens int
	Adapter   string
	CacheSalt string
	// RemotePrefill: the prompt's KV was computed by a prefill instance and
	// is received over the network (disaggregated decode).
	RemotePrefill bool
}

// Engine is a simulated model server driven by the virtual clock. It is
// called from one goroutine only.
type Engine interface {
	// Submit queues a request arriving at now.
	Submit(r EngineRequest, now time.Duration) error
	// Advance runs the engine up to now and appends its updates to out.
	Advance(now time.Duration, out []Update) []Update
	// NextEventTime is when the engine next changes state on its own; ok is
	// false when it is idle.
	NextEventTime() (t time.Duration, ok bool)
}

// EngineFactory makes the engine of a named instance; sink receives its KV
// event batches synchronously, during Submit and Advance.
type EngineFactory func(instance string, sink func(events.Batch)) (Engine, error)

// RouteRequest is what the driver tells a router about a request.
type RouteRequest struct {
	*workload.Request
	// Tokens are the prompt's token ids.
	Tokens []uint32
	// RoutingText is the prompt text cut to the router's prefix length.
	RoutingText string
	// Now is the virtual time of the decision.
	Now time.Duration
	// CacheSalt is the cache_salt the request carries to the engine ("" for none).
	CacheSalt string
	// EngineID is the id the request will have at its engine, the one
	// Started, FirstToken and Finished name: the workload index, or for a
	// disaggregated request's prefill stage that index tagged (disagg.go).
	EngineID uint64
	// KeptFree is the instances the admission queue keeps free of long
	// prompts for this request (Placer.KeptFree; router.Request.KeptFree).
	KeptFree []string
	// NoWarm: the pick may ask for no warm-up copy, as on the HTTP data
	// plane, whose disaggregated prefill pick comes before it can send
	// one and whose decode pick after a prefill pulls the KV instead
	// (router.Request.ProxyCanWarm). RemotePrefill is set on that decode
	// pick (router.Request.RemotePrefill).
	NoWarm, RemotePrefill bool
}

// Decision is a router's pick.
type Decision struct {
	Instance string
	// Reason as the router states it ("hash", "overflow", "kv-match", ...).
	Reason string
	// Overflow is true when the router could not use its first choice
	// because it was full.
	Overflow bool
	// Warm, when set, names the instance the router asked to compute a
	// warm-up copy of the prompt beside the request (router.Warm): the
	// driver submits it as an engine request of one output token, id
	// ID|WarmTag, through the same lifecycle calls as a request.
	// WarmTokens, when above 0, is the copy's prompt: the request's first
	// WarmTokens tokens (router.Warm.Tokens); else its whole prompt.
	Warm       string
	WarmTokens int
}

// Router picks an instance for each request. The driver calls it from one
// goroutine; the lifecycle calls keep its in-flight counts and let it see
// each request's outcome, as the proxy would.
type Router interface {
	Name() string
	// Pick chooses one of cands (the live instances, in a stable order).
	Pick(ctx context.Context, req *RouteRequest, cands []string) (Decision, error)
	// Started: request id is being sent to instance after Pick chose it
	// (before the engine answers, as the proxy counts a request in flight
	// before its upstream call).
	Started(id uint64, instance string)
	// FirstToken: its first token arrived, with the engine-reported cached
	// prompt tokens (usage.prompt_tokens_details.cached_tokens).
	FirstToken(id uint64, instance string, cachedTokens, promptTokens int)
	// Finished: the request ended on instance: completed (err nil), aborted
	// by the engine, or refused at submission. Every request Started is
	// Finished exactly once, so that whatever the router counted for it
	// (in-flight, pending prefill) is released whichever way it ended.
	Finished(id uint64, instance string, err error)
	// Removed: the instance left the fleet (scale-in).
	Removed(instance string)
}

// Admission is a flow-control queue in front of the router (package
// kvbench wires router/flowcontrol): it decides on each arrival and
// releases waiting requests as capacity frees and after each arrival and
// expiry (Admitted). The driver calls it from one goroutine.
type Admission interface {
	// Arrive: request id arrives at now. admit: route it now; otherwise
	// it waits, unless shed is set (refused at once, with that reason).
	Arrive(id uint64, req *workload.Request, now time.Duration) (admit bool, shed string)
	// Admitted appends the waiting requests admitted at now.
	Admitted(now time.Duration, dst []uint64) []uint64
	// Shed appends the waiting requests shed by now (expired, or displaced
	// by a more urgent arrival).
	Shed(now time.Duration, dst []Dropped) []Dropped
	// NextExpiry is when a waiting request next expires; ok is false when
	// none waits.
	NextExpiry() (t time.Duration, ok bool)
	// FirstToken and Finished follow an admitted request (Finished once,
	// whichever way it ended, including a routing failure), and a warm-up
	// copy (id|WarmTag).
	FirstToken(id uint64, now time.Duration)
	Finished(id uint64, now time.Duration)
	// Companion: the router sent a warm-up copy of admitted request of,
	// id of|WarmTag, to instance (router.Warm); it holds that instance's
	// budgets like a request until its FirstToken and Finished (the HTTP
	// data plane's flowcontrol.Ticket.Companion).
	Companion(of uint64, instance string, now time.Duration)
}

// Dropped is a waiting request the admission queue shed.
type Dropped struct {
	ID     uint64
	Reason string
}

// IndexWriter is what the driver needs of the router's block index
// (kvindex.Index satisfies it): events in, departed instances out.
type IndexWriter interface {
	Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error)
	Purge(ctx context.Context, instance string) error
}

// Config of one run. Zero values mean the defaults documented per field.
type Config struct {
	// Instances at the start of the run (required, >= 1).
	Instances int
	// NewEngine builds each instance's engine (required).
	NewEngine EngineFactory
	// Router decides placements (required).
	Router Router
	// Index, when set, receives every engine's KV events EventDelay after
	// the engine emitted them, as the live pipeline (ZMQ → kvbridge → NATS
	// → consumer) would deliver them; a kv-aware router reads it.
	Index IndexWriter
	// EventDelay is the engine-to-index latency (default 5 ms: ZMQ, one
	// NATS hop and an index write on one network; set < 0 for zero).
	EventDelay time.Duration
	// PrefixLength is how many characters of prompt text route (default 8,192,
	// the router's default prefix_length).
	PrefixLength int
	// SaltByTenant sends each request's tenant key as its cache_salt, so
	// engines keep tenants' KV apart.
	SaltByTenant bool
	// Progress, when set, is called after each completed request.
	Progress func(done, total int)
	// Clock, when set, is told every advance of the virtual clock, so that
	// components with their own notion of now (an index's last-event times,
	// a router's speculative entries) can follow virtual time.
	Clock func(now time.Duration)
	// Admission, when set, queues requests before the router, as the
	// router's flow control does (nil = every request routed on arrival).
	Admission Admission
	// Disagg, when set, serves requests in two stages (disagg.go).
	Disagg *Disagg
}

// Outcome is what happened to one request.
type Outcome struct {
	ID           int
	Instance     string
	Reason       string
	Overflow     bool
	Arrival      time.Duration
	TTFT         time.Duration // 0 when the request failed
	Finish       time.Duration
	PromptTokens int
	CachedTokens int
	OutputTokens int
	// Decision is the wall-clock time Pick took (tokens were computed before).
	Decision time.Duration
	// DecisionCPU is the CPU time the driver's thread spent in Pick (0 where
	// the platform gives no per-thread CPU clock). Unlike Decision it does
	// not count time the thread was preempted, so it is stable on a shared
	// machine.
	DecisionCPU time.Duration
	// Err is why the request failed (submit refused, aborted); empty when it succeeded.
	Err string
	// ErrKind is Err without request-specific details (the innermost
	// error's text): failures group by it.
	ErrKind string
	// Queued is the time it waited for admission (Config.Admission); Shed
	// is the reason the admission queue refused it ("" when it did not).
	Queued time.Duration
	Shed   string
	// PrefillInstance is the prefill stage's instance of a disaggregated
	// request (empty when it was served aggregated).
	PrefillInstance string
}

// Utilisation is how busy one engine was over its life in the run.
type Utilisation struct {
	Instance string
	// Life is from the instance's creation to the end of the run (or its
	// removal).
	Life time.Duration
	// Busy is the time it spent in steps; PrefillBusy the part of it in
	// steps that carried prompt (prefill) tokens.
	Busy, PrefillBusy time.Duration
}

// BusyReporter is implemented by engines that account for their busy time.
type BusyReporter interface {
	BusyTime() (busy, prefillBusy time.Duration)
}

// Result of a run.
type Result struct {
	Strategy  string
	Workload  string
	Outcomes  []Outcome
	Instances []string // every instance that existed during the run, in creation order
	// End is the virtual time the last request finished.
	End time.Duration
	// Wall is the real time the run took.
	Wall time.Duration
	// IndexDeliveries counts event batches applied to the index; IndexErrors
	// counts those Apply refused.
	IndexDeliveries, IndexErrors int
	// Warms counts the warm-up copies submitted (Decision.Warm);
	// WarmComputed is the prompt tokens those copies computed (prompt less
	// cached, at their first token): fleet prefill work that no request
	// of the workload's hit rate shows.
	Warms        int
	WarmComputed int64
	// Utilisation per instance (empty when the engines do not report busy
	// time, see BusyReporter).
	Utilisation []Utilisation
	// RemoteTokens is the prompt tokens decode instances received from
	// prefill instances (disaggregated runs; engines implementing
	// RemoteReporter).
	RemoteTokens uint64
}

// Simulated is the outcomes without what the host measured (Decision and
// DecisionCPU): the part of a run that its workload, configuration and
// seeds determine, equal between two runs of the same inputs.
func (r *Result) Simulated() []Outcome {
	out := slices.Clone(r.Outcomes)
	for i := range out {
		out[i].Decision, out[i].DecisionCPU = 0, 0
	}
	return out
}

type instance struct {
	name   string
	engine Engine
	live   bool
	// born and left bound the instance's life in the run (left = 0 while live).
	born, left time.Duration
	// lastUpdate is the time of the engine's latest update: a removed
	// instance drains what it held, so its life ends at max(left, this).
	lastUpdate time.Duration
	// gen versions the instance's scheduled wake-up: heap entries of older
	// generations are stale.
	gen uint64
}

type wake struct {
	at   time.Duration
	inst *instance
	gen  uint64
}

type wakeHeap []wake

func (h wakeHeap) Len() int { return len(h) }
func (h wakeHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].inst.name < h[j].inst.name
}
func (h wakeHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *wakeHeap) Push(x any)   { *h = append(*h, x.(wake)) }
func (h *wakeHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

type delivery struct {
	at    time.Duration
	inst  string
	batch events.Batch
}

type run struct {
	cfg      Config
	w        *workload.Workload
	insts    []*instance
	byName   map[string]*instance
	live     []string
	wakes    wakeHeap
	pending  []delivery // FIFO: the delay is constant, so append order is time order
	now      time.Duration
	res      *Result
	inflight map[uint64]*instance
	warmLen  map[uint64]int // a warm-up copy's prompt tokens, by its id
	done     int
	next     int // next request to issue
	ups      []Update
	tokBuf   []uint32
	// waiting counts requests in the admission queue; admitted and
	// dropped are scratch for its answers.
	waiting  int
	admitted []uint64
	dropped  []Dropped
	// freed is set when an admitted request released budget (its first
	// token or its end): the loop then admits waiting requests.
	freed bool
	// Disaggregation (disagg.go): the prefill and decode sets, requests
	// in their prefill stage (engine id → request), and prefills done
	// whose decode stage is due.
	prefillSet, decodeSet []string
	prefilling            map[uint64]int
	handoffs              []handoff
	// roomBuf is scratch for placeable (placer.go).
	roomBuf []string
	// keptBuf is scratch for keptFree (placer.go).
	keptBuf []string
}

// Run plays the workload through the fleet and returns what happened to
// every request. It stops early, with the context's error, when ctx ends.
func Run(ctx context.Context, cfg Config, w *workload.Workload) (*Result, error) {
	if cfg.Instances < 1 || cfg.NewEngine == nil || cfg.Router == nil {
		return nil, fmt.Errorf("%w: need instances >= 1, an engine factory and a router", ErrConfig)
	}
	if cfg.EventDelay == 0 {
		cfg.EventDelay = 5 * time.Millisecond
	} else if cfg.EventDelay < 0 {
		cfg.EventDelay = 0
	}
	if cfg.PrefixLength == 0 {
		cfg.PrefixLength = 8192
	}
	if cfg.PrefixLength < 0 {
		return nil, fmt.Errorf("%w: prefix length %d", ErrConfig, cfg.PrefixLength)
	}
	r := &run{
		cfg: cfg, w: w, byName: map[string]*instance{}, inflight: map[uint64]*instance{}, warmLen: map[uint64]int{},
		res: &Result{Strategy: cfg.Router.Name(), Workload: w.Name, Outcomes: make([]Outcome, len(w.Requests))},
	}
	for i := range r.res.Outcomes {
		r.res.Outcomes[i].ID = i
	}
	for range cfg.Instances {
		if err := r.addInstance(); err != nil {
			return nil, err
		}
	}
	if err := r.splitRoles(); err != nil {
		return nil, err
	}
	r.fleetChanged()
	// Pin the driver to one OS thread so that the thread's CPU clock
	// measures exactly the work of each Pick.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	start := time.Now()
	err := r.loop(ctx)
	r.res.Wall = time.Since(start)
	r.utilisation()
	return r.res, err
}

// utilisation records each engine's busy time over its life.
func (r *run) utilisation() {
	for _, in := range r.insts {
		br, ok := in.engine.(BusyReporter)
		if !ok {
			return
		}
		end := r.res.End
		if !in.live {
			// Removed: its life runs until it drained, whose steps are in
			// its busy time.
			end = max(in.left, in.lastUpdate)
		}
		busy, pre := br.BusyTime()
		r.res.Utilisation = append(r.res.Utilisation, Utilisation{Instance: in.name, Life: max(end-in.born, 0), Busy: busy, PrefillBusy: pre})
		if rr, ok := in.engine.(RemoteReporter); ok {
			r.res.RemoteTokens += rr.RemoteTokens()
		}
	}
}

func (r *run) addInstance() error {
	name := fmt.Sprintf("i%02d", len(r.insts))
	in := &instance{name: name, live: true, born: r.now}
	eng, err := r.cfg.NewEngine(name, func(b events.Batch) {
		if r.cfg.Index != nil {
			r.pending = append(r.pending, delivery{at: r.now + r.cfg.EventDelay, inst: name, batch: b})
		}
	})
	if err != nil {
		return fmt.Errorf("des: engine %s: %w", name, err)
	}
	in.engine = eng
	r.insts = append(r.insts, in)
	r.byName[name] = in
	r.live = append(r.live, name)
	r.res.Instances = append(r.res.Instances, name)
	return nil
}

func (r *run) removeInstance() {
	if len(r.live) <= 1 {
		return // keep one instance: a fleet of none serves nothing
	}
	name := r.live[len(r.live)-1]
	r.live = r.live[:len(r.live)-1]
	r.byName[name].live = false
	r.byName[name].left = r.now
	r.cfg.Router.Removed(name)
	if r.cfg.Index != nil {
		// The router forgets a departed instance (health checks would eject it).
		_ = r.cfg.Index.Purge(context.Background(), name)
	}
}

// schedule records when in next needs the clock.
func (r *run) schedule(in *instance) {
	in.gen++
	if t, ok := in.engine.NextEventTime(); ok {
		heap.Push(&r.wakes, wake{at: max(t, r.now), inst: in, gen: in.gen})
	}
}

// nextWake drops stale heap entries and returns the earliest valid one.
func (r *run) nextWake() (wake, bool) {
	for len(r.wakes) > 0 {
		w := r.wakes[0]
		if w.gen == w.inst.gen {
			return w, true
		}
		heap.Pop(&r.wakes)
	}
	return wake{}, false
}

const never = time.Duration(1<<63 - 1)

func (r *run) loop(ctx context.Context) error {
	total := len(r.w.Requests)
	fleet := 0
	closed := r.w.ClosedLoop
	for steps := 0; ; steps++ {
		if steps&1023 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		tArr := never
		if r.next < total {
			if closed > 0 {
				if len(r.inflight)-len(r.prefilling)+r.waiting < closed {
					tArr = r.now
				}
			} else {
				tArr = max(r.w.Requests[r.next].At, r.now)
			}
		}
		tFleet := never
		if fleet < len(r.w.Fleet) {
			tFleet = max(r.w.Fleet[fleet].At, r.now)
		}
		tDel := never
		if len(r.pending) > 0 {
			tDel = max(r.pending[0].at, r.now)
		}
		tEng := never
		wk, ok := r.nextWake()
		if ok {
			tEng = wk.at
		}
		tExp := never
		if a := r.cfg.Admission; a != nil {
			if e, ok := a.NextExpiry(); ok {
				tExp = max(e, r.now)
			}
		}
		tHand := never
		if len(r.handoffs) > 0 {
			tHand = max(r.handoffs[0].at, r.now)
		}
		t := min(tArr, tFleet, tDel, tEng, tExp, tHand)
		if t == never {
			if r.done < total {
				return fmt.Errorf("des: stalled with %d of %d requests unfinished", total-r.done, total)
			}
			return nil
		}
		if t != r.now && r.cfg.Clock != nil {
			r.cfg.Clock(t)
		}
		r.now = t
		// At equal times: engines report first (completions free capacity
		// and their events are already due), then index deliveries (so a
		// router sees state as of now), then queue expiries, then scale
		// events, then arrivals.
		switch t {
		case tEng:
			heap.Pop(&r.wakes)
			r.advance(wk.inst)
		case tDel:
			d := r.pending[0]
			r.pending = r.pending[1:]
			r.res.IndexDeliveries++
			if _, err := r.cfg.Index.Apply(ctx, d.inst, d.batch.Events); err != nil {
				r.res.IndexErrors++
			}
		case tExp:
			r.drop()
			r.freed = true // the requests behind one that expired may go now
		case tHand:
			h := r.handoffs[0]
			r.handoffs = r.handoffs[1:]
			r.decodeStage(ctx, h)
		case tFleet:
			ev := r.w.Fleet[fleet]
			fleet++
			for range ev.Instances {
				switch ev.Kind {
				case workload.ScaleOut:
					if err := r.addInstance(); err != nil {
						return err
					}
				case workload.ScaleIn:
					r.removeInstance()
				}
			}
			r.fleetChanged()
		default:
			r.arrive(ctx, r.next)
			r.next++
		}
		for r.freed {
			r.freed = false
			r.admitWaiting(ctx)
		}
	}
}

// arrive offers request i to the admission queue, if any, and routes it
// when admitted.
func (r *run) arrive(ctx context.Context, i int) {
	o := &r.res.Outcomes[i]
	o.Arrival = r.now
	o.PromptTokens = r.w.Requests[i].InputTokens()
	a := r.cfg.Admission
	if a == nil {
		r.issue(ctx, i)
		return
	}
	admit, shed := a.Arrive(uint64(i), &r.w.Requests[i], r.now)
	switch {
	case admit:
		r.issue(ctx, i)
	case shed != "":
		r.shed(o, shed)
	default:
		r.waiting++
	}
	r.drop() // an arrival may displace a waiting request
	// A queued arrival may go at once (ahead of a request held back only
	// by the reservation, or in a more urgent band), and a displaced one
	// may unblock those behind it: dispatch as the router's Gate does.
	r.freed = true
}

// drop ends the waiting requests the admission queue shed by now.
func (r *run) drop() {
	r.dropped = r.cfg.Admission.Shed(r.now, r.dropped[:0])
	for _, d := range r.dropped {
		r.waiting--
		o := &r.res.Outcomes[d.ID]
		o.Queued = r.now - o.Arrival
		r.shed(o, d.Reason)
	}
}

func (r *run) shed(o *Outcome, reason string) {
	o.Shed, o.Finish = reason, r.now
	r.fail(o, "shed", errors.New(reason))
}

// admitWaiting routes the waiting requests the admission queue admits now
// (called when capacity may have freed, and after an arrival or expiry).
func (r *run) admitWaiting(ctx context.Context) {
	a := r.cfg.Admission
	if a == nil {
		return
	}
	r.admitted = a.Admitted(r.now, r.admitted[:0])
	for _, id := range r.admitted {
		r.waiting--
		r.issue(ctx, int(id))
	}
}

func (r *run) advance(in *instance) {
	r.ups = in.engine.Advance(r.now, r.ups[:0])
	for _, u := range r.ups {
		in.lastUpdate = max(in.lastUpdate, u.At)
		if u.ID&prefillTag != 0 {
			r.prefillUpdate(in, u)
			continue
		}
		if u.ID&WarmTag != 0 {
			switch u.Kind {
			case FirstToken:
				prompt := r.warmLen[u.ID]
				r.res.WarmComputed += int64(max(prompt-u.CachedTokens, 0))
				r.cfg.Router.FirstToken(u.ID, in.name, u.CachedTokens, prompt)
				if a := r.cfg.Admission; a != nil {
					a.FirstToken(u.ID, u.At)
					r.freed = true // the copy's prefill budget is free: who waits for it may go
				}
			case Finished, Aborted:
				var err error
				if u.Kind == Aborted {
					err = errAborted
				}
				r.warmEnd(u.ID, in.name, err)
			}
			continue
		}
		o := &r.res.Outcomes[u.ID]
		switch u.Kind {
		case FirstToken:
			o.TTFT = u.At - o.Arrival
			o.CachedTokens = u.CachedTokens
			r.cfg.Router.FirstToken(u.ID, in.name, u.CachedTokens, o.PromptTokens)
			if a := r.cfg.Admission; a != nil {
				a.FirstToken(u.ID, u.At)
				r.freed = true
			}
		case Finished, Aborted:
			o.Finish = u.At
			o.OutputTokens = u.OutputTokens
			var err error
			if u.Kind == Aborted {
				err = errAborted
				o.Err, o.ErrKind = err.Error(), err.Error()
				o.TTFT = 0
			}
			r.complete(u.ID, in, err)
		}
	}
	r.schedule(in)
}

// errAborted ends a request the engine gave up on.
var errAborted = errors.New("aborted by engine")

func (r *run) complete(id uint64, in *instance, err error) {
	delete(r.inflight, id)
	r.cfg.Router.Finished(id, in.name, err)
	r.admissionDone(id)
	r.done++
	r.res.End = max(r.res.End, r.now)
	if r.cfg.Progress != nil {
		r.cfg.Progress(r.done, len(r.w.Requests))
	}
}

// fail counts a request that never reached an engine.
func (r *run) fail(o *Outcome, stage string, err error) {
	o.Err = stage + ": " + err.Error()
	o.ErrKind = stage + ": " + rootError(err).Error()
	r.done++
	if r.cfg.Progress != nil {
		r.cfg.Progress(r.done, len(r.w.Requests))
	}
}

// admissionDone tells the admission queue request id ended.
func (r *run) admissionDone(id uint64) {
	if a := r.cfg.Admission; a != nil {
		a.Finished(id, r.now)
		r.freed = true
	}
}

// issue routes request i (arrived, and admitted when there is a queue) and
// submits it to the picked engine.
func (r *run) issue(ctx context.Context, i int) {
	req := &r.w.Requests[i]
	o := &r.res.Outcomes[i]
	o.Queued = r.now - o.Arrival
	r.tokBuf = req.AppendTokens(r.tokBuf[:0])
	salt := ""
	if r.cfg.SaltByTenant {
		salt = req.Tenant
	}
	rr := &RouteRequest{Request: req, Tokens: r.tokBuf, RoutingText: req.TextPrefix(r.cfg.PrefixLength), Now: r.now, CacheSalt: salt, EngineID: uint64(i)}
	cands := r.live
	if r.cfg.Disagg != nil {
		if r.prefillStage(ctx, i, rr) {
			return
		}
		rr.EngineID, rr.NoWarm = uint64(i), false
		cands = r.decodeSet
	}
	cands = r.placeable(uint64(i), cands)
	rr.KeptFree = r.keptFree(uint64(i))
	cpu0 := cputime.Thread()
	start := time.Now()
	d, err := r.cfg.Router.Pick(ctx, rr, cands)
	o.Decision = time.Since(start)
	if cpu0 >= 0 {
		o.DecisionCPU = max(cputime.Thread()-cpu0, 0)
	}
	in := r.byName[d.Instance]
	if err == nil && (in == nil || !in.live) {
		err = fmt.Errorf("%w: router picked %q", errNotLive, d.Instance)
	}
	if err != nil {
		r.admissionDone(uint64(i))
		r.fail(o, "route", err)
		return
	}
	o.Instance, o.Reason, o.Overflow = d.Instance, d.Reason, d.Overflow
	r.placed(uint64(i), in.name)
	r.cfg.Router.Started(uint64(i), in.name)
	// The engine keeps the prompt slice: give it its own copy.
	prompt := append([]uint32(nil), r.tokBuf...)
	if err := in.engine.Submit(EngineRequest{ID: uint64(i), Prompt: prompt, MaxTokens: req.OutputTokens, Adapter: req.Adapter, CacheSalt: salt}, r.now); err != nil {
		// Refused (e.g. over the model's context): the request ends here,
		// through the same path as every other end.
		o.Err = "submit: " + err.Error()
		o.ErrKind = "submit: " + rootError(err).Error()
		o.Finish = r.now
		r.cfg.Router.Finished(uint64(i), in.name, err)
		r.admissionDone(uint64(i))
		r.done++
		if r.cfg.Progress != nil {
			r.cfg.Progress(r.done, len(r.w.Requests))
		}
		return
	}
	r.inflight[uint64(i)] = in
	r.schedule(in)
	if d.Warm != "" {
		r.warm(uint64(i), d.Warm, d.WarmTokens, req, salt)
	}
}

// WarmTag marks engine request ids of warm-up copies (request ids are
// far below it; prefillTag is the bit above).
const WarmTag = uint64(1) << 61

// warm submits request id's warm-up copy to the named instance: its prompt,
// or the first ntok tokens of it when ntok is above 0, for one output
// token. Its updates reach the router's lifecycle calls under id|WarmTag
// and nothing else: it is no request of the workload.
func (r *run) warm(id uint64, name string, ntok int, req *workload.Request, salt string) {
	wid := id | WarmTag
	r.cfg.Router.Started(wid, name) // every end below releases what this counts
	in := r.byName[name]
	if in == nil || !in.live {
		r.warmEnd(wid, name, fmt.Errorf("%w: warm-up on %q", errNotLive, name))
		return
	}
	n := len(r.tokBuf)
	if ntok > 0 && ntok < n {
		n = ntok
	}
	prompt := append([]uint32(nil), r.tokBuf[:n]...)
	r.warmLen[wid] = n
	if err := in.engine.Submit(EngineRequest{ID: wid, Prompt: prompt, MaxTokens: 1, Adapter: req.Adapter, CacheSalt: salt}, r.now); err != nil {
		r.warmEnd(wid, in.name, err)
		return
	}
	if a := r.cfg.Admission; a != nil {
		// Counted once the engine has it, as the data plane counts a copy
		// it sends (an end before this is a no-op for the queue).
		a.Companion(id, name, r.now)
	}
	r.res.Warms++
	r.schedule(in)
}

// warmEnd ends warm-up copy wid, however it ended, for the router and the
// admission queue.
func (r *run) warmEnd(wid uint64, name string, err error) {
	delete(r.warmLen, wid)
	r.cfg.Router.Finished(wid, name, err)
	r.admissionDone(wid)
}

var errNotLive = errors.New("not a live instance")

// rootError is the innermost wrapped error: the kind of failure without
// the request's details.
func rootError(err error) error {
	for {
		u := errors.Unwrap(err)
		if u == nil {
			return err
		}
		err = u
	}
}
