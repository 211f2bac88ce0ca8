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
	"slices"
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
	minGaps   string
	sequence  string
	agreement bool
}

func (f *replicaFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.routers, "routers", "1", "router replicas behind the balancer, a comma-separated list to compare (e.g. 1,2,4)")
	fs.StringVar(&f.latencies, "sync-latency", "0", "replica sync delivery latency, a comma-separated list (e.g. 0,10ms,100ms,off); off = no replica sync: each replica routes on its own counters only")
	fs.StringVar(&f.balance, "balance", "round-robin", "how the balancer spreads requests over replicas: round-robin or random")
	fs.DurationVar(&f.interval, "sync-interval", replicasync.DefaultInterval, "replica sync interval (events.replica_sync.interval)")
	fs.StringVar(&f.minGaps, "sync-min-gap", replicasync.DefaultMinGap.String(), "replica sync early send: a replica sends this long after a decision or an end, ahead of the interval (events.replica_sync.min_gap); a comma-separated list to compare (e.g. 1ms,off); off = only every interval (disable_early_send)")
	fs.StringVar(&f.sequence, "sequence", "off", "with replica sync: sequence same-instant bursts (replicasync.Sequencer): each replica holds a request until its epoch of this length (wall-clock aligned) ends plus one --sync-latency for the peers' intents, then every replica decides the epoch's requests in one order as one router would; a comma-separated list to compare (e.g. off,2ms); off = decide on arrival")
	fs.BoolVar(&f.agreement, "agreement", false, "with several replicas: after each decision, evaluate the same request on every other replica (dry) and report how often they agree, over all decisions and over those made while settled (every replica had applied the others' state as of the last change anywhere)")
}

// replicaRun is one replica configuration to run.
type replicaRun struct {
	routers int
	sync    bool
	latency time.Duration
	gap     time.Duration // early sends' min_gap; 0 = off
	seq     time.Duration // sequencing epoch δ; 0 = off
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
	gaps, err := durationsOrOff("--sync-min-gap", f.minGaps, replicasync.MinMinGap, f.interval, "--sync-interval")
	if err != nil {
		return nil, err
	}
	seq := f.sequence
	if seq == "" {
		seq = "off" // the flag's default
	}
	seqs, err := durationsOrOff("--sequence", seq, time.Nanosecond, time.Second, "1s")
	if err != nil {
		return nil, err
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
		for _, g := range gaps {
			for _, q := range seqs {
				lats = append(lats, replicaRun{sync: true, latency: d, gap: g, seq: q})
			}
		}
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

// durationsOrOff parses a comma-separated list of durations in lo..hi
// (hiName names hi in the error) or "off" (0).
func durationsOrOff(flagName, list string, lo, hi time.Duration, hiName string) ([]time.Duration, error) {
	var out []time.Duration
	for _, s := range splitList(list) {
		if s == "off" {
			out = append(out, 0)
			continue
		}
		d, err := time.ParseDuration(s)
		if err != nil || d < lo || d > hi {
			return nil, fmt.Errorf("%s %q: want a duration in %v..%s (%v), or off", flagName, s, lo, hiName, hi)
		}
		out = append(out, d)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: empty", flagName)
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
	l := fmt.Sprintf("%s x%d sync %v", strategy, r.routers, r.latency)
	if r.gap != 0 {
		l += fmt.Sprintf(" early %v", r.gap)
	}
	if r.seq != 0 {
		l += fmt.Sprintf(" seq %v", r.seq)
	}
	return l
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
	dc := des.Config{Instances: ff.instances, NewEngine: simFactory(scfg, made), Router: set, Clock: set.clock, Progress: bar.Update}
	ff.configure(&dc)
	if set.index != nil {
		dc.Index = set.index
	}
	if set.seq != nil {
		dc.Admission = set.seq
	}
	res, err := des.Run(ctx, dc, b.w)
	bar.Done()
	if err != nil {
		return report.Summary{}, fmt.Errorf("%s: %w", set.Name(), err)
	}
	if set.agree != nil {
		fmt.Fprintf(stdout, "agreement %s: %s\n", set.Name(), set.agree)
	}
	if set.sync && len(set.reps) > 1 {
		fmt.Fprintf(stdout, "sync traffic %s: %s\n", set.Name(), set.traffic(res.End))
	}
	if set.seq != nil {
		fmt.Fprintf(stdout, "sequencing %s: %s\n", set.Name(), set.seq)
	}
	s := report.Summarize(res, 0)
	if boundHits != nil {
		s = report.SummarizeBound(res, boundHits, aloneFloor(scfg))
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
	gap               time.Duration // early sends' min_gap (0 = off)
	now               time.Duration
	nextFlush         time.Duration
	transit           []syncDelivery // in delivery order (constant latency)
	probing           bool           // probeOthers runs: its dry picks change nothing to send

	seq   *sequencing // nil = no sequencing (--sequence off)
	agree *agreement  // nil = no probes
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
	// changed is when the replica's router-local state last changed (a
	// decision, a start, a first token, an end); applied is the state
	// time of its newest flush every peer has applied. changed < applied
	// on every replica: each knows the others' state as it is (settled).
	changed, applied time.Duration
	changes          bool
}

// syncDelivery is one replica's flush, due at its peers at at; state is
// the virtual time whose state it carries (every change before it; the
// state does not change between two driver steps).
type syncDelivery struct {
	at, state  time.Duration
	from       int
	load, spec *replicasync.Message
	place      *replicasync.Message // placement averages (interval flushes)
	rent       *replicasync.Message // rent accounts changed (every flush)
}

func newReplicaSet(name string, run replicaRun, rf *replicaFlags, ff *fleetFlags, scfg sim.Config, seed uint64) (*replicaSet, error) {
	s := &replicaSet{name: run.label(name), owner: map[uint64]int{}, sync: run.sync, latency: run.latency, interval: rf.interval, gap: run.gap}
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
				p := &simPeers{name: fmt.Sprintf("r%d", i),
					Table:  replicasync.NewTable(replicasync.DefaultPeerTimeout, replicasync.DefaultSpecCapacity, s.wall),
					budget: replicasync.DefaultMaxBytesPerSecond, lastSent: map[string]replicasync.Load{}}
				p.onChange = func() { s.early(p) }
				rep.peers = p
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
	if run.seq > 0 && s.sync && s.index != nil && len(s.reps) > 1 {
		// The peers' intents are waited for one delivery (the sync's
		// latency) after the epoch's end.
		s.seq = newSequencing(len(s.reps), run.seq, s.latency, ff)
		s.seq.set = s
	}
	return s, nil
}

func (s *replicaSet) wall() time.Time { return epoch.Add(s.now) }

func (s *replicaSet) Name() string { return s.name }

func (s *replicaSet) Pick(ctx context.Context, req *des.RouteRequest, cands []string) (des.Decision, error) {
	var i int
	held, sequenced := replicasync.Intent{}, false
	if s.seq != nil {
		// Handed to its replica at arrival (sequencing.Arrive).
		i = s.owner[req.EngineID]
		if held, sequenced = s.seq.held[req.EngineID]; sequenced {
			delete(s.seq.held, req.EngineID)
			s.seq.sequenced(ctx, held, cands)
		}
	} else {
		i = s.assign()
	}
	settled := s.settled()
	d, err := s.reps[i].Pick(ctx, req, cands)
	if err != nil {
		return d, err
	}
	if sequenced {
		s.seq.compare(i, d.Instance)
	}
	s.change(i)
	s.owner[req.EngineID] = i
	if d.Warm != "" {
		// The warm-up copy's lifecycle calls come under its own id; its
		// observer is this replica's.
		s.owner[req.EngineID|des.WarmTag] = i
	}
	s.last.req, s.last.cands, s.last.reason, s.last.from, s.last.settled = req, cands, d.Reason, i, settled
	return d, nil
}

// change records that replica i's router-local state changed now.
func (s *replicaSet) change(i int) { s.reps[i].changed, s.reps[i].changes = s.now, true }

// settled reports whether every replica has applied its peers' state as
// it is now: each replica's newest flush delivered everywhere was taken
// after its last change (or it has not changed yet).
func (s *replicaSet) settled() bool {
	if !s.sync {
		return false
	}
	for _, r := range s.reps {
		if r.changes && r.changed >= r.applied {
			return false
		}
	}
	return true
}

// early is a replica's Changed (kv_aware calls it after a decision and
// after an end): with early sends on, the replica flushes gap later
// (replicasync.Syncer.Changed; one send per gap: a change while one is
// due shares it).
func (s *replicaSet) early(p *simPeers) {
	if s.gap > 0 && !s.probing && !p.earlyDue {
		p.earlyDue, p.earlyAt = true, s.now+s.gap
	}
}

func (s *replicaSet) Started(id uint64, inst string) {
	i, ok := s.owner[id]
	if !ok {
		return
	}
	s.reps[i].Started(id, inst)
	s.change(i)
	if s.agree != nil && s.last.req != nil && s.last.req.EngineID == id {
		s.probeOthers(i, inst)
	}
	s.last.req = nil
}

func (s *replicaSet) FirstToken(id uint64, inst string, cached, prompt int) {
	if i, ok := s.owner[id]; ok {
		s.reps[i].FirstToken(id, inst, cached, prompt)
		s.change(i)
	}
}

func (s *replicaSet) Finished(id uint64, inst string, err error) {
	if i, ok := s.owner[id]; ok {
		s.reps[i].Finished(id, inst, err)
		delete(s.owner, id)
		s.change(i)
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
	s.probing = true
	defer func() { s.probing = false }()
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
// the previous step, and one at the last, carry everything) and, with
// early sends, gap after a change (one per gap, within the byte budget);
// peers apply a flush latency later — before any decision at or after
// that time.
func (s *replicaSet) clock(now time.Duration) {
	s.now = now
	if s.seq != nil {
		s.endEpoch()
		s.seq.deliver(now)
	}
	for _, r := range s.reps {
		r.clock(now)
	}
	if !s.sync || len(s.reps) < 2 {
		return
	}
	if s.nextFlush == 0 {
		s.nextFlush = s.interval
	}
	// The sends due by now, in time order (transit stays in delivery
	// order); the state they carry is the state now.
	type due struct {
		at  time.Duration
		rep int // -1: every replica's interval flush
	}
	var dues []due
	if now >= s.nextFlush {
		first := s.nextFlush
		last := first + (now-first)/s.interval*s.interval
		dues = append(dues, due{first, -1})
		if last != first {
			dues = append(dues, due{last, -1})
		}
		s.nextFlush = last + s.interval
	}
	for i, r := range s.reps {
		if p := r.peers; p != nil && p.earlyDue && p.earlyAt <= now {
			p.earlyDue = false
			dues = append(dues, due{p.earlyAt, i})
		}
	}
	sort.SliceStable(dues, func(a, b int) bool { return dues[a].at < dues[b].at })
	for _, d := range dues {
		if d.rep < 0 {
			for i := range s.reps {
				s.flush(i, d.at, false)
			}
			continue
		}
		s.flush(d.rep, d.at, true)
	}
	for len(s.transit) > 0 && s.transit[0].at <= now {
		d := s.transit[0]
		s.transit = s.transit[1:]
		for j, r := range s.reps {
			if j == d.from || r.peers == nil {
				continue
			}
			r.peers.Table.ApplyLoad(d.load)
			if d.place != nil {
				r.peers.Table.ApplyPlacement(d.place)
			}
			if d.spec != nil {
				r.peers.Table.ApplySpec(d.spec, nil)
			}
			if d.rent != nil {
				r.peers.Table.ApplyRent(d.rent)
			}
		}
		s.reps[d.from].applied = max(s.reps[d.from].applied, d.state)
	}
}

// flush sends replica i's whole load table (complete: a lossless network
// makes deltas and heartbeats equivalent to it) and its queued speculative
// blocks, due at the peers at b + latency. An early send goes only when
// the replica's byte budget holds a whole message (else the interval's
// flush carries the change), as the Syncer's does. The budget and the
// traffic count what the Syncer would send: deltas between heartbeats.
func (s *replicaSet) flush(i int, b time.Duration, early bool) {
	r := s.reps[i]
	p := r.peers
	if p == nil {
		return
	}
	if early {
		if p.refill(b) < replicasync.DefaultMaxMessageBytes {
			p.deferred++
			return
		}
		p.early++
	}
	p.seq++
	loads := r.localLoads()
	load := &replicasync.Message{Kind: replicasync.KindLoad, Replica: p.name, Incarnation: 1, Seq: p.seq, Complete: true, Loads: loads}
	p.account(b, loads)
	var spec *replicasync.Message
	if len(p.queue) > 0 {
		spec = &replicasync.Message{Kind: replicasync.KindSpec, Replica: p.name, Incarnation: 1, Specs: p.queue}
		p.queue = nil
		p.count(b, spec)
	}
	var place *replicasync.Message
	if !early && p.place != nil {
		// Every interval, as the Syncer sends them (whole: lossless).
		qs, computed := p.place(nil)
		place = &replicasync.Message{Kind: replicasync.KindPlacement, Replica: p.name, Incarnation: 1, Complete: true, Computed: computed, Queues: qs}
		if !p.placeSent || computed != p.lastPlace.Computed || !slices.Equal(qs, p.lastPlace.Queues) {
			p.count(b, place)
			p.lastPlace, p.placeSent = *place, true
		}
	}
	var rent *replicasync.Message
	if p.rent != nil {
		// With every send, as the Syncer sends them: the accounts that
		// changed, all of them every heartbeat.
		full := !p.rentSent || b-p.rentFull >= replicasync.DefaultHeartbeat
		if rs := p.rent(nil, full); full || len(rs) > 0 {
			rent = &replicasync.Message{Kind: replicasync.KindRent, Replica: p.name, Incarnation: 1, Complete: full, Rents: rs}
			p.count(b, rent)
			if full {
				p.rentFull, p.rentSent = b, true
			}
		}
	}
	s.transit = append(s.transit, syncDelivery{at: b + s.latency, state: b, from: i, load: load, spec: spec, place: place, rent: rent})
}

// traffic is what one replica sent on average over the run's d.
func (s *replicaSet) traffic(d time.Duration) string {
	var msgs, bytes, early, deferred float64
	n := 0
	for _, r := range s.reps {
		if p := r.peers; p != nil {
			msgs, bytes, early, deferred = msgs+float64(p.msgs), bytes+float64(p.bytes), early+float64(p.early), deferred+float64(p.deferred)
			n++
		}
	}
	if n == 0 || d <= 0 {
		return "none"
	}
	sec := d.Seconds() * float64(n)
	return fmt.Sprintf("%.1f messages/s, %.0f bytes/s per replica (%.1f early sends/s, %.1f deferred by the byte budget; deltas between 1 s heartbeats, as the Syncer sends)",
		msgs/sec, bytes/sec, early/sec, deferred/sec)
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
	name string
	// The peer table answers kvaware's questions about the peers (PeerLoad,
	// PeerQueue, PeerEnded, PeerExtend, PeerHolders, PeerComputed,
	// PeerQueued) as a Syncer's does.
	*replicasync.Table
	local func(dst []replicasync.Load) []replicasync.Load
	place func(dst []replicasync.Queued) ([]replicasync.Queued, float64)
	// lastPlace is the placement message last counted (the Syncer sends
	// one when they changed).
	lastPlace replicasync.Message
	placeSent bool
	// rent is kv_aware's rent accounts (AttachRent); rentFull is when
	// they last went whole.
	rent     func(dst []replicasync.Rent, full bool) []replicasync.Rent
	rentFull time.Duration
	rentSent bool
	queue    []replicasync.Spec
	seq      uint64
	// onChange is Changed (replicaSet.early); earlyDue and earlyAt: an
	// early send is due at earlyAt.
	onChange func()
	earlyDue bool
	earlyAt  time.Duration
	// What the Syncer would send, for the byte budget and the traffic
	// line: the table last sent (deltas), the last heartbeat, the token
	// bucket (replicasync's MaxBytesPerSecond, holding one second's worth).
	lastSent        map[string]replicasync.Load
	lastFull        time.Duration
	sentAny         bool
	budget          float64
	refilled        time.Duration
	buf             []byte
	msgs, bytes     int64
	early, deferred int64
}

var (
	_ kvaware.PeerState      = (*simPeers)(nil)
	_ kvaware.PlacementPeers = (*simPeers)(nil)
	_ kvaware.RentPeers      = (*simPeers)(nil)
)

// Speculate queues a decision's blocks for the next flush (unbounded: the
// simulation measures the protocol's timing, not its rate bound).
func (p *simPeers) Speculate(inst string, keys []kvindex.Key, ttl time.Duration) {
	ks := make([]uint64, len(keys))
	for i, k := range keys {
		ks[i] = uint64(k)
	}
	p.queue = append(p.queue, replicasync.Spec{Instance: inst, TTL: ttl, Keys: ks})
}

func (p *simPeers) AttachPlacement(f func(dst []replicasync.Queued) ([]replicasync.Queued, float64)) {
	p.place = f
}

func (p *simPeers) AttachRent(f func(dst []replicasync.Rent, full bool) []replicasync.Rent) {
	p.rent = f
}

func (p *simPeers) AttachLocal(f func(dst []replicasync.Load) []replicasync.Load) { p.local = f }

// Changed asks for an early send (replicaSet.early).
func (p *simPeers) Changed() {
	if p.onChange != nil {
		p.onChange()
	}
}

// refill brings the byte budget up to virtual time t and returns it.
func (p *simPeers) refill(t time.Duration) float64 {
	const rate = float64(replicasync.DefaultMaxBytesPerSecond)
	p.budget = min(rate, p.budget+rate*(t-p.refilled).Seconds())
	p.refilled = t
	return p.budget
}

// account counts the load message the Syncer would send at t for loads:
// the whole table every heartbeat, else the changes since the last send
// (nothing when none).
func (p *simPeers) account(t time.Duration, loads []replicasync.Load) {
	cur := make(map[string]replicasync.Load, len(loads))
	for _, l := range loads {
		if !l.Empty() {
			cur[l.Instance] = l
		}
	}
	full := !p.sentAny || t-p.lastFull >= replicasync.DefaultHeartbeat
	var out []replicasync.Load
	if full {
		for _, l := range cur {
			out = append(out, l)
		}
	} else if out = replicasync.Delta(out, p.lastSent, cur); len(out) == 0 {
		return
	}
	p.lastSent, p.sentAny = cur, true
	if full {
		p.lastFull = t
	}
	p.count(t, &replicasync.Message{Kind: replicasync.KindLoad, Replica: p.name, Incarnation: 1, Seq: p.seq, Complete: full, Loads: out})
}

// count takes a message's encoded size from the budget and the totals.
func (p *simPeers) count(t time.Duration, m *replicasync.Message) {
	var err error
	if p.buf, err = m.AppendBinary(p.buf[:0]); err != nil {
		return
	}
	p.refill(t)
	p.budget -= float64(len(p.buf))
	p.msgs++
	p.bytes += int64(len(p.buf))
}
