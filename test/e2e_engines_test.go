package test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
	"github.com/kvrouter/kvrouter/tiers"
)

// Engine sources end to end: simulated engines speaking SGLang's or
// TensorRT-LLM's event format (kvsim --engine), the real bridge (ZMQ or
// the TensorRT-LLM poller), NATS JetStream, and the router's events
// pipeline and kv_aware data plane. For each: a repeated prompt is routed
// kv_match with as many matched tokens as the engine then reports cached,
// the engine's evictions reach the index, and a restarted engine leaves
// nothing behind.

const engModel = "eng-model"

// engineNode is one simulated engine (fixed address, so that it can be
// restarted as a pod would be) and its bridge.
type engineNode struct {
	t        *testing.T
	ctx      context.Context
	id       string
	format   string
	addr     string
	pubEP    string
	replayEP string
	natsURL  string
	pool     string
	stream   kvstream.StreamConfig
	bucket   kvstream.BucketConfig

	mu  sync.Mutex // guards sim
	sim *simserver.Instance
}

func (n *engineNode) url() string { return "http://" + n.addr }

func (n *engineNode) start() {
	n.t.Helper()
	s := startSim(n.t, n.ctx, simserver.Config{
		Engine:    sim.Config{Model: engModel, GPUBlocks: 40, HashSeed: uint64(len(n.id))},
		Listen:    n.addr,
		TimeScale: 50,
		Events:    simserver.EventsConfig{Endpoint: n.pubEP, ReplayEndpoint: n.replayEP, Format: n.format},
	})
	n.mu.Lock()
	n.sim = s
	n.mu.Unlock()
}

func (n *engineNode) stop() {
	n.mu.Lock()
	s := n.sim
	n.sim = nil
	n.mu.Unlock()
	_ = s.Close()
}

// startBridge runs the bridge of the node's format until the test ends.
func (n *engineNode) startBridge() {
	n.t.Helper()
	nc := testenv.Connect(n.t, n.natsURL, nats.MaxReconnects(-1))
	src := bridge.Source{Instance: n.id, Endpoint: n.pubEP, ReplayEndpoint: n.replayEP, URL: n.url(), FirstSeq: simserver.FirstSeq}
	if n.format == simserver.FormatTRTLLM {
		p, err := bridge.NewTRTLLMPoller(n.ctx, bridge.TRTLLMConfig{EngineURL: n.url(), Interval: 20 * time.Millisecond, Logger: quietLogger()})
		if err != nil {
			n.t.Fatal(err)
		}
		src = p.Source(0, n.id, n.url())
		n.t.Cleanup(p.Close) // after the poller has stopped (cleanups run last first)
		testenv.Go(n.t, n.ctx, func(ctx context.Context) error { p.Run(ctx); return nil })
	}
	runBridge(n.t, n.ctx, simBridgeTimings(bridge.Config{
		Pool: n.pool, Model: engModel, Conn: nc, Stream: n.stream, Bucket: n.bucket,
		Sources: []bridge.Source{src},
	}))
}

// completeDirect sends a prompt straight to the engine (not through the
// router), to fill its cache.
func (n *engineNode) completeDirect(ids []uint32) {
	n.t.Helper()
	if resp := testenv.PostJSON(n.t, n.url()+"/v1/completions", map[string]any{"model": engModel, "prompt": ids, "max_tokens": 1}); resp.Status != 200 {
		n.t.Fatalf("%s: completion %d %s", n.id, resp.Status, resp.Body)
	}
}

// engineScene is how the engine tests and kvrScene open: a context of its
// own timeout, names unique to the test (name; pool p_, stream EV_, bucket
// SN_ of it) and an embedded NATS server.
type engineScene struct {
	ctx        context.Context
	ns         *testenv.NATSServer
	name, pool string
	stream     kvstream.StreamConfig
	bucket     kvstream.BucketConfig
}

func newEngineScene(t *testing.T, timeout time.Duration) engineScene {
	t.Helper()
	ctx := testenv.Context(t, timeout)
	name := testenv.UniqueName(t)
	return engineScene{ctx: ctx, ns: testenv.StartNATS(t), name: name, pool: "p_" + name,
		stream: kvstream.StreamConfig{Name: "EV_" + name}, bucket: kvstream.BucketConfig{Name: "SN_" + name}}
}

type engineFleet struct {
	t     *testing.T
	nodes []*engineNode
	r     *kvrRouter
}

// newEngineFleet starts NATS, the router (one kv_aware pool) and one
// engine with its bridge per format given.
func newEngineFleet(t *testing.T, formats ...string) *engineFleet {
	sc := newEngineScene(t, 3*time.Minute)
	ctx, ns, pool, stream, bucket := sc.ctx, sc.ns, sc.pool, sc.stream, sc.bucket
	f := &engineFleet{t: t}
	var insts []config.InstanceConfig
	for i, format := range formats {
		n := &engineNode{t: t, ctx: ctx, id: fmt.Sprintf("%s-%d", format, i), format: format,
			addr:     fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)),
			pubEP:    fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)),
			replayEP: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)),
			natsURL:  ns.URL(), pool: pool, stream: stream, bucket: bucket}
		n.start()
		f.nodes = append(f.nodes, n)
		insts = append(insts, config.InstanceConfig{ID: n.id, URL: n.url()})
	}
	f.r = startEngineRouter(t, ctx, ns.URL(), pool, stream.Name, bucket.Name, insts, 0)
	for _, n := range f.nodes {
		n.startBridge()
	}
	for _, n := range f.nodes {
		f.r.waitLive(n.id, 20*time.Second)
	}
	return f
}

// startEngineRouter runs the router's events pipeline and data plane for
// one kv_aware pool (blockSize 0: learned from events).
func startEngineRouter(t *testing.T, ctx context.Context, natsURL, pool, stream, bucket string, insts []config.InstanceConfig, blockSize int) *kvrRouter {
	routing := config.RoutingConfig{Strategy: config.StrategyKVAware}
	if blockSize > 0 {
		routing.KV = &config.KVScoringConfig{BlockSize: blockSize}
	}
	cfg := config.Config{
		AdminToken: "adm",
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: natsURL, Stream: stream}, Bucket: bucket,
			StaleAfter: 2 * time.Second, PurgeAfter: 30 * time.Second},
		Pools: []config.PoolConfig{{Name: pool, Model: engModel, Routing: routing,
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: insts}},
	}
	kve, srv := newKVRouter(t, ctx, cfg, kvstate.Options{Logger: quietLogger(), SnapshotTimeout: 300 * time.Millisecond}, prometheus.NewRegistry())
	testenv.Go(t, ctx, srv.Run)
	r := serveKVR(t, kve, srv, pool)
	if err := kve.WaitReady(testenv.Context(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	return r
}

// gpuBlocks is what the index says inst holds of ids on GPU.
func (f *engineFleet) gpuBlocks(ids []uint32, inst string) int {
	for _, m := range f.r.lookup(ids).Matches {
		if m.Instance == inst {
			return m.GPUBlocks
		}
	}
	return 0
}

// route sends ids through the router and returns the pick, the reason,
// the matched tokens the router predicted and the tokens the engine
// reported cached.
func (f *engineFleet) route(ids []uint32) (inst, reason string, matched, cached int) {
	f.t.Helper()
	resp := f.r.do("POST", "/v1/completions", map[string]any{"model": engModel, "prompt": ids, "max_tokens": 1})
	b := resp.Body
	if resp.Status != 200 {
		f.t.Fatalf("completion: %d %s", resp.Status, b)
	}
	var out struct {
		Usage routertest.Usage `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		f.t.Fatalf("completion body %s: %v", b, err)
	}
	// "gpu=128,cpu=0,disk=0,shared=0": every tier's tokens beyond the faster ones.
	for _, part := range strings.Split(resp.Header.Get(router.HeaderMatchedTokens), ",") {
		if _, v, ok := strings.Cut(part, "="); ok {
			n, _ := strconv.Atoi(v)
			matched += n
		}
	}
	return resp.Header.Get(router.HeaderInstance), resp.Header.Get(router.HeaderReason), matched, out.Usage.Details.Cached
}

func engTokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(1000*seed + 7*i + 3)
	}
	return out
}

func TestE2EEngineSources(t *testing.T) {
	for _, format := range []string{simserver.FormatSGLang, simserver.FormatTRTLLM} {
		t.Run(format, func(t *testing.T) {
			f := newEngineFleet(t, format, format)
			a, other := f.nodes[0], f.nodes[1]
			prompt := engTokens(1, 8*16+5) // 8 full blocks
			a.completeDirect(prompt)
			testenv.WaitFor(t, 20*time.Second, "the index holds the prompt on "+a.id, func() bool { return f.gpuBlocks(prompt, a.id) == 8 })
			if n := f.gpuBlocks(prompt, other.id); n != 0 {
				t.Fatalf("%s holds %d blocks it never computed", other.id, n)
			}
			inst, reason, matched, cached := f.route(prompt)
			if inst != a.id || reason != string(router.ReasonKVMatch) || matched != 8*16 || cached != matched {
				t.Fatalf("repeated prompt: %s %s, matched %d, engine cached %d; want %s kv_match, 128 and 128", inst, reason, matched, cached, a.id)
			}

			// Evictions: other prompts through a's 40-block cache push the
			// first one out; the index follows.
			for s := 2; s < 9; s++ {
				a.completeDirect(engTokens(s, 8*16+5))
			}
			testenv.WaitFor(t, 20*time.Second, "the evicted prompt gone from the index", func() bool { return f.gpuBlocks(prompt, a.id) < 8 })

			// A restarted engine: nothing of the old process stays.
			last := engTokens(8, 8*16+5)
			testenv.WaitFor(t, 20*time.Second, "the last prompt indexed", func() bool { return f.gpuBlocks(last, a.id) == 8 })
			a.stop()
			a.start()
			testenv.WaitFor(t, 20*time.Second, "the restarted engine's blocks cleared", func() bool { return f.gpuBlocks(last, a.id) == 0 })
			a.completeDirect(prompt)
			testenv.WaitFor(t, 20*time.Second, "the new process's blocks indexed", func() bool { return f.gpuBlocks(prompt, a.id) == 8 })
		})
	}
}

// A pool of one vLLM and one SGLang engine of the same model: the router
// matches prompts on both.
func TestE2EMixedVLLMSGLangPool(t *testing.T) {
	f := newEngineFleet(t, simserver.FormatVLLM, simserver.FormatSGLang)
	v, s := f.nodes[0], f.nodes[1]
	pv, ps := engTokens(21, 6*16+1), engTokens(22, 5*16+9)
	v.completeDirect(pv)
	s.completeDirect(ps)
	testenv.WaitFor(t, 20*time.Second, "both engines indexed", func() bool { return f.gpuBlocks(pv, v.id) == 6 && f.gpuBlocks(ps, s.id) == 5 })
	for _, c := range []struct {
		ids    []uint32
		inst   string
		blocks int
	}{{pv, v.id, 6}, {ps, s.id, 5}} {
		inst, reason, matched, cached := f.route(c.ids)
		if inst != c.inst || reason != string(router.ReasonKVMatch) || matched != 16*c.blocks || cached != matched {
			t.Errorf("prompt of %s: routed %s %s, matched %d, engine cached %d", c.inst, inst, reason, matched, cached)
		}
	}
}

// LMCache through vLLM's publisher: 16-token GPU blocks, 64-token CPU
// chunks with tokens and parents, and never a removal for the chunks. The
// real bridge ages the CPU tier out (--age-out cpu=…); the router scores a
// chunk only whole (llm-d-router#2889) and drops it once aged.
func TestE2EStoresOnlyLMCache(t *testing.T) {
	sc := newEngineScene(t, 2*time.Minute)
	ctx, ns, pool, stream, bucket := sc.ctx, sc.ns, sc.pool, sc.stream, sc.bucket
	eng, pc := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{FirstSeq: 1})
	publish := func(evs ...events.Event) {
		t.Helper()
		eventstest.Publish(t, eng, events.Batch{TS: 1, Events: evs, HasDPRank: true})
	}
	const inst = "lmc-0"
	r := startEngineRouter(t, ctx, ns.URL(), pool, stream.Name, bucket.Name,
		[]config.InstanceConfig{{ID: inst, URL: "http://127.0.0.1:1"}}, 16)

	nc := testenv.Connect(t, ns.URL(), nats.MaxReconnects(-1))
	const lifetime = 2 * time.Second
	br, _ := runBridge(t, ctx, bridge.Config{
		Pool: pool, Model: engModel, Conn: nc, Stream: stream, Bucket: bucket,
		Sources:           []bridge.Source{{Instance: inst, Endpoint: pc.Endpoint, ReplayEndpoint: pc.ReplayEndpoint, FirstSeq: pc.FirstSeq}},
		HeartbeatInterval: 200 * time.Millisecond, SnapshotInterval: 300 * time.Millisecond,
		EngineProbeInterval: -1, ReplayTimeout: 2 * time.Second, PublishTimeout: 2 * time.Second,
		AgeOut: map[tiers.Tier]time.Duration{tiers.CPU: lifetime},
	})
	testenv.WaitFor(t, 20*time.Second, "bridge subscribed", eng.Subscribed)

	ids := engTokens(31, 8*16) // two 64-token chunks
	gpu := events.Event{Kind: events.BlockStored, BlockHashes: []uint64{1, 2, 3, 4, 5, 6, 7, 8}, TokenIDs: ids, BlockSize: 16, Medium: "GPU"}
	chunk0 := events.Event{Kind: events.BlockStored, BlockHashes: []uint64{9001}, TokenIDs: ids[:64], BlockSize: 64, Medium: "cpu"}
	chunk1 := events.Event{Kind: events.BlockStored, BlockHashes: []uint64{9002}, ParentHash: 9001, HasParent: true, TokenIDs: ids[64:], BlockSize: 64, Medium: "cpu"}
	publish(gpu, chunk0, chunk1)
	// The GPU copy goes (vLLM evicts it); the chunks stay in LMCache.
	publish(events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{1, 2, 3, 4, 5, 6, 7, 8}, Medium: "GPU"})
	match := func(q []uint32) admin.KVLookupMatch {
		for _, m := range r.lookup(q).Matches {
			if m.Instance == inst {
				return m
			}
		}
		return admin.KVLookupMatch{}
	}
	// While waiting, the chunks are stored again now and then (LMCache
	// re-puts what it keeps): a loaded machine can take longer than the
	// 2 s lifetime to show them, and re-stores are what keep them alive.
	refreshed := time.Now()
	testenv.WaitFor(t, 10*time.Second, "both chunks on CPU", func() bool {
		m := match(ids)
		if m.GPUBlocks == 0 && m.CPUBlocks == 8 {
			return true
		}
		if time.Since(refreshed) > lifetime/4 {
			publish(chunk0, chunk1)
			refreshed = time.Now()
		}
		return false
	})
	// A prompt sharing 6 blocks (a chunk and a half) is credited one chunk.
	if m := match(ids[:6*16]); m.CPUBlocks != 4 || m.GPUBlocks != 0 {
		t.Fatalf("a chunk and a half: %+v, want 4 CPU blocks (one whole chunk)", m)
	}
	// Re-storing chunk 0 keeps it; chunk 1, never stored again, ages out.
	time.Sleep(lifetime / 2)
	publish(chunk0)
	refreshed = time.Now()
	testenv.WaitFor(t, 10*time.Second, "chunk 1 aged out, chunk 0 kept", func() bool {
		m := match(ids)
		if m.CPUBlocks == 4 {
			return true
		}
		if time.Since(refreshed) > lifetime/4 {
			publish(chunk0) // kept alive however long chunk 1 takes to go
			refreshed = time.Now()
		}
		return false
	})
	if st := br.Stats()[0]; st.Aged != 1 {
		t.Fatalf("bridge aged %d blocks, want 1 (the one engine block of chunk 1)", st.Aged)
	}
	testenv.WaitFor(t, 10*time.Second, "chunk 0 aged out too", func() bool { return match(ids).CPUBlocks == 0 })
}

// SGLang under attention DP: each rank publishes on port + rank
// (offset_endpoint_port) and is its own instance. The index holds, per
// rank, exactly the blocks that rank's cache holds — never another's. A
// rank that never publishes (sgl-project/sglang#16030: only tp_rank 0
// emitted) stays empty rather than being credited with rank 0's blocks.
func TestE2ESGLangAttentionDPRanks(t *testing.T) {
	sc := newEngineScene(t, 2*time.Minute)
	ctx, ns, pool, stream, bucket := sc.ctx, sc.ns, sc.pool, sc.stream, sc.bucket
	pubBase, replayBase := testenv.FreePorts(t, 3), testenv.FreePorts(t, 3)
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	s, err := simserver.Start(ctx, simserver.Config{
		Engine:           sim.Config{Model: engModel, GPUBlocks: 200, HashSeed: 5},
		Listen:           addr,
		DataParallelSize: 2,
		TimeScale:        20,
		Logger:           quietLogger(),
		Events: simserver.EventsConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubBase),
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayBase), Format: simserver.FormatSGLang},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	url := "http://" + addr
	// Three ranks configured, two publish: rank 2 is the silent one.
	var insts []config.InstanceConfig
	var srcs []bridge.Source
	for rk := 0; rk < 3; rk++ {
		id := fmt.Sprintf("sg-dp%d", rk)
		insts = append(insts, config.InstanceConfig{ID: id, URL: fmt.Sprintf("http://127.0.0.1:%d", testenv.FreePort(t))})
		srcs = append(srcs, bridge.Source{Instance: id, Rank: rk, Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubBase+rk),
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayBase+rk), FirstSeq: simserver.FirstSeq})
	}
	r := startEngineRouter(t, ctx, ns.URL(), pool, stream.Name, bucket.Name, insts, 0)
	nc := testenv.Connect(t, ns.URL(), nats.MaxReconnects(-1))
	runBridge(t, ctx, bridge.Config{Pool: pool, Model: engModel, Conn: nc, Stream: stream, Bucket: bucket, Sources: srcs,
		HeartbeatInterval: 200 * time.Millisecond, SnapshotInterval: 300 * time.Millisecond, EngineProbeInterval: -1,
		ReplayTimeout: time.Second, PublishTimeout: 2 * time.Second})
	testenv.WaitFor(t, 20*time.Second, "both ranks subscribed", s.EventsSubscribed)

	// Concurrent prompts spread over both ranks (the server sends each to
	// the rank with the least work); rounds until both got some, so a
	// loaded machine that serialises one round cannot fail the test.
	held := func(rk int) int {
		n := 0
		s.Engine(rk, func(e *sim.Engine) { g, _ := e.CachedBlocks(); n = len(g) })
		return n
	}
	prompts := 0
	for round := 0; round < 20 && (prompts == 0 || held(0) == 0 || held(1) == 0); round++ {
		var wg sync.WaitGroup
		for p := prompts; p < prompts+8; p++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				body := fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":32}`, engModel, mustJSON(engTokens(40+p, 4*16+3)))
				resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}()
		}
		wg.Wait()
		prompts += 8
	}
	indexed := func(id string) int {
		for _, v := range r.instances().Instances {
			if v.Instance == id {
				return v.Blocks["gpu"]
			}
		}
		return -1
	}
	if held(0) == 0 || held(1) == 0 {
		t.Fatalf("ranks hold %d and %d blocks: the prompts did not reach both", held(0), held(1))
	}
	testenv.WaitFor(t, 20*time.Second, "each rank's blocks under its own instance", func() bool {
		return indexed("sg-dp0") == held(0) && indexed("sg-dp1") == held(1)
	})
	if n := indexed("sg-dp2"); n > 0 {
		t.Fatalf("the silent rank is credited with %d blocks", n)
	}
	// No prompt is credited to two ranks.
	for p := 0; p < prompts; p++ {
		ids := engTokens(40+p, 4*16+3)
		var on []string
		for _, m := range r.lookup(ids).Matches {
			if m.GPUBlocks > 0 {
				on = append(on, m.Instance)
			}
		}
		if len(on) > 1 {
			t.Errorf("prompt %d indexed on %v, want one rank at most (evicted: none)", p, on)
		}
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
