package httpapi_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"

	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
)

// TestKVAwareOverNATS is the whole exact path with real parts: vLLM-encoded
// KV event batches published on kv.events.<pool>.<instance> into a real
// (embedded) NATS JetStream, the events consumer applying them to a memory
// index, and the router's kv_aware strategy following them over HTTP. When
// NATS goes down the pool falls back to prefix_aware (stream_down), and
// exact routing resumes when it is back.
func TestKVAwareOverNATS(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	name := testenv.UniqueName(t)
	pool := "pool_" + name
	ns := testenv.StartNATS(t)
	nc, err := nats.Connect(ns.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(consumer.Config{
		Conn: nc, Pool: pool, Applier: idx,
		Stream: kvstream.StreamConfig{Name: "EV_" + name}, Bucket: kvstream.BucketConfig{Name: "SN_" + name},
		SnapshotTimeout: 200 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(cctx) }()
	t.Cleanup(func() { cancel(); <-done })
	waitUntil(t, "consumer healthy", c.Healthy)

	// Three instances; they answer like vLLM, their caches are played by
	// the events below.
	pc := config.PoolConfig{Name: pool, Model: kvModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
		Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range 3 {
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`))
		}))
		t.Cleanup(up.Close)
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("vllm-%d", i), URL: up.URL})
	}
	srv, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{
		Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
			return idx, kvindex.FreshnessFuncs{Healthy: c.Healthy, IsStale: func(id string) bool { return !c.Live(id) }}
		}),
	})
	h := &kvHTTP{t: t, srv: srv, ts: ts}

	prompt := routertest.Prompt(77, 48*kvBS+3)
	resp, _ := h.complete(prompt, false)
	home := resp.Header.Get(router.HeaderInstance)
	if r := resp.Header.Get(router.HeaderReason); r != string(router.ReasonHeuristic) {
		t.Fatalf("before any event: reason %q", r)
	}
	holder := "vllm-0"
	if holder == home {
		holder = "vllm-1"
	}

	// The holder's engine reports the prefix stored (as kvbridge
	// publishes it: the engine's msgpack batch, unchanged, with headers).
	keys := kvindex.Keys(kvindex.Root(kvModel, "", ""), prompt, kvBS)
	ev := events.Event{Kind: events.BlockStored, BlockSize: kvBS, Medium: "GPU", TokenIDs: prompt[:len(keys)*kvBS]}
	for i := range keys {
		ev.BlockHashes = append(ev.BlockHashes, uint64(1000+i))
	}
	payload, err := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{ev}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	subj, err := kvstream.EventsSubject(pool, holder)
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	hdr := kvstream.EventHeaders{Seq: 1, HasSeq: true, Encoding: "array", Pool: pool, Instance: holder, Model: kvModel}.Header()
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: subj, Data: payload, Header: hdr}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the holder's blocks in the index", func() bool {
		ms, _ := idx.Lookup(ctx, keys)
		return len(ms) == 1 && ms[0].Instance == holder && ms[0].Blocks[0] == len(keys)
	})
	// Wait out the first request's speculative entries (default 2 s) by
	// checking the decision, not the clock.
	waitUntil(t, "exact routing to the holder", func() bool {
		resp, _ := h.complete(prompt, false)
		return resp.Header.Get(router.HeaderInstance) == holder && resp.Header.Get(router.HeaderReason) == string(router.ReasonKVMatch)
	})
	resp, _ = h.complete(prompt, false)
	if got, want := resp.Header.Get(router.HeaderMatchedTokens), "gpu="+strconv.Itoa(len(keys)*kvBS)+",cpu=0,disk=0,shared=0"; got != want {
		t.Errorf("matched %q, want %q", got, want)
	}

	// NATS goes away: the index may now be arbitrarily stale.
	ns.Shutdown()
	ns.WaitForShutdown()
	waitUntil(t, "consumer unhealthy", func() bool { return !c.Healthy() })
	resp, _ = h.complete(prompt, false)
	if r := resp.Header.Get(router.HeaderReason); r != string(router.ReasonStreamDown) || resp.Header.Get(router.HeaderInstance) != home {
		t.Fatalf("stream down: routed to %s (%s), want the hash-home %s (stream_down)", resp.Header.Get(router.HeaderInstance), r, home)
	}

	// NATS is back: exact routing resumes.
	ns.Restart(t)
	waitUntil(t, "consumer healthy again", c.Healthy)
	resp, _ = h.complete(prompt, false)
	if resp.Header.Get(router.HeaderInstance) != holder || resp.Header.Get(router.HeaderReason) != string(router.ReasonKVMatch) {
		t.Fatalf("after recovery: %s (%s)", resp.Header.Get(router.HeaderInstance), resp.Header.Get(router.HeaderReason))
	}
	body := testenv.Do(t, "GET", ts.URL+"/metrics", nil, nil).Body
	for _, want := range []string{
		fmt.Sprintf(`kvrouter_kv_stream_transitions_total{pool=%q,state="down"} 1`, pool),
		fmt.Sprintf(`kvrouter_kv_stream_transitions_total{pool=%q,state="up"} 1`, pool),
		fmt.Sprintf(`kvrouter_kv_stream_healthy{pool=%q} 1`, pool),
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// waitUntil waits out what a real NATS server and consumer take.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	servertest.WaitWithin(t, 30*time.Second, what, cond)
}
