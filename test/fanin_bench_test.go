package test

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// mooncakeEventsPerEngine is the block events per second one engine
// produces under the Mooncake trace's load: 5,117 prompt tokens/s per
// engine, 65.8 % of them not cached (kv_aware at 128 instances, the trace
// at 16× speed: its per-instance load), in 16-token blocks, stored and
// about as many removed in steady state (docs/BENCHMARKS.md §3, "One
// router's consumer"): 2 × 5117 × 0.658 / 16 ≈ 420.
const mooncakeEventsPerEngine = 420

// fanInBlocks is the blocks per engine batch: the captured vLLM shape's
// mean is 8.84 (docs/BENCHMARKS.md §3).
const fanInBlocks = 8

// fanInHeld is how many of its stored batches an engine keeps before it
// removes the oldest: 64 × 8 = 512 blocks per engine, a steady cache.
const fanInHeld = 64

// BenchmarkEventFanIn is issue 14's fan-in run: engines (vLLM's wire
// format on ZMQ), one kvbridge each, publishing into a 3-node JetStream
// cluster (stream and bucket at 3 replicas), consumed by one kvrouter
// process into its memory index. The offered rate steps up from a quarter
// of what the Mooncake trace's load implies to several times it; each step
// reports the block events the router applied per second, its consumer's
// lag (JetStream store → index) p50/p99 over the step, and the router's
// CPU (its own process) and this process's (engines, bridges and the three
// NATS servers). The router keeps up at a step when it applied what was
// offered within 2 % and its lag p99 stayed under a second; the run stops
// at the first step where it did not, or where the bridges and NATS here
// could not carry the offered rate (then the router's CPU per block says
// how far one router would go on its own core).
//
//	go test -run '^$' -bench EventFanIn -benchtime 1x -timeout 30m ./test/
func BenchmarkEventFanIn(b *testing.B) {
	r := newFanIn(b)
	r.startRouter()
	b.ResetTimer()
	// The first step warms up (the router's snapshot loads, the stream's
	// first messages of each instance, the Go runtime) and is not reported.
	for i, mult := range []float64{0.25, 0.25, 0.5, 1, 2, 4, 8} {
		warm := i == 0
		rate := mult * mooncakeEventsPerEngine * float64(r.engines) // block events/s
		lag0 := lagBuckets(b, r.rt.admin)
		a0, o0 := r.applied(), r.offered.Load()
		rcpu0, cpu0, t0 := processCPU(b, r.rt.pid), cputime.Process(), time.Now()
		const step = 10 * time.Second
		c0 := r.committed()
		// The router's backlog, sampled every 100 ms through the step.
		var backlog []float64
		var sampler sync.WaitGroup
		sampler.Add(1)
		go func() {
			defer sampler.Done()
			for time.Since(t0) < step {
				time.Sleep(100 * time.Millisecond)
				c := r.committed()
				backlog = append(backlog, max(c-r.processed(), 0))
			}
		}()
		r.offer(rate, t0, step)
		sampler.Wait()
		el := time.Since(t0).Seconds()
		c1 := r.committed()
		a1, o1 := r.applied(), r.offered.Load()
		rcpu, cpu := processCPU(b, r.rt.pid)-rcpu0, cputime.Process()-cpu0
		lag := lagBuckets(b, r.rt.admin).sub(lag0)
		// What the router had not applied when the offer stopped, and how
		// long it took to catch up.
		behind := float64(o1-o0) - (a1 - a0)
		drain := time.Now()
		for r.applied()-a0 < float64(o1-o0) && time.Since(drain) < 30*time.Second {
			time.Sleep(50 * time.Millisecond)
		}
		if warm {
			continue
		}
		p50, p99 := lag.quantile(0.5), lag.quantile(0.99)
		slices.Sort(backlog)
		bl99 := 0.0
		if len(backlog) > 0 {
			bl99 = backlog[(len(backlog)-1)*99/100]
		}
		commitRate := (c1 - c0) / el * fanInBlocks // block events/s the cluster committed
		// The router keeps up when its own backlog stays under a tenth of
		// a second of what the cluster commits; the sending side carried
		// the offer when it committed 98 % of it.
		routerKeeps := bl99*fanInBlocks < 0.1*max(commitRate, 1)
		carried := commitRate >= 0.98*float64(o1-o0)/el
		keeps := routerKeeps && carried
		b.Logf("engines=%d offered %.2f× Mooncake = %.0f block events/s: committed by the cluster %.0f/s, applied by the router %.0f/s; router backlog p99 %.0f messages (%.0f ms of commits); store→index lag p50 %.0f ms p99 %.0f ms (includes the cluster's replication); %.0f behind at the end, caught up in %v; router CPU %.2f cores (%.2f µs per block event), this process (engines, bridges, 3 NATS servers) %.2f cores; router keeps up: %v, sending side carried the offer: %v",
			r.engines, mult, float64(o1-o0)/el, commitRate, (a1-a0)/el, bl99, bl99*fanInBlocks/max(commitRate, 1)*1e3, p50*1e3, p99*1e3,
			behind, time.Since(drain).Round(10*time.Millisecond), rcpu.Seconds()/el, rcpu.Seconds()*1e6/max(a1-a0, 1), cpu.Seconds()/el, routerKeeps, carried)
		b.ReportMetric((a1-a0)/el, fmt.Sprintf("applied/s@%g×", mult))
		b.ReportMetric(p99*1e3, fmt.Sprintf("lag-p99-ms@%g×", mult))
		b.ReportMetric(bl99, fmt.Sprintf("router-backlog-p99@%g×", mult))
		if !keeps {
			break
		}
	}
}

// BenchmarkEventFanInDrain finds where one router stops keeping up
// without the senders sharing its cores. One kvrouter process starts and
// catches up; it is then stopped (SIGSTOP) while the engines and bridges
// fill the 3-node cluster's stream with a backlog (KV_FANIN_BACKLOG_S
// seconds, 40 by default, at KV_FANIN_BACKLOG_RATE times the Mooncake
// rate, 0.25 by default: what this machine's senders carried in
// BenchmarkEventFanIn); once the bridges have flushed, it is continued
// (SIGCONT) and drains the backlog while only it and the cluster work. Its
// drain rate is the most block events one router applies per second of
// wall time with its share of the machine, and its CPU per block event
// what one router core carries; both against the Mooncake rate of the
// fleet. (A router started after the backlog would not drain it: it asks
// the bridges for snapshots and reads on from their seqs.)
//
//	go test -run '^$' -bench EventFanInDrain -benchtime 1x -timeout 30m ./test/
func BenchmarkEventFanInDrain(b *testing.B) {
	r := newFanIn(b)
	secs := testenv.Value(b, "KV_FANIN_BACKLOG_S", 40)
	mult, err := strconv.ParseFloat(cmp.Or(os.Getenv("KV_FANIN_BACKLOG_RATE"), "0.25"), 64)
	if err != nil || mult <= 0 {
		b.Fatalf("KV_FANIN_BACKLOG_RATE=%q: a positive number", os.Getenv("KV_FANIN_BACKLOG_RATE"))
	}
	r.startRouter()
	// settled waits until the stream stops growing but for the bridges'
	// heartbeats (one per engine a second) and the router has taken
	// everything committed when procs is true.
	settled := func(procs bool) float64 {
		last, t0 := r.committed(), time.Now()
		for {
			if time.Since(t0) > 5*time.Minute {
				b.Fatalf("the stream did not settle in 5 minutes (committed %.0f, router took %.0f)", r.committed(), r.processed())
			}
			time.Sleep(time.Second)
			c := r.committed()
			if c-last <= 2*float64(r.engines) && (!procs || r.processed() >= c-2*float64(r.engines)) {
				return c
			}
			last = c
		}
	}
	settled(true)
	proc, err := os.FindProcess(r.rt.pid)
	if err != nil {
		b.Fatal(err)
	}
	p0, a0 := r.processed(), r.applied()
	c0 := r.committed()
	slow0 := r.slowConsumers()
	if err := proc.Signal(syscall.SIGSTOP); err != nil {
		b.Fatal(err)
	}
	testenv.WaitFor(b, 10*time.Second, "the router stopped", func() bool { return processState(b, r.rt.pid) == 'T' })
	b.ResetTimer()
	t0 := time.Now()
	r.offer(mult*mooncakeEventsPerEngine*float64(r.engines), t0, time.Duration(secs)*time.Second)
	offerEl := time.Since(t0).Seconds()
	backlog := settled(false) - c0
	offered := float64(r.offered.Load())
	rcpu0, cpu0, s0 := processCPU(b, r.rt.pid), cputime.Process(), time.Now()
	if err := proc.Signal(syscall.SIGCONT); err != nil {
		b.Fatal(err)
	}
	// Drained when it has taken the backlog's messages and applied every
	// block event offered (p0 may trail the stream by a heartbeat or two).
	for r.processed()-p0 < backlog || r.applied()-a0 < offered {
		if time.Since(s0) > 10*time.Minute {
			b.Fatalf("router took %.0f of %.0f backlog messages and applied %.0f of %.0f block events in 10 minutes",
				r.processed()-p0, backlog, r.applied()-a0, offered)
		}
		time.Sleep(100 * time.Millisecond)
	}
	el := time.Since(s0)
	rcpu := processCPU(b, r.rt.pid) - rcpu0
	cpu := cputime.Process() - cpu0
	applied := r.applied() - a0
	if slow := r.slowConsumers() - slow0; slow > 0 {
		// The server dropped the stopped router as a slow consumer: the
		// drain above includes its reconnect and the consumer's recovery.
		b.Logf("the NATS servers counted %d slow consumers while the router was stopped", slow)
	}
	rate := applied / el.Seconds()
	mooncake := mooncakeEventsPerEngine * float64(r.engines)
	b.Logf("engines=%d backlog: %.0f block events offered over %.1f s (%.2f× Mooncake), %.0f stream messages; the router drained it in %v: %.0f block events/s = %.2f× the %d-engine Mooncake rate; router CPU %v (%.2f µs per block event: one router core ≈ %.0f block events/s = %.2f× Mooncake), this process (3 NATS servers delivering; engines and bridges idle but for heartbeats) %.2f cores",
		r.engines, offered, offerEl, offered/offerEl/mooncake, backlog, el.Round(10*time.Millisecond),
		rate, rate/mooncake, r.engines, rcpu.Round(time.Millisecond), rcpu.Seconds()*1e6/applied, applied/rcpu.Seconds(), applied/rcpu.Seconds()/mooncake, cpu.Seconds()/el.Seconds())
	b.ReportMetric(rate, "drained/s")
	b.ReportMetric(rcpu.Seconds()*1e6/applied, "router-CPU-µs/event")
	b.ReportMetric(rate/mooncake, "×Mooncake")
}

// fanIn is the fan-in rig: a 3-node JetStream cluster, engines (vLLM's
// wire format on ZMQ) with a kvbridge each on its own connection, and one
// kvrouter process once startRouter runs.
type fanIn struct {
	b       *testing.B
	engines int
	pool    string
	stream  kvstream.StreamConfig
	es      []*fanInEngine
	rt      *tierReplica
	startRt func()
	js      jetstream.JetStream
	nc      *testenv.NATSCluster
	ctx     context.Context
	offered atomic.Int64
}

type fanInEngine struct {
	id   string
	pub  *enginezmq.Publisher
	next uint64     // next block hash (unique per engine)
	held [][]uint64 // stored batches not yet removed, oldest first
}

func newFanIn(b *testing.B) *fanIn {
	engines := testenv.Value(b, "KV_FANIN_ENGINES", 256)
	bin := buildRouter(b)
	name := testenv.UniqueName(b)
	ctx := testenv.Context(b, 30*time.Minute)
	nc := testenv.StartNATSCluster(b, 3)
	pool := "fanin_" + name
	stream := kvstream.StreamConfig{Name: "EV_" + name, Replicas: 3}
	bucket := kvstream.BucketConfig{Name: "SN_" + name, Replicas: 3}
	r := &fanIn{b: b, engines: engines, pool: pool, stream: stream, ctx: ctx, nc: nc}

	es := make([]*fanInEngine, engines)
	var bridges []*bridge.Bridge
	for i := range es {
		e := &fanInEngine{id: fmt.Sprintf("vllm-%03d", i), next: uint64(i+1) << 40}
		pubEP := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(b))
		pub, err := enginezmq.NewPublisher(ctx, enginezmq.PublisherConfig{Endpoint: pubEP, Topic: "kv@" + e.id + "@" + simModel})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = pub.Close() })
		e.pub = pub
		// Each bridge on its own connection, spread over the nodes as a
		// sidecar's seed list would land it.
		urls := strings.Split(nc.URLs(), ",")
		conn, err := kvstream.NATSConfig{URL: strings.Join(append(urls[i%3:], urls[:i%3]...), ","), Name: "kvbridge " + e.id,
			ReconnectWait: 50 * time.Millisecond, Logger: quietLogger()}.Connect()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(conn.Close)
		br, stop := runBridge(b, ctx, bridge.Config{Pool: pool, Model: simModel, Conn: conn, Stream: stream, Bucket: bucket,
			Sources:           []bridge.Source{{Instance: e.id, Endpoint: pubEP, URL: "http://127.0.0.1:1"}},
			HeartbeatInterval: time.Second, SnapshotInterval: time.Hour, EngineProbeInterval: -1,
			PublishTimeout: 5 * time.Second, Logger: quietLogger()})
		b.Cleanup(stop)
		bridges = append(bridges, br)
		es[i] = e
	}
	for i, br := range bridges {
		testenv.WaitFor(b, 2*time.Minute, es[i].id+" bridge ready", br.Ready)
		testenv.WaitFor(b, 2*time.Minute, es[i].id+" bridge subscribed", es[i].pub.Subscribed)
	}
	r.es = es

	cfg := config.Config{AdminToken: "adm",
		Listen:      fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(b)),
		AdminListen: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(b)),
		Log:         config.LogConfig{Level: "info", Format: "json"},
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: nc.URLs(), Stream: stream.Name, StreamReplicas: 3}, Bucket: bucket.Name,
			MaxInstances: 2 * engines},
		Pools: []config.PoolConfig{{Name: pool, Model: simModel,
			Routing: config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{BlockSize: 16}},
			Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "static-0", URL: "http://127.0.0.1:1"}}}},
	}
	r.startRt = func() { r.rt = startTierReplica(b, bin, cfg) }
	obs, err := kvstream.NATSConfig{URL: nc.URLs(), Name: "fan-in observer", Logger: quietLogger()}.Connect()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(obs.Close)
	if r.js, err = jetstream.New(obs); err != nil {
		b.Fatal(err)
	}
	return r
}

// startRouter starts the kvrouter process and waits until it is ready.
func (r *fanIn) startRouter() {
	r.startRt()
	testenv.WaitFor(r.b, 2*time.Minute, "router sees every instance", func() bool {
		return r.rt.metric(r.b, `kvrouter_events_instances{pool="`+r.pool+`",state="live"}`) >= float64(r.engines)
	})
}

// batch is an engine's next batch: once it holds fanInHeld batches, a
// removal of its oldest and a store of a new one alternate.
func (r *fanIn) batch(e *fanInEngine) []byte {
	var ev events.Event
	if len(e.held) >= fanInHeld && e.next%2 == 0 {
		ev = events.Event{Kind: events.BlockRemoved, BlockHashes: e.held[0], Medium: "GPU"}
		e.held = e.held[1:]
		e.next++
	} else {
		hs := make([]uint64, fanInBlocks)
		toks := make([]uint32, 16*fanInBlocks)
		for k := range hs {
			hs[k] = e.next
			e.next++
		}
		for k := range toks {
			toks[k] = uint32(hs[0]>>8) + uint32(k) // distinct per batch: distinct router keys
		}
		e.held = append(e.held, hs)
		ev = events.Event{Kind: events.BlockStored, BlockHashes: hs, TokenIDs: toks, BlockSize: 16, Medium: "GPU"}
	}
	p, err := events.Encode(nil, events.Batch{TS: float64(time.Now().UnixNano()) / 1e9, HasDPRank: true, Events: []events.Event{ev}}, events.EncodingArray)
	if err != nil {
		r.b.Fatal(err)
	}
	return p
}

// offer publishes rate block events a second over the engines from t0
// for d: eight drivers, each pacing its share of the engines.
func (r *fanIn) offer(rate float64, t0 time.Time, d time.Duration) {
	var wg sync.WaitGroup
	for k := 0; k < 8; k++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := r.es[k*r.engines/8 : (k+1)*r.engines/8]
			share := rate * float64(len(mine)) / float64(r.engines) / fanInBlocks // batches/s
			tick := time.NewTicker(5 * time.Millisecond)
			defer tick.Stop()
			sent, n := 0, 0
			for now := range tick.C {
				el := now.Sub(t0)
				if el > d {
					return
				}
				for due := int(share * el.Seconds()); sent < due; sent++ {
					e := mine[n%len(mine)]
					n++
					if _, err := e.pub.Publish(r.batch(e)); err != nil {
						r.b.Error(err)
						return
					}
					r.offered.Add(fanInBlocks)
				}
			}
		}()
	}
	wg.Wait()
}

// processed is how many stream messages the router has taken (applied or
// skipped, every result); committed is the stream's last sequence: their
// difference is the router's own backlog, whatever the bridges and the
// cluster's replication add before a message is committed.
func (r *fanIn) processed() float64 {
	n := 0.0
	scrape(r.b, r.rt.admin, func(line string) {
		if strings.HasPrefix(line, "kvrouter_events_messages_total{") {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			n += v
		}
	})
	return n
}

func (r *fanIn) committed() float64 {
	st, err := r.js.Stream(r.ctx, r.stream.Name)
	if err != nil {
		r.b.Fatal(err)
	}
	si, err := st.Info(r.ctx)
	if err != nil {
		r.b.Fatal(err)
	}
	return float64(si.State.LastSeq)
}

// slowConsumers is the cluster's count of clients dropped as slow
// consumers, over its nodes.
func (r *fanIn) slowConsumers() int64 {
	var n int64
	for i := range r.nc.Size() {
		if srv := r.nc.Server(i); srv != nil {
			v, err := srv.Varz(nil)
			if err != nil {
				r.b.Fatal(err)
			}
			n += v.SlowConsumers
		}
	}
	return n
}

func (r *fanIn) applied() float64 {
	return r.rt.metric(r.b, `kvrouter_events_blocks_stored_total{pool="`+r.pool+`"}`) + r.rt.metric(r.b, `kvrouter_events_blocks_removed_total{pool="`+r.pool+`"}`)
}

// processState is a process's state letter from /proc (T: stopped).
func processState(b *testing.B, pid int) byte {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	return data[strings.LastIndexByte(string(data), ')')+2]
}

// processCPU is a process's user+system CPU time from /proc.
func processCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name (in parentheses, may hold spaces).
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond // USER_HZ is 100 on Linux
}

// histogram is a Prometheus histogram's cumulative bucket counts by upper
// bound.
type histogram struct {
	le    []float64
	count []float64
}

// lagBuckets reads the router's kvrouter_events_lag_seconds buckets.
func lagBuckets(b *testing.B, admin string) histogram {
	b.Helper()
	var h histogram
	scrape(b, admin, func(line string) {
		if !strings.HasPrefix(line, "kvrouter_events_lag_seconds_bucket{") {
			return
		}
		i := strings.Index(line, `le="`)
		j := strings.Index(line[i+4:], `"`)
		le, err1 := strconv.ParseFloat(line[i+4:i+4+j], 64)
		n, err2 := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err1 != nil || err2 != nil {
			b.Fatalf("lag bucket line %q", line)
		}
		h.le, h.count = append(h.le, le), append(h.count, n)
	})
	return h
}

func (h histogram) sub(o histogram) histogram {
	out := histogram{le: h.le, count: make([]float64, len(h.count))}
	for i := range h.count {
		out.count[i] = h.count[i]
		if i < len(o.count) {
			out.count[i] -= o.count[i]
		}
	}
	return out
}

// quantile is the upper bound of the bucket holding quantile q (+Inf: past
// the last finite bound).
func (h histogram) quantile(q float64) float64 {
	if len(h.count) == 0 || h.count[len(h.count)-1] == 0 {
		return 0
	}
	want := q * h.count[len(h.count)-1]
	for i, c := range h.count {
		if c >= want {
			return h.le[i]
		}
	}
	return math.Inf(1)
}
