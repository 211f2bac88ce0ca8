package test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
)

// clusterFleet is a pool of kvsim engines, each with its kvbridge, on a
// 3-node NATS JetStream cluster whose stream, snapshot bucket and object
// store have 3 replicas; bridges, consumers and routers are given every
// seed URL, as a Kubernetes deployment gives them the StatefulSet's pods.
type clusterFleet struct {
	t       testing.TB
	ctx     context.Context
	nc      *testenv.NATSCluster
	pool    string
	stream  kvstream.StreamConfig
	bucket  kvstream.BucketConfig
	engines []*clusterEngine
}

type clusterEngine struct {
	id     string
	sim    *simserver.Instance
	url    string
	br     *bridge.Bridge
	bridge *nats.Conn
}

// newClusterFleet starts engines kvsim engines of blocks GPU blocks each,
// running timeScale times faster than real time.
func newClusterFleet(t testing.TB, engines, blocks int, timeScale float64) *clusterFleet {
	t.Helper()
	name := testenv.UniqueName(t)
	f := &clusterFleet{
		t: t, ctx: testenv.Context(t, 4*time.Minute), nc: testenv.StartNATSCluster(t, 3),
		pool:   "pool_" + name,
		stream: kvstream.StreamConfig{Name: "EV_" + name, Replicas: 3},
		bucket: kvstream.BucketConfig{Name: "SN_" + name, Replicas: 3},
	}
	for i := 0; i < engines; i++ {
		e := &clusterEngine{id: fmt.Sprintf("sim-%d", i)}
		httpAddr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
		pubEP := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
		replayEP := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
		s, err := simserver.Start(f.ctx, simserver.Config{
			Engine: sim.Config{Model: simModel, GPUBlocks: blocks, HashSeed: 3}, Listen: httpAddr, TimeScale: timeScale,
			Logger: quietLogger(), Events: simserver.EventsConfig{Endpoint: pubEP, ReplayEndpoint: replayEP},
		})
		if err != nil {
			t.Fatalf("kvsim: %v", err)
		}
		t.Cleanup(func() { _ = s.Close() })
		e.sim, e.url = s, "http://"+httpAddr
		e.bridge = f.conn("kvbridge " + e.id)
		br, err := bridge.New(bridge.Config{
			Pool: f.pool, Model: simModel, Conn: e.bridge, Stream: f.stream, Bucket: f.bucket,
			Sources:           []bridge.Source{{Instance: e.id, Endpoint: pubEP, ReplayEndpoint: replayEP, URL: e.url, FirstSeq: simserver.FirstSeq}},
			HeartbeatInterval: 200 * time.Millisecond, SnapshotInterval: time.Second, EngineProbeInterval: 200 * time.Millisecond,
			ReplayTimeout: 2 * time.Second, PublishTimeout: 2 * time.Second, Logger: quietLogger(),
		})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(f.ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			// Run returns early only for a configuration error: the
			// bridge would never be ready, say why.
			if err := br.Run(ctx); err != nil && ctx.Err() == nil {
				t.Errorf("%s bridge stopped: %v", e.id, err)
			}
		}()
		t.Cleanup(func() { cancel(); <-done })
		e.br = br
		f.engines = append(f.engines, e)
	}
	for _, e := range f.engines {
		testenv.WaitFor(t, 30*time.Second, e.id+" bridge ready", e.br.Ready)
	}
	return f
}

// conn connects to every seed URL, reconnecting forever.
func (f *clusterFleet) conn(name string) *nats.Conn {
	f.t.Helper()
	nc, err := kvstream.NATSConfig{URL: f.nc.URLs(), Name: name, ReconnectWait: 50 * time.Millisecond, Logger: quietLogger()}.Connect()
	if err != nil {
		f.t.Fatalf("nats connect: %v", err)
	}
	f.t.Cleanup(nc.Close)
	return nc
}

// nodeOf returns the cluster node a connection is on (-1: none).
func (f *clusterFleet) nodeOf(nc *nats.Conn) int {
	u := nc.ConnectedUrl()
	for i := 0; i < f.nc.Size(); i++ {
		if u == f.nc.URL(i) {
			return i
		}
	}
	return -1
}

// truth is what engine e holds on GPU.
func (f *clusterFleet) truth(e *clusterEngine) map[uint64]bool {
	out := map[uint64]bool{}
	e.sim.Engine(0, func(en *sim.Engine) {
		gpu, _ := en.CachedBlocks()
		for _, h := range gpu {
			out[h] = true
		}
	})
	return out
}

// startConsumer runs a router-side consumer on the cluster into a table
// that holds exactly what the events say, block by block.
func (f *clusterFleet) startConsumer() (*consumer.Consumer, *tableApplier) {
	f.t.Helper()
	a := newTableApplier()
	c, err := consumer.New(consumer.Config{Conn: f.conn("consumer"), Pool: f.pool, Applier: a, Stream: f.stream, Bucket: f.bucket,
		StaleAfter: 3 * time.Second, PurgeAfter: time.Minute, CheckInterval: 100 * time.Millisecond, Logger: quietLogger()})
	if err != nil {
		f.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(f.ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	f.t.Cleanup(func() { cancel(); <-done })
	testenv.WaitFor(f.t, 30*time.Second, "consumer healthy", c.Healthy)
	return c, a
}

// waitExact waits until the table holds every engine's cache exactly; cs,
// the consumers feeding it, are named in the failure.
func (f *clusterFleet) waitExact(a *tableApplier, what string, cs ...*consumer.Consumer) {
	f.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		bad := ""
		for _, e := range f.engines {
			want := f.truth(e)
			if stale, missing := diff(keys(a.dump(e.id)), want); stale+missing > 0 {
				bad += fmt.Sprintf(" %s: %d stale, %d missing of %d;", e.id, stale, missing, len(want))
			}
		}
		if bad == "" {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%s: the index never matched the engines:%s; %s", what, bad, f.positions(cs...))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// positions says where each bridge and the consumers are: what a test
// that did not converge prints.
func (f *clusterFleet) positions(cs ...*consumer.Consumer) string {
	var out []string
	for _, e := range f.engines {
		for _, s := range e.br.Stats() {
			out = append(out, fmt.Sprintf("%s bridge: published %d, stream seq %d, engine seq %d, dropped %d, gaps %d, replay failures %d, engine down %v",
				e.id, s.Published, s.StreamSeq, s.EngineSeq, s.Dropped, s.Gaps, s.ReplayFailures, s.EngineDown))
		}
	}
	for i, c := range cs {
		for _, s := range c.Instances() {
			out = append(out, fmt.Sprintf("consumer %d %s: %s, stream seq %d, gaps %d, replay lost %d", i, s.Instance, s.State, s.StreamSeq, s.Gaps, s.ReplayLost))
		}
	}
	return strings.Join(out, "; ")
}

// lost sums what the bridges dropped (outage buffer overflow) or could not
// replay, and the gaps the consumer saw: events that never reached it.
func (f *clusterFleet) lost(c *consumer.Consumer) (dropped, gaps uint64) {
	for _, e := range f.engines {
		for _, s := range e.br.Stats() {
			dropped += s.Dropped + s.ReplayFailures
		}
	}
	for _, s := range c.Instances() {
		gaps += s.Gaps + s.ReplayLost
	}
	return dropped, gaps
}

// clusterRouter is one kvrouter replica: the events pipeline on the
// cluster and the HTTP server, routing the fleet's pool kv_aware.
type clusterRouter struct {
	reg  *prometheus.Registry
	kve  *kvstate.Pipeline
	srv  *httpapi.Server
	http *httptest.Server
	stop func()
}

func (f *clusterFleet) routerConfig() config.Config {
	var insts []config.InstanceConfig
	for _, e := range f.engines {
		insts = append(insts, config.InstanceConfig{ID: e.id, URL: e.url})
	}
	return config.Config{
		AdminToken: "adm",
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: f.nc.URLs(), Stream: f.stream.Name, StreamReplicas: 3}, Bucket: f.bucket.Name,
			StaleAfter: 3 * time.Second, PurgeAfter: time.Minute},
		Pools: []config.PoolConfig{{Name: f.pool, Model: simModel,
			Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: insts}},
	}
}

func (f *clusterFleet) startRouter(cfg config.Config) *clusterRouter {
	f.t.Helper()
	reg := prometheus.NewRegistry()
	ctx, cancel := context.WithCancel(f.ctx)
	kve, err := kvstate.Start(ctx, cfg, kvstate.Options{Registerer: reg, Logger: quietLogger()})
	if err != nil {
		cancel()
		f.t.Fatal(err)
	}
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: quietLogger(), Registry: reg, KV: kvaware.NewSource(kve.KV), KVEvents: kve, Admin: admin.Routes(kve)})
	if err != nil {
		cancel()
		kve.Close()
		f.t.Fatal(err)
	}
	runDone := make(chan struct{})
	go func() { defer close(runDone); _ = srv.Run(ctx) }()
	ts := httptest.NewServer(srv.Handler())
	var once sync.Once
	r := &clusterRouter{reg: reg, kve: kve, srv: srv, http: ts}
	r.stop = func() {
		once.Do(func() {
			ts.CloseClientConnections()
			ts.Close()
			cancel()
			<-runDone
			kve.Close()
		})
	}
	f.t.Cleanup(r.stop)
	if err := kve.WaitReady(testenv.Context(f.t, 30*time.Second)); err != nil {
		f.t.Fatal(err)
	}
	return r
}

// load sends completions through routers (round robin, as an L4 balancer
// would) from workers goroutines until stopped: prompts from a set of
// shared prefixes with fresh tails, so some match and some are new.
type load struct {
	sent, failed atomic.Int64
	reasons      sync.Map // reason -> *atomic.Int64
	lastErr      atomic.Value
	stop         context.CancelFunc
	done         sync.WaitGroup
}

func (f *clusterFleet) startLoad(routers []*clusterRouter, workers int, seed uint64) *load {
	ctx, cancel := context.WithCancel(f.ctx)
	l := &load{stop: cancel}
	prefixes := make([][]uint32, 16)
	for i := range prefixes {
		for k := 0; k < 3*16; k++ {
			prefixes[i] = append(prefixes[i], uint32(50000+i*100+k))
		}
	}
	client := &http.Client{Timeout: 20 * time.Second}
	var next atomic.Uint64
	for w := 0; w < workers; w++ {
		l.done.Add(1)
		go func() {
			defer l.done.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for ctx.Err() == nil {
				p := append([]uint32(nil), prefixes[rng.IntN(len(prefixes))]...)
				for k := rng.IntN(2 * 16); k > 0; k-- {
					p = append(p, uint32(1000+rng.IntN(30000)))
				}
				r := routers[next.Add(1)%uint64(len(routers))]
				body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": p, "max_tokens": 4})
				l.sent.Add(1)
				resp, err := client.Post(r.http.URL+"/v1/completions", "application/json", bytes.NewReader(body))
				if err != nil {
					if ctx.Err() == nil {
						l.failed.Add(1)
						l.lastErr.Store(err.Error())
					}
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					l.failed.Add(1)
					l.lastErr.Store(resp.Status)
					continue
				}
				reason := resp.Header.Get(router.HeaderReason)
				v, _ := l.reasons.LoadOrStore(reason, new(atomic.Int64))
				v.(*atomic.Int64).Add(1)
			}
		}()
	}
	return l
}

func (l *load) finish() {
	l.stop()
	l.done.Wait()
}

func (l *load) summary() string {
	var parts []string
	l.reasons.Range(func(k, v any) bool {
		parts = append(parts, fmt.Sprintf("%s=%d", k, v.(*atomic.Int64).Load()))
		return true
	})
	return fmt.Sprintf("sent %d, failed %d (%v), reasons %s", l.sent.Load(), l.failed.Load(), l.lastErr.Load(), strings.Join(parts, " "))
}

// poke sends each engine, directly, a fresh 2-block prompt every 100 ms
// until the returned func is called, so that every engine stores new blocks.
func (f *clusterFleet) poke() func() {
	ctx, cancel := context.WithCancel(f.ctx)
	var wg sync.WaitGroup
	for i, e := range f.engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ctx.Err() == nil; n++ {
				p := make([]uint32, 2*16)
				for k := range p {
					p[k] = uint32(200000 + i*100000 + n*40 + k)
				}
				body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": p, "max_tokens": 1})
				if resp, err := http.Post(e.url+"/v1/completions", "application/json", bytes.NewReader(body)); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				select {
				case <-ctx.Done():
				case <-time.After(100 * time.Millisecond):
				}
			}
		}()
	}
	return func() { cancel(); wg.Wait() }
}
