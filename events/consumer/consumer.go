// Package consumer is the router side of the KV-event transport: it
// consumes kv.events.<pool>.> from JetStream into an index, in order per
// instance, rebuilding instances from snapshots so that a restarted router
// holds the same index as one that never stopped; it discovers instances
// from heartbeats, marks silent ones stale and purges them.
package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/events"

	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/ratelog"
	"github.com/kvrouter/kvrouter/kvindex"
)

// Applier is what the consumer feeds: kvindex.Index satisfies it. Apply
// calls for one instance come from one goroutine, in stream order; calls
// for different instances may overlap.
type Applier interface {
	Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error)
	Purge(ctx context.Context, instance string) error
}

var _ Applier = kvindex.Index(nil)

// State is an instance's state as the consumer sees it.
type State uint8

const (
	// StateLive: heartbeats or events arrive; its index entries count.
	StateLive State = iota + 1
	// StateStale: silent for longer than StaleAfter; its entries should
	// not count for routing, but are kept in case it comes back.
	StateStale
	// StatePurged: silent for longer than PurgeAfter; its entries are gone.
	StatePurged
)

func (s State) String() string {
	switch s {
	case StateLive:
		return "live"
	case StateStale:
		return "stale"
	case StatePurged:
		return "purged"
	}
	return "unknown"
}

// MarshalText renders the state's name in JSON.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

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

// InstanceStatus is the consumer's view of one instance.
type InstanceStatus struct {
	Instance      string    `json:"instance"`
	State         State     `json:"state"`
	LastSeq       uint64    `json:"last_seq"`
	LastEvent     time.Time `json:"last_event"`
	LastHeartbeat time.Time `json:"last_heartbeat"`
	Gaps          uint64    `json:"gaps"`
	Clears        uint64    `json:"clears"`
	Malformed     uint64    `json:"malformed"`
	Unknown       uint64    `json:"unknown_events"`
	SnapshotSeq   uint64    `json:"snapshot_stream_seq"`
	// ReplayLost counts reloads whose snapshot was older than messages
	// already applied that the stream no longer holds (see replay).
	ReplayLost uint64 `json:"replay_lost"`
	// IndexUnsynced: the instance's state in the shared index is not
	// known whole (being repaired); the instance is not live meanwhile.
	IndexUnsynced bool                `json:"index_unsynced,omitempty"`
	StreamSeq     uint64              `json:"stream_seq"`
	Heartbeat     *kvstream.Heartbeat `json:"heartbeat,omitempty"`
	// EngineDown: the bridge reports the engine dead (see
	// kvstream.Heartbeat.EngineDown); the instance is not live meanwhile.
	EngineDown bool `json:"engine_down,omitempty"`
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
	// logLimit bounds the lines logged for names refused a record.
	logLimit *ratelog.Limiter

	shards []chan work

	// shared is set with SharedIndex and a SharedApplier (see shared.go).
	shared   *sharedState
	epochOK  atomic.Bool  // shared: Redis answered the last epoch check, data not lost since
	unsynced atomic.Int64 // shared: instances with status.IndexUnsynced

	running atomic.Bool
	// caughtUp: a message was dispatched with nothing pending after it.
	caughtUp atomic.Bool
	// ready: the index was rebuilt once (Ready).
	ready   atomic.Bool
	lastErr atomic.Int64 // unix nanos of the last consume error
	lag     atomic.Int64 // nanoseconds behind the stream at the last message delivered

	// mu guards insts and every *inst's status fields. Read-mostly: Live
	// is on the router's request path, once per candidate.
	mu    sync.RWMutex
	insts map[string]*inst
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
	// Owned by the instance's shard goroutine.
	needLoad bool
	skipUpTo uint64
	// Shared index (shared.go). from: the position the index should be at
	// before this router's next message of the instance (shard-owned;
	// expect is a copy for watchShared, guarded by Consumer.mu);
	// skipped/skippedAt: the last message left to another router's writer
	// lease, not yet seen applied; syncQueued: a sync is queued (both
	// guarded by Consumer.mu).
	from       kvindex.Position
	expect     kvindex.Position
	skipped    uint64
	skippedAt  time.Time
	syncQueued bool
}

type workKind uint8

const (
	workEvent workKind = iota
	workLoad
	workPurge
	// workBarrier marks a point in a shard's queue: done is called once
	// everything queued before it has been applied.
	workBarrier
	workReload // the engine is back up: reload the bridge's table, then live
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
	if cfg.Shards == 0 {
		cfg.Shards = 4
	}
	if cfg.SnapshotTimeout == 0 {
		cfg.SnapshotTimeout = 2 * time.Second
	}
	if cfg.StaleAfter == 0 {
		cfg.StaleAfter = 15 * time.Second
	}
	if cfg.PurgeAfter == 0 {
		cfg.PurgeAfter = 10 * time.Minute
	}
	if cfg.CheckInterval == 0 {
		cfg.CheckInterval = time.Second
	}
	if cfg.MaxLag == 0 {
		cfg.MaxLag = 5 * time.Second
	}
	if cfg.MaxInstances == 0 {
		cfg.MaxInstances = DefaultMaxInstances
	}
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
	c := &Consumer{cfg: cfg, js: js, m: m, seed: maphash.MakeSeed(), insts: map[string]*inst{}, logLimit: ratelog.New(10*time.Second, 5)}
	if sa, ok := cfg.Applier.(SharedApplier); ok && cfg.SharedIndex {
		c.shared = &sharedState{idx: sa}
	}
	c.updateConsistent()
	c.shards = make([]chan work, cfg.Shards)
	for i := range c.shards {
		c.shards[i] = make(chan work, 256)
	}
	return c, nil
}

// Healthy reports whether the stream is being consumed: NATS connected,
// the consumer running, no consume error in the last 10s unless a
// delivery has followed it, not more than
// MaxLag behind the stream, and a shared index reachable with its data.
// The exact (kv_aware) strategy falls back to the heuristic when it is not.
func (c *Consumer) Healthy() bool {
	if !c.running.Load() || !c.cfg.Conn.IsConnected() {
		return false
	}
	if c.shared != nil && !c.epochOK.Load() {
		return false
	}
	if time.Duration(c.lag.Load()) > c.cfg.MaxLag {
		return false
	}
	last := c.lastErr.Load()
	return last == 0 || time.Since(time.Unix(0, last)) > 10*time.Second
}

// Ready reports whether the index has been rebuilt since Run started:
// the snapshots known at start loaded, the stream's history as of then
// applied, and the consumer healthy. It stays true once set (a later
// outage is what Healthy reports).
func (c *Consumer) Ready() bool { return c.ready.Load() }

// awaitRebuilt sets ready once the consumer is healthy, has been
// delivered everything the stream held for the pool, and every shard has
// applied what was queued before (snapshot loads included).
func (c *Consumer) awaitRebuilt(ctx context.Context, cons jetstream.Consumer) {
	t0 := time.Now()
	for !c.delivered(ctx, cons) {
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	passed := make(chan struct{}, len(c.shards))
	for _, ch := range c.shards {
		select {
		case ch <- work{kind: workBarrier, done: func() { passed <- struct{}{} }}:
		case <-ctx.Done():
			return
		}
	}
	for range c.shards {
		select {
		case <-passed:
		case <-ctx.Done():
			return
		}
	}
	c.ready.Store(true)
	c.cfg.Logger.Info("consumer: index rebuilt", "took", time.Since(t0).Round(time.Millisecond))
}

// delivered: healthy, and nothing of the pool's stream left to dispatch
// (the last message dispatched had none pending, or there was none).
func (c *Consumer) delivered(ctx context.Context, cons jetstream.Consumer) bool {
	if !c.Healthy() {
		return false
	}
	if c.caughtUp.Load() {
		return true
	}
	info, err := cons.Info(ctx)
	return err == nil && info.NumPending == 0 && info.Delivered.Consumer == 0
}

// Live reports whether the instance is known and live: its index entries
// should count for routing.
func (c *Consumer) Live(instance string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	in := c.insts[instance]
	return in != nil && in.status.State == StateLive && !in.status.IndexUnsynced
}

// LostEpoch counts the times the instance's cache was lost or could not be
// vouched for (cleared, restarted, engine down, purged). A guess about what
// the instance holds made under one epoch — the router's speculative
// entries — is void under the next.
func (c *Consumer) LostEpoch(instance string) uint64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if in := c.insts[instance]; in != nil {
		return in.lost
	}
	return 0
}

// Instances returns every known instance's status, sorted by name.
func (c *Consumer) Instances() []InstanceStatus {
	c.mu.RLock()
	out := make([]InstanceStatus, 0, len(c.insts))
	for _, in := range c.insts {
		s := in.status
		if s.Heartbeat != nil {
			hb := *s.Heartbeat
			s.Heartbeat = &hb
		}
		out = append(out, s)
	}
	c.mu.RUnlock()
	slices.SortFunc(out, func(a, b InstanceStatus) int {
		switch {
		case a.Instance < b.Instance:
			return -1
		case a.Instance > b.Instance:
			return 1
		}
		return 0
	})
	return out
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
	switch {
	case c.shared != nil:
		deliver = jetstream.DeliverNewPolicy
		wg.Add(1)
		go func() { defer wg.Done(); c.watchShared(ctx) }()
		c.syncKnown(ctx)
	case c.cfg.SharedIndex:
		deliver = jetstream.DeliverNewPolicy
	default:
		c.loadKnown(ctx)
	}
	evSubj, _ := kvstream.PoolSubjects(kvstream.SubjectEvents, c.cfg.Pool)
	streamName := c.cfg.Stream.Name
	if streamName == "" {
		streamName = kvstream.DefaultStreamName
	}
	cons, err := c.js.OrderedConsumer(ctx, streamName, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{evSubj},
		DeliverPolicy:  deliver,
	})
	if err != nil {
		return fmt.Errorf("consumer: ordered consumer on %s: %w", streamName, err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) { c.dispatch(ctx, m) },
		// Idle heartbeats every second: a consumer lost with its server
		// (one node of a cluster killed) is noticed and recreated after 2
		// missed ones, not after nats.go's default of 2×5s; the cost is
		// one small message a second per pool while the stream is idle.
		jetstream.PullHeartbeat(time.Second),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			c.lastErr.Store(time.Now().UnixNano())
			c.m.consumeErrors.Inc()
			c.cfg.Logger.Debug("consumer: consume error", "err", err)
		}))
	if err != nil {
		return fmt.Errorf("consumer: consume %s: %w", streamName, err)
	}
	defer cc.Stop()
	c.running.Store(true)
	defer c.running.Store(false)
	wg.Add(1)
	go func() { defer wg.Done(); c.awaitRebuilt(ctx, cons) }()

	tick := time.NewTicker(c.cfg.CheckInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			c.check(ctx)
		}
	}
}

func (c *Consumer) shardOf(instance string) chan work {
	return c.shards[maphash.String(c.seed, instance)%uint64(len(c.shards))]
}

func (c *Consumer) enqueue(ctx context.Context, w work) {
	select {
	case c.shardOf(w.instance) <- w:
	case <-ctx.Done():
	}
}

// loadKnown queues a snapshot load for every instance of the pool that has
// one in the bucket, before any stream message: the shard applies the
// snapshot, then skips the stream up to its sequence.
func (c *Consumer) loadKnown(ctx context.Context) {
	lister, err := c.kv.ListKeysFiltered(ctx, c.cfg.Pool+".*")
	if err != nil {
		c.cfg.Logger.Warn("consumer: list snapshots", "err", err)
		return
	}
	for key := range lister.Keys() {
		instance := key[len(c.cfg.Pool)+1:]
		if kvstream.ValidToken("instance", instance) != nil {
			continue
		}
		c.mu.Lock()
		if c.insts[instance] == nil {
			if reason := c.refuseNew(instance, false); reason != "" {
				c.mu.Unlock()
				c.dropNew(instance, reason, "snapshot")
				continue
			}
			c.insts[instance] = c.newInst(instance, time.Time{})
		}
		c.mu.Unlock()
		c.enqueue(ctx, work{kind: workLoad, instance: instance})
	}
}

// seen records activity at t (an event's store time, a snapshot's time, a
// heartbeat's arrival) and sets the state from it: live when recent, else
// stale. Replaying an hour of stream history must not make instances that
// died long ago look live. c.mu held.
func (c *Consumer) seen(in *inst, t time.Time) {
	if t.After(in.lastSeen) {
		in.lastSeen = t
	}
	if in.status.EngineDown || in.reloading {
		// Not live whatever arrives until the engine is back and the
		// bridge's table reloaded (see heartbeat).
		if in.status.State == StateLive {
			in.status.State = StateStale
		}
	} else if time.Since(in.lastSeen) <= c.cfg.StaleAfter {
		in.status.State = StateLive
	} else if in.status.State == StateLive {
		in.status.State = StateStale
	}
}

// newInst makes an instance record first seen at t (zero: not yet, a
// snapshot load will tell); c.mu held.
func (c *Consumer) newInst(instance string, t time.Time) *inst {
	in := &inst{status: InstanceStatus{Instance: instance, State: StateStale}, needLoad: true}
	if !t.IsZero() {
		c.seen(in, t)
	}
	return in
}

// refuseNew says why a name with no record may not get one ("" = it may):
// over the cap, or, for a name seen only in events, not admitted by
// Config.Admit. c.mu held.
func (c *Consumer) refuseNew(instance string, fromEvent bool) string {
	admitted := c.cfg.Admit != nil && c.cfg.Admit(instance)
	if fromEvent && c.cfg.Admit != nil && !admitted {
		return "unknown_instance"
	}
	if len(c.insts) >= c.cfg.MaxInstances && !admitted {
		return "over_cap"
	}
	return ""
}

// dropNew counts and (rate-limited) logs a name refused a record.
func (c *Consumer) dropNew(instance, reason, via string) {
	if via == "heartbeat" {
		c.m.heartbeats.WithLabelValues(reason).Inc()
	} else {
		c.m.messages.WithLabelValues(reason).Inc()
	}
	if ok, suppressed := c.logLimit.Allow(reason + via); ok {
		c.cfg.Logger.Warn("consumer: instance refused a record", "instance", instance, "reason", reason, "via", via,
			"max_instances", c.cfg.MaxInstances, "suppressed", suppressed)
	}
}

// dispatch runs on the consume goroutine: route the message to its shard.
func (c *Consumer) dispatch(ctx context.Context, m jetstream.Msg) {
	_, pool, instance, err := kvstream.ParseSubject(m.Subject())
	if err != nil || pool != c.cfg.Pool {
		c.m.messages.WithLabelValues("bad_subject").Inc()
		return
	}
	w := work{kind: workEvent, instance: instance, header: m.Headers(), data: m.Data()}
	if md, err := m.Metadata(); err == nil {
		w.streamSeq, w.stored = md.Sequence.Stream, md.Timestamp
		// Measured here, on the one consume goroutine, so that it follows
		// the stream's order (shards finish out of order). The newest
		// message in the stream, however old, leaves nothing to catch up
		// on: without that, a replay whose last message is older than
		// MaxLag (an idle pool) kept the consumer unhealthy, and kv_aware
		// routing by hash, until the next event.
		lag := time.Since(md.Timestamp)
		if md.NumPending == 0 {
			lag = 0
			c.caughtUp.Store(true)
		}
		c.lag.Store(int64(lag))
	}
	// A delivery after a consume error: consuming works again (an ordered
	// consumer resumes at the next stream sequence, so nothing was
	// skipped). Without this, losing one NATS node of a cluster cost 10s
	// of routing by hash after the consumer was back.
	if last := c.lastErr.Load(); last != 0 {
		c.lastErr.CompareAndSwap(last, 0)
	}
	c.mu.Lock()
	if c.insts[instance] == nil {
		if reason := c.refuseNew(instance, true); reason != "" {
			c.mu.Unlock()
			c.dropNew(instance, reason, "event")
			return
		}
		c.insts[instance] = c.newInst(instance, w.stored)
	}
	c.mu.Unlock()
	c.enqueue(ctx, w)
}

// heartbeat records a bridge heartbeat; an instance seen for the first
// time, or purged, gets its snapshot loaded.
func (c *Consumer) heartbeat(ctx context.Context, m *nats.Msg) {
	_, pool, instance, err := kvstream.ParseSubject(m.Subject)
	if err != nil || pool != c.cfg.Pool {
		return
	}
	var hb kvstream.Heartbeat
	if err := json.Unmarshal(m.Data, &hb); err != nil {
		c.m.heartbeats.WithLabelValues("malformed").Inc()
		return
	}
	if f := c.cfg.AdmitHeartbeat; f != nil && f(instance, m, &hb) != nil {
		c.m.heartbeats.WithLabelValues("refused").Inc()
		return
	}
	now := time.Now()
	c.mu.Lock()
	in := c.insts[instance]
	if in == nil {
		if reason := c.refuseNew(instance, false); reason != "" {
			c.mu.Unlock()
			c.dropNew(instance, reason, "heartbeat")
			return
		}
	}
	c.m.heartbeats.WithLabelValues("ok").Inc()
	load, reload := false, false
	if in == nil {
		in = c.newInst(instance, now)
		c.insts[instance] = in
		load = !c.cfg.SharedIndex
	} else if in.status.State == StatePurged {
		load = !c.cfg.SharedIndex
		in.status.State = StateLive
	} else if in.status.State == StateStale {
		in.status.State = StateLive
	}
	switch {
	case hb.EngineDown:
		// The engine is dead: its blocks must not count, now. They stay
		// in the index, since the engine may come back as the same
		// process (the bridge then keeps its table).
		if !in.status.EngineDown {
			c.cfg.Logger.Info("consumer: engine down, instance not live", "instance", instance)
			in.lost++
		}
		in.status.EngineDown = true
		in.status.State = StateStale
	case in.status.EngineDown:
		// Back up. The bridge decided before saying so whether this is
		// the same process (table kept) or a new one (cleared), but the
		// stream may not have brought that clear here yet: reload the
		// bridge's table, and count the instance live only after.
		in.status.EngineDown = false
		in.reloading, reload = true, true
		in.status.State = StateStale
	case in.reloading:
		in.status.State = StateStale
	}
	in.status.LastHeartbeat, in.lastSeen = now, now
	in.status.Heartbeat = &hb
	c.mu.Unlock()
	switch {
	case reload:
		c.enqueue(ctx, work{kind: workReload, instance: instance})
	case load:
		c.enqueue(ctx, work{kind: workLoad, instance: instance})
	}
}

// clearsAll reports whether a batch empties the engine's cache.
func clearsAll(evs []events.Event) bool {
	for i := range evs {
		if evs[i].Kind == events.AllBlocksCleared {
			return true
		}
	}
	return false
}

// check marks silent instances stale and queues purges.
func (c *Consumer) check(ctx context.Context) {
	now := time.Now()
	var purge []string
	counts := map[State]int{}
	c.mu.Lock()
	for name, in := range c.insts {
		if in.lastSeen.IsZero() {
			counts[in.status.State]++ // its snapshot load is still queued
			continue
		}
		silent := now.Sub(in.lastSeen)
		switch in.status.State {
		case StateLive:
			if silent > c.cfg.StaleAfter {
				in.status.State = StateStale
				c.cfg.Logger.Info("consumer: instance stale", "instance", name, "silent", silent.Round(time.Millisecond))
			}
		case StateStale:
			if silent > c.cfg.PurgeAfter {
				in.status.State = StatePurged
				purge = append(purge, name)
			}
		}
		counts[in.status.State]++
	}
	c.mu.Unlock()
	for _, s := range []State{StateLive, StateStale, StatePurged} {
		c.m.instances.WithLabelValues(s.String()).Set(float64(counts[s]))
	}
	for _, name := range purge {
		c.enqueue(ctx, work{kind: workPurge, instance: name})
	}
}

func (c *Consumer) shard(ctx context.Context, ch chan work) {
	for {
		select {
		case <-ctx.Done():
			return
		case w := <-ch:
			c.m.queue.Set(float64(len(ch)))
			if w.kind == workBarrier {
				w.done()
				continue
			}
			c.do(ctx, w)
		}
	}
}

func (c *Consumer) do(ctx context.Context, w work) {
	c.mu.Lock()
	in := c.insts[w.instance]
	c.mu.Unlock()
	if in == nil {
		// Forgotten after a purge since this was queued: the instance was
		// silent for PurgeAfter; if it is back, its heartbeat (or, for an
		// admitted name, its next event) makes a new record and reloads.
		if w.kind == workEvent {
			c.m.messages.WithLabelValues("purged_instance").Inc()
		}
		return
	}
	switch w.kind {
	case workPurge:
		c.mu.Lock()
		still := in.status.State == StatePurged
		c.mu.Unlock()
		if !still {
			return // came back since the purge was queued
		}
		if !c.cfg.SharedIndex {
			if err := c.cfg.Applier.Purge(ctx, w.instance); err != nil {
				c.cfg.Logger.Warn("consumer: purge", "instance", w.instance, "err", err)
			}
		}
		in.needLoad, in.skipUpTo = true, 0
		c.m.purges.Inc()
		// Forget it: a purged name keeps no record and no metric series
		// (the router's are read from the records), so names that come
		// and go cannot accumulate.
		c.mu.Lock()
		if c.insts[w.instance] == in && in.status.State == StatePurged {
			delete(c.insts, w.instance)
		}
		c.mu.Unlock()
		c.cfg.Logger.Info("consumer: instance purged and forgotten", "instance", w.instance)
	case workLoad:
		if c.shared != nil {
			c.syncShared(ctx, w.instance, in)
			return
		}
		if in.needLoad && !c.cfg.SharedIndex {
			c.load(ctx, w.instance, in, 0)
		}
	case workReload:
		switch {
		case c.shared != nil:
			// LoadAt takes the bridge's table only when it is newer than
			// the index's position; otherwise the clear arrives in order
			// through the stream.
			if _, err := c.seedShared(ctx, w.instance, in, 0); err != nil && ctx.Err() == nil {
				c.cfg.Logger.Warn("consumer: reloading a restarted engine's table into the shared index failed; the stream will repair it", "instance", w.instance, "err", err)
			}
		case !c.cfg.SharedIndex:
			c.load(ctx, w.instance, in, 0)
		}
		c.mu.Lock()
		in.reloading = false
		c.seen(in, time.Now())
		c.mu.Unlock()
	case workEvent:
		c.event(ctx, w, in)
	}
}

// load replaces the instance's index state with its snapshot: from the
// bridge (request-reply, the freshest), else the bucket, else nothing (the
// stream alone then rebuilds what it still holds).
//
// cur is the stream sequence of the message being processed (0 for a load
// with none: start-up, heartbeat). Every message of the instance below cur
// (or, without one, up to the last one processed) has already gone
// through this shard, so when the snapshot is older than that (a bucket
// snapshot, up to its refresh period old, while the bridge is down) the
// messages between the snapshot and cur are replayed from the stream
// after it; otherwise a reload would drop everything applied since the
// snapshot was taken.
func (c *Consumer) load(ctx context.Context, instance string, in *inst, cur uint64) {
	in.needLoad = false
	c.mu.Lock()
	done := in.status.StreamSeq
	c.mu.Unlock()
	if cur != 0 {
		done = cur - 1
	}
	snap, source, err := c.fetchSnapshot(ctx, instance)
	if err != nil {
		if !errors.Is(err, errNoSnapshot) && ctx.Err() == nil {
			// There is one but it could not be read: try again at the
			// instance's next event rather than trust the stream alone.
			in.needLoad = true
			c.m.snapshotLoads.WithLabelValues("error").Inc()
			c.cfg.Logger.Warn("consumer: snapshot unreadable, will retry", "instance", instance, "err", err)
		} else {
			c.m.snapshotLoads.WithLabelValues("none").Inc()
			c.cfg.Logger.Info("consumer: no snapshot, using the stream alone", "instance", instance, "err", err)
		}
		c.seenIfNever(in)
		return
	}
	batch, err := events.Decode(snap.Batch)
	if err != nil {
		c.m.snapshotLoads.WithLabelValues("malformed").Inc()
		c.cfg.Logger.Warn("consumer: malformed snapshot batch", "instance", instance, "source", source, "err", err)
		c.seenIfNever(in)
		return
	}
	if err := c.cfg.Applier.Purge(ctx, instance); err != nil {
		c.cfg.Logger.Warn("consumer: purge before snapshot", "instance", instance, "err", err)
	}
	if _, err := c.cfg.Applier.Apply(ctx, instance, batch.Events); err != nil {
		c.m.applyErrors.Inc()
		c.cfg.Logger.Warn("consumer: apply snapshot", "instance", instance, "err", err)
	}
	in.skipUpTo = snap.StreamSeq
	c.m.snapshotLoads.WithLabelValues(source).Inc()
	c.mu.Lock()
	in.status.SnapshotSeq = snap.StreamSeq
	if snap.StreamSeq > in.status.StreamSeq {
		in.status.StreamSeq = snap.StreamSeq
	}
	if snap.HasSeq {
		in.status.LastSeq, in.hasSeq = snap.EngineSeq, true
	} else {
		in.hasSeq = false
	}
	if in.status.State == StatePurged {
		in.status.State = StateStale // seen() decides from the snapshot's age
	}
	c.seen(in, snap.Taken)
	c.mu.Unlock()
	c.cfg.Logger.Info("consumer: loaded snapshot", "instance", instance, "source", source, "blocks", snap.Blocks, "stream_seq", snap.StreamSeq)
	if done > snap.StreamSeq {
		c.replay(ctx, instance, in, snap.StreamSeq, done)
	}
}

// seenIfNever starts the silence clock of an instance that has never been
// seen (listed from the bucket, but its snapshot is gone or unreadable):
// without it check() would wait for a first sighting forever and the
// instance would never be aged out. Its state is left as it is (stale):
// nothing says it is alive.
func (c *Consumer) seenIfNever(in *inst) {
	c.mu.Lock()
	if in.lastSeen.IsZero() {
		in.lastSeen = time.Now()
	}
	c.mu.Unlock()
}

// replay re-applies the instance's stream messages with a stream sequence
// in (from, to], in order, after a snapshot taken at from: they had been
// applied before the reload purged them. It reads them one by one with
// the stream's get-next-by-subject (a reload is rare; the messages are few
// seconds' worth), then moves skipUpTo to to so the consumer does not
// apply them twice.
//
// What it cannot replay is real loss: messages the stream no longer holds
// (retention passed them), seen as an engine sequence that does not follow
// on from the snapshot's. The bridge publishes every engine sequence or a
// clear, so the lost messages may have held stores and removals. The
// instance keeps the snapshot plus what survives, and the loss is counted
// (kvrouter_events_replay_lost_total, InstanceStatus.ReplayLost) and
// logged: clearing would throw away a table that is right but for those
// messages and send every request to a cold cache, while an entry kept
// wrongly costs one routing miss. The state is put right by the next
// snapshot load (a later gap or failure), by the bridge's resync clear
// when it restarts, or by the purge of a silent instance.
func (c *Consumer) replay(ctx context.Context, instance string, in *inst, from, to uint64) {
	subj, _ := kvstream.EventsSubject(c.cfg.Pool, instance)
	var applied int
	lost := false
	seq := from + 1
	for seq <= to && ctx.Err() == nil {
		m, err := c.stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subj))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			// Could not read the stream: leave the snapshot and try the
			// whole reload again at the instance's next event.
			in.needLoad = true
			c.m.applyErrors.Inc()
			c.cfg.Logger.Warn("consumer: replay after snapshot failed, will reload", "instance", instance, "stream_seq", seq, "err", err)
			break
		}
		if m.Sequence > to {
			break
		}
		seq = m.Sequence + 1
		h, herr := kvstream.ParseEventHeaders(m.Header)
		engineMsg := herr == nil && h.HasSeq && h.Synthetic == ""
		if engineMsg && in.hasSeq && h.Seq > in.status.LastSeq+1 {
			lost = true
		}
		batch, err := events.Decode(m.Data)
		if err == nil {
			if _, aerr := c.cfg.Applier.Apply(ctx, instance, batch.Events); aerr != nil {
				in.needLoad = true
				c.m.applyErrors.Inc()
				c.cfg.Logger.Warn("consumer: apply during replay failed, will reload", "instance", instance, "stream_seq", m.Sequence, "err", aerr)
				break
			}
			applied++
		}
		c.mu.Lock()
		in.status.StreamSeq = max(in.status.StreamSeq, m.Sequence)
		if engineMsg {
			in.status.LastSeq, in.hasSeq = h.Seq, true
		}
		switch h.Synthetic {
		case kvstream.SyntheticGap, kvstream.SyntheticRestart, kvstream.SyntheticResync:
			in.hasSeq = false
		}
		c.mu.Unlock()
	}
	if !in.needLoad {
		in.skipUpTo = max(in.skipUpTo, to)
	}
	c.m.replayed.Add(float64(applied))
	if lost {
		c.mu.Lock()
		in.status.ReplayLost++
		c.mu.Unlock()
		c.m.replayLost.Inc()
		c.cfg.Logger.Warn("consumer: messages after the snapshot are gone from the stream; keeping the snapshot and what remains",
			"instance", instance, "snapshot_stream_seq", from, "to", to)
	}
	c.cfg.Logger.Info("consumer: replayed messages after snapshot", "instance", instance, "from", from+1, "to", to, "applied", applied)
}

// errNoSnapshot: neither the bridge nor the bucket has one.
var errNoSnapshot = errors.New("consumer: no snapshot")

func (c *Consumer) fetchSnapshot(ctx context.Context, instance string) (kvstream.Snapshot, string, error) {
	// A snapshot in the object store can be replaced while it is read (the
	// bridge refreshes it); a second try reads the new one.
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return kvstream.Snapshot{}, "", ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
		var s kvstream.Snapshot
		var source string
		s, source, err = c.fetchSnapshotOnce(ctx, instance)
		if err == nil || errors.Is(err, errNoSnapshot) {
			return s, source, err
		}
		c.cfg.Logger.Debug("consumer: snapshot fetch failed, retrying", "instance", instance, "err", err)
	}
	return kvstream.Snapshot{}, "", err
}

func (c *Consumer) fetchSnapshotOnce(ctx context.Context, instance string) (kvstream.Snapshot, string, error) {
	subj, err := kvstream.SnapshotSubject(c.cfg.Pool, instance)
	if err != nil {
		return kvstream.Snapshot{}, "", err
	}
	rctx, cancel := context.WithTimeout(ctx, c.cfg.SnapshotTimeout)
	reply, err := c.cfg.Conn.RequestWithContext(rctx, subj, nil)
	cancel()
	if err == nil && reply.Header.Get("Kv-Error") == "" {
		s, err := kvstream.UnmarshalSnapshot(reply.Data)
		if err == nil {
			s, err = kvstream.ResolveSnapshot(ctx, c.obs, s)
		}
		if err == nil && s.Instance == instance {
			return s, "request", nil
		}
	}
	key, _ := kvstream.SnapshotKey(c.cfg.Pool, instance)
	e, err := c.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return kvstream.Snapshot{}, "", fmt.Errorf("%w: %w", errNoSnapshot, err)
	}
	if err != nil {
		return kvstream.Snapshot{}, "", fmt.Errorf("consumer: snapshot bucket: %w", err)
	}
	s, err := kvstream.UnmarshalSnapshot(e.Value())
	if err == nil {
		s, err = kvstream.ResolveSnapshot(ctx, c.obs, s)
	}
	if err != nil {
		return kvstream.Snapshot{}, "", err
	}
	if s.Instance != instance {
		return kvstream.Snapshot{}, "", fmt.Errorf("consumer: bucket key %s holds instance %q", key, s.Instance)
	}
	return s, "bucket", nil
}

// event applies one stream message, unless a loaded snapshot covers it.
func (c *Consumer) event(ctx context.Context, w work, in *inst) {
	c.mu.Lock()
	purged := in.status.State == StatePurged
	c.mu.Unlock()
	if purged && !c.cfg.SharedIndex {
		if !w.stored.IsZero() && time.Since(w.stored) > c.cfg.StaleAfter {
			// History of an instance purged for silence: not coming back.
			c.m.messages.WithLabelValues("purged_instance").Inc()
			return
		}
		// Fresh events after a purge: the instance is back.
		in.needLoad = true
	}
	if in.needLoad && !c.cfg.SharedIndex {
		c.load(ctx, w.instance, in, w.streamSeq)
	}
	if w.streamSeq != 0 && w.streamSeq <= in.skipUpTo {
		c.m.messages.WithLabelValues("covered_by_snapshot").Inc()
		return
	}
	h, herr := kvstream.ParseEventHeaders(w.header)
	engineMsg := herr == nil && h.HasSeq && h.Synthetic == ""
	// LastSeq and hasSeq are written only by this goroutine, so reading
	// them here without the lock is safe.
	if engineMsg && in.hasSeq && h.Seq > in.status.LastSeq+1 {
		// The bridge publishes every engine seq or a clear, so a hole here
		// means the stream lost messages before we read them (retention
		// passed us by): the snapshot is the only way back to the truth.
		c.mu.Lock()
		in.status.Gaps++
		c.mu.Unlock()
		c.m.gaps.Inc()
		c.cfg.Logger.Warn("consumer: engine seq gap in the stream, reloading snapshot", "instance", w.instance,
			"last_seq", in.status.LastSeq, "seq", h.Seq)
		if !c.cfg.SharedIndex {
			lostBefore := in.status.ReplayLost // written only by this goroutine
			c.load(ctx, w.instance, in, w.streamSeq)
			if w.streamSeq != 0 && w.streamSeq <= in.skipUpTo {
				c.m.messages.WithLabelValues("covered_by_snapshot").Inc()
				return
			}
			if in.hasSeq && h.Seq > in.status.LastSeq+1 && in.status.ReplayLost == lostBefore {
				// The snapshot and the replay after it still stop short
				// of this message: what lay between is gone (see replay).
				c.mu.Lock()
				in.status.ReplayLost++
				c.mu.Unlock()
				c.m.replayLost.Inc()
				c.cfg.Logger.Warn("consumer: engine seq gap remains after reload; keeping the snapshot and what remains",
					"instance", w.instance, "last_seq", in.status.LastSeq, "seq", h.Seq)
			}
		} else if c.shared != nil {
			// The stream lost messages of the instance: its state in the
			// index misses them too. A snapshot past them replaces it.
			if pos, err := c.seedShared(ctx, w.instance, in, w.streamSeq); err == nil {
				c.setFrom(in, pos)
			} else if !errors.Is(err, errOwned) {
				c.setSynced(in, false)
				c.cfg.Logger.Warn("consumer: snapshot load into the shared index failed, will retry", "instance", w.instance, "err", err)
			}
		}
	}
	batch, err := events.Decode(w.data)
	var res kvindex.ApplyResult
	var aerr error
	switch {
	case err == nil && c.shared != nil:
		res, aerr = c.applyShared(ctx, w.instance, in, w.streamSeq, batch.Events)
	case err == nil:
		res, aerr = c.cfg.Applier.Apply(ctx, w.instance, batch.Events)
	}
	// Status changes only after Apply, so "at seq N" means applied through N.
	now := time.Now()
	c.mu.Lock()
	st := &in.status
	st.StreamSeq = max(st.StreamSeq, w.streamSeq)
	if w.stored.IsZero() {
		c.seen(in, now)
	} else {
		c.seen(in, w.stored)
	}
	if engineMsg {
		st.LastSeq, in.hasSeq = h.Seq, true
	}
	switch h.Synthetic {
	case kvstream.SyntheticGap, kvstream.SyntheticRestart, kvstream.SyntheticResync:
		// The bridge cleared the instance: seq continuity starts over.
		st.Clears++
		in.hasSeq = false
		in.lost++
	}
	if err == nil && clearsAll(batch.Events) {
		in.lost++ // the engine emptied its cache (reset_prefix_cache)
	}
	if err != nil {
		st.Malformed++
	} else {
		st.Unknown += uint64(batch.Unknown)
		st.LastEvent = now
	}
	c.mu.Unlock()
	if err != nil {
		c.m.messages.WithLabelValues("malformed").Inc()
		c.cfg.Logger.Warn("consumer: malformed payload skipped", "instance", w.instance, "stream_seq", w.streamSeq, "err", err)
		return
	}
	if batch.Unknown > 0 {
		c.m.unknown.Add(float64(batch.Unknown))
	}
	if aerr != nil {
		c.m.applyErrors.Inc()
		if c.shared != nil {
			// Not live until repaired: by the next message of the
			// instance, or the sync watchShared queues meanwhile.
			c.cfg.Logger.Warn("consumer: apply to the shared index failed, will repair", "instance", w.instance, "err", aerr)
			return
		}
		c.cfg.Logger.Warn("consumer: apply failed, will reload the snapshot", "instance", w.instance, "err", aerr)
		// The index may now hold part of the batch or miss it: the next
		// event of the instance reloads its snapshot to get back in step.
		in.needLoad = true
		return
	}
	c.m.messages.WithLabelValues("applied").Inc()
	for i := range batch.Events {
		c.m.events.WithLabelValues(batch.Events[i].Kind.String()).Inc()
	}
	c.m.stored.Add(float64(res.Stored))
	c.m.removed.Add(float64(res.Removed))
	c.countDropped(res)
	if !w.stored.IsZero() {
		c.m.lag.Observe(now.Sub(w.stored).Seconds())
	}
}
