package main

import (
	"bytes"
	"context"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

func TestReplicaFlagsRuns(t *testing.T) {
	for _, tc := range []struct {
		routers, lat, gaps, balance string
		seq                         string
		want                        []string
		err                         bool
	}{
		{"1", "0", "off", "round-robin", "", []string{"kv_aware"}, false},
		{"1,2", "0,10ms,off", "off", "random", "", []string{"kv_aware", "kv_aware x2 sync 0s", "kv_aware x2 sync 10ms", "kv_aware x2 no sync"}, false},
		{"2", "0,off", "1ms,off", "round-robin", "", []string{"kv_aware x2 sync 0s early 1ms", "kv_aware x2 sync 0s", "kv_aware x2 no sync"}, false},
		{"2", "0", "50ms", "round-robin", "", []string{"kv_aware x2 sync 0s early 50ms"}, false},
		{"2", "0,off", "1ms", "round-robin", "2ms", []string{"kv_aware x2 sync 0s early 1ms seq 2ms", "kv_aware x2 no sync"}, false},
		{"2", "0", "1ms", "round-robin", "off,2ms", []string{"kv_aware x2 sync 0s early 1ms", "kv_aware x2 sync 0s early 1ms seq 2ms"}, false},
		{"2", "0", "1ms", "round-robin", "0", nil, true},
		{"2", "0", "1ms", "round-robin", "2s", nil, true},
		{"2", "0", "51ms", "round-robin", "", nil, true}, // over the interval
		{"2", "0", "10us", "round-robin", "", nil, true},
		{"2", "0", "", "round-robin", "", nil, true},
		{"0", "0", "off", "round-robin", "", nil, true},
		{"2", "-1ms", "off", "round-robin", "", nil, true},
		{"2", "soon", "off", "round-robin", "", nil, true},
		{"2", "0", "off", "least-conn", "", nil, true},
		{"", "0", "off", "round-robin", "", nil, true},
	} {
		f := replicaFlags{routers: tc.routers, latencies: tc.lat, minGaps: tc.gaps, balance: tc.balance, sequence: tc.seq, interval: 50 * time.Millisecond}
		runs, err := f.runs()
		if (err != nil) != tc.err {
			t.Fatalf("%+v: err %v", tc, err)
		}
		var got []string
		for _, r := range runs {
			got = append(got, r.label("kv_aware"))
		}
		if strings.Join(got, "|") != strings.Join(tc.want, "|") {
			t.Errorf("%+v: runs %q, want %q", tc, got, tc.want)
		}
	}
}

// syncWorld is a 3-replica kv_aware tier over two idle sim engines, driven
// by hand: one request routed by replica 0, then the clock moved.
func syncWorld(t *testing.T, run replicaRun) (*replicaSet, *des.RouteRequest) {
	t.Helper()
	ff := fleetFlags{instances: 2, gpuTokens: "100k", cpuTokens: "0"}
	scfg, _, err := ff.simConfig()
	if err != nil {
		t.Fatal(err)
	}
	rf := replicaFlags{balance: "round-robin", interval: 50 * time.Millisecond, agreement: true}
	set, err := newReplicaSet("kv_aware", run, &rf, &ff, scfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"a", "b"} {
		e, err := sim.New(scfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range set.reps {
			r.engineMade(n, e)
		}
	}
	toks := make([]uint32, 64*sim.DefaultBlockSize)
	for i := range toks {
		toks[i] = uint32(1000 + i)
	}
	req := &des.RouteRequest{Request: &workload.Request{OutputTokens: 1}, Tokens: toks, EngineID: 7}
	set.clock(time.Millisecond)
	return set, req
}

func TestReplicaSyncDeliversAfterIntervalAndLatency(t *testing.T) {
	set, req := syncWorld(t, replicaRun{routers: 3, sync: true, latency: 30 * time.Millisecond})
	d, err := set.Pick(context.Background(), req, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	set.Started(req.EngineID, d.Instance)
	if set.agree.probes != 2 {
		t.Fatalf("probes %d, want 2 (the two other replicas)", set.agree.probes)
	}
	peer := set.reps[1].peers
	for _, tc := range []struct {
		at       time.Duration
		inflight int64
	}{
		{49 * time.Millisecond, 0}, // before the first flush (50 ms)
		{79 * time.Millisecond, 0}, // flushed, in transit until 80 ms
		{80 * time.Millisecond, 1},
		{2 * time.Second, 1}, // refreshed by every flush: still in flight
	} {
		set.clock(tc.at)
		if f, tok, reqs := peer.PeerLoad(d.Instance); f != tc.inflight || (tc.inflight > 0 && (tok <= 0 || reqs != 1)) {
			t.Errorf("at %v: peer load on %s = %d in flight, %d tokens, %d requests; want %d in flight", tc.at, d.Instance, f, tok, reqs, tc.inflight)
		}
	}
	// The decision's speculative blocks reached the peer: the whole prompt
	// is held on d.Instance as far as replica 1 knows.
	if got, n := set.reps[1].peers.Table.SpecLen(), len(req.Tokens)/sim.DefaultBlockSize; got < n {
		t.Errorf("peer speculative entries %d, want >= %d", got, n)
	}
	set.Finished(req.EngineID, d.Instance, nil)
	set.clock(2050 * time.Millisecond)
	set.clock(2100 * time.Millisecond)
	if f, tok, _ := peer.PeerLoad(d.Instance); f != 0 || tok != 0 {
		t.Errorf("after the request finished: peer load %d in flight, %d tokens; want 0", f, tok)
	}
	// Settled: the same request evaluated on every replica picks the same.
	set.last.req, set.last.cands = req, []string{"a", "b"}
	before := set.agree.agreed
	set.probeOthers(0, d.Instance)
	if set.agree.agreed-before != 2 {
		t.Errorf("settled state: %d of 2 replicas agree with replica 0", set.agree.agreed-before)
	}
}

// With early sends a decision reaches the peers gap + latency after it,
// not at the next interval; a second decision within the gap shares the
// first one's send; the byte budget's deferrals are counted.
func TestReplicaSyncEarlySend(t *testing.T) {
	set, req := syncWorld(t, replicaRun{routers: 3, sync: true, latency: 5 * time.Millisecond, gap: time.Millisecond})
	d, err := set.Pick(context.Background(), req, []string{"a", "b"}) // at 1 ms
	if err != nil {
		t.Fatal(err)
	}
	set.Started(req.EngineID, d.Instance)
	peer := set.reps[1].peers
	if !set.reps[0].peers.earlyDue || set.reps[0].peers.earlyAt != 2*time.Millisecond {
		t.Fatalf("early send due %v at %v, want at 2ms", set.reps[0].peers.earlyDue, set.reps[0].peers.earlyAt)
	}
	for _, tc := range []struct {
		at       time.Duration
		inflight int64
	}{
		{6 * time.Millisecond, 0}, // sent at 2 ms, in transit until 7 ms
		{7 * time.Millisecond, 1}, // long before the first interval (50 ms)
	} {
		set.clock(tc.at)
		if f, _, _ := peer.PeerLoad(d.Instance); f != tc.inflight {
			t.Errorf("at %v: peer in flight %d, want %d", tc.at, f, tc.inflight)
		}
	}
	if got := set.reps[0].peers.early; got != 1 {
		t.Errorf("early sends %d, want 1", got)
	}
	// Two decisions 0.5 ms apart on replica 0 (round robin: requests 3k):
	// one send.
	for k, at := range []time.Duration{10 * time.Millisecond, 10*time.Millisecond + 500*time.Microsecond} {
		set.clock(at)
		for j := range 3 {
			r := *req
			r.EngineID = uint64(100 + 10*k + j)
			d, err := set.Pick(context.Background(), &r, []string{"a", "b"})
			if err != nil {
				t.Fatal(err)
			}
			set.Started(r.EngineID, d.Instance)
		}
	}
	set.clock(20 * time.Millisecond)
	if got := set.reps[0].peers.early; got != 2 {
		t.Errorf("early sends %d after two decisions within one gap, want 2 in all", got)
	}
	// An empty budget defers the early send to the interval.
	p := set.reps[0].peers
	p.budget, p.refilled = 0, set.now
	r := *req
	r.EngineID = 200
	set.next = 0
	if _, err := set.Pick(context.Background(), &r, []string{"a", "b"}); err != nil {
		t.Fatal(err)
	}
	set.clock(22 * time.Millisecond)
	if p.deferred != 1 || p.early != 2 {
		t.Errorf("with no budget: %d deferred, %d early sends; want 1, 2", p.deferred, p.early)
	}
	if p.msgs == 0 || p.bytes == 0 {
		t.Errorf("traffic not counted: %d messages, %d bytes", p.msgs, p.bytes)
	}
}

func TestReplicaNoSyncSharesNothing(t *testing.T) {
	set, req := syncWorld(t, replicaRun{routers: 3})
	d, err := set.Pick(context.Background(), req, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	set.Started(req.EngineID, d.Instance)
	set.clock(time.Second)
	for i, r := range set.reps {
		if r.peers != nil {
			t.Fatalf("replica %d has replica sync with sync off", i)
		}
		if f, _, _ := r.kv.state.PeerLoad(d.Instance); f != 0 {
			t.Errorf("replica %d sees %d peer requests with sync off", i, f)
		}
	}
}

// TestDESReplicasCommand runs des with replicas end to end: every row
// present, nothing failed, agreement reported; and with sync the replicas
// agree at least as often as without.
func TestDESReplicasCommand(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"des", "--workload", "chat", "--limit", "300", "--instances", "4",
		"--strategies", "kv_aware", "--routers", "1,3", "--sync-latency", "0,off", "--sync-min-gap", "1ms,off", "--agreement", "--bound=false", "--progress=false"}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	s := out.String()
	for _, row := range []string{"| kv_aware |", "| kv_aware x3 sync 0s early 1ms |", "| kv_aware x3 sync 0s |", "| kv_aware x3 no sync |",
		"sync traffic kv_aware x3 sync 0s early 1ms: ", "sync traffic kv_aware x3 sync 0s: "} {
		if !strings.Contains(s, row) {
			t.Errorf("no row %q in\n%s", row, s)
		}
	}
	re := regexp.MustCompile(`agreement kv_aware x3 (sync 0s early 1ms|sync 0s|no sync): ([0-9.]+)% of ([0-9]+)`)
	got := map[string]float64{}
	for _, m := range re.FindAllStringSubmatch(s, -1) {
		pct, _ := strconv.ParseFloat(m[2], 64)
		n, _ := strconv.Atoi(m[3])
		if n != 600 {
			t.Errorf("%s: %d probes, want 600 (2 other replicas × 300 requests)", m[1], n)
		}
		got[m[1]] = pct
	}
	if len(got) != 3 {
		t.Fatalf("agreement lines: %v\n%s", got, s)
	}
	for _, k := range []string{"sync 0s", "sync 0s early 1ms"} {
		if got[k] < got["no sync"] {
			t.Errorf("agreement with %s %.2f%% < without sync %.2f%%", k, got[k], got["no sync"])
		}
	}
	if strings.Contains(s, "failed:") {
		t.Errorf("failures reported:\n%s", s)
	}
}

// TestReplicaSettled: the tier is settled when every replica has applied
// a flush taken after the last change anywhere; a decision probed while
// settled counts in the settled agreement.
func TestReplicaSettled(t *testing.T) {
	set, req := syncWorld(t, replicaRun{routers: 2, sync: true, latency: 30 * time.Millisecond})
	if !set.settled() {
		t.Fatal("nothing changed yet: want settled")
	}
	d, err := set.Pick(context.Background(), req, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	set.Started(req.EngineID, d.Instance) // at 1 ms
	if set.agree.settled != 1 {
		t.Errorf("a decision made before any change: %d settled probes, want 1", set.agree.settled)
	}
	for _, tc := range []struct {
		at      time.Duration
		settled bool
	}{
		{49 * time.Millisecond, false}, // not flushed yet
		{79 * time.Millisecond, false}, // flushed at 50 ms, in transit
		{80 * time.Millisecond, true},  // applied by the peer
	} {
		set.clock(tc.at)
		if got := set.settled(); got != tc.settled {
			t.Errorf("at %v: settled %v, want %v", tc.at, got, tc.settled)
		}
	}
	set.Finished(req.EngineID, d.Instance, nil) // at 80 ms: after the 50 ms flush's state
	for _, tc := range []struct {
		at      time.Duration
		settled bool
	}{
		{100 * time.Millisecond, false},
		{129 * time.Millisecond, false}, // the 100 ms flush (taken after the end) is in transit
		{130 * time.Millisecond, true},
	} {
		set.clock(tc.at)
		if got := set.settled(); got != tc.settled {
			t.Errorf("after the end, at %v: settled %v, want %v", tc.at, got, tc.settled)
		}
	}
	// Without sync nothing is ever settled: the replicas never learn.
	off, req2 := syncWorld(t, replicaRun{routers: 2})
	if off.settled() {
		t.Error("no sync: want never settled")
	}
	d2, err := off.Pick(context.Background(), req2, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	off.Started(req2.EngineID, d2.Instance)
	if off.agree.settled != 0 || off.agree.probes != 1 {
		t.Errorf("no sync: %d settled of %d probes, want 0 of 1", off.agree.settled, off.agree.probes)
	}
}

func TestSpreadBatches(t *testing.T) {
	ms := time.Millisecond
	reqs := []workload.Request{{ID: 0, At: 0}, {ID: 1, At: 0}, {ID: 2, At: 0}, {ID: 3, At: 3000 * ms}, {ID: 4, At: 4000 * ms}, {ID: 5, At: 4000 * ms}}
	spreadBatches(reqs)
	want := []time.Duration{0, 1000 * ms, 2000 * ms, 3000 * ms, 4000 * ms, 4500 * ms}
	for i, r := range reqs {
		if r.ID != i || r.At != want[i] {
			t.Errorf("request %d: id %d at %v, want id %d at %v", i, r.ID, r.At, i, want[i])
		}
	}
}

// TestDESSpread: --spread spreads the trace's same-time arrivals and is
// refused for a generated workload (it has none).
func TestDESSpread(t *testing.T) {
	f := workloadFlags{name: "mooncake", trace: workload.DefaultTracePath, speed: 1, replicate: 1, limit: 200, spread: true}
	b, err := f.buildAll()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[time.Duration]bool{}
	for _, r := range b.w.Requests {
		if seen[r.At] {
			t.Fatalf("two requests at %v after --spread", r.At)
		}
		seen[r.At] = true
	}
	var out, errb bytes.Buffer
	err = run(context.Background(), []string{"des", "--workload", "chat", "--spread", "--limit", "10", "--progress=false"}, &out, &errb)
	if err == nil || !strings.Contains(err.Error(), "--spread applies to trace workloads only") {
		t.Errorf("des --workload chat --spread: err %v, want refused", err)
	}
}

// TestReplicaWarmCopies: with two synced replicas on the agent workload,
// each warm-up copy's lifecycle reaches the replica whose decision asked
// for it: every request is served and no replica is left counting a
// copy's prefill as pending.
func TestReplicaWarmCopies(t *testing.T) {
	w, err := workload.Agent{Sessions: 160, Arrivals: workload.Arrivals{Rate: 3}}.Generate(2)
	if err != nil {
		t.Fatal(err)
	}
	ff := fleetFlags{instances: 4, gpuTokens: "1.35M", cpuTokens: "0", delay: 5 * time.Millisecond}
	scfg, _, err := ff.simConfig()
	if err != nil {
		t.Fatal(err)
	}
	rf := replicaFlags{balance: "round-robin", interval: 50 * time.Millisecond}
	set, err := newReplicaSet("kv_aware", replicaRun{routers: 2, sync: true, latency: time.Millisecond}, &rf, &ff, scfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	made := func(inst string, e *sim.Engine) {
		for _, r := range set.reps {
			r.engineMade(inst, e)
		}
	}
	dc := des.Config{Instances: ff.instances, NewEngine: simFactory(scfg, made), Router: set, Clock: set.clock, EventDelay: ff.delay, Index: set.index}
	res, err := des.Run(context.Background(), dc, w)
	if err != nil {
		t.Fatal(err)
	}
	states := make([]*kvaware.KVState, len(set.reps))
	for i, r := range set.reps {
		states[i] = r.kv.state
	}
	checkWarmRun(t, res, states...)
}

// TestDESSequence: on the raw trace's same-instant bursts, sequenced
// replicas hold every request once a peer is live, every intent reaches
// every peer in time, the peers' dry decisions are mostly the owners',
// and the tier's p90 TTFT is nearer one router's than sync alone.
func TestDESSequence(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"des", "--workload", "mooncake", "--limit", "300", "--instances", "8",
		"--strategies", "kv_aware", "--routers", "1,2", "--sync-latency", "0", "--sync-min-gap", "1ms", "--sequence", "off,1ms", "--bound=false", "--progress=false"}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	s := out.String()
	m := regexp.MustCompile(`sequencing kv_aware x2 sync 0s early 1ms seq 1ms: held ([0-9]+), alone ([0-9]+); peers' intents sequenced ([0-9]+), late ([0-9]+), over the bound ([0-9]+); a peer's dry decision = the owner's: ([0-9.]+)% of ([0-9]+)`).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("no sequencing line in\n%s", s)
	}
	n := func(i int) int { v, _ := strconv.Atoi(m[i]); return v }
	if held, alone := n(1), n(2); held+alone != 300 || alone > 20 {
		t.Errorf("held %d, alone %d of 300: want nearly all held (alone only before the first sync reaches the peer)", held, alone)
	}
	if n(3) != n(1) || n(4) != 0 || n(5) != 0 {
		t.Errorf("intents sequenced %d of %d held, late %d, over the bound %d", n(3), n(1), n(4), n(5))
	}
	if pct, _ := strconv.ParseFloat(m[6], 64); pct < 90 {
		t.Errorf("peers' dry decisions the owners' in %.2f%%, want ≥ 90%%", pct)
	}
	p90 := map[string]float64{}
	for _, row := range regexp.MustCompile(`\| mooncake \| (kv_aware[^|]*) \|(?:[^|]*\|){6} ([0-9.]+) \|`).FindAllStringSubmatch(s, -1) {
		v, _ := strconv.ParseFloat(row[2], 64)
		p90[strings.TrimSpace(row[1])] = v
	}
	one, sync, seq := p90["kv_aware"], p90["kv_aware x2 sync 0s early 1ms"], p90["kv_aware x2 sync 0s early 1ms seq 1ms"]
	if one == 0 || sync == 0 || seq == 0 {
		t.Fatalf("p90 rows %v in\n%s", p90, s)
	}
	t.Logf("p90 ms: one router %.1f, sync %.1f, sequenced %.1f", one, sync, seq)
	if seq-one >= sync-one {
		t.Errorf("p90: one router %.1f, sync %.1f, sequenced %.1f: sequencing did not bring the tier nearer one router", one, sync, seq)
	}
}
