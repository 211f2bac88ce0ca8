// Package consumer is the router side of the KV-event transport: it
// consumes kv.events.<pool>.> from JetStream into an index, in order per
// instance, rebuilding instances from snapshots so that a restarted router
// holds the same index as one that never stopped; it discovers instances
// from heartbeats, marks silent ones stale and purges them.
//
// Files by concern: consumer.go (Config, New, Run), order.go (a stream
// message's path: dispatch to its instance's shard, the shard's work loop,
// skipping what a snapshot covers, sequence gaps, applying), snapshot.go
// (snapshot loads and the replay after them), liveness.go (heartbeats,
// admission of new names, stale and purged instances), status.go (what the
// router reads: Healthy, Ready, Live, Instances), shared.go (the
// shared-Redis index: positions, seeding, repair), metrics.go.
package consumer

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/ratelog"
	"github.com/kvrouter/kvrouter/internal/tick"
	"github.com/kvrouter/kvrouter/internal/zero"
	"github.com/kvrouter/kvrouter/kvindex"
)

// Applier is what the consumer feeds: kvindex.Index satisfies it. Apply
// calls for one instance come from one goroutine, in stream order; calls
// for different instances may overlap. evs and their slices are the
// consumer's decode buffers, valid only until Apply returns: an Applier
// copies what it keeps.
type Applier interface {
	Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error)
	Purge(ctx context.Context, instance string) error
}

var _ Applier = kvindex.Index(nil)

// DefaultMaxInstances is Config.MaxInstances when unset.
const DefaultMaxInstances = 4096

// Config configures a Consumer. Zero values mean the documented defaults.
type Config struct {
	// Conn is the NATS connection; required.
	Conn *nats.Conn
	// Pool is the pool whose instances are consumed; required.
	Pool string
	// Applier receives the events (the pool's kvindex.Index); required.
	Applier Applier
	// Stream and Bucket name the events stream and the snapshot bucket;
	// both are created when missing (the router may start before any
	// bridge).
	Stream kvstream.StreamConfig
	Bucket kvstream.BucketConfig
	// SharedIndex says the Applier is shared with other routers (the
	// Redis index): then the consumer never purges instances from it and
	// consumes only new messages: the shared map is kept current by every
	// router. When the Applier is a SharedApplier, each message is applied
	// once whichever router gets there first, and a router repairs the
	// shared map from snapshots and the stream when it finds it behind or
	// emptied (see SharedApplier); otherwise the consumer only keeps up.
	SharedIndex bool
	// Shards is the number of apply goroutines (default 4); each instance
	// always maps to the same one, so its events stay in order.
	Shards int
	// SnapshotTimeout bounds a snapshot request to a bridge before the
	// bucket is used instead (default 2s).
	SnapshotTimeout time.Duration
	// StaleAfter marks an instance stale after this much silence (no
	// heartbeat, no event); default 15s, three missed 5s heartbeats.
	StaleAfter time.Duration
	// PurgeAfter purges a silent instance from the index (default 10m:
	// long enough to ride out a bridge or NATS restart).
	PurgeAfter time.Duration
	// CheckInterval is the stale/purge check period (default 1s).
	CheckInterval time.Duration
	// MaxLag is how far behind the stream (JetStream store time of the
	// message being applied) the consumer may be and still call itself
	// healthy (default 5s): while it catches up after a start or an outage
	// the index is behind and exact routing should not trust it.
	MaxLag time.Duration
	// Admit says whether an instance not yet known may get a record from
	// its events alone (the router: the pool's configured instances).
	// Otherwise a name needs an admitted heartbeat, or a snapshot in the
	// bucket, first: a message on a junk subject then creates nothing
	// (counted as messages{result="unknown_instance"}). nil admits any
	// name (tools and tests that publish events without bridges).
	Admit func(instance string) bool
	// AdmitHeartbeat vets a heartbeat (signature, URL allow-list) before
	// it creates or refreshes a record; an error refuses it, counted as
	// heartbeats{result="refused"} (the caller logs and counts why). nil
	// admits every well-formed heartbeat.
	AdmitHeartbeat func(instance string, m *nats.Msg, hb *kvstream.Heartbeat) error
	// EngineDown, when set, is called once each time an admitted
	// heartbeat first reports an instance's engine down (the bridge's
	// health probes fail and no event arrives), from the goroutine that
	// reads heartbeats: it must not block. The router ejects the instance
	// with it instead of waiting for its own health checks.
	EngineDown func(instance string)
	// MaxInstances caps the instance records (default 4096, far above a
	// pool's engines times data-parallel ranks): a new name beyond it is
	// dropped and counted (result over_cap) unless Admit names it.
	// Purged instances are forgotten, so the cap is of names seen within
	// PurgeAfter.
	MaxInstances int
	// Registerer receives the consumer's metrics (nil: not registered).
	Registerer prometheus.Registerer
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Consumer feeds one pool's events into an Applier.
type Consumer struct {
	cfg Config
	js  jetstream.JetStream
	// stream, kv and obs are set once by Run before any shard starts.
	stream jetstream.Stream
	kv     jetstream.KeyValue
	obs    jetstream.ObjectStore
	m      *metrics
	seed   maphash.Seed
	// logLimit bounds the lines logged for names refused a record and for
	// payloads or events that could not be read.
	logLimit *ratelog.Limiter

	shards []chan work

	// shared is set with SharedIndex and a SharedApplier (see shared.go).
	shared  *sharedState
	epochOK atomic.Bool // shared: Redis answered the last epoch check, data not lost since
	// answered: shared, when an epoch check last answered, as monoNow
	// (0: never); unanswered longer than epochDue, Redis counts as
	// unreachable (see epochFresh). hungLogged: that was logged. born is
	// monoNow's reference.
	answered   atomic.Int64
	hungLogged atomic.Bool
	born       time.Time
	// renumbered: shared index, the stream was re-created under it (see
	// restream): the index's positions number the old stream, so the
	// consumer reports itself unhealthy until the router restarts.
	renumbered atomic.Bool
	unsynced   atomic.Int64 // shared: instances with status.IndexUnsynced

	running atomic.Bool
	// caughtUp: a message was dispatched with nothing pending after it.
	caughtUp atomic.Bool
	// ready: the index was rebuilt once (Ready).
	ready   atomic.Bool
	lastErr atomic.Int64 // unix nanos of the last consume error
	lag     atomic.Int64 // nanoseconds behind the stream at the last message delivered
	// evSubj, streamName: what is consumed (set by Run); sc: the ordered
	// consumer in use and its watchdog's state (watchdog.go).
	evSubj, streamName string
	sc                 streamCons

	// mu guards insts and every *inst's status fields. Read-mostly: Live
	// is on the router's request path, once per candidate.
	mu    sync.RWMutex
	insts map[string]*inst

	// afterListing, tests only: called by Run after the start's listing
	// of the bucket's snapshots, before the stream consumer is created,
	// so that a test can store messages in that window.
	afterListing func()
}

// inst is one instance's state.
type inst struct {
	status   InstanceStatus // guarded by Consumer.mu
	lastSeen time.Time      // guarded by Consumer.mu
	hasSeq   bool           // guarded by Consumer.mu
	// reloading: an engine came back up and its snapshot reload is
	// queued; it turns live when the reload is done. Guarded by Consumer.mu.
	reloading bool
	// lost counts the times the instance's cache was lost or could not be
	// vouched for: a clear by the bridge (gap, restart, resync) or the
	// engine, the engine reported down, a purge. Guarded by Consumer.mu.
	lost uint64
	// loadFailed: its last snapshot load found a snapshot it could not
	// read; the next heartbeat queues another (a quiet engine sends no
	// event to retry at). Guarded by Consumer.mu.
	loadFailed bool
	// short: its last reload's replay of the stream after the snapshot
	// stopped before the messages applied ahead of the reload (the stream
	// did not answer, or the index refused a batch): the state is an
	// older snapshot without their removals, so the instance is not live
	// (seenAt) until a reload completes, queued by its next message or
	// heartbeat, loadRetryAt apart. Memory index. Guarded by Consumer.mu.
	short bool
	// backwardsAt: the engine seq applied when a heartbeat last showed
	// the bridge's behind it (heartbeat), so that with the shared index,
	// which does not reload for it, one episode is counted and logged
	// once, until the new process's seqs pass it (the memory index
	// reloads at each until the state holds the new process's seqs).
	// Guarded by Consumer.mu.
	backwardsAt uint64
	// holeAt: the stream seq of the first message after the last hole a
	// shared-index replay found in the instance's engine seqs, so that a
	// hole met again at every repair is counted and logged once. Guarded
	// by Consumer.mu.
	holeAt uint64
	// hole: the stream seq of the instance's message after a hole in its
	// engine seqs that no snapshot loaded since reaches (0: none). What
	// the lost messages did is missing from the index, so the instance is
	// not live (shared index: setSynced; memory: holdHole) until a
	// snapshot loaded at or past it, or a clear applied after it, makes
	// its state exact again. Written by the shard goroutine; guarded by
	// Consumer.mu.
	hole uint64
	// clearAt: the stream seq of the instance's last clear by its bridge
	// (or of a snapshot loaded without an engine seq: a table after one),
	// while no engine seq has followed it (hasSeq false): the stream
	// position its next engine message follows on from (lostSinceClear).
	// 0: none known. Written by the shard goroutine; guarded by
	// Consumer.mu.
	clearAt uint64
	// Owned by the instance's shard goroutine.
	needLoad bool
	// resync: whether the instance's last message this router took in (or
	// the snapshot it loaded, which is never inside a resync) is part of
	// a bridge's resync: its clear or a table chunk after it (orphanChunk).
	resync resyncState
	// run and prevRun: the bridge runs (from the message ids) of the
	// instance's last message and of the last one before it from another
	// run; a message of prevRun means two bridges alternate (publisher).
	run, prevRun string
	skipUpTo     uint64
	// restreamed: the stream was re-created and no message of the
	// instance has been seen in the new one since: a snapshot's stream
	// seq may number the old stream, so a load takes none as a position
	// (load).
	restreamed bool
	// retryAt: after a failed load, or one (or, shared index, a repair)
	// that fell short of a hole, no event or heartbeat tries again before
	// it (loadRetryAt); zero when the last load neither failed nor fell
	// short.
	retryAt time.Time
	// Shared index (shared.go). from: the position the index should be at
	// before this router's next message of the instance (shard-owned;
	// expect is a copy for watchShared, guarded by Consumer.mu);
	// skipped/skippedAt: the last message left to another router's writer
	// lease, not yet seen applied; yielded: it was left to a writer whose
	// lease had run out (checked a check interval later, not a lease);
	// syncQueued: a sync is queued (all guarded by Consumer.mu).
	from       kvindex.Position
	expect     kvindex.Position
	skipped    uint64
	skippedAt  time.Time
	yielded    bool
	syncQueued bool
	// await (0: none): the stream seq the index must reach before the
	// instance is live again, set when this router found, or could not
	// rule out, the index missing messages it consumed (an apply or a
	// read failed; a check or a sync found it behind) and the repair may
	// be another router's, its writer's: a message left to that writer,
	// or a sync that finds it, counts the instance live only once the
	// index is at or past await (shared.go, setSyncedAt). Guarded by
	// Consumer.mu.
	await uint64
}

// resyncState is what a router knows of an instance's last message, for
// a resync's table chunk to tell whether it follows its clear.
type resyncState uint8

const (
	resyncUnknown resyncState = iota // nothing taken in yet: a shared index's router that started after it
	resyncClosed                     // an engine message, another synthetic one, or a snapshot
	resyncOpen                       // a resync's clear, or a chunk after it
)

type workKind uint8

const (
	workEvent workKind = iota
	workLoad
	workPurge
	// workBarrier marks a point in a shard's queue: done is called once
	// everything queued before it has been applied.
	workBarrier
	workReload // the engine is back up: reload the bridge's table, then live
	// workRestream: the stream was re-created; the instance's positions in
	// the old one are forgotten and its snapshot reloaded (restream).
	workRestream
	// workTail: a heartbeat's stream seq (streamSeq) is past the
	// instance's last message here: check the stream still holds the
	// messages between (lostTail).
	workTail
)

type work struct {
	kind      workKind
	instance  string
	streamSeq uint64
	header    nats.Header
	data      []byte
	stored    time.Time
	done      func() // workBarrier
}

// New validates cfg.
func New(cfg Config) (*Consumer, error) {
	if cfg.Conn == nil {
		return nil, errors.New("consumer: no NATS connection")
	}
	if cfg.Applier == nil {
		return nil, errors.New("consumer: no applier (index)")
	}
	if err := kvstream.ValidToken("pool", cfg.Pool); err != nil {
		return nil, fmt.Errorf("consumer: %w", err)
	}
	zero.Default(&cfg.Shards, 4)
	zero.Default(&cfg.SnapshotTimeout, 2*time.Second)
	zero.Default(&cfg.StaleAfter, 15*time.Second)
	zero.Default(&cfg.PurgeAfter, 10*time.Minute)
	zero.Default(&cfg.CheckInterval, time.Second)
	zero.Default(&cfg.MaxLag, 5*time.Second)
	zero.Default(&cfg.MaxInstances, DefaultMaxInstances)
	if cfg.MaxInstances < 0 || cfg.MaxLag < 0 || cfg.Shards < 0 || cfg.SnapshotTimeout < 0 || cfg.StaleAfter < 0 || cfg.PurgeAfter < 0 || cfg.CheckInterval < 0 {
		return nil, errors.New("consumer: negative shards or interval in config")
	}
	if cfg.PurgeAfter < cfg.StaleAfter {
		return nil, fmt.Errorf("consumer: purge after %v is shorter than stale after %v", cfg.PurgeAfter, cfg.StaleAfter)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m, err := newMetrics(cfg.Registerer, cfg.Pool)
	if err != nil {
		return nil, fmt.Errorf("consumer: metrics: %w", err)
	}
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return nil, fmt.Errorf("consumer: jetstream: %w", err)
	}
	c := &Consumer{cfg: cfg, js: js, m: m, seed: maphash.MakeSeed(), insts: map[string]*inst{}, logLimit: ratelog.New(10*time.Second, 5), born: time.Now()}
	if sa, ok := cfg.Applier.(SharedApplier); ok && cfg.SharedIndex {
		c.shared = &sharedState{idx: sa}
	}
	consistent := c.consistentValue
	m.consistentFn.Store(&consistent)
	c.shards = make([]chan work, cfg.Shards)
	for i := range c.shards {
		c.shards[i] = make(chan work, 256)
	}
	return c, nil
}

// Run consumes until ctx is done and returns ctx.Err(), or an error when
// the stream or bucket cannot be made for a configuration reason
// (kvstream.IsConfigError: another stream holds the subjects, an invalid
// setting); outages are retried with backoff until ctx is done.
func (c *Consumer) Run(ctx context.Context) error {
	res, err := kvstream.EnsureAll(ctx, c.js, c.cfg.Stream, c.cfg.Bucket, c.cfg.Logger)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("consumer: %w", err)
	}
	c.stream, c.kv, c.obs = res.Stream, res.Bucket, res.ObjectStore
	if info := res.Stream.CachedInfo(); info != nil {
		c.sc.created = info.Created
	}
	// Deferred in this order so that every return cancels the shards
	// first and then waits for them.
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range c.shards {
		wg.Add(1)
		go func() { defer wg.Done(); c.shard(ctx, c.shards[i]) }()
	}

	hbSubj, _ := kvstream.PoolSubjects(kvstream.SubjectInstances, c.cfg.Pool)
	hbSub, err := c.cfg.Conn.Subscribe(hbSubj, func(m *nats.Msg) { c.heartbeat(ctx, m) })
	if err != nil {
		return fmt.Errorf("consumer: subscribe %s: %w", hbSubj, err)
	}
	defer func() { _ = hbSub.Unsubscribe() }()

	deliver := jetstream.DeliverAllPolicy
	var start uint64 // the stream seq the consumer starts at (0: by deliver)
	switch {
	case c.shared != nil:
		deliver = jetstream.DeliverNewPolicy
		// From the stream's end as it was before the listing, not as it
		// is when the consumer is made: what is stored in between is
		// delivered (a message of an instance in no snapshot listed, or
		// one after a listed instance's sync read the stream), and what
		// is stored before is brought in by the syncs (startSeq).
		start = c.startSeq(ctx, res.Stream)
		wg.Add(1)
		go func() { defer wg.Done(); c.watchShared(ctx) }()
		c.syncKnown(ctx)
	case c.cfg.SharedIndex:
		deliver = jetstream.DeliverNewPolicy
	default:
		c.loadKnown(ctx)
	}
	c.evSubj, _ = kvstream.PoolSubjects(kvstream.SubjectEvents, c.cfg.Pool)
	c.streamName = c.cfg.Stream.Name
	zero.Default(&c.streamName, kvstream.DefaultStreamName)
	if c.afterListing != nil {
		c.afterListing()
	}
	s := &c.sc
	cons, cc, err := c.startConsumer(ctx, ctx, 0, deliver, start)
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	s.mu.Lock()
	s.cons, s.cc = cons, cc
	// Where it starts: what a replacement resumes after until it
	// delivers.
	if start > 0 {
		s.seq = start - 1
	} else if info := cons.CachedInfo(); info != nil {
		s.seq = info.Delivered.Stream
	}
	s.done.Store(s.seq)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		cc := s.cc
		s.mu.Unlock()
		cc.Stop()
	}()
	c.running.Store(true)
	defer c.running.Store(false)
	wg.Add(3)
	go func() { defer wg.Done(); c.awaitRebuilt(ctx, s.current) }()
	go func() { defer wg.Done(); c.watch(ctx, deliver) }()
	go func() { defer wg.Done(); c.markOnDisconnect(ctx) }()

	return tick.Every(ctx, c.cfg.CheckInterval, func() { c.check(ctx) })
}

// startSeq is where a router on a shared index starts consuming: after
// the stream's last message, read before the bucket is listed. Every
// message after it is delivered; every instance with a message at or
// before it is brought whole by a sync before it counts as live (listed
// with a snapshot, or made known by a heartbeat: newInst, heartbeat), or
// by its first message after it. The stream info from EnsureAll, read
// earlier still, stands in when the stream does not answer (a few more
// messages delivered, each applied once); without either, the stream is
// consumed from its start.
func (c *Consumer) startSeq(ctx context.Context, st jetstream.Stream) uint64 {
	ictx, cancel := context.WithTimeout(ctx, apiTimeout)
	info, err := st.Info(ictx)
	cancel()
	if err != nil {
		info = st.CachedInfo()
	}
	if info == nil {
		return 1
	}
	return info.State.LastSeq + 1
}
