// Package bridge carries one engine's KV events from its ZMQ PUB socket(s)
// to NATS JetStream, as kvbridge does: per-rank sequence tracking, gap
// repair from the engine's replay socket (else a synthetic clear), restart
// and death detection (see engine.go), a live block table answered as
// snapshots, heartbeats and eviction records.
package bridge

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/ratelog"
	"github.com/kvrouter/kvrouter/internal/zero"
	"github.com/kvrouter/kvrouter/tiers"
)

// Source is one engine publisher (one data-parallel rank) and the
// instance name its events are published under.
type Source struct {
	// Instance is the NATS instance token (see kvstream.ValidToken).
	Instance string
	// Rank is the data-parallel rank, sent in headers and heartbeats.
	Rank int
	// Endpoint is the engine's PUB endpoint; Bind listens on it instead
	// (for engines that dial).
	Endpoint string
	Bind     bool
	// ReplayEndpoint is the engine's replay ROUTER endpoint; "" means the
	// engine has no replay, so every gap becomes a clear.
	ReplayEndpoint string
	// Topic is the ZMQ subscription prefix ("" = all).
	Topic string
	// FirstSeq is the seq the engine's publisher gives its first message:
	// 0 for vLLM and SGLang (their ZmqEventPublisher counts with
	// itertools.count()), 1 for llm-d-inference-sim and kvsim. A history
	// replayed from the engine's start must begin with it: one that
	// begins later lost its first messages, which is a hole like any
	// other, not a complete history.
	FirstSeq uint64
	// URL is the instance's HTTP base URL, advertised in heartbeats and
	// probed (GET /health, /metrics) to tell a dead or restarted engine.
	URL string
	// LoopbackReplay: the endpoints are not the engine's but a publisher
	// in the bridge's own process that feeds it (TRTLLMPoller.Source sets
	// it). That publisher outlives the engine: what its replay returns
	// proves nothing about which engine process is behind it, its history
	// is the dead process's too, and its seq goes on across the engine's
	// restarts. An engine back from down is then cleared unless its start
	// time proves it the same, and nothing is replayed after a restart.
	LoopbackReplay bool
	// pollNow, when set, asks the publisher's poller to read the engine
	// at once rather than at the end of a backoff grown while it was down.
	pollNow func()
}

// Config configures a Bridge. Zero values mean the documented defaults.
type Config struct {
	// Pool is the pool (model deployment) token; required.
	Pool string
	// Model is the served model name (headers, heartbeats).
	Model string
	// BlockSize is advertised in heartbeats until learned from events.
	BlockSize int
	// Adapters are the LoRA adapters the instance serves (heartbeats).
	Adapters []string
	// Role is the engine's disaggregated-serving role (heartbeats):
	// prefill, decode or both ("" = both).
	Role string
	// Sources lists the engine's publishers; at least one.
	Sources []Source
	// Conn is the NATS connection; required. Configure it to reconnect
	// forever (nats.MaxReconnects(-1)); the bridge retries publishes.
	Conn *nats.Conn
	// Stream is the events stream, created when missing.
	Stream kvstream.StreamConfig
	// Bucket is the snapshot key-value bucket, created when missing.
	Bucket kvstream.BucketConfig
	// MaxBlocks bounds each instance's block table; set it to the
	// engine's number of KV blocks (GPU plus offload tiers). Default 1<<20.
	MaxBlocks int
	// Buffer is the number of engine messages held while NATS is
	// unreachable (default 10000, vLLM's replay buffer_steps: beyond that
	// the replay could not fill the hole anyway). Messages beyond it are
	// dropped, counted, and the gap repaired from replay on reconnect.
	Buffer int
	// BufferBytes bounds the same buffer by the engine payload bytes it
	// holds (default DefaultBufferBytes); a message past either bound
	// is dropped alike. An empty buffer takes one message whatever its
	// size, as the count bound always takes one.
	BufferBytes int
	// ReplayBytes bounds the payload bytes of one replay's replies after
	// the first, all held until the replay ends (default
	// enginezmq.DefaultReplayBytes); a replay past it fails as one past
	// its message count does (enginezmq.ReplayConfig). The first is not
	// counted: a replay after a known message starts at it, to compare
	// it, so a dropped message within both byte bounds is replayable.
	ReplayBytes int
	// HeartbeatInterval defaults to 5s.
	HeartbeatInterval time.Duration
	// HeartbeatKey, when set, signs every heartbeat (kvstream.SignHeartbeat)
	// for routers that verify them (KVROUTER_HEARTBEAT_KEY); at least
	// kvstream.MinHeartbeatKeyBytes.
	HeartbeatKey []byte
	// SnapshotInterval is how often the snapshot bucket is refreshed
	// (default 30s); keep it well below the stream's MaxAge.
	SnapshotInterval time.Duration
	// EngineProbeInterval is how often each source's URL is probed:
	// /health to tell an engine that is down, /metrics's
	// process_start_time_seconds to tell one that restarted (default 1s:
	// a restarted engine is cleared, and a dead one reported, within a
	// second or two; the two requests cost the engine far less than a
	// Prometheus scrape). Negative: no probing (then only the seq and the
	// replay socket tell a restart).
	EngineProbeInterval time.Duration
	// ReplayTimeout bounds one replay request (default 5s).
	ReplayTimeout time.Duration
	// PublishTimeout bounds one publish attempt, the wait for one ack
	// (default 5s).
	PublishTimeout time.Duration
	// PublishWindow is the most engine messages per instance published
	// and not yet acknowledged by JetStream (default DefaultPublishWindow;
	// 1: wait for each ack before the next publish). Order and
	// at-least-once delivery hold whatever the window (window.go).
	PublishWindow int
	// Coalesce is the most consecutive engine messages of an instance
	// published as one NATS message when they are already queued behind
	// the publish window (a backlog): their payloads concatenated
	// unchanged, headers naming the seq range (kvstream.HeaderBatches).
	// 0 or 1 (the default): off, one NATS message per engine message.
	// Nothing waits to be joined, so a quiet engine's latency is
	// unchanged. Every router reading the stream must understand
	// coalesced messages before a bridge turns it on (coalesce.go); at
	// most kvstream.MaxCoalesced. DefaultCoalesce is the advised value.
	Coalesce int
	// CoalesceBytes bounds a coalesced message's payload (default, and
	// at most, a quarter of the server's max payload: coalesce.go). An
	// engine message larger than it is published alone.
	CoalesceBytes int
	// InlineSnapshotMax is the largest snapshot sent as one message (reply
	// or bucket value); larger ones go to the snapshot object store and the
	// message carries a pointer (default 512 KiB, half NATS's default 1 MB
	// max payload). At most half the server's max payload is used whatever
	// the setting: a server configured lower refuses a larger message, so
	// every such snapshot failed to store and to serve (inlineMax).
	InlineSnapshotMax int
	// MaxBlocksPerMessage bounds a synthetic resync message (default 4096
	// blocks, ~400 KB with 16-token blocks: under NATS's 1 MB max payload).
	MaxBlocksPerMessage int
	// AgeOut gives stores-only tiers (sources that never report removals,
	// such as LMCache) a lifetime: a block held in such a tier and not
	// stored there again within the duration is removed (aging.go). Tiers
	// not listed never age.
	AgeOut map[tiers.Tier]time.Duration
	// Registerer receives the bridge's metrics (nil: not registered).
	Registerer prometheus.Registerer
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// DefaultBufferBytes is Config.BufferBytes's default. The count bound
// (10,000 messages) alone let an engine fill the heap: each message may
// be up to enginezmq.MaxFrame (64 MiB). vLLM's messages are hundreds of
// bytes to a few KiB (the captured engine's: 0.6 KB on average, 3.3 KB at
// most, so 10,000 of them 6-33 MB); a scheduler step at vLLM's default
// max_num_batched_tokens (8,192) stores at most 512 16-token blocks, some
// 50 KB. 128 MiB holds 10,000 messages of ~13 KiB, four times the largest
// captured, so the count bound is the one met unless a NATS outage meets
// a run of large prefill steps.
//
// The bridge's memory budget, per instance, at worst: this buffer; one
// replay (enginezmq.DefaultReplayBytes, 128 MiB, and its first message),
// whose messages the replay window keeps until live ones pass them; the
// publish window (DefaultPublishWindow, 128 messages in flight, each at
// most the NATS server's max payload: 128 MiB at NATS's default 1 MiB);
// and the block table (Config.MaxBlocks). The byte bounds add up past
// the vLLM sidecar's 512 MiB limit in deploy/ only when NATS stalls
// while every message is large; at vLLM's sizes the count bounds are
// met first (the buffer and a replay 6-33 MB each, the publish window
// under 1 MB, 32 MiB with coalescing). kvsim's sidecar
// (deploy/kubernetes/kvsim) has 256 MiB, sized for the simulator's
// messages, not for this worst case.
const DefaultBufferBytes = 128 << 20

// Bridge runs one instance pipeline per Source.
type Bridge struct {
	cfg   Config
	js    jetstream.JetStream
	m     *metrics
	runID string
	insts []*instance
	ready atomic.Bool
	http  *http.Client // engine probes
	// logLimit bounds the lines logged for engine payloads and events
	// that cannot be read (each is counted regardless).
	logLimit *ratelog.Limiter

	storesMu sync.Mutex // guards kv and obs, replaced when JetStream lost them
	kv       jetstream.KeyValue
	obs      jetstream.ObjectStore
}

func (b *Bridge) setStores(kv jetstream.KeyValue, obs jetstream.ObjectStore) {
	b.storesMu.Lock()
	b.kv, b.obs = kv, obs
	b.storesMu.Unlock()
}

// stores returns the snapshot bucket and object store.
func (b *Bridge) stores() (jetstream.KeyValue, jetstream.ObjectStore) {
	b.storesMu.Lock()
	defer b.storesMu.Unlock()
	return b.kv, b.obs
}

// remakeStores makes the stream, snapshot bucket and object store again after
// they failed: a JetStream whose store was wiped comes back without them,
// and without them a restarted bridge or router has no snapshot to start
// from.
func (b *Bridge) remakeStores(ctx context.Context) error {
	if _, err := kvstream.EnsureStream(ctx, b.js, b.cfg.Stream); err != nil {
		return err
	}
	kv, err := kvstream.EnsureBucket(ctx, b.js, b.cfg.Bucket)
	if err != nil {
		return err
	}
	obs, err := kvstream.EnsureObjectStore(ctx, b.js, b.cfg.Bucket)
	if err != nil {
		return err
	}
	b.setStores(kv, obs)
	return nil
}

// New validates cfg; Run starts the work.
func New(cfg Config) (*Bridge, error) {
	if err := kvstream.ValidToken("pool", cfg.Pool); err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	if cfg.Conn == nil {
		return nil, errors.New("bridge: no NATS connection")
	}
	if len(cfg.Sources) == 0 {
		return nil, errors.New("bridge: no sources (engine endpoints)")
	}
	zero.Default(&cfg.MaxBlocks, 1<<20)
	zero.Default(&cfg.Buffer, 10000)
	zero.Default(&cfg.BufferBytes, DefaultBufferBytes)
	zero.Default(&cfg.ReplayBytes, enginezmq.DefaultReplayBytes)
	zero.Default(&cfg.HeartbeatInterval, 5*time.Second)
	zero.Default(&cfg.SnapshotInterval, 30*time.Second)
	zero.Default(&cfg.ReplayTimeout, 5*time.Second)
	zero.Default(&cfg.EngineProbeInterval, time.Second)
	zero.Default(&cfg.PublishTimeout, 5*time.Second)
	zero.Default(&cfg.MaxBlocksPerMessage, 4096)
	zero.Default(&cfg.PublishWindow, DefaultPublishWindow)
	zero.Default(&cfg.InlineSnapshotMax, 512<<10)
	if cfg.MaxBlocks < 0 || cfg.Buffer < 0 || cfg.BufferBytes < 0 || cfg.ReplayBytes < 0 ||
		cfg.HeartbeatInterval < 0 || cfg.SnapshotInterval < 0 ||
		cfg.ReplayTimeout < 0 || cfg.PublishTimeout < 0 || cfg.MaxBlocksPerMessage < 0 || cfg.BlockSize < 0 ||
		cfg.InlineSnapshotMax < 0 || cfg.PublishWindow < 0 || cfg.Coalesce < 0 || cfg.CoalesceBytes < 0 {
		return nil, errors.New("bridge: negative size or interval in config")
	}
	if cfg.Coalesce > kvstream.MaxCoalesced {
		return nil, fmt.Errorf("bridge: coalesce %d is over %d engine messages per NATS message", cfg.Coalesce, kvstream.MaxCoalesced)
	}
	if cfg.HeartbeatKey != nil && len(cfg.HeartbeatKey) < kvstream.MinHeartbeatKeyBytes {
		return nil, fmt.Errorf("bridge: heartbeat key of %d bytes, want at least %d", len(cfg.HeartbeatKey), kvstream.MinHeartbeatKeyBytes)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("bridge: metrics: %w", err)
	}
	// The ack timeout bounds how long a pipelined publish waits (a lost
	// ack would otherwise hold the window forever); every instance keeps
	// at most PublishWindow in flight, so the client's own bound is never
	// what stalls a publish.
	js, err := jetstream.New(cfg.Conn, jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
		jetstream.WithPublishAsyncMaxPending(cfg.PublishWindow*len(cfg.Sources)+1))
	if err != nil {
		return nil, fmt.Errorf("bridge: jetstream: %w", err)
	}
	var id [6]byte
	_, _ = rand.Read(id[:])
	b := &Bridge{cfg: cfg, js: js, m: m, runID: hex.EncodeToString(id[:]), http: &http.Client{}, logLimit: ratelog.New(10*time.Second, 5)}
	seen := map[string]bool{}
	for _, s := range cfg.Sources {
		if seen[s.Instance] {
			return nil, fmt.Errorf("bridge: instance %q listed twice", s.Instance)
		}
		seen[s.Instance] = true
		in, err := newInstance(b, s)
		if err != nil {
			return nil, err
		}
		b.insts = append(b.insts, in)
	}
	return b, nil
}

// Ready reports whether every instance has finished its start-up resync
// and NATS is connected: the health endpoint's answer.
func (b *Bridge) Ready() bool {
	if !b.ready.Load() || !b.cfg.Conn.IsConnected() {
		return false
	}
	for _, in := range b.insts {
		if !in.started.Load() {
			return false
		}
	}
	return true
}

// Run ensures the stream and bucket, then runs every instance until ctx is
// done; call it once. It returns ctx.Err(), or an error if the stream or
// bucket cannot be made for a configuration reason (kvstream.IsConfigError:
// another stream holds the subjects, an invalid setting); outages are
// retried with backoff until ctx is done.
func (b *Bridge) Run(ctx context.Context) error {
	res, err := kvstream.EnsureAll(ctx, b.js, b.cfg.Stream, b.cfg.Bucket, b.cfg.Logger)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("bridge: %w", err)
	}
	b.setStores(res.Bucket, res.ObjectStore)
	for _, in := range b.insts {
		sub, err := b.cfg.Conn.Subscribe(in.snapSubj, in.serveSnapshot)
		if err != nil {
			return fmt.Errorf("bridge: subscribe %s: %w", in.snapSubj, err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	b.ready.Store(true)
	var wg sync.WaitGroup
	for _, in := range b.insts {
		wg.Add(3)
		go func() { defer wg.Done(); _ = in.sub.Run(ctx, in.enqueue) }()
		go func() { defer wg.Done(); in.process(ctx) }()
		go func() { defer wg.Done(); in.periodic(ctx) }()
		if in.probing() {
			wg.Add(1)
			go func() { defer wg.Done(); in.probe(ctx) }()
		}
		if len(b.cfg.AgeOut) > 0 {
			wg.Add(1)
			go func() { defer wg.Done(); in.ageTicker(ctx) }()
		}
	}
	wg.Wait()
	return ctx.Err()
}

// Stats is one instance's counters, for tests and the health page.
type Stats struct {
	Instance       string `json:"instance"`
	Published      uint64 `json:"published"` // engine and synthetic messages published (a coalesced NATS message counts its engine messages)
	Gaps           uint64 `json:"gaps"`
	Replays        uint64 `json:"replays"` // replays that filled a gap
	ReplayFailures uint64 `json:"replay_failures"`
	Clears         uint64 `json:"clears"`  // synthetic clears (gap, restart, resync)
	Dropped        uint64 `json:"dropped"` // dropped for a full buffer, or larger than the max payload and unreadable
	// OversizeResyncs counts engine messages larger than the max payload
	// folded into the table and published as a resync (a clear, then the
	// table in chunks that fit).
	OversizeResyncs uint64 `json:"oversize_resyncs"`
	Malformed       uint64 `json:"malformed"`
	Aged            uint64 `json:"aged"` // blocks removed by aging (AgeOut)
	// Reorders counts publish failures after which the stream held the
	// instance's messages out of order, repaired by a resync (window.go).
	Reorders uint64 `json:"reorders"`
	// Repairs counts publish failures in the window, after which its
	// messages were settled and the failed ones resent in order.
	Repairs uint64 `json:"repairs"`
	// MaxInFlight is the most messages the instance had published and
	// not yet acknowledged at once: at most PublishWindow.
	MaxInFlight uint64 `json:"max_in_flight"`
	// Coalesced counts NATS messages that carried several engine
	// messages (Config.Coalesce), and CoalescedBatches those engine
	// messages; MaxCoalesced is the most one carried.
	Coalesced        uint64 `json:"coalesced"`
	CoalescedBatches uint64 `json:"coalesced_batches"`
	MaxCoalesced     uint64 `json:"max_coalesced"`
	Blocks           int    `json:"blocks"`
	EngineDown       bool   `json:"engine_down"`
	EngineSeq        uint64 `json:"engine_seq"`
	HasSeq           bool   `json:"has_seq"`
	StreamSeq        uint64 `json:"stream_seq"`
}

// Stats returns every instance's counters.
func (b *Bridge) Stats() []Stats {
	out := make([]Stats, 0, len(b.insts))
	for _, in := range b.insts {
		out = append(out, in.stats())
	}
	return out
}

// instance is the pipeline of one Source.
type instance struct {
	b         *Bridge
	src       Source
	log       *slog.Logger
	sub       *enginezmq.Subscriber
	replay    enginezmq.ReplayConfig
	subj      string
	evictSubj string
	hbSubj    string
	snapSubj  string
	key       string
	in        chan enginezmq.Message
	lost      chan struct{} // signalled (cap 1) when enqueue drops
	storeNow  chan struct{} // signalled (cap 1) when the stream had to be made again
	tail      chan struct{} // signalled (cap 1) when the subscriber (re)connected
	// buffered is the payload bytes of the messages in `in`: added by
	// enqueue before a message goes in, taken off as one is taken out.
	buffered atomic.Int64
	// dropping: a message was dropped since `in` was last seen empty
	// (set by drop, cleared by enqueue).
	dropping atomic.Bool
	// connected: set at each (re)connection, taken by catchTail, which
	// then starts its retries over; tailRetry is the wait before its next
	// retry (processing goroutine only).
	connected atomic.Bool
	tailRetry time.Duration
	probes    chan probeResult
	ageNow    chan struct{} // signalled (cap 1) when aged tiers are due a sweep
	started   atomic.Bool
	lastRecv  atomic.Int64 // unix nanos of the last engine message received
	// engineDown: probes fail and no events arrive (heartbeats say so).
	engineDown atomic.Bool

	// Owned by the process goroutine.
	tracker  enginezmq.SeqTracker
	msgCount uint64
	replayed replayWindow // payloads a replay folded in, until live passes them
	// firstSeqWarned: the kinds of replay warnFirstSeq has warned of.
	firstSeqWarned map[string]bool
	topic          string // topic of the last live message
	probeFails     int    // probes failed in a row

	// enc is the engine's event encoding (events.Encoding), used for
	// synthetic messages; read by the snapshot goroutines.
	enc atomic.Uint32

	published, gaps, replays, replayFails, clears, dropped, malformed, aged, reorders, repairs, oversizeResyncs atomic.Uint64
	maxInFlight                                                                                                 atomic.Uint64 // the window's high-water mark
	coalesced, coalescedBatches, maxCoalesced                                                                   atomic.Uint64 // coalesce.go
	// group is the engine messages being joined into one NATS message
	// (coalesce.go); owned by the process goroutine.
	group group

	win window // messages in flight (window.go); owned by the process goroutine
	// results is applyAcked's buffer, reused (process goroutine).
	results []TableResult
	// dec decodes engine payloads (process goroutine). Retaining: a
	// message's events are kept until its ack, and messages are dropped
	// in the order they were decoded, so batches share allocations.
	dec events.Decoder

	counters *instanceCounters // owned by the process goroutine
	// sent and completed count messages handed to the window and those
	// acknowledged and folded in: a snapshot request waits for the ones
	// in flight (waitCompleted).
	sent, completed atomic.Uint64

	mu        sync.Mutex // guards table, engineSeq, hasSeq, streamSeq, storedSeq, lastHash, engineStart
	table     *Table
	engineSeq uint64
	hasSeq    bool
	streamSeq uint64
	storedSeq uint64 // streamSeq of the last snapshot put in the bucket
	// lastHash is the xxhash64 of message engineSeq's payload, and
	// engineStart the engine's process start time (0 unknown): what
	// proves later that the engine is the same process (see engine.go).
	lastHash    uint64
	engineStart float64
}

func newInstance(b *Bridge, s Source) (*instance, error) {
	if err := kvstream.ValidToken("instance", s.Instance); err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	frames := b.m.drops.WithLabelValues(s.Instance, "frames")
	in := &instance{
		b:        b,
		src:      s,
		log:      b.cfg.Logger.With("instance", s.Instance, "rank", s.Rank),
		replay:   enginezmq.ReplayConfig{Endpoint: s.ReplayEndpoint, Timeout: b.cfg.ReplayTimeout, MaxBytes: b.cfg.ReplayBytes},
		in:       make(chan enginezmq.Message, b.cfg.Buffer),
		lost:     make(chan struct{}, 1),
		tail:     make(chan struct{}, 1),
		storeNow: make(chan struct{}, 1),
		probes:   make(chan probeResult, 1),
		ageNow:   make(chan struct{}, 1),
		table:    NewTable(b.cfg.MaxBlocks),
		counters: newInstanceCounters(b.m, s.Instance),
		dec:      events.Decoder{Retain: true},
	}
	sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: s.Endpoint, Bind: s.Bind, Topic: s.Topic, Logger: b.cfg.Logger,
		OnMalformed: func(error) { frames.Inc() },
		// Once connected, and again when the subscription has surely
		// reached the engine (ZMQ drops what a PUB sends before), ask
		// the replay for what was published meanwhile.
		OnConnect: func() { in.connected.Store(true); in.kickTail(); time.AfterFunc(tailRecheck, in.kickTail) }})
	if err != nil {
		return nil, fmt.Errorf("bridge: instance %s: %w", s.Instance, err)
	}
	in.sub = sub
	in.enc.Store(uint32(events.EncodingMap))
	pool := b.cfg.Pool
	in.subj, _ = kvstream.EventsSubject(pool, s.Instance)
	in.evictSubj, _ = kvstream.EvictionsSubject(pool, s.Instance)
	in.hbSubj, _ = kvstream.InstancesSubject(pool, s.Instance)
	in.snapSubj, _ = kvstream.SnapshotSubject(pool, s.Instance)
	in.key, _ = kvstream.SnapshotKey(pool, s.Instance)
	return in, nil
}

func (in *instance) stats() Stats {
	in.mu.Lock()
	defer in.mu.Unlock()
	return Stats{
		Instance: in.src.Instance, Published: in.published.Load(), Gaps: in.gaps.Load(), Replays: in.replays.Load(),
		ReplayFailures: in.replayFails.Load(), Clears: in.clears.Load(), Dropped: in.dropped.Load(), OversizeResyncs: in.oversizeResyncs.Load(),
		Malformed: in.malformed.Load(), Aged: in.aged.Load(), Reorders: in.reorders.Load(),
		Repairs: in.repairs.Load(), MaxInFlight: in.maxInFlight.Load(),
		Coalesced: in.coalesced.Load(), CoalescedBatches: in.coalescedBatches.Load(), MaxCoalesced: in.maxCoalesced.Load(), Blocks: in.table.Len(), EngineDown: in.engineDown.Load(), EngineSeq: in.engineSeq, HasSeq: in.hasSeq, StreamSeq: in.streamSeq,
	}
}

// enqueue runs on the subscriber goroutine and never blocks it: a full
// buffer (Config.Buffer messages, or Config.BufferBytes) drops the
// message, and the hole is repaired as a gap.
func (in *instance) enqueue(m enginezmq.Message) {
	in.lastRecv.Store(time.Now().UnixNano())
	// The process goroutine only takes bytes off meanwhile: a message
	// that fits now fits when it goes in.
	n := int64(len(m.Payload))
	if held := in.buffered.Load(); held > 0 && held+n > int64(in.b.cfg.BufferBytes) {
		in.drop(m)
		return
	}
	if len(in.in) == 0 {
		in.dropping.Store(false) // drained since the last drop
	} else if in.dropping.Load() {
		// Kept among dropped messages: the dialing subscriber carves
		// payloads from shared 1 MiB chunks (enginezmq, payloads.go),
		// and a kept payload would keep its chunk alive, mostly the
		// dropped messages' bytes, so BufferBytes bounded the bytes
		// counted, not the heap (40 kept 50 KB messages held 41.9 MB).
		// Copied only then: in normal operation a message is not.
		m = m.Detached()
	}
	in.buffered.Add(n)
	select {
	case in.in <- m:
	default:
		in.buffered.Add(-n)
		in.drop(m)
	}
}

// drop counts and logs an engine message the buffer has no room for, and
// tells the processor to catch up once it has drained the buffer.
func (in *instance) drop(m enginezmq.Message) {
	in.dropping.Store(true)
	in.dropped.Add(1)
	in.b.m.drops.WithLabelValues(in.src.Instance, "buffer_full").Inc()
	if ok, suppressed := in.b.logLimit.Allow("buffer_full " + in.src.Instance); ok {
		msg := "buffer full (NATS slower than the engine): dropping engine messages, replayed once the buffer drains (the instance cleared if the replay cannot fill them)"
		if in.src.ReplayEndpoint == "" {
			// catchUp has nothing to replay from: the gap the drops
			// leave clears the instance at the engine's next message.
			msg = "buffer full (NATS slower than the engine): dropping engine messages; no replay endpoint, so the instance is cleared at the engine's next message"
		}
		in.log.Warn(msg, "seq", m.Seq, "buffered", len(in.in), "buffered_bytes", in.buffered.Load(),
			"max", in.b.cfg.Buffer, "max_bytes", in.b.cfg.BufferBytes, "suppressed", suppressed)
	}
	// A dropped message followed by others shows up as a gap; a dropped
	// tail would not until the engine speaks again, so the processor is
	// told to catch up once it has drained the buffer.
	select {
	case in.lost <- struct{}{}:
	default:
	}
}

func (in *instance) process(ctx context.Context) {
	if err := in.resync(ctx); err != nil {
		return // ctx done
	}
	in.started.Store(true)
	in.heartbeat()
	depth := in.b.m.bufferDepth.WithLabelValues(in.src.Instance)
	for {
		// Each signal but a message is handled after the messages already
		// buffered (drained, acked), by its own step.
		var step func(context.Context) error
		select {
		case <-ctx.Done():
			return
		case m := <-in.in:
			in.buffered.Add(-int64(len(m.Payload)))
			depth.Set(float64(len(in.in)))
			if err := in.handle(ctx, m); err != nil {
				return
			}
			if len(in.in) == 0 {
				// Nothing more to send: take the acks now, so that the
				// table, snapshots and heartbeats are current while the
				// engine is quiet.
				if in.flush(ctx) != nil {
					return
				}
			}
		case <-in.lost:
			step = in.catchUp
		case <-in.tail:
			step = in.catchTail
		case <-in.ageNow:
			step = in.ageOut
		case r := <-in.probes:
			// Messages received before the probe belong to whatever
			// process sent them: handled first, as for every step.
			step = func(ctx context.Context) error { return in.onProbe(ctx, r) }
		}
		if step == nil {
			continue
		}
		if in.drain(ctx) != nil {
			return
		}
		depth.Set(0)
		if err := step(ctx); err != nil {
			return
		}
		// A step may have published engine messages from the replay
		// (catchUp, catchTail, a restart found by a probe): with
		// coalescing the last of them could still be waiting to be joined,
		// and nothing else may come to publish them. Send them; take the
		// acks too (flush) only if no engine message waits, as after the
		// last buffered one.
		done := in.seal
		if len(in.in) == 0 {
			done = in.flush
		}
		if done(ctx) != nil {
			return
		}
	}
}

// drain handles every message already buffered and waits for their acks.
func (in *instance) drain(ctx context.Context) error {
	for {
		select {
		case m := <-in.in:
			in.buffered.Add(-int64(len(m.Payload)))
			if err := in.handle(ctx, m); err != nil {
				return err
			}
		default:
			return in.flush(ctx)
		}
	}
}

// probing reports whether the engine's HTTP side is probed.
func (in *instance) probing() bool { return in.src.URL != "" && in.b.cfg.EngineProbeInterval > 0 }

// catchUp replays everything the engine published after the last message
// handled, after messages were dropped: the live ones still to come that
// the replay already covered are recognised as duplicates.
func (in *instance) catchUp(ctx context.Context) error {
	last, ok := in.tracker.Last()
	in.log.Debug("catching up after drops", "last", last, "known", ok)
	if !ok {
		return nil
	}
	if in.src.ReplayEndpoint == "" {
		// Without replay the next live message reveals the gap and clears.
		return nil
	}
	// Asked from the last message handled, which must come back byte for
	// byte: the engine may have restarted, its first messages dropped,
	// and counted past it meanwhile.
	msgs, from, restart, err := in.replayAfter(ctx)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if restart {
		in.log.Info("engine restarted while its messages were dropped: clearing instance", "last_seq", last)
		return in.restarted(ctx)
	}
	if err != nil || !contiguous(msgs, from) {
		in.countGap()
		in.countReplay(false)
		in.log.Warn("dropped messages: replay cannot fill them, clearing instance", "from", from, "err", err)
		in.tracker.Reset()
		return in.clear(ctx, kvstream.SyntheticGap)
	}
	if len(msgs) == 0 {
		return nil
	}
	in.countGap()
	in.countReplay(true)
	in.log.Info("dropped messages filled from replay", "from", from, "messages", len(msgs))
	return in.publishReplayed(ctx, msgs)
}

// handle publishes one live message after repairing what precedes it.
func (in *instance) handle(ctx context.Context, m enginezmq.Message) error {
	if in.duplicate(m) {
		return nil
	}
	// vLLM's topic names the publisher (kv@<ip>:<port>@<model>): another
	// topic on the same endpoint is another engine process, whatever its
	// seq says.
	newPublisher := in.topic != "" && m.Topic != in.topic
	in.topic = m.Topic
	wasDown := in.engineDown.Load()
	st, from := in.tracker.Observe(m.Seq)
	if newPublisher {
		st = enginezmq.SeqRestart
	}
	if st != enginezmq.SeqNext || wasDown {
		// Repairs read the last message's hash and the table: let every
		// message in flight be acknowledged first.
		if err := in.flush(ctx); err != nil {
			return err
		}
	}
	if st == enginezmq.SeqNext && wasDown {
		// Events again from an engine seen down: the seq follows on, but
		// a new process could have counted up to it; prove it is the same.
		in.tracker.Set(m.Seq - 1)
		if !in.sameEngine(ctx) {
			st = enginezmq.SeqRestart
		}
		in.tracker.Set(m.Seq)
	}
	if wasDown {
		in.engineDown.Store(false)
		in.b.m.engineDown.WithLabelValues(in.src.Instance).Set(0)
		in.log.Info("engine up again: events arrive")
	}
	switch st {
	case enginezmq.SeqFirst:
		if err := in.fillStart(ctx, m.Seq); err != nil {
			return err
		}
	case enginezmq.SeqGap:
		in.countGap()
		err := in.fillGap(ctx, from, m.Seq)
		if !errors.Is(err, errNotSameEngine) {
			if err != nil {
				return err
			}
			break
		}
		in.log.Info("engine restarted behind a gap: clearing instance", "seq", m.Seq)
		fallthrough
	case enginezmq.SeqRestart:
		in.log.Info("engine restarted: clearing instance, replaying the new process's first messages", "seq", m.Seq, "topic", m.Topic, "new_publisher", newPublisher)
		in.tracker.Reset()
		in.replayed = replayWindow{}
		if err := in.clear(ctx, kvstream.SyntheticRestart); err != nil {
			return err
		}
		// A loopback's history before m is the dead process's.
		if !in.src.LoopbackReplay {
			if err := in.fillStart(ctx, m.Seq); err != nil {
				return err
			}
		}
	}
	if err := in.publishEngine(ctx, m); err != nil {
		return err
	}
	in.tracker.Set(m.Seq)
	if wasDown {
		in.heartbeat()
	}
	return nil
}

// fillGap publishes [from, to) from the engine's replay, or clears the
// instance when it cannot. The replay starts one message earlier, at the
// last one published, which must come back unchanged: otherwise the
// engine is a new process that has counted past the old seq, and
// errNotSameEngine is returned without publishing anything.
func (in *instance) fillGap(ctx context.Context, from, to uint64) error {
	if in.src.ReplayEndpoint != "" {
		in.mu.Lock()
		hash := in.lastHash
		in.mu.Unlock()
		check := hash != 0 && from > 0
		start := from
		if check {
			start = from - 1
		}
		msgs, err := enginezmq.ReplayRange(ctx, in.replay, start, to)
		if err == nil && check {
			if xxhash.Sum64(msgs[0].Payload) != hash {
				return errNotSameEngine
			}
			msgs = msgs[1:]
		}
		if err == nil {
			in.countReplay(true)
			in.log.Info("gap filled from replay", "from", from, "to", to)
			for _, m := range msgs {
				if err := in.publishEngine(ctx, m); err != nil {
					return err
				}
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		in.log.Warn("gap: replay failed, clearing instance", "from", from, "to", to, "err", err)
	} else {
		in.log.Warn("gap: no replay endpoint, clearing instance", "from", from, "to", to)
	}
	in.countReplay(false)
	return in.clear(ctx, kvstream.SyntheticGap)
}

// publishEngine publishes an engine message unchanged and folds it into
// the table once JetStream has acknowledged it (in publish order).
func (in *instance) publishEngine(ctx context.Context, m enginezmq.Message) error {
	batch, derr := in.dec.Decode(m.Payload)
	h := kvstream.EventHeaders{Seq: m.Seq, HasSeq: true, Rank: in.src.Rank, Pool: in.b.cfg.Pool, Instance: in.src.Instance, Model: in.b.cfg.Model}
	if derr == nil && batch.Encoding != 0 {
		h.Encoding = batch.Encoding.String()
		in.enc.Store(uint32(batch.Encoding))
	}
	if derr != nil {
		// Published anyway: the payload is the engine's, and consumers
		// count what they cannot read. The table cannot use it.
		in.malformed.Add(1)
		in.b.m.malformed.WithLabelValues(in.src.Instance).Inc()
		if ok, suppressed := in.b.logLimit.Allow("malformed " + in.src.Instance); ok {
			in.log.Warn("malformed engine payload (published unchanged)", "seq", m.Seq, "err", derr, "suppressed", suppressed)
		}
	} else if batch.Invalid > 0 {
		if ok, suppressed := in.b.logLimit.Allow("invalid " + in.src.Instance); ok {
			in.log.Warn("unreadable engine events (published unchanged; consumers skip and count them)",
				"seq", m.Seq, "events", batch.Invalid, "first", batch.InvalidErr, "suppressed", suppressed)
		}
	}
	if in.oversize(len(m.Payload), h) {
		// NATS refuses it, at every attempt: retrying would hold every
		// later message of the engine behind it for good.
		return in.publishOversize(ctx, m, batch, derr)
	}
	if derr == nil && batch.InvalidRemovals == 0 && in.b.cfg.Coalesce > 1 {
		// Joinable: a well-formed payload that needs no clear after it.
		return in.join(ctx, m, batch.Events, h.Encoding)
	}
	// Published alone, after whatever is being joined.
	if err := in.seal(ctx); err != nil {
		return err
	}
	if err := in.publishAsync(ctx, m.Payload, h, 1, func(seq uint64) {
		in.applyAcked([]enginezmq.Message{m}, [][]events.Event{batch.Events}, seq)
	}); err != nil {
		return err
	}
	if derr == nil && batch.InvalidRemovals > 0 {
		// The engine dropped blocks nobody can be told of: the table and
		// every index would hold them as fresh. Clear the instance, as
		// after a gap replay cannot fill (publish flushes the window
		// first, so the message's own blocks are folded in before).
		in.log.Warn("unreadable removal: clearing instance", "seq", m.Seq, "events", batch.InvalidRemovals)
		return in.clear(ctx, kvstream.SyntheticGap)
	}
	return nil
}

// publishOversize publishes an engine message larger than the server's
// max payload, which cannot go as it is, as a resync: the message is
// folded into the table as if acknowledged (after every message before it
// is), then a clear and the whole table follow in chunks that fit
// (publishResync). A consumer ends with exactly the table, the message's
// blocks included; the engine seq and payload hash become the message's,
// so that the next message follows on and the restart checks compare
// this one (the engine's replay holds it). Consumers need nothing new:
// the resync is what a bridge publishes at start and after a reorder, and
// it resets their seq continuity, so the next engine message applies
// after it, in order.
//
// Why not several NATS messages cut at event boundaries: they cannot all
// carry the message's engine seq (a consumer applies a seq once and skips
// the others as duplicates — and a skipped part holding removals would
// leave it blocks the engine dropped), a single event can be over the
// limit by itself (one store of 20,000 blocks), and parts without the
// seq would be a new kind of message for every consumer and snapshot to
// place. The resync costs the whole table (at most MaxBlocks blocks)
// rather than the message, once per such message, which is rare.
//
// What the table cannot hold the consumers do not get: a table bounded
// below what the message stores keeps what its bound lets it (Table:
// the newest blocks, or none of a chain whose evicted head passes the
// ghost bound): fewer than the engine, never one it does not hold. A message that does not decode,
// or has a removal that cannot be read, cannot be folded in: it is
// dropped, counted (kvbridge_drops_total{reason="oversize"}), and the
// instance cleared, as after a gap replay cannot fill.
func (in *instance) publishOversize(ctx context.Context, m enginezmq.Message, batch events.Batch, derr error) error {
	if err := in.flush(ctx); err != nil {
		return err
	}
	mp := in.b.cfg.Conn.MaxPayload()
	if derr != nil || batch.InvalidRemovals > 0 {
		in.dropped.Add(1)
		in.b.m.drops.WithLabelValues(in.src.Instance, "oversize").Inc()
		in.log.Warn("engine message larger than the NATS server's max payload and not readable whole: dropped, clearing instance",
			"seq", m.Seq, "bytes", len(m.Payload), "max_payload", mp, "err", derr, "invalid_removals", batch.InvalidRemovals)
		return in.clear(ctx, kvstream.SyntheticGap)
	}
	in.mu.Lock()
	cur := in.streamSeq
	in.mu.Unlock()
	// The stream position stays: nothing of the message is in the stream
	// yet, and a snapshot taken meanwhile (the table with it, the old
	// position) makes a consumer apply the resync after it, which ends the
	// same.
	in.applyAcked([]enginezmq.Message{m}, [][]events.Event{batch.Events}, cur)
	in.oversizeResyncs.Add(1)
	in.b.m.oversizeResyncs.WithLabelValues(in.src.Instance).Inc()
	in.log.Warn("engine message larger than the NATS server's max payload: folded into the table, publishing a resync (clear, then the table)",
		"seq", m.Seq, "bytes", len(m.Payload), "max_payload", mp)
	return in.publishResync(ctx)
}

// oversize reports whether a payload of n bytes under headers h (and the
// message id every publish adds) is more than the server takes.
func (in *instance) oversize(n int, h kvstream.EventHeaders) bool {
	mp := in.b.cfg.Conn.MaxPayload()
	if mp <= 0 {
		return false
	}
	hdr := len("NATS/1.0\r\n\r\n") + len(nats.MsgIdHdr) + len(in.b.cfg.Pool) + len(in.src.Instance) + len(in.b.runID) + 24 + 4
	for k, vs := range h.Header() {
		for _, v := range vs {
			hdr += len(k) + len(v) + 4
		}
	}
	return int64(n+hdr) > mp
}

// applyAcked folds acknowledged engine messages into the table: one, or
// the batches of a coalesced message (ms, their events evs, in order),
// all under one hold of the lock, so that a snapshot or heartbeat never
// shows part of a coalesced message beside its stream sequence (a
// consumer loading it skips the stream up to that sequence: the batches
// not yet applied would be lost to it). The last message sets engineSeq
// and lastHash (only its payload is hashed). Eviction records are
// published after, one per tier for the whole message (evictions).
func (in *instance) applyAcked(ms []enginezmq.Message, evs [][]events.Event, seq uint64) {
	res := in.results[:0]
	in.mu.Lock()
	for i := range ms {
		res = append(res, in.table.Apply(evs[i]))
	}
	last := ms[len(ms)-1]
	in.engineSeq, in.hasSeq, in.streamSeq = last.Seq, true, seq
	in.lastHash = xxhash.Sum64(last.Payload)
	n := in.table.Len()
	in.mu.Unlock()
	in.counters.tableBlocks.Set(float64(n))
	var acc evictions
	for i := range res {
		r := &res[i]
		if r.Evicted > 0 {
			in.b.m.tableFull.WithLabelValues(in.src.Instance).Add(float64(r.Evicted))
			in.log.Warn("block table full: dropped held blocks (raise --max-blocks to the engine's block count)", "dropped", r.Evicted, "max", in.b.cfg.MaxBlocks)
		}
		in.countEvents(evs[i])
		for _, rm := range r.Removed {
			acc.add(rm.Tier, rm.Hashes)
		}
		if r.Cleared > 0 {
			acc.flush(in)
			in.evict(kvstream.EvictionRecord{Tier: kvstream.TierAll, Blocks: r.Cleared, Time: time.Now().UTC(), Reason: kvstream.ReasonCleared})
		}
	}
	acc.flush(in)
	clear(res)
	in.results = res[:0]
}

// evictions gathers removed blocks by tier, in the order the tiers first
// appear, so that a coalesced message's batches publish one eviction
// record per tier (evict splits a long one) instead of one per batch.
type evictions struct {
	tiers  []tiers.Tier
	hashes [][]uint64
}

func (a *evictions) add(t tiers.Tier, hs []uint64) {
	for i, have := range a.tiers {
		if have == t {
			a.hashes[i] = append(a.hashes[i], hs...)
			return
		}
	}
	a.tiers = append(a.tiers, t)
	a.hashes = append(a.hashes, hs)
}

// flush publishes what was gathered and empties a.
func (a *evictions) flush(in *instance) {
	if len(a.tiers) == 0 {
		return
	}
	now := time.Now().UTC()
	for i, t := range a.tiers {
		in.evict(kvstream.EvictionRecord{Tier: t.String(), Blocks: len(a.hashes[i]), Hashes: a.hashes[i], Time: now, Reason: kvstream.ReasonEvicted})
	}
	a.tiers, a.hashes = a.tiers[:0], a.hashes[:0]
}

func (in *instance) countEvents(evs []events.Event) {
	for i := range evs {
		e := &evs[i]
		tier, tierIdx := kvstream.TierAll, tiers.Count
		if e.Kind != events.AllBlocksCleared {
			t, _ := tiers.FromMedium(e.Medium)
			tier, tierIdx = t.String(), int(t)
		}
		c := in.counters.kind(e.Kind, tierIdx, tier)
		c[0].Inc()
		if n := len(e.BlockHashes); n > 0 {
			c[1].Add(float64(n))
		}
	}
}

// evict publishes an eviction record; one listing more hashes than
// kvstream.MaxEvictionHashes goes as several, so that every removed block
// appears in exactly one record.
func (in *instance) evict(rec kvstream.EvictionRecord) {
	rec.Pool, rec.Instance = in.b.cfg.Pool, in.src.Instance
	rest := rec.Hashes
	for {
		if len(rest) > 0 {
			n := min(len(rest), kvstream.MaxEvictionHashes)
			rec.Hashes, rest = rest[:n], rest[n:]
			rec.Blocks = n
		}
		data, err := rec.AppendJSON(make([]byte, 0, 160+21*len(rec.Hashes)))
		if err != nil {
			return
		}
		// Core NATS, best effort: eviction records are for dashboards.
		_ = in.b.cfg.Conn.Publish(in.evictSubj, data)
		if len(rest) == 0 {
			return
		}
	}
}

// clear publishes a synthetic AllBlocksCleared and empties the table.
func (in *instance) clear(ctx context.Context, reason string) error {
	payload, err := events.Encode(nil, events.Batch{
		TS:        float64(time.Now().UnixNano()) / 1e9,
		Events:    []events.Event{{Kind: events.AllBlocksCleared}},
		DPRank:    in.src.Rank,
		HasDPRank: true,
	}, in.encoding())
	if err != nil {
		return fmt.Errorf("bridge: encode clear: %w", err)
	}
	seq, err := in.publish(ctx, payload, kvstream.EventHeaders{Rank: in.src.Rank, Encoding: in.encoding().String(),
		Pool: in.b.cfg.Pool, Instance: in.src.Instance, Model: in.b.cfg.Model, Synthetic: reason})
	if err != nil {
		return err
	}
	in.mu.Lock()
	n := in.table.Clear()
	in.streamSeq = seq
	in.hasSeq, in.lastHash = false, 0
	in.mu.Unlock()
	in.b.m.tableBlocks.WithLabelValues(in.src.Instance).Set(0)
	in.clears.Add(1)
	in.b.m.clears.WithLabelValues(in.src.Instance, reason).Inc()
	in.evict(kvstream.EvictionRecord{Tier: kvstream.TierAll, Blocks: n, Time: time.Now().UTC(), Reason: reason})
	return nil
}

func (in *instance) encoding() events.Encoding { return events.Encoding(in.enc.Load()) }
