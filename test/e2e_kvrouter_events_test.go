package test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

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
	"github.com/kvrouter/kvrouter/router/fleet"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvstate"
)

const kvrModel = "kvr-model"

// kvrEngine is one engine's KV-event side: a vLLM-format ZMQ publisher
// (PUB + replay) and a kvbridge forwarding it to NATS.
type kvrEngine struct {
	pub  *enginezmq.Publisher
	stop func() // stops the bridge and waits for it
}

func startKVREngine(t *testing.T, ctx context.Context, natsURL, pool, instance, url, stream, bucket string) *kvrEngine {
	t.Helper()
	pub, pc := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{}) // closed after the bridge and its connection (cleanups run last first)
	nc := testenv.Connect(t, natsURL, reconnectForever...)
	_, stop := runBridge(t, ctx, bridge.Config{Pool: pool, Model: kvrModel, BlockSize: 16, Conn: nc,
		Sources: []bridge.Source{{Instance: instance, Endpoint: pc.Endpoint, ReplayEndpoint: pc.ReplayEndpoint, URL: url}},
		Stream:  kvstream.StreamConfig{Name: stream}, Bucket: kvstream.BucketConfig{Name: bucket},
		HeartbeatInterval: 200 * time.Millisecond})
	e := &kvrEngine{pub: pub, stop: stop}
	testenv.WaitFor(t, 15*time.Second, "the bridge subscribed to the engine", pub.Subscribed)
	return e
}

func (e *kvrEngine) close() { e.stop() }

// kvrScene is how the Redis-index and restart tests open: an engineScene
// (a context, names unique to the test, an embedded NATS server) and a
// config of one kv_aware pool (model kvrModel, health checks and discovery
// off) holding one instance, vllm-0, whose events go through that server.
type kvrScene struct {
	engineScene
	cfg config.Config
}

func newKVRScene(t *testing.T) *kvrScene {
	t.Helper()
	sc := &kvrScene{engineScene: newEngineScene(t, 2*time.Minute)}
	sc.cfg = config.Config{
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: sc.ns.URL(), Stream: sc.stream.Name}, Bucket: sc.bucket.Name},
		Pools: []config.PoolConfig{{Name: sc.pool, Model: kvrModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: "http://127.0.0.1:1"}}}},
	}
	return sc
}

// engine starts vllm-0's engine side: its publisher and its bridge.
func (sc *kvrScene) engine(t *testing.T) *kvrEngine {
	t.Helper()
	return startKVREngine(t, sc.ctx, sc.ns.URL(), sc.pool, "vllm-0", "http://127.0.0.1:1", sc.stream.Name, sc.bucket.Name)
}

// publish sends one vLLM batch (array encoding, as the engine does).
func (e *kvrEngine) publish(t *testing.T, evs ...events.Event) {
	t.Helper()
	eventstest.Publish(t, e.pub, events.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Events: evs})
}

// offload publishes what vLLM with CPU offloading sends for a prompt of n
// 16-token blocks (hashes from, from+1, ...; tokens ids): the blocks stored
// on the GPU, then its last cpu blocks stored on the CPU and removed from
// the GPU, in one batch.
func (e *kvrEngine) offload(t *testing.T, ids []uint32, from, n, cpu int) {
	t.Helper()
	e.publish(t, events.Event{Kind: events.BlockStored, BlockHashes: kvrHashes(from, n), TokenIDs: ids[:n*16], BlockSize: 16, Medium: "GPU"})
	moved := kvrHashes(from+n-cpu, cpu)
	e.publish(t,
		events.Event{Kind: events.BlockStored, BlockHashes: moved, Medium: "CPU"},
		events.Event{Kind: events.BlockRemoved, BlockHashes: moved, Medium: "GPU"})
}

func kvrTokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(seed*100003 + i*7 + 1)
	}
	return out
}

func kvrHashes(from, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(from + i)
	}
	return out
}

// kvrRouter is kvrouter wired as cmd/kvrouter wires it: the KV events
// pipeline (consumer per pool, index, accounting) behind the router's
// data plane and admin API.
type kvrRouter struct {
	t    *testing.T
	kve  *kvstate.Pipeline
	srv  *httpapi.Server
	ts   *httptest.Server
	pool string
}

// serveKVR serves srv on a test listener for the test's lifetime: the
// kvrRouter the tests drive.
func serveKVR(t *testing.T, kve *kvstate.Pipeline, srv *httpapi.Server, pool string) *kvrRouter {
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return &kvrRouter{t: t, kve: kve, srv: srv, ts: ts, pool: pool}
}

func (r *kvrRouter) do(method, path string, body any) testenv.Result {
	r.t.Helper()
	var b []byte
	if body != nil {
		b, _ = json.Marshal(body)
	}
	return testenv.Do(r.t, method, r.ts.URL+path, b, map[string]string{"Authorization": "Bearer adm"})
}

// adminJSON sends an admin API request and decodes its answer, which must
// be a 200, into out.
func (r *kvrRouter) adminJSON(method, path string, body, out any) {
	r.t.Helper()
	resp := r.do(method, path, body)
	if resp.Status != 200 {
		r.t.Fatalf("%s %s: %d %s", method, path, resp.Status, resp.Body)
	}
	if err := json.Unmarshal(resp.Body, out); err != nil {
		r.t.Fatal(err)
	}
}

func (r *kvrRouter) lookup(ids []uint32) (out admin.KVLookupResponse) {
	r.t.Helper()
	r.adminJSON("POST", "/admin/pools/"+r.pool+"/lookup", map[string]any{"token_ids": ids}, &out)
	return out
}

func (r *kvrRouter) instances() (out admin.KVInstancesResponse) {
	r.t.Helper()
	r.adminJSON("GET", "/admin/pools/"+r.pool+"/instances", nil, &out)
	return out
}

// waitLive waits until the admin API lists instance id as live: its
// bridge's heartbeats reach the router.
func (r *kvrRouter) waitLive(id string, within time.Duration) {
	r.t.Helper()
	testenv.WaitFor(r.t, within, id+" live", func() bool {
		for _, in := range r.instances().Instances {
			if in.Instance == id {
				return in.State == "live"
			}
		}
		return false
	})
}

// complete routes a /v1/completions request with token ids.
func (r *kvrRouter) complete(ids []uint32) (instance, reason string) {
	r.t.Helper()
	resp := r.do("POST", "/v1/completions", map[string]any{"model": kvrModel, "prompt": ids, "max_tokens": 1})
	if resp.Status != 200 {
		r.t.Fatalf("completion: %d %s", resp.Status, resp.Body)
	}
	return resp.Header.Get(router.HeaderInstance), resp.Header.Get(router.HeaderReason)
}

func (r *kvrRouter) metrics() string {
	return string(r.do("GET", "/metrics", nil).Body)
}

// sseReader reads an event stream line by line in the background.
type sseReader struct {
	lines  chan string
	cancel context.CancelFunc
	done   chan struct{}
}

func openEvictions(t *testing.T, ctx context.Context, url string) *sseReader {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	req.Header.Set("Authorization", "Bearer adm")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		cancel()
		t.Fatalf("evictions: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	s := &sseReader{lines: make(chan string, 1024), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer close(s.lines)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
	}()
	return s
}

// next returns the next line with the prefix, or fails after d.
func (s *sseReader) next(t *testing.T, prefix string, d time.Duration) string {
	t.Helper()
	deadline := time.After(d)
	for {
		select {
		case l, ok := <-s.lines:
			if !ok {
				t.Fatalf("event stream ended before a %q line", prefix)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-deadline:
			t.Fatalf("no %q line within %v", prefix, d)
		}
	}
}

// TestKVRouterEventsEndToEnd: an engine's vLLM-format ZMQ events → kvbridge
// → NATS JetStream → kvrouter's consumer and index, seen through the admin
// lookup and instances endpoints, the eviction SSE stream, the tier
// metrics, exact routing, heartbeat discovery, and the fallback while NATS
// is down.
func TestKVRouterEventsEndToEnd(t *testing.T) {
	ctx := testenv.Context(t, 3*time.Minute)
	name := testenv.UniqueName(t)
	pool := "p_" + name
	stream, bucket := "EV_"+name, "SN_"+name
	ns := testenv.StartNATS(t)

	var ups []*httptest.Server
	for range 3 {
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":1}}`)
		}))
		t.Cleanup(up.Close)
		ups = append(ups, up)
	}
	cfg := config.Config{
		AdminToken: "adm",
		Events: &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: stream}, Bucket: bucket,
			StaleAfter: time.Second, PurgeAfter: 3 * time.Second},
		Pools: []config.PoolConfig{{Name: pool, Model: kvrModel,
			Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
			Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: ups[0].URL}, {ID: "vllm-1", URL: ups[1].URL}}}},
	}
	if !config.KVEventsWanted(cfg) {
		t.Fatal("a kv_aware pool does not want KV events")
	}
	kve, srv := newKVRouter(t, ctx, cfg, kvstate.Options{Logger: quietLogger(), SnapshotTimeout: 300 * time.Millisecond}, prometheus.NewRegistry())
	testenv.Go(t, ctx, srv.Run)
	testenv.Go(t, ctx, fleet.New(srv, kve, cfg, 100*time.Millisecond, quietLogger()).Run)
	r := serveKVR(t, kve, srv, pool)
	if err := kve.WaitReady(testenv.Context(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}

	eng := startKVREngine(t, ctx, ns.URL(), pool, "vllm-1", ups[1].URL, stream, bucket)
	r.waitLive("vllm-1", 15*time.Second)
	// A pool the router does not serve is a 404, not an empty stream.
	if resp := r.do("GET", "/v1/kv/evictions?pool=no-such-pool", nil); resp.Status != http.StatusNotFound || !strings.Contains(string(resp.Body), `unknown pool "no-such-pool"`) {
		t.Fatalf("evictions of an unknown pool: %d %q, want 404", resp.Status, resp.Body)
	}
	// A client that leaves: its NATS subscription goes with it.
	base := kve.Conn().NumSubscriptions()
	gone := openEvictions(t, ctx, r.ts.URL+"/v1/kv/evictions?pool="+pool)
	gone.next(t, ": kv evictions", 10*time.Second)
	if n := kve.Conn().NumSubscriptions(); n != base+1 {
		t.Fatalf("subscriptions with a client: %d, want %d", n, base+1)
	}
	gone.cancel()
	<-gone.done
	testenv.WaitFor(t, 10*time.Second, "the left client's subscription dropped", func() bool { return kve.Conn().NumSubscriptions() == base })

	sse := openEvictions(t, ctx, r.ts.URL+"/v1/kv/evictions?pool="+pool+"&instance=vllm-1&tier=gpu")
	defer sse.cancel()

	// Four blocks stored on GPU; the last two offloaded to CPU, then
	// evicted from GPU: GPU holds 2 leading blocks, CPU 2 more.
	ids := kvrTokens(1, 4*16+5)
	eng.offload(t, ids, 1000, 4, 2)
	want := admin.KVLookupMatch{Instance: "vllm-1", GPUBlocks: 2, CPUBlocks: 2, Live: true}
	testenv.WaitFor(t, 15*time.Second, "lookup sees GPU and CPU blocks", func() bool {
		lr := r.lookup(ids)
		return len(lr.Matches) == 1 && lr.Matches[0] == want && lr.BlockSize == 16 && lr.Blocks == 4
	})

	// The GPU eviction reached the SSE stream as a record.
	line := sse.next(t, "data: ", 10*time.Second)
	var rec kvstream.EvictionRecord
	if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &rec); err != nil {
		t.Fatalf("eviction record %q: %v", line, err)
	}
	if rec.Pool != pool || rec.Instance != "vllm-1" || rec.Tier != "gpu" || rec.Blocks != 2 || rec.Reason != kvstream.ReasonEvicted {
		t.Fatalf("eviction record %+v", rec)
	}

	// Instances view: blocks per tier from the index, state and seq from
	// the consumer, membership from the pool.
	var v1 admin.KVInstanceView
	iv := r.instances()
	for _, in := range iv.Instances {
		if in.Instance == "vllm-1" {
			v1 = in
		}
	}
	if !iv.StreamHealthy || v1.State != "live" || !v1.InPool || !v1.Configured || v1.Blocks["gpu"] != 2 || v1.Blocks["cpu"] != 2 || v1.LastEvent.IsZero() || v1.StreamSeq == 0 {
		t.Fatalf("instances view: %+v", iv)
	}
	// Tier accounting and the consumer's metrics on the router's registry
	// (the consumer's instance gauge is sampled once a second).
	testenv.WaitFor(t, 5*time.Second, "the consumer's instance gauge", func() bool {
		return strings.Contains(r.metrics(), fmt.Sprintf(`kvrouter_events_instances{pool=%q,state="live"} 1`, pool))
	})
	m := r.metrics()
	for _, s := range []string{
		`kvrouter_tier_blocks{instance="vllm-1",tier="gpu"} 2`,
		`kvrouter_tier_blocks{instance="vllm-1",tier="cpu"} 2`,
		`kvrouter_tier_blocks_stored_total{instance="vllm-1",tier="gpu"} 4`,
		`kvrouter_tier_blocks_evicted_total{instance="vllm-1",tier="gpu"} 2`,
		fmt.Sprintf(`kvrouter_events_instances{pool=%q,state="live"}`, pool),
		fmt.Sprintf(`kvrouter_events_instance_state{instance="vllm-1",pool=%q,state="live"} 1`, pool),
		fmt.Sprintf(`kvrouter_events_instance_state{instance="vllm-1",pool=%q,state="stale"} 0`, pool),
		fmt.Sprintf(`kvrouter_events_stream_healthy{pool=%q} 1`, pool),
		`kvrouter_events_instance_last_event_age_seconds{instance="vllm-1"`,
	} {
		if !strings.Contains(m, s) {
			t.Errorf("metrics lack %s", s)
		}
	}

	// Exact routing follows the index (after the first request's
	// speculative entries on the hash-home expire).
	testenv.WaitFor(t, 30*time.Second, "kv_match to vllm-1", func() bool {
		in, reason := r.complete(ids)
		return in == "vllm-1" && reason == string(router.ReasonKVMatch)
	})

	// NATS down: the stream is unhealthy and the pool routes
	// heuristically; back up: exact again.
	ns.Shutdown()
	ns.WaitForShutdown()
	testenv.WaitFor(t, 20*time.Second, "stream unhealthy", func() bool { return !r.instances().StreamHealthy })
	if m := r.metrics(); !strings.Contains(m, fmt.Sprintf(`kvrouter_events_stream_healthy{pool=%q} 0`, pool)) {
		t.Error("kvrouter_events_stream_healthy not 0 while NATS is down")
	}
	if _, reason := r.complete(ids); reason != string(router.ReasonStreamDown) {
		t.Fatalf("NATS down: reason %q, want %s", reason, router.ReasonStreamDown)
	}
	ns = ns.Restart(t)
	testenv.WaitFor(t, 30*time.Second, "exact routing after NATS is back", func() bool {
		in, reason := r.complete(ids)
		return in == "vllm-1" && reason == string(router.ReasonKVMatch)
	})

	// Removal: everything leaves the index.
	eng.publish(t,
		events.Event{Kind: events.BlockRemoved, BlockHashes: kvrHashes(1000, 2), Medium: "GPU"},
		events.Event{Kind: events.BlockRemoved, BlockHashes: kvrHashes(1002, 2), Medium: "CPU"})
	testenv.WaitFor(t, 15*time.Second, "lookup sees the removal", func() bool { return len(r.lookup(ids).Matches) == 0 })
	if m := r.metrics(); !strings.Contains(m, `kvrouter_tier_blocks{instance="vllm-1",tier="gpu"} 0`) || !strings.Contains(m, `kvrouter_tier_blocks{instance="vllm-1",tier="cpu"} 0`) {
		t.Error("tier gauges not back to 0 after the removal")
	}

	// Heartbeat discovery: a bridge for an instance not in the file joins
	// the pool; when it goes silent it turns stale, then is purged and
	// leaves the pool.
	eng2 := startKVREngine(t, ctx, ns.URL(), pool, "vllm-2", ups[2].URL, stream, bucket)
	inPool := func(id string) bool {
		p, _ := srv.Pool(pool)
		for _, in := range p.Instances() {
			if in.ID() == id {
				return true
			}
		}
		return false
	}
	testenv.WaitFor(t, 15*time.Second, "vllm-2 discovered", func() bool { return inPool("vllm-2") })
	for _, in := range r.instances().Instances {
		if in.Instance == "vllm-2" && (in.Configured || !in.InPool || in.URL != ups[2].URL) {
			t.Fatalf("discovered instance view %+v", in)
		}
	}
	// A bridge naming a configured engine (same URL) differently adds no
	// second candidate for it.
	alias := startKVREngine(t, ctx, ns.URL(), pool, "alias-of-0", ups[0].URL, stream, bucket)
	r.waitLive("alias-of-0", 15*time.Second) // its heartbeat arrived
	time.Sleep(300 * time.Millisecond)       // three discovery rounds
	if inPool("alias-of-0") {
		t.Fatal("a heartbeat with a configured instance's URL became a second candidate")
	}
	alias.close()
	eng2.close()
	testenv.WaitFor(t, 20*time.Second, "vllm-2 purged and out of the pool", func() bool { return !inPool("vllm-2") })
	if !inPool("vllm-0") || !inPool("vllm-1") {
		t.Fatal("configured instances left the pool")
	}

	// The SSE stream ends cleanly when the router stops streaming.
	kve.StopStreams()
	sse.next(t, "event: close", 10*time.Second)
	select {
	case <-sse.done:
	case <-time.After(10 * time.Second):
		t.Fatal("event stream not closed after the close event")
	}
}

// TestKVRouterEventsRedisIndex: with index.backend redis the pipeline feeds
// a Redis index (shared by router replicas: this router only keeps up with
// new events), and a second router's pipeline on the same Redis and NATS
// sees the same blocks.
func TestKVRouterEventsRedisIndex(t *testing.T) {
	sc := newKVRScene(t)
	ctx, pool, cfg := sc.ctx, sc.pool, sc.cfg
	cfg.Index = &config.IndexConfig{Backend: "redis", Redis: &config.RedisConfig{Addrs: []string{testenv.Redis(t)}, KeyPrefix: sc.name}}
	var routers []*kvrRouter
	for range 2 {
		kve, srv := newKVRouter(t, ctx, cfg, kvstate.Options{Logger: quietLogger()}, nil)
		if err := kve.WaitReady(testenv.Context(t, 20*time.Second)); err != nil {
			t.Fatal(err)
		}
		routers = append(routers, serveKVR(t, kve, srv, pool))
	}
	t.Cleanup(func() {
		// Only this test's keys: its own prefix.
		idx, _ := routers[0].kve.KV(cfg.Pools[0])
		_ = idx.Purge(context.Background(), "vllm-0")
	})
	eng := sc.engine(t)
	ids := kvrTokens(7, 3*16)
	eng.publish(t, events.Event{Kind: events.BlockStored, BlockHashes: kvrHashes(500, 3), TokenIDs: ids, BlockSize: 16, Medium: "GPU"})
	want := admin.KVLookupMatch{Instance: "vllm-0", GPUBlocks: 3, Live: true}
	for i, r := range routers {
		testenv.WaitFor(t, 15*time.Second, fmt.Sprintf("router %d sees the blocks in Redis", i), func() bool {
			lr := r.lookup(ids)
			return len(lr.Matches) == 1 && lr.Matches[0] == want
		})
	}
	eng.publish(t, events.Event{Kind: events.BlockRemoved, BlockHashes: kvrHashes(500, 3), Medium: "GPU"})
	for i, r := range routers {
		testenv.WaitFor(t, 15*time.Second, fmt.Sprintf("router %d sees the removal", i), func() bool { return len(r.lookup(ids).Matches) == 0 })
	}
}

// TestKVRouterRestartRebuildsIndex: a router restarted (a new pipeline on
// the same NATS) rebuilds its memory index from the bridges' snapshots and
// the stream, to what the first one held — GPU and CPU tiers alike.
func TestKVRouterRestartRebuildsIndex(t *testing.T) {
	sc := newKVRScene(t)
	ctx, pool, cfg := sc.ctx, sc.pool, sc.cfg
	start := func() *kvrRouter {
		kve, srv := newKVRouter(t, ctx, cfg, kvstate.Options{Logger: quietLogger(), SnapshotTimeout: 500 * time.Millisecond}, nil)
		return serveKVR(t, kve, srv, pool)
	}
	r1 := start()
	eng := sc.engine(t)
	ids := kvrTokens(9, 5*16)
	eng.offload(t, ids, 700, 5, 2)
	want := admin.KVLookupMatch{Instance: "vllm-0", GPUBlocks: 3, CPUBlocks: 2, Live: true}
	testenv.WaitFor(t, 15*time.Second, "the first router's index", func() bool {
		lr := r1.lookup(ids)
		return len(lr.Matches) == 1 && lr.Matches[0] == want
	})
	r1.kve.Close()

	r2 := start()
	testenv.WaitFor(t, 20*time.Second, "the restarted router's index", func() bool {
		lr := r2.lookup(ids)
		return len(lr.Matches) == 1 && lr.Matches[0] == want
	})
}
