package test

import (
	"cmp"
	"context"
	"fmt"
	"github.com/prometheus/client_golang/prometheus"
	"log/slog"
	"os"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
)

// tableApplier is an index that keeps, per instance, exactly the engine's
// block table (bridge.Table), so tests can compare what a consumer built
// with what the engine holds, block by block and tier by tier.
type tableApplier struct {
	mu     sync.Mutex // guards tables and purges
	tables map[string]*bridge.Table
	purges int
}

var _ consumer.Applier = (*tableApplier)(nil)

func newTableApplier() *tableApplier { return &tableApplier{tables: map[string]*bridge.Table{}} }

func (a *tableApplier) Apply(_ context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.tables[instance]
	if t == nil {
		t = bridge.NewTable(0)
		a.tables[instance] = t
	}
	r := t.Apply(evs)
	removed := 0
	for _, x := range r.Removed {
		removed += len(x.Hashes)
	}
	return kvindex.ApplyResult{Stored: r.Stored, Removed: removed, Skipped: r.Skipped, Unmapped: r.Unplaced}, nil
}

func (a *tableApplier) Purge(_ context.Context, instance string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.tables, instance)
	a.purges++
	return nil
}

func (a *tableApplier) dump(instance string) map[uint64]bridge.Placement {
	a.mu.Lock()
	defer a.mu.Unlock()
	if t := a.tables[instance]; t != nil {
		return t.Dump()
	}
	return map[uint64]bridge.Placement{}
}

// reference applies payloads to an empty table: what the engine holds.
func reference(t testing.TB, payloads ...[]byte) map[uint64]bridge.Placement {
	t.Helper()
	tab := bridge.NewTable(0)
	for _, p := range payloads {
		b, err := events.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		tab.Apply(b.Events)
	}
	return tab.Dump()
}

// waitTable waits until the applier holds want for the instance.
func waitTable(t testing.TB, a *tableApplier, instance string, want map[uint64]bridge.Placement) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := a.dump(instance)
		if reflect.DeepEqual(got, want) {
			return
		}
		if time.Now().After(deadline) {
			missing, extra, differ := 0, 0, 0
			for h, p := range want {
				if g, ok := got[h]; !ok {
					missing++
				} else if g != p {
					differ++
				}
			}
			for h := range got {
				if _, ok := want[h]; !ok {
					extra++
				}
			}
			t.Fatalf("index for %s never matched the engine: %d blocks, want %d (%d missing, %d extra, %d differ)",
				instance, len(got), len(want), missing, extra, differ)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// streamRig is what both event rigs (rig, simRig) share: one NATS
// server, one pool's stream and snapshot bucket, one instance's engine
// endpoints, and the bridge that carries its events into the stream.
type streamRig struct {
	t        testing.TB
	ctx      context.Context
	ns       *testenv.NATSServer
	pool     string
	instance string
	stream   kvstream.StreamConfig
	bucket   kvstream.BucketConfig
	pubEP    string
	replayEP string

	br        *bridge.Bridge
	brStopped func() // stops br and waits for it (nil: not running)
	// gate, when set, stands between the bridge and NATS (rigOpts.gate).
	gate *testenv.ReplyGate
}

// conn connects to the rig's NATS server, reconnecting forever.
func (r *streamRig) conn() *nats.Conn {
	r.t.Helper()
	return testenv.Connect(r.t, r.ns.URL(), reconnectForever...)
}

// reconnectForever are the options of a connection that outlives NATS
// restarts: it retries its first connect and every reconnect, 50ms apart.
var reconnectForever = []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond), nats.RetryOnFailedConnect(true)}

// runBridge runs a bridge on cfg, given the rig's pool, connection,
// stream and bucket (and a quiet logger unless cfg names one), until the
// test ends or stopBridge.
func (r *streamRig) runBridge(cfg bridge.Config) {
	r.t.Helper()
	cfg.Pool, cfg.Conn, cfg.Stream, cfg.Bucket = r.pool, r.conn(), r.stream, r.bucket
	if r.gate != nil {
		cfg.Conn = testenv.Connect(r.t, "nats://"+r.gate.Addr(), reconnectForever...)
	}
	r.br, r.brStopped = runBridge(r.t, r.ctx, cfg)
}

func (r *streamRig) stopBridge() {
	if r.brStopped != nil {
		r.brStopped()
		r.brStopped = nil
	}
}

// runConsumer runs a router-side consumer on cfg, given the rig's pool,
// connection, stream and bucket (and a quiet logger unless cfg names one),
// until the test ends or stop; it returns once the consumer is healthy.
func (r *streamRig) runConsumer(cfg consumer.Config) (c *consumer.Consumer, stop func()) {
	r.t.Helper()
	cfg.Conn, cfg.Pool, cfg.Stream, cfg.Bucket = r.conn(), r.pool, r.stream, r.bucket
	return runConsumer(r.t, r.ctx, cfg, 20*time.Second)
}

// runBridge runs a bridge on cfg (a quiet logger unless cfg names one)
// until the test ends or stop.
func runBridge(t testing.TB, ctx context.Context, cfg bridge.Config) (br *bridge.Bridge, stop func()) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	br, err := bridge.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return br, testenv.Go(t, ctx, br.Run)
}

// runConsumer runs a router-side consumer on cfg (a quiet logger unless
// cfg names one) until the test ends or stop; it returns once the consumer
// is healthy, and fails the test if it is not within healthy.
func runConsumer(t testing.TB, ctx context.Context, cfg consumer.Config, healthy time.Duration) (c *consumer.Consumer, stop func()) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	c, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop = testenv.Go(t, ctx, c.Run)
	testenv.WaitFor(t, healthy, "consumer healthy", c.Healthy)
	return c, stop
}

// newKVRouter starts cfg's KV-state pipeline on ctx (closed when the test
// ends) and a router server over it with the admin API mounted, as
// cmd/kvrouter wires them; both log to opts.Logger, and reg (nil: the
// server's own) receives both one's metrics. Running the server and
// waiting for the pipeline are the caller's.
func newKVRouter(t testing.TB, ctx context.Context, cfg config.Config, opts kvstate.Options, reg *prometheus.Registry) (*kvstate.Pipeline, *httpapi.Server) {
	t.Helper()
	if reg != nil {
		opts.Registerer = reg
	}
	kve, err := kvstate.Start(ctx, cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kve.Close)
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: opts.Logger, Registry: reg, KV: kvaware.NewSource(kve.KV), KVEvents: kve, Admin: admin.Routes(kve)})
	if err != nil {
		t.Fatal(err)
	}
	return kve, srv
}

// rig is one engine (ZMQ PUB + replay), NATS, a bridge and consumers.
type rig struct {
	streamRig
	pub *enginezmq.Publisher
}

type rigOpts struct {
	noReplay     bool
	maxMsgs      int64
	snapInterval time.Duration
	buffer       int // bridge outage buffer (0: default)
	inlineMax    int // bridge InlineSnapshotMax (0: default)
	window       int // bridge PublishWindow (0: default)
	coalesce     int // bridge Coalesce (0: off)
	coalesceMax  int // bridge CoalesceBytes (0: default)
	// publishTimeout is the bridge's PublishTimeout (0: 1s).
	publishTimeout time.Duration
	heartbeatKey   []byte
	reg            prometheus.Registerer // bridge metrics (nil: none)
	// gate puts a testenv.ReplyGate between the bridge and NATS, so a
	// test can hold JetStream's acks back (rig.gate).
	gate bool
}

func newRig(t testing.TB, o rigOpts) *rig {
	t.Helper()
	name := testenv.UniqueName(t)
	r := &rig{streamRig: streamRig{
		t:        t,
		ctx:      testenv.Context(t, 2*time.Minute),
		ns:       testenv.StartNATS(t),
		pool:     "pool_" + name,
		instance: "vllm-0",
		stream:   kvstream.StreamConfig{Name: "EV_" + name, MaxMsgs: o.maxMsgs},
		bucket:   kvstream.BucketConfig{Name: "SN_" + name},
		pubEP:    fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)),
	}}
	if !o.noReplay {
		r.replayEP = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	}
	if o.gate {
		r.gate = testenv.StartReplyGate(t, fmt.Sprintf("127.0.0.1:%d", r.ns.Port))
	}
	r.startEngine(rigTopic, rigFirstSeq)
	r.startBridge(o)
	return r
}

// rigTopic is the rig's engine's ZMQ topic (vLLM's kv@<ip>:<port>@<model>).
const rigTopic = "kv@127.0.0.1:18000@fake-model"

// rigFirstSeq is the rig's engine's first seq, as the captured engine
// (llm-d-inference-sim) counts.
const rigFirstSeq = 1

// startEngine starts the engine's publisher on the rig's endpoints, its
// first batch numbered firstSeq.
func (r *rig) startEngine(topic string, firstSeq uint64) {
	r.t.Helper()
	pub, err := enginezmq.NewPublisher(r.ctx, enginezmq.PublisherConfig{
		Endpoint: r.pubEP, ReplayEndpoint: r.replayEP, Topic: topic, FirstSeq: firstSeq})
	if err != nil {
		r.t.Fatal(err)
	}
	r.pub = pub
	r.t.Cleanup(func() { _ = pub.Close() })
}

func (r *rig) startBridge(o rigOpts) {
	r.t.Helper()
	snapEvery := o.snapInterval
	if snapEvery == 0 {
		snapEvery = time.Hour
	}
	r.runBridge(bridge.Config{
		Model: "fake-model",
		Sources: []bridge.Source{{Instance: r.instance, Endpoint: r.pubEP, ReplayEndpoint: r.replayEP,
			URL: "http://127.0.0.1:18000", FirstSeq: rigFirstSeq}},
		Buffer:            o.buffer,
		InlineSnapshotMax: o.inlineMax,
		PublishWindow:     o.window,
		Coalesce:          o.coalesce,
		CoalesceBytes:     o.coalesceMax,
		HeartbeatInterval: 100 * time.Millisecond,
		HeartbeatKey:      o.heartbeatKey,
		Registerer:        o.reg,
		SnapshotInterval:  snapEvery,
		ReplayTimeout:     2 * time.Second,
		PublishTimeout:    cmp.Or(o.publishTimeout, time.Second),
		// No HTTP server stands behind this engine's URL: a probe would
		// rightly call it down.
		EngineProbeInterval: -1,
	})
	testenv.WaitFor(r.t, 20*time.Second, "bridge ready", r.br.Ready)
	testenv.WaitFor(r.t, 20*time.Second, "bridge subscribed to the engine", r.pub.Subscribed)
}

func (r *rig) stats() bridge.Stats { return r.br.Stats()[0] }

// startConsumer runs a router-side consumer into a fresh applier.
func (r *rig) startConsumer(cfg consumer.Config) (*consumer.Consumer, *tableApplier, func()) {
	r.t.Helper()
	a := newTableApplier()
	cfg.Applier = a
	c, stop := r.runConsumer(cfg)
	return c, a, stop
}

func (r *rig) publish(payloads ...[]byte) {
	r.t.Helper()
	for _, p := range payloads {
		if _, err := r.pub.Publish(p); err != nil {
			r.t.Fatal(err)
		}
	}
}

// publishFollowed publishes each payload once the consumer has applied
// the one before: for a stream that keeps only a few messages, which no
// consumer can follow through a burst (the bridge publishes a burst as
// fast as JetStream stores it).
func (r *rig) publishFollowed(c *consumer.Consumer, payloads ...[]byte) {
	r.t.Helper()
	for _, p := range payloads {
		seq, err := r.pub.Publish(p)
		if err != nil {
			r.t.Fatal(err)
		}
		testenv.WaitFor(r.t, 20*time.Second, fmt.Sprintf("consumer at engine seq %d", seq), func() bool {
			for _, st := range c.Instances() {
				if st.Instance == r.instance && st.LastSeq >= seq {
					return true
				}
			}
			return false
		})
	}
}

// waitPublished waits until the bridge has published through engine seq.
func (r *rig) waitPublished(seq uint64) {
	r.t.Helper()
	testenv.WaitFor(r.t, 20*time.Second, fmt.Sprintf("bridge at engine seq %d", seq), func() bool {
		s := r.stats()
		return s.HasSeq && s.EngineSeq >= seq
	})
}

func quietLogger() *slog.Logger {
	if os.Getenv("KV_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(nopWriter{}, nil))
}

type nopWriter struct{}

func (nopWriter) Write(p []byte) (int, error) { return len(p), nil }
