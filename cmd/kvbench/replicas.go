package main

// des --routers: several router replicas behind a plain L4 balancer, each
// with its own router-local state (in-flight counts, pending prefill,
// speculative blocks), sharing it through replica sync delayed by a
// configurable latency — or not at all — to show what being distributed
// costs (issue 14, docs/replicas.md).

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/sim"
)

// replicaFlags are des's replica knobs.
type replicaFlags struct {
	routers   string
	latencies string
	balance   string
	interval  time.Duration
	agreement bool
}

func (f *replicaFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.routers, "routers", "1", "router replicas behind the balancer, a comma-separated list to compare (e.g. 1,2,4)")
	fs.StringVar(&f.latencies, "sync-latency", "0", "replica sync delivery latency, a comma-separated list (e.g. 0,10ms,100ms,off); off = no replica sync: each replica routes on its own counters only")
	fs.StringVar(&f.balance, "balance", "round-robin", "how the balancer spreads requests over replicas: round-robin or random")
	fs.DurationVar(&f.interval, "sync-interval", replicasync.DefaultInterval, "replica sync interval (events.replica_sync.interval)")
	fs.BoolVar(&f.agreement, "agreement", false, "with several replicas: after each decision, evaluate the same request on every other replica (dry) and report how often they agree, over all decisions and over those made while settled (every replica had applied the others' state as of the last change anywhere)")
}

// replicaRun is one replica configuration to run.
type replicaRun struct {
	routers int
	sync    bool
	latency time.Duration
}

// runs lists the configurations asked for: one router first (sync has
// nothing to share there), then every replica count with every latency.
func (f *replicaFlags) runs() ([]replicaRun, error) {
	if f.balance != "round-robin" && f.balance != "random" {
		return nil, fmt.Errorf("--balance %q: want round-robin or random", f.balance)
	}
	if f.interval <= 0 {
		return nil, fmt.Errorf("--sync-interval %v: want > 0", f.interval)
	}
	var lats []replicaRun
	for _, s := range splitList(f.latencies) {
		if s == "off" {
			lats = append(lats, replicaRun{})
			continue
		}
		d, err := time.ParseDuration(s)
		if s == "0" {
			d, err = 0, nil
		}
		if err != nil || d < 0 {
			return nil, fmt.Errorf("--sync-latency %q: want a duration >= 0 or off", s)
		}
		lats = append(lats, replicaRun{sync: true, latency: d})
	}
	if len(lats) == 0 {
		return nil, errors.New("--sync-latency: empty")
	}
	var out []replicaRun
	for _, s := range splitList(f.routers) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 64 {
			return nil, fmt.Errorf("--routers %q: want 1..64", s)
		}
		if n == 1 {
			out = append(out, replicaRun{routers: 1})
			continue
		}
		for _, l := range lats {
			l.routers = n
			out = append(out, l)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("--routers: empty")
	}
	return out, nil
}

// label names a configuration in the report's strategy column.
func (r replicaRun) label(strategy string) string {
	switch {
	case r.routers <= 1:
		return strategy
	case !r.sync:
		return fmt.Sprintf("%s x%d no sync", strategy, r.routers)
	}
	return fmt.Sprintf("%s x%d sync %v", strategy, r.routers, r.latency)
}

// agreement counts the dry evaluations of --agreement.
type agreement struct {
	probes, agreed int
	// settled and settledAgreed count the probes of decisions made while
	// the tier's state was settled: every replica had applied its peers'
	// state as it was after the last change anywhere (replicaSet.settled).
	settled, settledAgreed int
	// byReason counts disagreements by the deciding replica's reason.
	byReason map[string]int
}

func (a *agreement) String() string {
	if a.probes == 0 {
		return "no probes"
	}
	var parts []string
	for r, n := range a.byReason {
		parts = append(parts, fmt.Sprintf("%s %d", r, n))
	}
	sort.Strings(parts)
	settled := "settled: no probes"
	if a.settled > 0 {
		settled = fmt.Sprintf("settled %.2f%% of %d", 100*float64(a.settledAgreed)/float64(a.settled), a.settled)
	}
	return fmt.Sprintf("%.2f%% of %d; %s (disagreements by the deciding replica's reason: %s)",
		100*float64(a.agreed)/float64(a.probes), a.probes, settled, strings.Join(parts, ", "))
}

// runReplicated runs strategy name on a replicated router tier.
func runReplicated(ctx context.Context, name string, run replicaRun, rf *replicaFlags, ff *fleetFlags, scfg sim.Config, b *built, boundHits []int64, seed uint64, bar *report.Progress, stdout io.Writer) (report.Summary, error) {
	set, err := newReplicaSet(name, run, rf, ff, scfg, seed)
	if err != nil {
		return report.Summary{}, err
	}
	made := func(inst string, e *sim.Engine) {
		for _, r := range set.reps {
			r.engineMade(inst, e)
		}
	}
	dc := des.Config{Instances: ff.instances, NewEngine: simFactory(scfg, made), Router: set, Clock: set.clock,
		EventDelay: ff.delay, PrefixLength: ff.prefixLen, SaltByTenant: ff.salt, Progress: bar.Update}
	if set.index != nil {
		dc.Index = set.index
	}
	res, err := des.Run(ctx, dc, b.w)
	bar.Done()
	if err != nil {
		return report.Summary{}, fmt.Errorf("%s: %w", set.Name(), err)
	}
	if set.agree != nil {
		fmt.Fprintf(stdout, "agreement %s: %s\n", set.Name(), set.agree)
	}
	s := report.Summarize(res, 0)
	if boundHits != nil {
		s = report.SummarizeBound(res, boundHits)
	}
	b.record(&s)
	return s, nil
}

// replicaSet is a des.Router: a balancer in front of router replicas.
type replicaSet struct {
	name   string
	reps   []*replica
	index  *kvindex.Memory // shared by the replicas (nil without kv_aware)
	random *rand.Rand      // nil = round robin
	next   int
	// owner maps a request (engine id) to the replica that routed it.
	owner map[uint64]int

	sync              bool
	latency, interval time.Duration
	now               time.Duration
	nextFlush         time.Duration
	transit           []syncDelivery // in delivery order (constant latency)
	// changed is when router-local state last changed on any replica (a
	// decision, a start, a first token, an end); applied is the state time
	// of the newest flush every peer has applied. changed < applied: each
	// replica knows the others' state as it is (settled).
	changed, applied time.Duration
	changes          bool

	agree *agreement // nil = no probes
	// last is the decision just made, probed at Started (outside the
	// driver's decision timing).
	last struct {
		req     *des.RouteRequest
		cands   []string
		reason  string
		from    int
		settled bool
	}
}

var _ des.Router = (*replicaSet)(nil)

// replica is one router replica.
type replica struct {
	*strategyRouter
	peers *simPeers // nil without sync
	reg   *prometheus.Registry
	// probe evaluates a request dry on this replica (kv_aware only).
	probe *kvaware.Shadow
	fixed *fixedPick
}

// syncDelivery is one replica's flush, due at its peers at at; state is
// the virtual time whose state it carries (every change before it; the
// state does not change between two driver steps).
type syncDelivery struct {
	at, state  time.Duration
	from       int
	load, spec *replicasync.Message
}

func newReplicaSet(name string, run replicaRun, rf *replicaFlags, ff *fleetFlags, scfg sim.Config, seed uint64) (*replicaSet, error) {
	s := &replicaSet{name: run.label(name), owner: map[uint64]int{}, sync: run.sync, latency: run.latency, interval: rf.interval}
	if rf.balance == "random" {
		s.random = rand.New(rand.NewPCG(seed, 0x5eed))
	}
	if rf.agreement && needsKV(name) {
		s.agree = &agreement{byReason: map[string]int{}}
	}
	if needsKV(name) {
		// One index for all: memory indexes fed from the same stream
		// with the same delay hold the same blocks (docs/replicas.md), as
		// the shared Redis index does; what differs per replica is the
		// router-local state this run is about.
		idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: sim.DefaultModel, BlockSize: sim.DefaultBlockSize, Now: s.wall, Capacity: indexCapacity(ff.instances, scfg)})
		if err != nil {
			return nil, err
		}
		s.index = idx
	}
	for i := range run.routers {
		rep := &replica{reg: prometheus.NewRegistry()}
		share := kvShare{index: s.index}
		if s.index != nil {
			m, err := kvaware.NewKVMetrics(rep.reg)
			if err != nil {
				return nil, err
			}
			share.metrics = m
			if s.sync {
				rep.peers = &simPeers{name: fmt.Sprintf("r%d", i),
					table: replicasync.NewTable(replicasync.DefaultPeerTimeout, replicasync.DefaultSpecCapacity, s.wall)}
				share.fresh = rep.peers
			}
		}
		// Replicas are separate processes: each has its own seed.
		r, err := newStrategyRouterShared(name, ff.routing(), seed+uint64(i)*0x9e3779b97f4a7c15, sim.DefaultModel, 0, share)
		if err != nil {
			return nil, err
		}
		rep.strategyRouter = r
		if kv, ok := r.s.(*kvaware.KVAware); ok && s.agree != nil {
			rep.fixed = &fixedPick{}
			rep.probe = kvaware.NewShadow(rep.fixed, kv)
		}
		s.reps = append(s.reps, rep)
	}
	return s, nil
}

func (s *replicaSet) wall() time.Time { return epoch.Add(s.now) }

func (s *replicaSet) Name() string { return s.name }

func (s *replicaSet) Pick(ctx context.Context, req *des.RouteRequest, cands []string) (des.Decision, error) {
	i := s.next
	if s.random != nil {
		i = s.random.IntN(len(s.reps))
	} else {
		s.next = (s.next + 1) % len(s.reps)
	}
	settled := s.settled()
	d, err := s.reps[i].Pick(ctx, req, cands)
	if err != nil {
		return d, err
	}
	s.change()
	s.owner[req.EngineID] = i
	s.last.req, s.last.cands, s.last.reason, s.last.from, s.last.settled = req, cands, d.Reason, i, settled
	return d, nil
}

// change records that router-local state changed now.
func (s *replicaSet) change() { s.changed, s.changes = s.now, true }

// settled reports whether every replica has applied its peers' state as
// it is now: the newest flush delivered everywhere was taken after the
// last change on any replica (or nothing has changed yet).
func (s *replicaSet) settled() bool {
	return s.sync && (!s.changes || s.changed < s.applied)
}

func (s *replicaSet) Started(id uint64, inst string) {
	i, ok := s.owner[id]
	if !ok {
		return
	}
	s.reps[i].Started(id, inst)
	s.change()
	if s.agree != nil && s.last.req != nil && s.last.req.EngineID == id {
		s.probeOthers(i, inst)
	}
	s.last.req = nil
}

func (s *replicaSet) FirstToken(id uint64, inst string, cached, prompt int) {
	if i, ok := s.owner[id]; ok {
		s.reps[i].FirstToken(id, inst, cached, prompt)
		s.change()
	}
}

func (s *replicaSet) Finished(id uint64, inst string, err error) {
	if i, ok := s.owner[id]; ok {
		s.reps[i].Finished(id, inst, err)
		delete(s.owner, id)
		s.change()
	}
}

func (s *replicaSet) Removed(inst string) {
	for _, r := range s.reps {
		r.Removed(inst)
	}
}

// probeOthers evaluates the request just routed by replica from to inst
// on every other replica, dry (kvaware.Shadow with the decision made as
// the strategy in use: kv_aware scores without committing anything), and
// counts whether each would have picked inst. The shadow's observer is
// ended at once, as the gRPC Pick does for a request routed elsewhere.
func (s *replicaSet) probeOthers(from int, inst string) {
	req := s.last.req
	for j, rep := range s.reps {
		if j == from || rep.probe == nil {
			continue
		}
		target, err := rep.instance(inst)
		if err != nil {
			continue
		}
		rep.cands = rep.cands[:0]
		for _, c := range s.last.cands {
			in, err := rep.instance(c)
			if err != nil {
				continue
			}
			rep.cands = append(rep.cands, in)
		}
		rep.loadScrape()
		before := shadowAgreed(rep.reg)
		rep.fixed.inst = target
		d, err := rep.probe.Pick(context.Background(), rep.request(req), rep.cands)
		if err != nil {
			continue
		}
		if d.Observer != nil {
			d.Observer.Done(0, -1)
		}
		s.agree.probes++
		agreed := shadowAgreed(rep.reg) > before
		if s.last.settled {
			s.agree.settled++
			if agreed {
				s.agree.settledAgreed++
			}
		}
		if agreed {
			s.agree.agreed++
		} else {
			s.agree.byReason[s.last.reason]++
		}
	}
}

// shadowAgreed reads kvrouter_shadow_decisions_total{agree="true"}.
func shadowAgreed(reg *prometheus.Registry) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvrouter_shadow_decisions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "agree" && l.GetValue() == "true" {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// fixedPick is a strategy that picks the instance it is told: the
// decision another replica made, for the shadow to compare with.
type fixedPick struct{ inst *router.Instance }

var _ router.Strategy = (*fixedPick)(nil)

func (f *fixedPick) Name() string { return "decided" }

func (f *fixedPick) Pick(context.Context, *router.Request, []*router.Instance) (router.Decision, error) {
	return router.Decision{Instance: f.inst, Reason: "decided"}, nil
}

// clock follows the virtual clock and runs replica sync: each replica
// flushes its state at every interval boundary (the state between two
// driver steps does not change, so one flush at the first boundary after
// the previous step, and one at the last, carry everything), and peers
// apply it latency later — before any decision at or after that time.
func (s *replicaSet) clock(now time.Duration) {
	s.now = now
	for _, r := range s.reps {
		r.clock(now)
	}
	if !s.sync || len(s.reps) < 2 {
		return
	}
	if s.nextFlush == 0 {
		s.nextFlush = s.interval
	}
	if now >= s.nextFlush {
		first := s.nextFlush
		last := first + (now-first)/s.interval*s.interval
		s.flush(first)
		if last != first {
			s.flush(last)
		}
		s.nextFlush = last + s.interval
	}
	for len(s.transit) > 0 && s.transit[0].at <= now {
		d := s.transit[0]
		s.transit = s.transit[1:]
		for j, r := range s.reps {
			if j == d.from || r.peers == nil {
				continue
			}
			r.peers.table.ApplyLoad(d.load)
			if d.spec != nil {
				r.peers.table.ApplySpec(d.spec, nil)
			}
		}
		// A flush's messages from every replica share their due time:
		// after the last of them, every peer has applied its state.
		if len(s.transit) == 0 || s.transit[0].at != d.at {
			s.applied = max(s.applied, d.state)
		}
	}
}

// flush sends every replica's whole load table (complete: a lossless
// network makes deltas and heartbeats equivalent to it) and its queued
// speculative blocks, due at the peers at b + latency.
func (s *replicaSet) flush(b time.Duration) {
	for i, r := range s.reps {
		p := r.peers
		if p == nil {
			continue
		}
		p.seq++
		load := &replicasync.Message{Kind: replicasync.KindLoad, Replica: p.name, Incarnation: 1, Seq: p.seq, Complete: true, Loads: r.localLoads()}
		var spec *replicasync.Message
		if len(p.queue) > 0 {
			spec = &replicasync.Message{Kind: replicasync.KindSpec, Replica: p.name, Incarnation: 1, Specs: p.queue}
			p.queue = nil
		}
		s.transit = append(s.transit, syncDelivery{at: b + s.latency, state: b, from: i, load: load, spec: spec})
	}
}

// localLoads is what the replica publishes: its requests in flight per
// instance (the proxy's counters, here the driver's instances) and
// kv_aware's pending prefill (KVState's, through AttachLocal).
func (r *replica) localLoads() []replicasync.Load {
	var loads []replicasync.Load
	if r.peers.local != nil {
		loads = r.peers.local(nil)
	}
	at := map[string]int{}
	for i, l := range loads {
		at[l.Instance] = i
	}
	names := make([]string, 0, len(r.insts))
	for n := range r.insts {
		names = append(names, n)
	}
	sort.Strings(names) // deterministic messages
	for _, n := range names {
		f := int64(r.insts[n].InFlight())
		if f <= 0 {
			continue
		}
		if i, ok := at[n]; ok {
			loads[i].InFlight = f
			continue
		}
		loads = append(loads, replicasync.Load{Instance: n, InFlight: f})
	}
	return loads
}

// simPeers is a replica's kvaware.PeerState in the simulation: the real
// replicasync.Table on the virtual clock, fed by replicaSet.clock
// instead of a NATS subscription.
type simPeers struct {
	kvindex.FreshnessFuncs
	name  string
	table *replicasync.Table
	local func(dst []replicasync.Load) []replicasync.Load
	queue []replicasync.Spec
	seq   uint64
}

var _ kvaware.PeerState = (*simPeers)(nil)

func (p *simPeers) PeerLoad(inst string) (int64, int64, int64) { return p.table.PeerLoad(inst) }

func (p *simPeers) PeerQueue(inst string, q *replicasync.PeerQueue) { p.table.PeerQueue(inst, q) }

func (p *simPeers) PeerEnded(inst string, asked, got int64) int {
	return p.table.PeerEnded(inst, asked, got)
}

func (p *simPeers) PeerExtend(keys []kvindex.Key, from int, inst string, epoch uint64) int {
	return p.table.PeerExtend(keys, from, inst, epoch)
}

func (p *simPeers) PeerHolders(dst []string, key kvindex.Key) []string {
	return p.table.PeerHolders(dst, key)
}

// Speculate queues a decision's blocks for the next flush (unbounded: the
// simulation measures the protocol's timing, not its rate bound).
func (p *simPeers) Speculate(inst string, keys []kvindex.Key, ttl time.Duration) {
	ks := make([]uint64, len(keys))
	for i, k := range keys {
		ks[i] = uint64(k)
	}
	p.queue = append(p.queue, replicasync.Spec{Instance: inst, TTL: ttl, Keys: ks})
}

func (p *simPeers) AttachLocal(f func(dst []replicasync.Load) []replicasync.Load) { p.local = f }
