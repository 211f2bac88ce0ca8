package des

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/workload"
)

// fifoEngine serves one request at a time: prefill costs 1 µs per prompt
// token, each output token 1 ms. It emits one BlockStored batch when a
// request's prefill ends. It checks that its clock never runs backwards.
type fifoEngine struct {
	t       *testing.T
	name    string
	sink    func(events.Batch)
	queue   []EngineRequest
	arrived map[uint64]time.Duration
	busy    bool
	cur     EngineRequest
	first   time.Duration // first token of cur
	end     time.Duration
	sentFT  bool
	now     time.Duration
	seen    map[uint64]bool
	// busyT and prefill accumulate service time (BusyReporter).
	busyT, prefill time.Duration
}

func (e *fifoEngine) BusyTime() (time.Duration, time.Duration) { return e.busyT, e.prefill }

func (e *fifoEngine) clock(now time.Duration) {
	if now < e.now {
		e.t.Errorf("%s: clock went back from %v to %v", e.name, e.now, now)
	}
	e.now = now
}

func (e *fifoEngine) Submit(r EngineRequest, now time.Duration) error {
	if r.MaxTokens < 1 {
		return errors.New("max tokens")
	}
	e.clock(now)
	e.arrived[r.ID] = now
	e.queue = append(e.queue, r)
	if !e.busy {
		e.start(now)
	}
	return nil
}

func (e *fifoEngine) start(at time.Duration) {
	if len(e.queue) == 0 {
		e.busy = false
		return
	}
	e.cur, e.queue = e.queue[0], e.queue[1:]
	e.busy, e.sentFT = true, false
	e.first = at + time.Duration(len(e.cur.Prompt))*time.Microsecond
	e.end = e.first + time.Duration(e.cur.MaxTokens)*time.Millisecond
	e.busyT += e.end - at
	e.prefill += e.first - at
}

func (e *fifoEngine) Advance(now time.Duration, out []Update) []Update {
	e.clock(now)
	for e.busy {
		if !e.sentFT && e.first <= now {
			e.sentFT = true
			e.sink(events.Batch{Events: []events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{e.cur.ID}}}})
			out = append(out, Update{ID: e.cur.ID, Kind: FirstToken, At: e.first})
		}
		if e.end > now {
			break
		}
		out = append(out, Update{ID: e.cur.ID, Kind: Finished, At: e.end, OutputTokens: e.cur.MaxTokens})
		e.start(e.end)
	}
	return out
}

func (e *fifoEngine) NextEventTime() (time.Duration, bool) {
	if !e.busy {
		return 0, false
	}
	if !e.sentFT {
		return e.first, true
	}
	return e.end, true
}

func fifoFactory(t *testing.T) EngineFactory {
	return func(name string, sink func(events.Batch)) (Engine, error) {
		return &fifoEngine{t: t, name: name, sink: sink, arrived: map[uint64]time.Duration{}}, nil
	}
}

// rrRouter cycles over candidates and records what it saw.
type rrRouter struct {
	n        int
	inflight map[string]int
	maxIn    int
	removed  []string
	cands    [][]string
	onPick   func(req *RouteRequest)
	failed   int // Finished with an error
}

func newRR() *rrRouter { return &rrRouter{inflight: map[string]int{}} }

func (r *rrRouter) Name() string { return "rr" }
func (r *rrRouter) Pick(_ context.Context, req *RouteRequest, cands []string) (Decision, error) {
	if r.onPick != nil {
		r.onPick(req)
	}
	r.cands = append(r.cands, append([]string(nil), cands...))
	r.n++
	return Decision{Instance: cands[r.n%len(cands)], Reason: "rr"}, nil
}
func (r *rrRouter) FirstToken(uint64, string, int, int) {}
func (r *rrRouter) Started(_ uint64, in string) {
	r.inflight[in]++
	total := 0
	for _, v := range r.inflight {
		total += v
	}
	r.maxIn = max(r.maxIn, total)
}
func (r *rrRouter) Finished(_ uint64, in string, err error) {
	r.inflight[in]--
	if err != nil {
		r.failed++
	}
}
func (r *rrRouter) Removed(in string) { r.removed = append(r.removed, in) }

// countIndex is a kvindex.Index that only counts applied batches.
type countIndex struct {
	applied int
	purged  []string
}

var _ IndexWriter = (*countIndex)(nil)

func (c *countIndex) Apply(_ context.Context, _ string, evs []events.Event) (kvindex.ApplyResult, error) {
	c.applied++
	return kvindex.ApplyResult{Stored: len(evs)}, nil
}
func (c *countIndex) Purge(_ context.Context, in string) error {
	c.purged = append(c.purged, in)
	return nil
}
func (c *countIndex) Instances(context.Context) ([]kvindex.InstanceStats, error) { return nil, nil }
func (c *countIndex) Len(context.Context) (int, error)                           { return c.applied, nil }

func smallWorkload(t *testing.T, n int) *workload.Workload {
	w, err := workload.LongContext{Groups: n, RequestsPerGroup: 1, PrefixTokens: 100, QuestionTokens: 10, OutputTokens: 5}.Generate(1)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestRunTimeProperties(t *testing.T) {
	w := smallWorkload(t, 200)
	res, err := Run(context.Background(), Config{Instances: 3, NewEngine: fifoFactory(t), Router: newRR()}, w)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Outcomes) != 200 || len(res.Instances) != 3 {
		t.Fatalf("%d outcomes, %d instances", len(res.Outcomes), len(res.Instances))
	}
	for i, o := range res.Outcomes {
		if o.Err != "" {
			t.Fatalf("request %d: %s", i, o.Err)
		}
		if o.Arrival != w.Requests[i].At {
			t.Fatalf("request %d arrived at %v, workload says %v", i, o.Arrival, w.Requests[i].At)
		}
		// The engine model: TTFT >= prefill, finish = first token + 5 ms.
		if o.TTFT < 110*time.Microsecond || o.Finish != o.Arrival+o.TTFT+5*time.Millisecond {
			t.Fatalf("request %d: arrival %v ttft %v finish %v", i, o.Arrival, o.TTFT, o.Finish)
		}
		if o.Finish > res.End {
			t.Fatalf("request %d finished after the run's end", i)
		}
	}
}

func TestRunDeterministic(t *testing.T) {
	w := smallWorkload(t, 100)
	var runs [2][]Outcome
	for k := range runs {
		res, err := Run(context.Background(), Config{Instances: 4, NewEngine: fifoFactory(t), Router: newRR()}, w)
		if err != nil {
			t.Fatal(err)
		}
		runs[k] = res.Simulated()
	}
	for i := range runs[0] {
		if runs[0][i] != runs[1][i] {
			t.Fatalf("request %d differs: %+v vs %+v", i, runs[0][i], runs[1][i])
		}
	}
}

func TestEventDelay(t *testing.T) {
	tests := []struct {
		name  string
		delay time.Duration
		// check gets, per request, the number of batches applied before it was routed.
		check func(t *testing.T, seen []int)
	}{
		{"zero delay: every earlier first token is visible", -1, func(t *testing.T, seen []int) {
			if seen[len(seen)-1] < len(seen)/2 {
				t.Errorf("last request saw %d batches of %d", seen[len(seen)-1], len(seen)-1)
			}
		}},
		{"delay longer than the run: nothing is visible", time.Hour, func(t *testing.T, seen []int) {
			for i, n := range seen {
				if n != 0 {
					t.Fatalf("request %d saw %d batches", i, n)
				}
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			idx := &countIndex{}
			rt := newRR()
			var seen []int
			rt.onPick = func(*RouteRequest) { seen = append(seen, idx.applied) }
			res, err := Run(context.Background(), Config{Instances: 2, NewEngine: fifoFactory(t), Router: rt, Index: idx, EventDelay: tc.delay}, smallWorkload(t, 50))
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, seen)
			// Every batch is delivered in the end, even after the last request.
			if res.IndexDeliveries != 50 || idx.applied != 50 {
				t.Errorf("delivered %d, applied %d, want 50", res.IndexDeliveries, idx.applied)
			}
		})
	}
}

func TestScaleEvents(t *testing.T) {
	w := smallWorkload(t, 300)
	w, err := workload.Scale{OutBy: 3, InBy: 2}.Apply(w)
	if err != nil {
		t.Fatal(err)
	}
	idx := &countIndex{}
	rt := newRR()
	res, err := Run(context.Background(), Config{Instances: 2, NewEngine: fifoFactory(t), Router: rt, Index: idx}, w)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Instances) != 5 {
		t.Fatalf("instances %v, want 2 + 3", res.Instances)
	}
	sizes := map[int]bool{}
	for i, c := range rt.cands {
		sizes[len(c)] = true
		at := res.Outcomes[i].Arrival
		want := 2
		switch {
		case at >= w.Fleet[1].At:
			want = 3
		case at >= w.Fleet[0].At:
			want = 5
		}
		if len(c) != want {
			t.Fatalf("request %d at %v saw %d candidates, want %d", i, at, len(c), want)
		}
	}
	if fmt.Sprint(rt.removed) != "[i04 i03]" || fmt.Sprint(idx.purged) != "[i04 i03]" {
		t.Errorf("removed %v, purged %v", rt.removed, idx.purged)
	}
	// New instances took traffic; removed ones took none after removal.
	per := map[string]int{}
	for _, o := range res.Outcomes {
		per[o.Instance]++
		if (o.Instance == "i03" || o.Instance == "i04") && o.Arrival >= w.Fleet[1].At {
			t.Fatalf("request %d sent to removed %s", o.ID, o.Instance)
		}
	}
	if per["i04"] == 0 {
		t.Errorf("scale-out instance got no traffic: %v", per)
	}
}

func TestClosedLoop(t *testing.T) {
	w := smallWorkload(t, 60)
	w.ClosedLoop = 3
	rt := newRR()
	res, err := Run(context.Background(), Config{Instances: 2, NewEngine: fifoFactory(t), Router: rt}, w)
	if err != nil {
		t.Fatal(err)
	}
	if rt.maxIn != 3 {
		t.Errorf("max in flight %d, want 3", rt.maxIn)
	}
	// Arrivals follow completions, not the workload's timestamps.
	arr := make([]time.Duration, len(res.Outcomes))
	for i, o := range res.Outcomes {
		arr[i] = o.Arrival
	}
	if !sort.SliceIsSorted(arr, func(i, j int) bool { return arr[i] < arr[j] }) || arr[0] != 0 || arr[3] == 0 {
		t.Errorf("closed-loop arrivals %v", arr[:6])
	}
}

func TestRunErrors(t *testing.T) {
	w := smallWorkload(t, 5)
	if _, err := Run(context.Background(), Config{}, w); !errors.Is(err, ErrConfig) {
		t.Errorf("empty config: %v", err)
	}
	// A router that picks a non-instance fails that request, not the run.
	bad := &badRouter{}
	res, err := Run(context.Background(), Config{Instances: 1, NewEngine: fifoFactory(t), Router: bad}, w)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range res.Outcomes {
		if o.Err == "" {
			t.Fatalf("request %d: no error", o.ID)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Run(ctx, Config{Instances: 1, NewEngine: fifoFactory(t), Router: newRR()}, w); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
}

type badRouter struct{ rrRouter }

func (*badRouter) Pick(context.Context, *RouteRequest, []string) (Decision, error) {
	return Decision{Instance: "nowhere"}, nil
}

// lifeRouter checks the lifecycle calls: Started, then FirstToken, then
// Finished, once each, on the instance Pick chose.
type lifeRouter struct {
	rrRouter
	t     *testing.T
	picks map[uint64]string
	stage map[uint64]int
}

func (l *lifeRouter) Pick(ctx context.Context, req *RouteRequest, cands []string) (Decision, error) {
	d, err := l.rrRouter.Pick(ctx, req, cands)
	l.picks[uint64(req.ID)] = d.Instance
	return d, err
}

func (l *lifeRouter) step(id uint64, in string, from int) {
	if l.picks[id] != in || l.stage[id] != from {
		l.t.Errorf("request %d: stage %d on %s, expected stage %d on %s", id, from+1, in, l.stage[id]+1, l.picks[id])
	}
	l.stage[id] = from + 1
}

func (l *lifeRouter) Started(id uint64, in string) { l.step(id, in, 0) }
func (l *lifeRouter) FirstToken(id uint64, in string, _, prompt int) {
	if prompt != 110 {
		l.t.Errorf("request %d: prompt %d tokens", id, prompt)
	}
	l.step(id, in, 1)
}
func (l *lifeRouter) Finished(id uint64, in string, err error) {
	if err != nil {
		l.t.Errorf("request %d: %v", id, err)
	}
	l.step(id, in, 2)
}

func TestRouterLifecycleAndClock(t *testing.T) {
	lr := &lifeRouter{rrRouter: *newRR(), t: t, picks: map[uint64]string{}, stage: map[uint64]int{}}
	var last time.Duration
	ticks := 0
	clock := func(now time.Duration) {
		if now <= last {
			t.Errorf("clock went from %v to %v", last, now)
		}
		last = now
		ticks++
	}
	res, err := Run(context.Background(), Config{Instances: 3, NewEngine: fifoFactory(t), Router: lr, Clock: clock}, smallWorkload(t, 80))
	if err != nil {
		t.Fatal(err)
	}
	for id, st := range lr.stage {
		if st != 3 {
			t.Errorf("request %d ended at stage %d", id, st)
		}
	}
	if len(lr.stage) != 80 || last != res.End || ticks < 80 {
		t.Errorf("%d requests tracked, clock ended at %v (run end %v), %d ticks", len(lr.stage), last, res.End, ticks)
	}
}

// BenchmarkRun measures the driver's own cost per request (the engine is
// the trivial FIFO model, so this is queue and bookkeeping work).
func BenchmarkRun(b *testing.B) {
	w, err := workload.LongContext{Groups: 500, RequestsPerGroup: 2, PrefixTokens: 64, QuestionTokens: 16, OutputTokens: 4}.Generate(1)
	if err != nil {
		b.Fatal(err)
	}
	t := &testing.T{}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Run(context.Background(), Config{Instances: 16, NewEngine: fifoFactory(t), Router: newRR(), Index: &countIndex{}}, w); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(w.Requests)), "ns/request")
}

// TestRefusedRequestFinishes: a request the engine refuses at submission
// ends through Router.Finished like any other (so whatever the router
// counted for it is released), and its failure is recorded with a
// detail-free kind to group by.
func TestRefusedRequestFinishes(t *testing.T) {
	w := smallWorkload(t, 60)
	for i := range w.Requests {
		if i%4 == 0 {
			w.Requests[i].OutputTokens = 0 // the FIFO engine refuses these
		}
	}
	rr := newRR()
	res, err := Run(context.Background(), Config{Instances: 3, NewEngine: fifoFactory(t), Router: rr}, w)
	if err != nil {
		t.Fatal(err)
	}
	for in, n := range rr.inflight {
		if n != 0 {
			t.Errorf("%s: %d requests still in flight for the router", in, n)
		}
	}
	if rr.failed != 15 {
		t.Errorf("Finished with an error %d times, want 15", rr.failed)
	}
	for i, o := range res.Outcomes {
		if refused := i%4 == 0; refused != (o.Err != "") || refused && o.ErrKind != "submit: max tokens" {
			t.Errorf("request %d: err %q kind %q", i, o.Err, o.ErrKind)
		}
	}
}

// TestUtilisation: each engine's busy time over its life comes back per
// instance, and the FIFO model's busy time is exactly its service time.
func TestUtilisation(t *testing.T) {
	w := smallWorkload(t, 90)
	res, err := Run(context.Background(), Config{Instances: 3, NewEngine: fifoFactory(t), Router: newRR()}, w)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Utilisation) != 3 {
		t.Fatalf("utilisation of %d instances", len(res.Utilisation))
	}
	var want, got time.Duration
	for _, o := range res.Outcomes {
		want += time.Duration(o.PromptTokens)*time.Microsecond + time.Duration(o.OutputTokens)*time.Millisecond
	}
	for _, u := range res.Utilisation {
		got += u.Busy
		if u.Life != res.End || u.PrefillBusy <= 0 || u.PrefillBusy >= u.Busy || u.Busy > u.Life {
			t.Errorf("%+v (run end %v)", u, res.End)
		}
	}
	if got != want {
		t.Errorf("busy %v, want %v", got, want)
	}
}
