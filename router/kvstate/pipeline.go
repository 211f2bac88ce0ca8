package kvstate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/ratelog"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/tiers"
	"github.com/kvrouter/kvrouter/tiers/tiermetrics"
)

// DefaultEmbeddedStoreDir is the embedded NATS server's store when
// events.nats.store_dir is unset: $TMPDIR/kvrouter-nats-<port>-<fleet>,
// where <fleet> hashes the pools' names and models. A router restarted with
// the same pools finds its stream and snapshots again; a router for another
// fleet gets its own store instead of loading this one's instances.
func DefaultEmbeddedStoreDir(port int, pools []config.PoolConfig) string {
	names := make([]string, len(pools))
	for i, p := range pools {
		names[i] = p.Name + "=" + p.Model
	}
	sort.Strings(names)
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvrouter-nats-%d-%016x", port, xxhash.Sum64String(strings.Join(names, "\n"))))
}

// DefaultEmbeddedNATSListen is where the embedded NATS server listens when
// events.nats.listen is empty: loopback on NATS's standard port, so a
// kvbridge on the same host reaches it with its default --nats-url.
const DefaultEmbeddedNATSListen = "127.0.0.1:4222"

// Options are the dependencies of Start. The zero value is
// usable.
type Options struct {
	// Registerer receives the consumers' and the tier accounting's
	// metrics (the router's registry); nil = not registered.
	Registerer prometheus.Registerer
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Conn, when set, is used instead of connecting from the config (the
	// caller keeps ownership: Close does not close it).
	Conn *nats.Conn
	// Stream and Bucket override the stream and snapshot bucket settings
	// (names default from the config; an in-process demo may want memory
	// storage).
	Stream kvstream.StreamConfig
	Bucket kvstream.BucketConfig
	// SnapshotTimeout is the consumers' snapshot request timeout
	// (0 = the consumer's default).
	SnapshotTimeout time.Duration
	// NATSErrorHandler receives the NATS connection's asynchronous errors
	// (kvstream.NATSConfig.ErrorHandler; nil = logged, rate-limited).
	NATSErrorHandler nats.ErrHandler
}

// Pipeline is the router's KV-state pipeline: one block index per pool,
// fed by one events consumer per pool from NATS JetStream (an external
// server, or one embedded in the router), with per-tier block accounting.
// It gives the Server each pool's index and freshness (Options.KV), the
// admin API its per-instance views and the eviction stream
// (Options.KVEvents), and the pools their heartbeat-discovered instances.
type Pipeline struct {
	cfg      config.Config
	opts     Options
	log      *slog.Logger
	acct     *tiermetrics.Accounting
	embedded *kvstream.EmbeddedNATS
	conn     *nats.Conn
	replicas replicaSync // events.replica_sync (replicas.go)
	ownConn  bool
	natsURL  string
	ctx      context.Context // the consumers run under it
	cancel   context.CancelFunc
	// streamsCtx ends the eviction streams (StopStreams), before the
	// consumers stop, so an HTTP server's graceful shutdown is not held up
	// by dashboards that never hang up.
	streamsCtx  context.Context
	stopStreams context.CancelFunc
	wg          sync.WaitGroup // the consumers' goroutines

	// mu guards pools and closed.
	mu     sync.Mutex
	pools  map[string]*kvPool
	closed bool

	// discovered holds "pool/instance" of the instances added from
	// heartbeats in the configuration last applied; read by the admin API.
	discovered atomic.Pointer[map[string]bool]

	// adm decides which names and heartbeats get instance records
	// (configured ids, allow-lists, heartbeat key); swapped on reload.
	adm        atomic.Pointer[Admission]
	dm         *discoveryMetrics
	refusedLog *ratelog.Limiter
	started    time.Time
	// readyTimedOut: IndexReady gave up waiting (logged once).
	readyTimedOut atomic.Bool
	// engineDown receives the instances whose bridge reports the engine
	// down (OnEngineDown); nil until set.
	engineDown atomic.Pointer[func(pool, instance string)]
}

// kvPool is one pool's index and consumer; immutable once built.
type kvPool struct {
	model string
	idxs  *PoolIndexes
	index kvindex.Index
	cons  *consumer.Consumer
	fresh kvindex.Freshness
}

// Start connects to NATS (events.nats.url; with none, starts the
// embedded server), builds each pool's index and starts its consumer under
// ctx. Close stops everything. Call it only when KVEventsWanted(cfg).
func Start(ctx context.Context, cfg config.Config, opts Options) (*Pipeline, error) {
	cfg = cfg.WithDefaults()
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	ec := config.EventsConfig{}
	if cfg.Events != nil {
		ec = *cfg.Events
	}
	acct, err := tiermetrics.NewAccounting(opts.Registerer)
	if err != nil {
		return nil, err
	}
	k := &Pipeline{cfg: cfg, opts: opts, log: opts.Logger, acct: acct, pools: map[string]*kvPool{},
		refusedLog: newRefusedLog(), started: time.Now()}
	k.adm.Store(newAdmission(cfg))
	if k.dm, err = newDiscoveryMetrics(opts.Registerer); err != nil {
		return nil, fmt.Errorf("router: register discovery metrics: %w", err)
	}
	if config.DiscoverEnabled(cfg) && cfg.HeartbeatKey == nil {
		for _, p := range cfg.Pools {
			if len(p.AllowedInstanceURLs) == 0 {
				k.log.Warn("heartbeat discovery admits any URL announced on NATS for this pool: set "+HeartbeatKeyEnv+
					" (signed heartbeats) or pools[].allowed_instance_urls unless NATS authenticates publishers (docs/security.md)", "pool", p.Name)
			}
		}
	}
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(newKVEventsCollector(k)); err != nil {
			return nil, fmt.Errorf("router: register kv events metrics: %w", err)
		}
	}
	k.ctx, k.cancel = context.WithCancel(ctx)
	k.streamsCtx, k.stopStreams = context.WithCancel(k.ctx)
	fail := func(err error) (*Pipeline, error) {
		k.Close()
		return nil, err
	}
	switch {
	case opts.Conn != nil:
		k.conn, k.natsURL = opts.Conn, opts.Conn.ConnectedUrl()
	case ec.NATS.URL != "":
		k.natsURL = ec.NATS.URL
	default:
		listen := ec.NATS.Listen
		if listen == "" {
			listen = DefaultEmbeddedNATSListen
		}
		host, portStr, err := net.SplitHostPort(listen)
		if err != nil {
			return fail(fmt.Errorf("%w: events.nats.listen %q: %w", config.ErrInvalidConfig, listen, err))
		}
		port, err := strconv.Atoi(portStr)
		if err != nil {
			return fail(fmt.Errorf("%w: events.nats.listen %q: bad port", config.ErrInvalidConfig, listen))
		}
		if port == 0 {
			port = -1 // a free port
		}
		storeDir := ec.NATS.StoreDir
		if storeDir == "" && port > 0 {
			storeDir = DefaultEmbeddedStoreDir(port, cfg.Pools)
		}
		k.embedded, err = kvstream.StartEmbeddedNATS(k.ctx, kvstream.EmbeddedNATSConfig{Host: host, Port: port, StoreDir: storeDir})
		switch {
		case errors.Is(err, kvstream.ErrPortInUse):
			return fail(fmt.Errorf("router: embedded nats: %w\n  another NATS server (or router) has %s: set events.nats.url to use that server, "+
				"or events.nats.listen to a free address (e.g. 127.0.0.1:0 for any port; bridges then need --nats-url with the port this router logs)", err, listen))
		case errors.Is(err, kvstream.ErrStoreInUse):
			return fail(fmt.Errorf("router: embedded nats: %w (events.nats.store_dir)", err))
		case err != nil:
			return fail(fmt.Errorf("router: embedded nats on %s: %w", listen, err))
		}
		k.natsURL = k.embedded.ClientURL()
		k.log.Info("embedded NATS server with JetStream started; point kvbridges at it with --nats-url",
			"nats_url", k.natsURL, "store_dir", k.embedded.StoreDir())
	}
	if k.conn == nil {
		nc := kvstream.NATSConfig{URL: k.natsURL, CredsFile: ec.NATS.CredsFile, Name: "kvrouter", Logger: k.log, ErrorHandler: opts.NATSErrorHandler}
		if t := ec.NATS.TLS; t != nil {
			nc.TLSCA, nc.TLSCert, nc.TLSKey = t.CAFile, t.CertFile, t.KeyFile
		}
		if k.conn, err = nc.Connect(); err != nil {
			return fail(err)
		}
		k.ownConn = true
	}
	for _, pc := range cfg.Pools {
		if _, err := k.pool(pc); err != nil {
			return fail(err)
		}
	}
	return k, nil
}

// NATSURL is the URL the pipeline consumes from (the embedded server's
// when it runs one): where kvbridges publish.
func (k *Pipeline) NATSURL() string { return k.natsURL }

// Conn is the pipeline's NATS connection.
func (k *Pipeline) Conn() *nats.Conn { return k.conn }

// Accounting is the per-instance, per-tier block accounting fed by the
// consumers.
func (k *Pipeline) Accounting() *tiermetrics.Accounting { return k.acct }

// KV is Options.KV: the pool's index and its stream's freshness, built
// (and its consumer started) on first use, so a pool added by a reload gets
// one; the same pool name keeps its index and consumer across reloads.
func (k *Pipeline) KV(pc config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
	p, err := k.pool(pc)
	if err != nil {
		k.log.Error("pool KV state unavailable", "pool", pc.Name, "err", err)
		return nil, nil
	}
	return p.index, p.fresh
}

// Consumer returns the pool's events consumer.
func (k *Pipeline) Consumer(pool string) (*consumer.Consumer, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	p, ok := k.pools[pool]
	if !ok {
		return nil, false
	}
	return p.cons, true
}

// KVInstances implements KVEventsSource.
func (k *Pipeline) KVInstances(pool string) ([]consumer.InstanceStatus, bool) {
	c, ok := k.Consumer(pool)
	if !ok {
		return nil, false
	}
	return c.Instances(), true
}

// StreamHealthy implements KVEventsSource.
func (k *Pipeline) StreamHealthy(pool string) bool {
	c, ok := k.Consumer(pool)
	return ok && c.Healthy()
}

// EvictionHandler implements KVEventsSource: kv.evictions.<pool>.> as
// server-sent events, ending when the pipeline stops.
func (k *Pipeline) EvictionHandler() http.Handler {
	return kvstream.EvictionSSEHandler(k.streamsCtx, k.conn, kvstream.EvictionSSEConfig{Logger: k.log,
		KnownPool: func(pool string) bool { _, ok := k.Consumer(pool); return ok }})
}

func (k *Pipeline) pool(pc config.PoolConfig) (*kvPool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if p, ok := k.pools[pc.Name]; ok {
		if p.model != pc.Model {
			k.log.Warn("pool model changed on reload; its index keeps the old model's block keys until restart", "pool", pc.Name, "old", p.model, "new", pc.Model)
		}
		return p, nil
	}
	if k.closed {
		return nil, errors.New("router: kv events pipeline closed")
	}
	ic := k.cfg.Index
	if ic == nil {
		ic = &config.IndexConfig{} // memory, default capacity
	}
	idxs, err := NewPoolIndexes(config.Config{Index: ic, Pools: []config.PoolConfig{pc}})
	if err != nil {
		return nil, err
	}
	index := idxs.ByPool[pc.Name]
	ec := config.EventsConfig{}
	if k.cfg.Events != nil {
		ec = *k.cfg.Events
	}
	stream := k.opts.Stream
	if stream.Name == "" {
		stream.Name = ec.NATS.Stream
	}
	bucket := k.opts.Bucket
	if bucket.Name == "" {
		bucket.Name = ec.Bucket
	}
	if stream.Replicas == 0 {
		stream.Replicas = ec.NATS.StreamReplicas
	}
	if bucket.Replicas == 0 {
		bucket.Replicas = ec.NATS.StreamReplicas
	}
	var applier consumer.Applier = &accountingApplier{Index: index, acct: k.acct}
	if rs, ok := index.(*kvindex.Redis); ok {
		applier = &sharedAccountingApplier{accountingApplier{Index: index, acct: k.acct}, rs}
	}
	cons, err := consumer.New(consumer.Config{
		Conn: k.conn, Pool: pc.Name,
		Applier:     applier,
		Stream:      stream,
		Bucket:      bucket,
		SharedIndex: ic.Backend == "redis",
		StaleAfter:  ec.StaleAfter, PurgeAfter: ec.PurgeAfter, MaxLag: ec.MaxLag,
		MaxInstances: ec.MaxInstances,
		// Names seen only in events need to be configured; others need an
		// admitted heartbeat first (junk subjects create nothing).
		Admit: func(instance string) bool { return k.adm.Load().configured[pc.Name][instance] },
		AdmitHeartbeat: func(instance string, m *nats.Msg, hb *kvstream.Heartbeat) error {
			return k.admitHeartbeat(pc.Name, instance, m, hb)
		},
		EngineDown: func(instance string) {
			if f := k.engineDown.Load(); f != nil {
				(*f)(pc.Name, instance)
			}
		},
		SnapshotTimeout: k.opts.SnapshotTimeout,
		Registerer:      k.opts.Registerer,
		Logger:          k.log.With("pool", pc.Name),
	})
	if err != nil {
		_ = idxs.Close()
		return nil, fmt.Errorf("router: pool %q events consumer: %w", pc.Name, err)
	}
	fresh, err := k.withReplicaSync(pc, cons,
		kvindex.FreshnessFuncs{Healthy: cons.Healthy, IsStale: func(id string) bool { return !cons.Live(id) }, Epoch: cons.LostEpoch})
	if err != nil {
		_ = idxs.Close()
		return nil, err
	}
	p := &kvPool{model: pc.Model, idxs: idxs, index: index, cons: cons, fresh: fresh}
	k.pools[pc.Name] = p
	k.wg.Go(func() {
		if err := cons.Run(k.ctx); err != nil && !errors.Is(err, context.Canceled) {
			k.log.Error("events consumer stopped", "pool", pc.Name, "err", err)
		}
	})
	return p, nil
}

// OnEngineDown has fn called each time a pool's consumer reads a heartbeat
// that first reports an instance's engine down, from the consumer's
// goroutine (fn must not block); and at once for every instance whose
// engine is down now, since the consumers started before fn was set. The
// router ejects those instances (httpapi.Server.EngineDown).
func (k *Pipeline) OnEngineDown(fn func(pool, instance string)) {
	k.engineDown.Store(&fn)
	k.mu.Lock()
	cons := make(map[string]*consumer.Consumer, len(k.pools))
	for name, p := range k.pools {
		cons[name] = p.cons
	}
	k.mu.Unlock()
	for pool, c := range cons {
		for _, st := range c.Instances() {
			if st.EngineDown {
				fn(pool, st.Instance)
			}
		}
	}
}

// StopStreams ends every open eviction stream (with a final "close"
// event); register it with http.Server.RegisterOnShutdown.
func (k *Pipeline) StopStreams() { k.stopStreams() }

// DefaultReadyTimeout is events.ready_timeout when unset: long enough to
// load a few thousand bucket snapshots and replay the stream's recent
// history, short enough that a router whose index cannot be rebuilt (a
// bucket unreachable) still joins its load balancer and routes
// heuristically rather than never serving.
const DefaultReadyTimeout = 30 * time.Second

// IndexReady implements KVEventsSource: true once every pool's consumer
// has rebuilt its index (consumer.Ready), or events.ready_timeout after
// start; otherwise false and the pools still rebuilding.
func (k *Pipeline) IndexReady() (bool, string) {
	k.mu.Lock()
	var waiting []string
	for name, p := range k.pools {
		if !p.cons.Ready() {
			waiting = append(waiting, name)
		}
	}
	k.mu.Unlock()
	if len(waiting) == 0 {
		return true, ""
	}
	timeout := DefaultReadyTimeout
	if k.cfg.Events != nil && k.cfg.Events.ReadyTimeout > 0 {
		timeout = k.cfg.Events.ReadyTimeout
	}
	slices.Sort(waiting)
	if time.Since(k.started) > timeout {
		if k.readyTimedOut.CompareAndSwap(false, true) {
			k.log.Warn("KV index not rebuilt within events.ready_timeout; reporting ready, kv_aware routes heuristically until the stream is healthy",
				"pools", waiting, "ready_timeout", timeout)
		}
		return true, ""
	}
	return false, "KV index of pool(s) " + strings.Join(waiting, ", ") + " still being rebuilt from snapshots and the event stream"
}

// WaitReady waits until every pool's consumer is healthy (subscribed and
// caught up), or ctx ends.
func (k *Pipeline) WaitReady(ctx context.Context) error {
	for {
		ready := true
		k.mu.Lock()
		for _, p := range k.pools {
			ready = ready && p.cons.Healthy()
		}
		k.mu.Unlock()
		if ready {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("router: events consumers not ready: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Close stops the consumers, then closes the NATS connection (when the
// pipeline made it), the embedded server and the indexes' Redis clients.
func (k *Pipeline) Close() {
	k.mu.Lock()
	k.closed = true
	k.mu.Unlock()
	k.cancel()
	k.wg.Wait()
	if k.ownConn && k.conn != nil {
		k.conn.Close()
	}
	if k.embedded != nil {
		k.embedded.Shutdown()
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, p := range k.pools {
		_ = p.idxs.Close()
	}
}

// accountingApplier feeds tiermetrics.Accounting from what the consumer applies.
type accountingApplier struct {
	kvindex.Index
	acct *tiermetrics.Accounting
}

var _ consumer.Applier = (*accountingApplier)(nil)

// Apply applies evs and accounts them per tier. The index reports totals
// only (after deduplication), so per-tier figures come from the events;
// when a batch touches one tier per kind and holds no clear — nearly
// always — the index's deduplicated totals are used instead.
func (a *accountingApplier) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	res, err := a.Index.Apply(ctx, instance, evs)
	if err != nil {
		return res, err
	}
	a.account(instance, evs, res, true)
	return res, nil
}

// account accounts evs per tier; exact says res is the index's result for
// them (else, for events another router applied, the events' own counts).
func (a *accountingApplier) account(instance string, evs []events.Event, res kvindex.ApplyResult, exact bool) {
	var stored, removed [tiers.Count]int
	storedTiers, removedTiers, cleared := 0, 0, false
	for _, ev := range evs {
		switch ev.Kind {
		case events.BlockStored:
			t := a.acct.Medium(ev.Medium)
			if stored[t] == 0 {
				storedTiers++
			}
			stored[t] += len(ev.BlockHashes)
		case events.BlockRemoved:
			t := a.acct.Medium(ev.Medium)
			if removed[t] == 0 {
				removedTiers++
			}
			removed[t] += len(ev.BlockHashes)
		case events.AllBlocksCleared:
			cleared = true
		}
	}
	if cleared {
		// Order matters around a clear: replay the batch event by event.
		for _, ev := range evs {
			switch ev.Kind {
			case events.BlockStored:
				a.acct.Stored(instance, a.acct.Medium(ev.Medium), len(ev.BlockHashes))
			case events.BlockRemoved:
				a.acct.Evicted(instance, a.acct.Medium(ev.Medium), len(ev.BlockHashes))
			case events.AllBlocksCleared:
				a.acct.Cleared(instance)
			}
		}
		return
	}
	for t := range tiers.Count {
		n := stored[t]
		if exact && storedTiers == 1 && n > 0 {
			n = res.Stored
		}
		a.acct.Stored(instance, tiers.Tier(t), n)
		n = removed[t]
		if exact && removedTiers == 1 && n > 0 {
			n = res.Removed
		}
		a.acct.Evicted(instance, tiers.Tier(t), n)
	}
}

// Purge drops the instance from the index and its accounting series.
func (a *accountingApplier) Purge(ctx context.Context, instance string) error {
	err := a.Index.Purge(ctx, instance)
	a.acct.Forget(instance)
	return err
}

// sharedAccountingApplier is accountingApplier for a Redis index shared by
// router replicas: the consumer applies through ApplyAt and LoadAt (see
// consumer.SharedApplier). Every replica accounts every message it
// consumes, whichever replica wrote it to the index, so that each one's
// per-tier figures describe the whole pool.
type sharedAccountingApplier struct {
	accountingApplier
	shared *kvindex.Redis
}

var (
	_ consumer.SharedApplier = (*sharedAccountingApplier)(nil)
	_ consumer.Sweeper       = (*sharedAccountingApplier)(nil)
	_ consumer.Forgetter     = (*sharedAccountingApplier)(nil)
)

// ApplyAt implements consumer.SharedApplier.
func (a *sharedAccountingApplier) ApplyAt(ctx context.Context, instance string, from kvindex.Position, seq uint64, evs []events.Event) (kvindex.SeqResult, error) {
	r, err := a.shared.ApplyAt(ctx, instance, from, seq, evs)
	a.accountShared(instance, evs, r, err)
	return r, err
}

// accountShared accounts an ApplyAt's message by its result.
func (a *sharedAccountingApplier) accountShared(instance string, evs []events.Event, r kvindex.SeqResult, err error) {
	switch {
	case err != nil:
	case r.Status == kvindex.SeqApplied:
		a.account(instance, evs, r.ApplyResult, true)
	case r.Status == kvindex.SeqNotOwner || r.Status == kvindex.SeqYielded || r.Status == kvindex.SeqDuplicate:
		// Written by another replica. (A repair re-applies messages this
		// replica consumed and accounted before: counted twice, as in a
		// memory index's replay after a snapshot reload.)
		a.account(instance, evs, r.ApplyResult, false)
	}
}

// ApplyAtYielding implements consumer.SharedApplier.
func (a *sharedAccountingApplier) ApplyAtYielding(ctx context.Context, instance string, from kvindex.Position, seq uint64, evs []events.Event) (kvindex.SeqResult, error) {
	r, err := a.shared.ApplyAtYielding(ctx, instance, from, seq, evs)
	a.accountShared(instance, evs, r, err)
	return r, err
}

// ApplyAtHole implements consumer.SharedApplier.
func (a *sharedAccountingApplier) ApplyAtHole(ctx context.Context, instance string, from kvindex.Position, seq uint64, yield bool, evs []events.Event) (kvindex.SeqResult, error) {
	r, err := a.shared.ApplyAtHole(ctx, instance, from, seq, yield, evs)
	a.accountShared(instance, evs, r, err)
	return r, err
}

// LoadAt implements consumer.SharedApplier: a loaded snapshot replaces the
// instance's accounting.
func (a *sharedAccountingApplier) LoadAt(ctx context.Context, instance string, seq uint64, evs []events.Event) (kvindex.SeqResult, error) {
	r, err := a.shared.LoadAt(ctx, instance, seq, evs)
	if err == nil && r.Status == kvindex.SeqApplied {
		a.acct.Forget(instance)
		a.account(instance, evs, r.ApplyResult, true)
	}
	return r, err
}

// Position implements consumer.SharedApplier.
func (a *sharedAccountingApplier) Position(ctx context.Context, instance string) (kvindex.Position, error) {
	return a.shared.Position(ctx, instance)
}

// Positions implements consumer.SharedApplier.
func (a *sharedAccountingApplier) Positions(ctx context.Context, instances []string) ([]kvindex.Position, error) {
	return a.shared.Positions(ctx, instances)
}

// Epoch implements consumer.SharedApplier.
func (a *sharedAccountingApplier) Epoch(ctx context.Context) (string, bool, error) {
	return a.shared.Epoch(ctx)
}

// Rewound implements consumer.SharedApplier.
func (a *sharedAccountingApplier) Rewound(ctx context.Context) (bool, error) {
	return a.shared.Rewound(ctx)
}

// Sweep implements consumer.Sweeper: the shared index's instances silent
// for longer than its TTL are purged from it (block keys carry no TTL),
// and their accounting series with them. Without it here the consumer
// found no Sweeper behind this applier and never swept.
func (a *sharedAccountingApplier) Sweep(ctx context.Context) ([]string, error) {
	gone, err := a.shared.Sweep(ctx)
	for _, instance := range gone {
		a.acct.Forget(instance)
	}
	return gone, err
}

// Forget implements consumer.Forgetter: a purged instance's accounting
// series go, the shared index's state is left to the other routers and
// to Sweep.
func (a *sharedAccountingApplier) Forget(instance string) { a.acct.Forget(instance) }

// RestartsUnseen is kvindex.Redis.RestartsUnseen (the consumer logs it).
func (a *sharedAccountingApplier) RestartsUnseen() bool { return a.shared.RestartsUnseen() }

// WriterLease implements consumer.SharedApplier.
func (a *sharedAccountingApplier) WriterLease() time.Duration { return a.shared.WriterLease() }

// admitHeartbeat is the pool consumer's AdmitHeartbeat: signature and
// URL allow-list; a refusal is counted and logged (rate-limited).
func (k *Pipeline) admitHeartbeat(pool, instance string, m *nats.Msg, hb *kvstream.Heartbeat) error {
	err := k.adm.Load().check(pool, instance, m, hb, time.Now())
	var r *errHeartbeatRefused
	if errors.As(err, &r) {
		k.dm.refused.WithLabelValues(pool, r.reason).Inc()
		logRefused(k.log, k.refusedLog, pool, instance, hb, r)
	}
	return err
}

// Discovered returns the instances of the pool announced by bridge
// heartbeats (not purged, with an http(s) URL, serving the pool's model
// when the heartbeat names one), sorted by id.
func (k *Pipeline) Discovered(pool config.PoolConfig) []config.InstanceConfig {
	c, ok := k.Consumer(pool.Name)
	if !ok {
		return nil
	}
	allow := k.adm.Load().allow[pool.Name]
	var out []config.InstanceConfig
	for _, st := range c.Instances() {
		hb := st.Heartbeat
		if st.State == consumer.StatePurged || hb == nil || hb.URL == "" || !config.ValidName(st.Instance) {
			continue
		}
		if !allow.Allows(hb.URL) {
			continue // admitted before a reload narrowed the list
		}
		if hb.Model != "" && hb.Model != pool.Model {
			continue
		}
		if u, err := url.Parse(hb.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			continue
		}
		role := hb.Role
		switch role {
		case "", config.RoleBoth, config.RolePrefill, config.RoleDecode:
		default:
			role = "" // a role this router does not know: serve it as both
		}
		out = append(out, config.InstanceConfig{ID: st.Instance, URL: hb.URL, Adapters: slices.Clone(hb.Adapters), Role: role})
	}
	return out
}

// Discovery is what the pipeline found for one file configuration: the
// configuration with each pool's heartbeat-discovered instances added. The
// pipeline only reports it; whoever owns the pool table applies Config and
// then tells the pipeline with Publish (see package fleet).
type Discovery struct {
	// Config is the file configuration plus the discovered instances
	// (configured ids and URLs win).
	Config config.Config
	// Added holds "pool/instance" of each instance added from heartbeats.
	Added map[string]bool
	// Fingerprint is equal for two discoveries that added the same
	// instances with the same URLs and adapters.
	Fingerprint string
}

// Discover joins base with each pool's discovered instances (configured
// ids win) under the admission rules last set by Admit.
func (k *Pipeline) Discover(base config.Config) Discovery {
	d := Discovery{Config: base, Added: map[string]bool{}}
	if !config.DiscoverEnabled(base) {
		return d
	}
	var fp []byte
	pools := slices.Clone(base.Pools)
	for i, pc := range pools {
		// A heartbeat for a configured instance (same id, or the same URL
		// under another name) adds nothing: the file's entry wins, and one
		// engine must not be a candidate twice.
		have := map[string]bool{}
		for _, in := range pc.Instances {
			have[in.ID] = true
			have["url:"+strings.TrimSuffix(in.URL, "/")] = true
		}
		insts := slices.Clone(pc.Instances)
		for _, disc := range k.Discovered(pc) {
			if have[disc.ID] || have["url:"+strings.TrimSuffix(disc.URL, "/")] {
				continue
			}
			insts = append(insts, disc)
			d.Added[pc.Name+"/"+disc.ID] = true
			fp = fmt.Appendf(fp, "%s/%s=%s%v;", pc.Name, disc.ID, disc.URL, disc.Adapters)
		}
		pools[i].Instances = insts
	}
	d.Config.Pools = pools
	d.Fingerprint = string(fp)
	return d
}

// IsDiscovered implements KVEventsSource: the instance was added to the
// pool from heartbeats, not from the file.
func (k *Pipeline) IsDiscovered(pool, instance string) bool {
	m := k.discovered.Load()
	return m != nil && (*m)[pool+"/"+instance]
}

// Admit makes cfg's heartbeat admission rules current (configured names,
// allow-lists, key) and returns the previous rules, for Readmit when the
// configuration could not be applied. index: and events: changes are
// logged: they take effect on restart, the running consumers and indexes
// are kept (a new pool gets its own through KV).
func (k *Pipeline) Admit(cfg config.Config) (prev *Admission) {
	if !reflect.DeepEqual(cfg.WithDefaults().Events, k.cfg.Events) || !reflect.DeepEqual(cfg.Index, k.cfg.Index) {
		k.log.Warn("reload: index: and events: changes apply on restart; the running consumers and indexes are kept")
	}
	return k.adm.Swap(newAdmission(cfg))
}

// Readmit restores admission rules Admit replaced.
func (k *Pipeline) Readmit(prev *Admission) { k.adm.Store(prev) }

// Publish makes d's added instances the ones IsDiscovered reports and
// returns the previous set. Call it before the pool table shows d.Config,
// so that no admin view sees a discovered instance in a pool without
// knowing it is one; on failure, Unpublish(prev).
func (k *Pipeline) Publish(d Discovery) (prev map[string]bool) {
	added := d.Added
	if added == nil {
		added = map[string]bool{}
	}
	if p := k.discovered.Swap(&added); p != nil {
		return *p
	}
	return nil
}

// Unpublish restores the set Publish replaced.
func (k *Pipeline) Unpublish(prev map[string]bool) { k.discovered.Store(&prev) }

// Report logs and counts the instances that joined or left pools between
// the previously applied discovered set and d (applied). (The reload
// that applied d forgets those that left: httpapi.Server.Reload.)
func (k *Pipeline) Report(prev map[string]bool, d Discovery) {
	urls := map[string]string{}
	for _, pc := range d.Config.Pools {
		for _, in := range pc.Instances {
			urls[pc.Name+"/"+in.ID] = in.URL
		}
	}
	for key := range d.Added {
		if !prev[key] {
			pool, id, _ := strings.Cut(key, "/")
			k.dm.joins.WithLabelValues(pool).Inc()
			k.log.Info("instance joined pool from heartbeat", "pool", pool, "instance", id, "url", urls[key])
		}
	}
	for key := range prev {
		if !d.Added[key] {
			pool, id, _ := strings.Cut(key, "/")
			k.dm.leaves.WithLabelValues(pool).Inc()
			k.log.Info("heartbeat-discovered instance left pool", "pool", pool, "instance", id)
		}
	}
}
