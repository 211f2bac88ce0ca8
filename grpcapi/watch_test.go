package grpcapi_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// TestWatch streams a pool's events from a real NATS server, as the
// bridges publish them, through Events.Watch with each filter.
func TestWatch(t *testing.T) {
	nc := connectNATS(t)
	reg := prometheus.NewRegistry()
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.NATS, g.Registerer = nc, reg })
	pool := "kv" // the NATS server is this test's own

	tokens := routertest.Prompt(5, 2*bs)
	batchA := events.Batch{TS: 1700000000.5, Events: []events.Event{
		{Kind: events.BlockStored, BlockHashes: []uint64{11, 12}, BlockSize: bs, TokenIDs: tokens, Medium: "GPU"},
		{Kind: events.BlockStored, BlockHashes: []uint64{11}, Medium: "CPU"},
		{Kind: events.BlockRemoved, BlockHashes: []uint64{12}, Medium: "GPU"},
		{Kind: events.AllBlocksCleared},
	}}
	batchB := events.Batch{TS: 1700000001, Events: []events.Event{
		{Kind: events.BlockStored, BlockHashes: []uint64{21}, ParentHash: 20, HasParent: true, Medium: "CPU_PINNED", LoraName: "lora-b"},
	}}
	// batchC follows batchB in one coalesced message (a kvbridge with
	// --coalesce): sent as a message of its own, with its own seq.
	batchC := events.Batch{TS: 1700000002, Events: []events.Event{
		{Kind: events.BlockStored, BlockHashes: []uint64{31}, Medium: "GPU"},
	}}
	publish := func(inst string, seq uint64, bs ...events.Batch) {
		t.Helper()
		var payload []byte
		for _, b := range bs {
			p, err := events.Encode(nil, b, events.EncodingArray)
			if err != nil {
				t.Fatal(err)
			}
			payload = append(payload, p...)
		}
		subj, err := kvstream.EventsSubject(pool, inst)
		if err != nil {
			t.Fatal(err)
		}
		h := kvstream.EventHeaders{Seq: seq, HasSeq: true, Pool: pool, Instance: inst}
		if len(bs) > 1 {
			h.Batches = len(bs)
		}
		hd := h.Header()
		if err := nc.PublishMsg(&nats.Msg{Subject: subj, Data: payload, Header: hd}); err != nil {
			t.Fatal(err)
		}
	}
	// ev is an expected event, compact: instance/kind/tier/hashes/seq.
	ev := func(inst string, k kvrouterv1.EventKind, tier kvrouterv1.Tier, seq uint64, hashes ...uint64) string {
		return fmt.Sprintf("%s %v %v %v seq=%d", inst, k, tier, hashes, seq)
	}
	const (
		stored  = kvrouterv1.EventKind_EVENT_KIND_BLOCK_STORED
		removed = kvrouterv1.EventKind_EVENT_KIND_BLOCK_REMOVED
		cleared = kvrouterv1.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED
		gpu     = kvrouterv1.Tier_TIER_GPU
		cpu     = kvrouterv1.Tier_TIER_CPU
		none    = kvrouterv1.Tier_TIER_UNSPECIFIED
	)
	tests := []struct {
		name string
		req  *kvrouterv1.WatchRequest
		want []string
	}{
		{name: "everything", req: &kvrouterv1.WatchRequest{}, want: []string{
			ev("a", stored, gpu, 7, 11, 12), ev("a", stored, cpu, 7, 11), ev("a", removed, gpu, 7, 12), ev("a", cleared, none, 7),
			ev("b", stored, cpu, 9, 21), ev("b", stored, gpu, 10, 31)}},
		{name: "cpu tier (clears span every tier)", req: &kvrouterv1.WatchRequest{Tiers: []kvrouterv1.Tier{cpu}}, want: []string{
			ev("a", stored, cpu, 7, 11), ev("a", cleared, none, 7), ev("b", stored, cpu, 9, 21)}},
		{name: "one instance", req: &kvrouterv1.WatchRequest{Instance: "b"}, want: []string{ev("b", stored, cpu, 9, 21), ev("b", stored, gpu, 10, 31)}},
		{name: "removals", req: &kvrouterv1.WatchRequest{Kinds: []kvrouterv1.EventKind{removed}}, want: []string{ev("a", removed, gpu, 7, 12)}},
		{name: "gpu stores", req: &kvrouterv1.WatchRequest{Kinds: []kvrouterv1.EventKind{stored}, Tiers: []kvrouterv1.Tier{gpu}}, want: []string{ev("a", stored, gpu, 7, 11, 12), ev("b", stored, gpu, 10, 31)}},
	}
	type watch struct {
		got  chan *kvrouterv1.Event
		want []string
		name string
	}
	var watches []watch
	// No deadline: watch clients normally set none, and the server must not
	// need one (nats.go's FlushWithContext refuses a context without it).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, tc := range tests {
		tc.req.Pool = pool
		st, err := kvrouterv1.NewEventsClient(h.conn).Watch(ctx, tc.req)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Header(); err != nil { // the subscription is live
			t.Fatal(err)
		}
		w := watch{got: make(chan *kvrouterv1.Event, 100), want: tc.want, name: tc.name}
		go func() {
			defer close(w.got)
			for {
				e, err := st.Recv()
				if err != nil {
					return
				}
				w.got <- e
			}
		}()
		watches = append(watches, w)
	}
	publish("a", 7, batchA)
	if err := nc.Publish("kv.events."+pool+".a", []byte("not msgpack")); err != nil { // skipped, counted
		t.Fatal(err)
	}
	publish("b", 9, batchB, batchC)
	if err := nc.Publish("kv.events."+pool+"x.a", mustEncode(t, batchB)); err != nil { // another pool
		t.Fatal(err)
	}
	for _, w := range watches {
		var got []string
		var first *kvrouterv1.Event
		timeout := time.After(10 * time.Second)
		for len(got) < len(w.want) {
			select {
			case e, ok := <-w.got:
				if !ok {
					t.Fatalf("%s: stream ended after %v", w.name, got)
				}
				if first == nil {
					first = e
				}
				got = append(got, ev(e.Instance, e.Kind, e.Tier, e.Seq, e.BlockHashes...))
			case <-timeout:
				t.Fatalf("%s: got %v, want %v", w.name, got, w.want)
			}
		}
		select {
		case e := <-w.got:
			t.Errorf("%s: unexpected extra event %v", w.name, e)
		case <-time.After(100 * time.Millisecond):
		}
		if !slices.Equal(got, w.want) {
			t.Errorf("%s:\n got %v\nwant %v", w.name, got, w.want)
		}
		if first.Pool != pool || first.GetTime().AsTime().Unix() < 1700000000 || first.Dropped != 0 {
			t.Errorf("%s: first event %v: want pool, engine time, nothing dropped", w.name, first)
		}
	}
	cancel()

}

// connectNATS starts this test's own NATS server and connects to it.
func connectNATS(t *testing.T) *nats.Conn {
	t.Helper()
	ns := testenv.StartNATS(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func mustEncode(t *testing.T, b events.Batch) []byte {
	t.Helper()
	p, err := events.Encode(nil, b, events.EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestWatchBadRequests: Watch validates before subscribing.
func TestWatchBadRequests(t *testing.T) {
	nc := connectNATS(t)
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.NATS = nc })
	for _, tc := range []struct {
		name string
		req  *kvrouterv1.WatchRequest
		want codes.Code
	}{
		{"no pool", &kvrouterv1.WatchRequest{}, codes.InvalidArgument},
		{"wildcard pool", &kvrouterv1.WatchRequest{Pool: "p.>"}, codes.InvalidArgument},
		{"bad instance", &kvrouterv1.WatchRequest{Pool: "kv", Instance: "a b*"}, codes.InvalidArgument},
		{"unknown tier", &kvrouterv1.WatchRequest{Pool: "kv", Tiers: []kvrouterv1.Tier{42}}, codes.InvalidArgument},
		{"unspecified tier", &kvrouterv1.WatchRequest{Pool: "kv", Tiers: []kvrouterv1.Tier{kvrouterv1.Tier_TIER_UNSPECIFIED}}, codes.InvalidArgument},
		{"unknown kind", &kvrouterv1.WatchRequest{Pool: "kv", Kinds: []kvrouterv1.EventKind{9}}, codes.InvalidArgument},
		{"pool the router does not serve", &kvrouterv1.WatchRequest{Pool: "elsewhere"}, codes.NotFound},
	} {
		st, err := kvrouterv1.NewEventsClient(h.conn).Watch(ctxT(t), tc.req)
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}

// TestWatchSlowClient: a watcher that stops reading loses events instead of
// stalling the router, and is told how many: received + dropped = published.
func TestWatchSlowClient(t *testing.T) {
	nc := connectNATS(t)
	reg := prometheus.NewRegistry()
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.NATS, g.Registerer, g.WatchBuffer = nc, reg, 1 })
	pool := "hash" // the NATS server is this test's own
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := kvrouterv1.NewEventsClient(h.conn).Watch(ctx, &kvrouterv1.WatchRequest{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	subj, _ := kvstream.EventsSubject(pool, "a")
	publishN := func(n int, first uint64) {
		for i := range n {
			b := events.Batch{Events: []events.Event{{Kind: events.BlockRemoved, BlockHashes: []uint64{first + uint64(i)}, Medium: "GPU"}}}
			if err := nc.Publish(subj, mustEncode(t, b)); err != nil {
				t.Fatal(err)
			}
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// Far more than gRPC's flow-control windows hold while nobody reads.
	const n = 20000
	publishN(n, 1)
	deadline := time.Now().Add(10 * time.Second)
	for dropped(t, reg) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no event dropped with a stalled watcher")
		}
		time.Sleep(10 * time.Millisecond)
	}
	got := make(chan *kvrouterv1.Event, n+1)
	go func() {
		for {
			e, err := st.Recv()
			if err != nil {
				close(got)
				return
			}
			got <- e
		}
	}()
	var received, lost uint64
	quiet := time.After(time.Second)
drain:
	for {
		select {
		case e := <-got:
			received++
			lost += e.Dropped
			quiet = time.After(500 * time.Millisecond)
		case <-quiet:
			break drain
		}
	}
	publishN(1, n+1) // the sentinel reports the drops since the last event
	select {
	case e := <-got:
		if e.BlockHashes[0] != n+1 {
			t.Fatalf("sentinel: got hash %v", e.BlockHashes)
		}
		lost += e.Dropped
	case <-time.After(10 * time.Second):
		t.Fatal("sentinel not received")
	}
	if received+lost != n || lost == 0 || float64(lost) != dropped(t, reg) {
		t.Errorf("received %d + reported dropped %d != %d published (metric %v)", received, lost, n, dropped(t, reg))
	}
}

func dropped(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	return servertest.Metric(t, reg, "kvrouter_grpc_watch_dropped_total", nil)
}

// TestServeStopsWithOpenWatch: Serve's graceful stop ends open Watch
// streams cleanly instead of waiting out its 5 s grace period.
func TestServeStopsWithOpenWatch(t *testing.T) {
	nc := connectNATS(t)
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.NATS = nc })
	st, err := kvrouterv1.NewEventsClient(h.conn).Watch(ctxT(t), &kvrouterv1.WatchRequest{Pool: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	if d := h.stop(); d > 3*time.Second {
		t.Errorf("Serve took %v to stop with a Watch open", d)
	}
	if _, err := st.Recv(); err == nil || status.Code(err) != codes.OK && err.Error() != "EOF" {
		t.Errorf("watch after stop: %v, want a clean end of stream", err)
	}
}
