package kvindex

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// DefaultRedisTTL is how long an instance of the Redis backend counts in
// lookups after its last event. It must exceed the time a block stays
// cached on a live instance without being stored again (vLLM reports a
// block once, when it is stored, however often it is hit later), hence a
// day rather than minutes; routers purge lost instances explicitly, and
// Sweep purges the ones silent for longer than this.
const DefaultRedisTTL = 24 * time.Hour

// DefaultRedisLookupTimeout is the router's bound on one Lookup (at most
// two round trips, ~0.2-1 ms on a LAN, ~20 ms for ExactLookup with 64
// holders). A lookup is on a request's path: against a hung Redis (stopped, a fork, a paused VM)
// go-redis alone waits its read timeout on each of its retries (35 s for a
// lookup's pipeline with the defaults), and the request with it, although
// the consumer flags the index and kv_aware stops looking up within
// seconds. Past the bound the lookup fails and the request routes on the
// heuristic. The bound cuts a read only on a client with
// ContextTimeoutEnabled (the router's; without it, only dials and the waits
// between retries).
const DefaultRedisLookupTimeout = 250 * time.Millisecond

// LookupFailure names why a lookup failed, for a metric's label:
// "timeout" (the lookup's bound or a network read timed out: the index is
// slow or hung), "canceled" (the caller gave up: a client that went away,
// not the index's fault) or "error" (anything else: refused, a cluster
// without a master, a reply not understood).
func LookupFailure(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "error"
}

// DefaultRedisPrefix is the key prefix when none is configured.
const DefaultRedisPrefix = "kvindex"

// DefaultRedisMapCache bounds the engine-hash map entries a Redis index
// keeps in process for the instances it writes (see RedisConfig.MapCache):
// the memory index's default capacity, 64 instances of 60k blocks, at
// ~40 bytes each (~160 MB) when one router writes a whole fleet.
const DefaultRedisMapCache = 4_000_000

// redisLayout names this data model in every key but the block keys
// (<prefix>:v3:...), so an index written by an older kvrouter (v1:
// <prefix>:b:<hex>, with a TTL on every key; v2: block keys of 11
// characters, fields named by a fixed instance id) is never read as this
// one: see docs/kvindex.md (upgrades).
const redisLayout = "v3"

// RedisConfig configures the Redis backend. The zero value is valid, but
// pools sharing one Redis must each set their own Prefix.
type RedisConfig struct {
	// Prefix starts every key of this pool's index; "" = DefaultRedisPrefix.
	// Keys are listed in docs/kvindex.md.
	Prefix string
	// Model is the pool's model name, folded into chain roots (see Root).
	Model string
	// BlockSize in tokens; 0 = learn it from the first event that has one.
	BlockSize int
	// TTL: lookups ignore instances whose last event is older than TTL,
	// and Sweep purges them; 0 = DefaultRedisTTL.
	TTL time.Duration
	// Now is the clock; nil = time.Now.
	Now func() time.Time
	// WriterLease is how long a router keeps the right to write an
	// instance after its last write, when routers share the index through
	// ApplyAt; 0 = DefaultWriterLease.
	WriterLease time.Duration
	// MapCache bounds the engine-hash map entries kept in process for the
	// instances this index writes (each kept map counts one more, for
	// itself); 0 = DefaultRedisMapCache, < 0 = no cache (every Apply
	// reads the instance's map: one more round trip).
	MapCache int
	// ExactLookup makes every lookup read each chain position up to each
	// instance's first missing probe, so that a hole in the middle of a
	// chain ends the match exactly where it is. The default (false)
	// assumes presence is prefix-closed per tier between two probes that
	// show the same tiers — vLLM frees a request's blocks last-first, so
	// chains are evicted from their ends — and reads only the gaps where
	// an instance's tiers change and the gap below its first missing
	// probe. Both take at most two round trips; the default reads ~10
	// positions for a fully held 512-block chain, exact mode ~500 per
	// holding instance (20 ms with 64 holders, see docs/benchmarks).
	ExactLookup bool
	// LookupTimeout bounds each Lookup (its context's deadline, when none
	// is sooner); 0 = no bound. The router sets DefaultRedisLookupTimeout.
	LookupTimeout time.Duration
}

func (c RedisConfig) validate() error {
	if c.BlockSize < 0 {
		return fmt.Errorf("%w: redis: block size %d < 0", ErrConfig, c.BlockSize)
	}
	if c.TTL < 0 {
		return fmt.Errorf("%w: redis: ttl %v < 0", ErrConfig, c.TTL)
	}
	if c.WriterLease < 0 || c.WriterLease > 0 && c.WriterLease < 10*time.Millisecond {
		return fmt.Errorf("%w: redis: writer lease %v: want 0 (default) or at least 10ms", ErrConfig, c.WriterLease)
	}
	if c.LookupTimeout < 0 {
		return fmt.Errorf("%w: redis: lookup timeout %v < 0", ErrConfig, c.LookupTimeout)
	}
	if c.TTL > 0 && c.TTL < time.Second {
		return fmt.Errorf("%w: redis: ttl %v below a second", ErrConfig, c.TTL)
	}
	if strings.ContainsAny(c.Prefix, "{}") {
		// A hash tag in the prefix would put the whole index in one
		// Cluster slot.
		return fmt.Errorf("%w: redis: prefix %q must not contain a hash tag", ErrConfig, c.Prefix)
	}
	return nil
}

// Redis is the Index backend shared by router replicas, on one Redis
// server or a Redis Cluster.
//
// Data model (docs/kvindex.md has the table): one small hash per block key
// (field: the holding instance's 5-byte field id, random per incarnation;
// value: tier bits), with no TTL; per instance a metadata hash (position,
// writer lease, counters, field id) and an append-only log of its
// engine-hash map's changes, both hash-tagged with the instance's id so
// that one script changes them atomically on one Cluster slot; a registry
// hash (instance id → last event, field id, name).
// Block keys carry no hash tag, so they spread over every slot.
//
// The writer keeps each instance's engine-hash map in process (MapCache),
// current to the map's generation in Redis, so an Apply is one pipelined
// round trip: the block-key writes and the script that appends the map's
// changes, checks the generation (and, for ApplyAt, the position and the
// writer lease) and sets the counters. An Apply without a current map
// (first write, another writer took over, Redis lost it) reads the log in
// a first round trip. A lookup takes at most two pipelined round trips.
//
// Apply for one instance must come from one writer at a time (the event
// consumer shards by instance); routers sharing an index use ApplyAt.
type Redis struct {
	rdb    redis.UniversalClient
	prefix string // <prefix>: block keys are prefix + 10 characters
	ns     string // <prefix>:v3: every other key starts with it
	model  string
	ttl    time.Duration
	now    func() time.Time
	bs     blockSizer

	exact    bool          // ExactLookup
	lookupTO time.Duration // LookupTimeout; 0: no bound
	lease    time.Duration // WriterLease
	token    string        // this index's writer-lease token (random)
	leaseArg any           // lease in ms, boxed once
	bitsArg  [256]any      // tier-bit values as Redis strings, boxed once

	maps     mapCache
	topo     atomic.Pointer[string]              // see topology
	pool     sync.Pool                           // *redisOverlay, reused across Apply calls
	bsStored atomic.Bool                         // the learned block size is in <prefix>:v3:bs
	rewind   rewindState                         // Rewound's counters
	slots    atomic.Pointer[[]redis.ClusterSlot] // the slot map refreshTopology last read (Cluster)
}

var _ Index = (*Redis)(nil)

// NewRedis returns a Redis-backed index using client (a *redis.Client or
// *redis.ClusterClient; the caller owns and closes it).
func NewRedis(client redis.UniversalClient, cfg RedisConfig) (*Redis, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: redis: nil client", ErrConfig)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &Redis{rdb: client, prefix: cfg.Prefix, model: cfg.Model, ttl: cfg.TTL, now: cfg.Now, exact: cfg.ExactLookup, lookupTO: cfg.LookupTimeout}
	if r.prefix == "" {
		r.prefix = DefaultRedisPrefix
	}
	r.prefix += ":"
	r.ns = r.prefix + redisLayout + ":"
	if r.ttl == 0 {
		r.ttl = DefaultRedisTTL
	}
	if r.now == nil {
		r.now = time.Now
	}
	r.bs.configured = cfg.BlockSize
	r.pool.New = func() any { return &redisOverlay{} }
	r.lease = cfg.WriterLease
	if r.lease == 0 {
		r.lease = DefaultWriterLease
	}
	r.leaseArg = r.lease.Milliseconds()
	r.token = newToken()
	for i := range r.bitsArg {
		r.bitsArg[i] = strconv.Itoa(i)
	}
	r.maps.limit = cfg.MapCache
	if r.maps.limit == 0 {
		r.maps.limit = DefaultRedisMapCache
	}
	r.maps.byInst = map[string]*instMap{}
	return r, nil
}

// Instance metadata fields (the per-instance hash <prefix>:v3:i:{id}).
const (
	fieldEntries = "#n"
	fieldTier    = "#t" // + tier digit
	fieldGen     = "#g" // generation: a random token set by every commit
	fieldField   = "#f" // the instance's field name in block keys (see fieldIDs)
	fieldName    = "#name"
)

// keyAlphabet writes block keys' 8 bytes as 10 digits in base 85 (85¹⁰ >
// 2⁶⁴): printable ASCII without a hash-tag brace, a colon or a glob
// character (*?[]\), so block keys never collide with <prefix>:v3:...,
// never name a Cluster hash tag, and are matched literally by SCAN
// patterns. Ten characters, not base64's eleven: an index of this data
// model and one of v2 (11) never share a block key, and a v2 index's
// block keys are told apart by their length (see docs/kvindex.md).
const keyAlphabet = "!\"#$%&()+,-./0123456789;<=>@ABCDEFGHIJKLMNOPQRSTUVWXYZ^_`abcdefghijklmnopqrstuvwxyz|~"

// blockKeyDigits is the length of a block key after the prefix.
const blockKeyDigits = 10

// blockKey is <prefix><10 characters>: short, because there is one per
// block and its name is a good part of its memory.
func (r *Redis) blockKey(k Key) string {
	var b [64]byte
	s := append(b[:0], r.prefix...)
	n := len(s)
	s = s[:n+blockKeyDigits]
	for i, v := n+blockKeyDigits-1, uint64(k); i >= n; i-- {
		s[i] = keyAlphabet[v%uint64(len(keyAlphabet))]
		v /= uint64(len(keyAlphabet))
	}
	return string(s)
}

// instID is an instance's id: the hash tag of its metadata and log keys
// and its field in the registry, the top 40 bits of the name's xxhash64.
// Two names of a pool share an id with probability n²/2⁴¹ (3·10⁻⁸ for 256
// instances, 5·10⁻⁵ for 10,000); the registry write detects it
// (ErrInstanceID) rather than letting two instances' blocks merge
// silently. Block keys name the instance by its field id instead (see
// fieldIDs).
func instID(instance string) string {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], xxhash.Sum64String(instance))
	return string(b[:instIDLen])
}

const instIDLen = 5

// ErrInstanceID: two instance names of one pool have the same id in the
// Redis index (see instID); rename one of them.
var ErrInstanceID = errors.New("kvindex: redis: two instances share an id")

// instTag is the Cluster hash tag of an instance's keys: its id in hex
// (an instance name may hold braces itself).
func instTag(id string) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 0, 2+2*len(id))
	b = append(b, '{')
	for i := range len(id) {
		b = append(b, digits[id[i]>>4], digits[id[i]&0xf])
	}
	return string(append(b, '}'))
}

func (r *Redis) metaKey(id string) string { return r.ns + "i:" + instTag(id) }
func (r *Redis) logKey(id string) string  { return r.ns + "l:" + instTag(id) }
func (r *Redis) regKey() string           { return r.ns + "r" }

func appendHex(b []byte, v uint64) []byte {
	const digits = "0123456789abcdef"
	for i := 60; i >= 0; i -= 4 {
		b = append(b, digits[(v>>uint(i))&0xf])
	}
	return b
}

// mapVal is an engine-hash map value: the router key and tier bits.
type mapVal struct {
	key  Key
	bits tiers.Set
}

// BlockSize implements Index.
func (r *Redis) BlockSize() int { return r.bs.get() }

// redisOverlay is one Apply's view of an instance's engine-hash map: the
// cached map (read only) under the changes made so far, flushed at the
// end.
type redisOverlay struct {
	pre     map[uint64]mapVal // the instance's map before this Apply (not owned)
	cur     map[uint64]mapVal // changed in this Apply; bits 0 = deleted
	cleared bool              // AllBlocksCleared seen: pre no longer counts
	scratch []Key
}

func (o *redisOverlay) reset(pre map[uint64]mapVal) {
	if o.cur == nil {
		o.cur = make(map[uint64]mapVal)
	}
	clear(o.cur)
	o.pre = pre
	o.cleared = false
}

var _ instanceOps = (*redisOverlay)(nil)

func (o *redisOverlay) get(h uint64) (mapVal, bool) {
	if v, ok := o.cur[h]; ok {
		return v, v.bits != 0
	}
	if o.cleared {
		return mapVal{}, false
	}
	v, ok := o.pre[h]
	return v, ok
}

func (o *redisOverlay) keyOf(h uint64) (Key, bool) {
	v, ok := o.get(h)
	return v.key, ok
}

func (o *redisOverlay) store(h uint64, k Key, t tiers.Tier) bool {
	v, ok := o.get(h)
	if !ok || v.key != k {
		v = mapVal{key: k}
	}
	added := !v.bits.Has(t)
	v.bits |= t.Bit()
	o.cur[h] = v
	return added
}

func (o *redisOverlay) addTier(h uint64, t tiers.Tier) (mapped, added bool) {
	v, ok := o.get(h)
	if !ok {
		return false, false
	}
	added = !v.bits.Has(t)
	v.bits |= t.Bit()
	o.cur[h] = v
	return true, added
}

func (o *redisOverlay) removeTier(h uint64, t tiers.Tier) (mapped, removed bool) {
	v, ok := o.get(h)
	if !ok {
		return false, false
	}
	if !v.bits.Has(t) {
		return true, false
	}
	v.bits &^= t.Bit()
	o.cur[h] = v
	return true, true
}

func (o *redisOverlay) clearAll() {
	o.cleared = true
	clear(o.cur)
}

// Apply implements Index: the events applied to the instance's cached
// engine-hash map in memory, then one pipeline: the block-key writes and
// mapScript's commit (the map's changes appended to its log, counters,
// generation; one atomic step on the instance's slot). Without a current
// cached map, a first round trip reads the map's log. Apply takes no
// writer lease and leaves the instance's position alone: routers sharing
// an index use ApplyAt.
func (r *Redis) Apply(ctx context.Context, instance string, evs []events.Event) (ApplyResult, error) {
	res, err := r.apply(ctx, instance, nil, evs)
	return res.ApplyResult, err
}

// apply is Apply (g nil), ApplyAt and LoadAt.
//
// The first round trip (mapScript's begin: position and lease checks, the
// lease taken, and the map's log when the cached map is not current) is
// skipped when the cached map is current and, with a guard, this index
// took or renewed the instance's lease less than half a lease ago at the
// position the guard expects, below the guard's new one: nobody else can have written the instance
// since, and the commit checks all of it again.
//
// Arguments are passed pre-boxed (one interface value per block key,
// instance id and tier value): go-redis otherwise boxes each argument of
// each command, and at hundreds of thousands of blocks a second the
// client's allocations, not Redis, set the pace.
func (r *Redis) apply(ctx context.Context, instance string, g *seqGuard, evs []events.Event) (SeqResult, error) {
	var res SeqResult
	m := r.maps.get(instance)
	m.mu.Lock()
	defer m.mu.Unlock()
	defer r.maps.release(m) // after the drop below, under m.mu
	ok := false
	defer func() {
		if !ok {
			// Whatever happened, this process no longer knows the map.
			r.maps.drop(m)
		}
	}()

	id := instID(instance)
	mkey, lkey := r.metaKey(id), r.logKey(id)
	if err := r.settle(ctx, m, mkey); err != nil {
		return res, err
	}
	token, expected, newPos := "", "*", ""
	if g != nil {
		token, expected, newPos = r.token, g.expected(), strconv.FormatUint(g.seq, 10)
	}
	started := time.Now()
	takeover := false // see below
	skip := m.vals != nil && r.maps.limit > 0
	if g != nil {
		// A message at or below the expected position (one a snapshot
		// loaded ahead of it already covers) is the begin's to answer
		// as a duplicate: skipped, its block writes would go out and
		// the commit's refusal would unsettle a good state.
		skip = skip && !g.load && m.pos.at(g.from) && g.from.Seeded && g.seq > g.from.Seq &&
			!m.leased.IsZero() && started.Sub(m.leased) < r.lease/2
	}
	if !skip {
		if m.vals == nil {
			m.gen = "" // ask for the log whatever the generation
		}
		var begin *redis.SliceCmd
		_, err := r.pipelined(ctx, func(p redis.Pipeliner) {
			mode := "b"
			if g != nil && g.yield {
				mode = "y"
			}
			begin = redis.NewSliceCmd(ctx, "evalsha", mapScript.Hash(), 2, mkey, lkey, mode, token, r.leaseArg, expected, newPos, m.gen, r.topology())
			_ = p.Process(ctx, begin)
		})
		if err != nil {
			return res, r.failed(fmt.Errorf("kvindex: redis: read engine-hash map of %s: %w", instance, err))
		}
		reply := begin.Val()
		st, pos, err := scriptStatus(reply)
		if err != nil {
			return res, err
		}
		res.Position = pos
		if st != SeqApplied {
			// Another router applies these events; this one still
			// needs the block size to key its lookups.
			r.bs.learn(evs)
			res.Status = st
			return res, nil
		}
		gen, _ := reply[2].(string)
		fid, _ := reply[3].(string)
		mine, _ := reply[4].(string)
		takeover = g != nil && !g.load && mine != "1"
		if len(reply) > 5 || m.vals == nil {
			// The log, or (m.gen "" matched) no map at all.
			var log string
			if len(reply) > 5 {
				chunks, _ := reply[5].([]any)
				log = joinChunks(chunks)
			}
			if err := m.load(gen, log); err != nil {
				return res, r.failed(fmt.Errorf("kvindex: redis: engine-hash map of %s: %w", instance, err))
			}
		}
		m.gen = gen
		m.fid = fid
		if g != nil {
			m.leased, m.pos = started, pos
		}
	}

	o := r.pool.Get().(*redisOverlay)
	defer r.pool.Put(o)
	o.reset(m.vals)
	if g != nil && g.load {
		o.clearAll()
	}
	o.scratch = applyEvents(o, r.model, &r.bs, evs, &res.ApplyResult, o.scratch)
	rewritten := takeover && !o.cleared && m.fid != "" // no field id: it starts over anyway (below)
	if rewritten {
		// The last commit was another writer's, or another writer has
		// held the lease since (it ran out), or none was guarded: that
		// writer's last pipeline may still be on
		// its way (a stalled process, a hung server's socket), and its
		// block writes, under the current field id, would land among
		// this writer's — a late removal deleting a block stored since,
		// a late store bringing back one removed since — with nothing
		// to tell: its commit is refused, but the fields are not in the
		// commit. A takeover therefore starts a new incarnation: the
		// whole map, with these events, written under a new field id
		// (the old one's fields removed first, as a load does), so that
		// nothing written under the old one counts once it commits.
		for h, v := range m.vals {
			if _, changed := o.cur[h]; !changed {
				o.cur[h] = v
			}
		}
		o.cleared = true
	}

	if g != nil && time.Since(m.leased) > r.lease/2 {
		// Another router may take the instance over once the lease runs
		// out; writing block keys now could interleave with its writes.
		return res, fmt.Errorf("%w (%s, %v since the lease was taken)", errLeaseTooOld, instance, time.Since(m.leased).Round(time.Millisecond))
	}
	now := r.now()
	pipe := r.rdb.Pipeline()
	// One backing array for every block-key command's arguments.
	w := make([]any, 0, 4*len(o.cur)+3*len(m.vals)*b2i(o.cleared)+16)
	cmd := func(args ...any) {
		start := len(w)
		w = append(w, args...)
		_ = pipe.Process(ctx, onceCmd{redis.NewCmd(ctx, w[start:len(w):len(w)]...)})
	}
	// A load, a clear or a takeover starts a new incarnation under a new
	// field id: every field written before it stops counting in lookups
	// at once, whether this Apply removes it or not (see fieldIDs). So
	// does the first write of an instance whose metadata names none (new,
	// or lost by Redis).
	fid, oldFid := m.fid, m.fid
	if fid == "" && len(m.vals) > 0 {
		// A map without a field id (its metadata lost or deleted by hand
		// while its log was not): it starts over, keeping only what these
		// events stored or changed; its fields are removed under the id
		// the registry names, if the registry still knows one.
		o.cleared = true
		oldFid = r.registryFieldID(ctx, id, instance)
	}
	if o.cleared || fid == "" {
		fid = newFieldID()
	}
	oldArg, fidArg := any(oldFid), any(fid)
	counts := m.counts
	account := func(v mapVal, sign int) {
		if v.bits&allTiers == 0 {
			return
		}
		counts[0] += sign
		for t := range tiers.Count {
			if v.bits&(1<<t) != 0 {
				counts[1+t] += sign
			}
		}
	}
	if o.cleared {
		// Drop this instance's old field from every block it held (the
		// blocks re-stored after the clear are written under the new id
		// below), before the commit: once the commit names the new id,
		// nothing lists the old one's fields any more, so removals cut
		// off after it (Redis hung or gone while the pipeline was sent)
		// would stay in Redis for good. Cut off before the commit, the
		// removals leave the incarnation that still counts short, and
		// the write's error marks the instance (unsettle, settle): it
		// reads as unseeded and is reloaded, and the reload, still under
		// the old id, removes what is left of it.
		if oldFid != "" {
			for _, v := range m.vals {
				cmd("hdel", r.blockKey(v.key), oldArg)
			}
		}
		counts = [1 + tiers.Count]int{}
	}
	var rec []byte
	var placed []any // block key, value: the fields this Apply wrote
	for h, v := range o.cur {
		pv, had := m.vals[h]
		if o.cleared {
			had = false
		}
		if had {
			account(pv, -1)
		}
		account(v, +1)
		if had && (v.bits == 0 || pv.key != v.key) {
			cmd("hdel", r.blockKey(pv.key), fidArg)
		}
		if v.bits == 0 {
			if had {
				rec = appendLogRecord(rec, h, mapVal{})
			}
			continue
		}
		if had && pv == v {
			continue // re-stored where it already was
		}
		bk, val := r.blockKey(v.key), r.bitsArg[uint8(v.bits)]
		cmd("hset", bk, fidArg, val)
		placed = append(placed, bk, val)
		rec = appendLogRecord(rec, h, v)
	}
	// The log is rewritten whole after a clear, and when it has grown to
	// twice the live entries (a block stored, removed and stored again
	// leaves stale records): its size stays within 2× the map's, and the
	// rewrite's cost is paid by the appends that made it necessary.
	live := counts[0]
	mode := "a"
	if o.cleared || m.logLen+len(rec) > 2*logRecord*live+4096 {
		mode = "w"
	}
	newGen := newToken()
	commit := redis.NewSliceCmd(ctx, "evalsha", mapScript.Hash(), 2, mkey, lkey, "c", token, r.leaseArg, expected, newPos, m.gen,
		newGen, mode, nil, counts[0], counts[1], counts[2], counts[3], counts[4], instance, fid, g.holeArg(evs), r.topology())
	if mode == "w" {
		// Build the new map to write it whole.
		next := r.merged(m.vals, o)
		rec = rec[:0]
		for h, v := range next {
			rec = appendLogRecord(rec, h, v)
		}
	}
	commit.Args()[13] = rec
	_ = pipe.Process(ctx, onceSliceCmd{commit})
	fidHex, prevHex := hex.EncodeToString([]byte(fid)), prevFidHex(m.fid, fid)
	entry := strconv.FormatInt(now.UnixMilli(), 10) + " " + fidHex + " " + instance
	reg := redis.NewSliceCmd(ctx, "evalsha", regScript.Hash(), 1, r.regKey(), id, entry, instance, fidHex, prevHex)
	_ = pipe.Process(ctx, onceSliceCmd{reg})
	storeBS := r.bs.configured == 0 && r.bs.get() != 0 && !r.bsStored.Load()
	if storeBS {
		// For routers that start while the pool is idle (see Epoch).
		pipe.SetNX(ctx, r.bsKey(), r.bs.get(), 0)
	}
	_, err := pipe.Exec(ctx)
	if err == nil && storeBS {
		r.bsStored.Store(true)
	}
	if err != nil && hasNoScript([]redis.Cmder{commit, reg}) {
		// A Redis that never ran the scripts (new, restarted): load them
		// and send the commit and the registry write again; the block-key
		// writes went through.
		// Only the scripts that were refused run again: the other may
		// have run (a commit twice would find its own generation).
		err = r.loadScripts(ctx)
		if err == nil {
			_, err = r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				if hasNoScript([]redis.Cmder{commit}) {
					commit = redis.NewSliceCmd(ctx, commit.Args()...)
					_ = p.Process(ctx, onceSliceCmd{commit})
				}
				if hasNoScript([]redis.Cmder{reg}) {
					reg = redis.NewSliceCmd(ctx, reg.Args()...)
					_ = p.Process(ctx, onceSliceCmd{reg})
				}
				return nil
			})
		}
	}
	if err != nil {
		r.unsettle(ctx, m, mkey, placed, fidArg)
		return res, r.failed(fmt.Errorf("kvindex: redis: write %d changes of %s: %w", len(o.cur), instance, err))
	}
	st, pos, err := scriptStatus(commit.Val())
	if err != nil {
		r.unsettle(ctx, m, mkey, placed, fidArg)
		return res, err
	}
	if st != SeqApplied {
		// Lost the lease or the map between the two round trips, or the
		// cached map was not current (Redis restarted, a purge, another
		// writer, a topology change, a lease that ran out while the write
		// was under way): the block-key writes went out regardless, and
		// may have crossed another writer's. Unsettled, the instance is
		// reloaded in a new incarnation, which retires them.
		r.unsettle(ctx, m, mkey, placed, fidArg)
		return res, fmt.Errorf("%w: %s is %s at %s", errMoved, instance, st, pos)
	}
	if v := reg.Val(); len(v) == 2 && v[0] == "name" {
		// The block-key writes went out: the two instances' blocks are
		// mixed until one of them is renamed.
		return res, fmt.Errorf("%w: %q and %q", ErrInstanceID, instance, v[1])
	} else if len(v) == 2 && v[0] == "fid" {
		found, _ := v[1].(string)
		// The commit applied, so this write is the instance's current
		// one: the registry lost a write (a failover) and must follow —
		// unless it has moved on since. The fix-up replaces only the
		// entry just found: run late (this process stalled, a copy sent
		// again after a timeout) once another writer has written the
		// instance in a new incarnation, it would point lookups back at
		// the retired field id.
		fix := redis.NewSliceCmd(ctx, "evalsha", regScript.Hash(), 1, r.regKey(), id, entry, instance, fidHex, found)
		if _, err := r.pipelined(ctx, func(p redis.Pipeliner) { _ = p.Process(ctx, onceSliceCmd{fix}) }); err != nil {
			return res, r.failed(fmt.Errorf("kvindex: redis: registry entry of %s: %w", instance, err))
		}
	}
	// The cached map follows the commit.
	if mode == "w" {
		m.logLen = len(rec)
	} else {
		m.logLen += len(rec)
	}
	m.gen, m.counts, m.fid = newGen, counts, fid
	r.maps.resize(m, r.mergeInto(m, o))
	if g != nil {
		m.leased, m.pos = started, pos
	}
	res.Status, res.Position = SeqApplied, pos
	res.Takeover = rewritten
	ok = true
	return res, nil
}

// unsettle is what a write whose outcome is unknown (an error: the commit
// may or may not have run; on a Cluster the block keys and the instance's
// map may lie on different masters, one of them failing) or that did not
// commit (its map or lease was not current) leaves behind: block fields
// the instance's map may not list — never cleaned by a reload or a purge,
// answering lookups with blocks the instance may not hold — and fields it
// lists missing. It marks the instance (see markCmd), then takes back every
// field it wrote that still holds what it wrote (delIfScript: one key
// each, so one slot). Best effort: a master that cannot be reached now is
// failed over, which changes the topology and unseeds every instance
// anyway; what it leaves is retired by the incarnation. When the mark's
// answer does not come back, the instance stays marked unsettled in this
// process, and its next write or Position marks it first.
func (r *Redis) unsettle(ctx context.Context, m *instMap, mkey string, placed []any, id any) {
	// Sent whatever the caller's context does now or next (a router
	// shutting down: its writes may still land, and the mark is what has
	// the next writer reload and retire them), within its own bound.
	// Checking ctx.Err() and then deriving from ctx left a gap in which a
	// cancellation cut the mark.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.lease)
	defer cancel()
	marked := false
	for range 2 {
		pipe := r.rdb.Pipeline()
		// The mark first: a pipeline cut short (Redis hung or gone while
		// it was sent) takes no field back without it.
		mark := r.markCmd(ctx, mkey)
		_ = pipe.Process(ctx, onceCmd{mark})
		for i := 0; i+1 < len(placed); i += 2 {
			c := redis.NewCmd(ctx, "evalsha", delIfScript.Hash(), 1, placed[i], id, placed[i+1])
			_ = pipe.Process(ctx, onceCmd{c})
		}
		cmds, err := pipe.Exec(ctx)
		marked = marked || mark.Err() == nil
		if err == nil || !hasNoScript(cmds) || r.loadScripts(ctx) != nil {
			break
		}
	}
	if !marked {
		m.unsettled.Add(1)
	}
}

// markCmd is the mark of an instance whose state is not known: its
// position no longer counts (the instance reads as unseeded, so the
// consumers reload it, in a new incarnation that retires every field
// written before) and its generation changes, so that no commit sent
// before the mark — a copy of a write still in a hung server's socket, or
// one sent again by the client — can apply after it: ApplyAt's would find
// the instance unseeded, but LoadAt's accepts any position.
func (r *Redis) markCmd(ctx context.Context, mkey string) *redis.Cmd {
	return redis.NewCmd(ctx, "hset", mkey, fieldTopology, "!", fieldGen, newToken())
}

// settle marks the instance if a write of this process left it
// unsettled without its mark's answer (see unsettle); the caller holds
// m.mu or does not need it (the count is atomic, the mark idempotent).
func (r *Redis) settle(ctx context.Context, m *instMap, mkey string) error {
	n := m.unsettled.Load()
	if n == 0 {
		return nil
	}
	mark := r.markCmd(ctx, mkey)
	if err := r.rdb.Process(ctx, onceCmd{mark}); err != nil {
		return r.failed(fmt.Errorf("kvindex: redis: mark %s after a write of unknown outcome: %w", m.name, err))
	}
	// Only the failures this mark answers: one recorded while it was
	// under way (a concurrent write's) keeps the count, and is marked
	// again.
	m.unsettled.CompareAndSwap(n, 0)
	return nil
}

// onceCmd and onceSliceCmd are writes that go-redis must not send again
// after an error (a read timeout, a connection reset; on a Cluster also
// through MaxRedirects): the first copy may still be in the server's
// socket, or be running, and would run again after it, interleaved with
// whatever this index writes meanwhile. A write's error is an unknown
// outcome, which unsettle and the consumer's repair handle; reads keep
// the client's retries.
type onceCmd struct{ *redis.Cmd }

func (onceCmd) NoRetry() bool { return true }

type onceSliceCmd struct{ *redis.SliceCmd }

func (onceSliceCmd) NoRetry() bool { return true }

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// merged returns the map after o's changes, as a new map (o.pre is left
// alone: the commit may fail).
func (r *Redis) merged(pre map[uint64]mapVal, o *redisOverlay) map[uint64]mapVal {
	next := make(map[uint64]mapVal, len(pre)+len(o.cur))
	if !o.cleared {
		for h, v := range pre {
			next[h] = v
		}
	}
	for h, v := range o.cur {
		if v.bits == 0 {
			delete(next, h)
		} else {
			next[h] = v
		}
	}
	return next
}

// mergeInto applies o's changes to m's map and returns its new size.
func (r *Redis) mergeInto(m *instMap, o *redisOverlay) int {
	if o.cleared {
		clear(m.vals)
	}
	for h, v := range o.cur {
		if v.bits == 0 {
			delete(m.vals, h)
		} else {
			m.vals[h] = v
		}
	}
	return len(m.vals)
}

// probePositions are the chain positions read in a lookup's first round
// trip: 0, 1, 3, 7, ... and the last. Presence is nearly prefix-closed, so
// the first probe an instance lacks bounds its match from above.
func probePositions(n int) []int {
	var out []int
	for p := 1; p <= n; p *= 2 {
		out = append(out, p-1)
	}
	if last := n - 1; len(out) == 0 || out[len(out)-1] != last {
		out = append(out, last)
	}
	return out
}

// Lookup implements Index in at most two round trips: the first reads the
// instance registry and the probe positions (HGETALL); for each live
// instance holding keys[0], the first probe it lacks bounds its match; the
// second reads, with HMGET of just the instances that need it, the
// positions below those bounds that the probes leave open: the gaps where
// an instance's tiers change and the gap below its bound, or, with
// ExactLookup, every position not probed.
func (r *Redis) Lookup(ctx context.Context, keys []Key) ([]Match, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	if r.lookupTO > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.lookupTO)
		defer cancel()
	}
	probes := probePositions(len(keys))
	pipe := r.rdb.Pipeline()
	reg := pipe.HGetAll(ctx, r.regKey())
	pcmds := make([]*redis.MapStringStringCmd, len(probes))
	for i, p := range probes {
		pcmds[i] = pipe.HGetAll(ctx, r.blockKey(keys[p]))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, r.failed(fmt.Errorf("kvindex: redis: lookup: %w", err))
	}
	cutoff := r.now().Add(-r.ttl).UnixMilli()
	first := pcmds[0].Val()
	if len(first) == 0 {
		return nil, nil
	}
	type cand struct {
		id    string // the field naming it in block keys (its field id)
		name  string
		bound int         // first probed position it lacks (or len(keys))
		bits  []tiers.Set // per position below bound, once known
	}
	var cands []cand
	// The registry names each instance's current field id: fields of any
	// other (an old incarnation's, a purged instance's) do not count.
	for _, v := range reg.Val() {
		fid, ok := regFieldID(v)
		if !ok || fieldBits(first[string(fid[:])]) == 0 {
			continue
		}
		ms, _, name, ok := parseRegEntry(v)
		if !ok || ms < cutoff {
			continue // silent for longer than the TTL
		}
		c := cand{id: string(fid[:]), name: name, bound: len(keys)}
		for i, p := range probes {
			if fieldBits(pcmds[i].Val()[c.id]) == 0 {
				c.bound = p
				break
			}
		}
		cands = append(cands, c)
	}
	if len(cands) == 0 {
		return nil, nil
	}
	maxBound := 0
	for _, c := range cands {
		maxBound = max(maxBound, c.bound)
	}
	// Fill in each candidate's bits below its bound: probes are known;
	// the positions between two probes are read in round two, unless both
	// probes show the same cumulative tiers and the lookup is not exact
	// (then they are assumed alike). The gap below the bound is always
	// read: the match ends somewhere inside it.
	needers := make([][]int, maxBound) // position → candidates to read it for
	for ci := range cands {
		c := &cands[ci]
		c.bits = make([]tiers.Set, c.bound)
		prev, prevBits := -1, tiers.Set(0)
		gap := func(from, to int, assumed tiers.Set) {
			for q := from; q < to; q++ {
				if assumed != 0 {
					c.bits[q] = assumed
				} else {
					needers[q] = append(needers[q], ci)
				}
			}
		}
		for i, p := range probes {
			if p >= c.bound {
				break
			}
			b := fieldBits(pcmds[i].Val()[c.id])
			c.bits[p] = b
			var assumed tiers.Set
			if !r.exact && cumTiers(b) == cumTiers(prevBits) {
				assumed = b
			}
			gap(prev+1, p, assumed)
			prev, prevBits = p, b
		}
		gap(prev+1, c.bound, 0)
	}
	var fills []*redis.SliceCmd
	var fillPos []int
	var names []string
	var lastWho []int
	for p, who := range needers {
		if len(who) == 0 {
			continue
		}
		if fills == nil {
			pipe = r.rdb.Pipeline()
		}
		if !slices.Equal(who, lastWho) {
			// Consecutive positions mostly need the same candidates: share
			// the field list.
			names = make([]string, len(who))
			for i, ci := range who {
				names[i] = cands[ci].id
			}
			lastWho = who
		}
		fills = append(fills, pipe.HMGet(ctx, r.blockKey(keys[p]), names...))
		fillPos = append(fillPos, p)
	}
	if fills != nil {
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			return nil, r.failed(fmt.Errorf("kvindex: redis: lookup fill: %w", err))
		}
		for fi, cmd := range fills {
			p := fillPos[fi]
			for i, v := range cmd.Val() {
				s, _ := v.(string)
				c := &cands[needers[p][i]]
				c.bits[p] = fieldBits(s)
			}
		}
	}
	out := make([]Match, 0, len(cands))
	for _, c := range cands {
		m := Match{Instance: c.name}
		var ended [tiers.Count]bool
		for _, b := range c.bits {
			if b == 0 {
				break
			}
			for t := range tiers.Count {
				if !ended[t] {
					if b&(2<<t-1) != 0 {
						m.Blocks[t]++
					} else {
						ended[t] = true
					}
				}
			}
		}
		if m.Blocks[tiers.Count-1] > 0 {
			out = append(out, m)
		}
	}
	return r.bs.roundUnits(out), nil
}

// cumTiers is the set of tiers a block counts for in a Match: its fastest
// tier and every slower one.
func cumTiers(b tiers.Set) tiers.Set {
	b &= allTiers
	if b == 0 {
		return 0
	}
	return ^(b&-b - 1) & allTiers
}

func parseBits(s string) tiers.Set {
	if s == "" {
		return 0
	}
	v, err := strconv.ParseUint(s, 10, 8)
	if err != nil {
		return 0
	}
	return tiers.Set(v)
}

// parseRegEntry parses a registry value: "<last event, unix ms> <field
// id, 10 hex digits> <name>".
func parseRegEntry(v string) (ms int64, fid [fieldIDLen]byte, name string, ok bool) {
	a, rest, ok := strings.Cut(v, " ")
	if !ok {
		return 0, fid, "", false
	}
	if fid, ok = regFieldID(v); !ok {
		return 0, fid, "", false
	}
	ms, err := strconv.ParseInt(a, 10, 64)
	return ms, fid, rest[2*fieldIDLen+1:], err == nil
}

// regFieldID reads the field id of a registry value.
func regFieldID(v string) (fid [fieldIDLen]byte, ok bool) {
	sp := strings.IndexByte(v, ' ')
	if sp < 0 || len(v) < sp+2*fieldIDLen+2 || v[sp+1+2*fieldIDLen] != ' ' {
		return fid, false
	}
	for i := range fieldIDLen {
		hi, lo := unhex(v[sp+1+2*i]), unhex(v[sp+2+2*i])
		if hi > 15 || lo > 15 {
			return fid, false
		}
		fid[i] = hi<<4 | lo
	}
	return fid, true
}

func unhex(c byte) byte {
	switch {
	case '0' <= c && c <= '9':
		return c - '0'
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10
	}
	return 255
}

// fieldIDs: block keys name an instance by a field id, 5 random bytes
// drawn anew at each load (a snapshot replacing its state), at each clear
// and at the first write of an instance whose metadata holds none (#f);
// the registry and the metadata hold the current one, and lookups count
// only the fields under it. A load or a clear thus retires every field
// written before it at once and for good — including fields its map does
// not list (block writes of an Apply whose commit failed, a late write of
// a router whose lease ran out, and what a Redis Cluster failover leaves
// when it loses the instance's last metadata writes or a block key's last
// removals), which removals cannot reach. Drawn, not counted: a counter
// in the metadata can itself lose its last increments in a failover and
// hand the same number out twice, bringing back the fields written under
// it, and a small counter wraps (docs/kvindex.md, "Incarnations"). Each
// attempt draws its own, so two attempts (one of which may fail half-way)
// never share one. Five bytes keep a one-holder block key in Redis'
// smallest listpack allocation (16 bytes: an 8-byte id would take 24);
// two field ids of a pool's live and retired incarnations coincide with
// probability n²/2⁴¹ for n of them (about 3·10⁻⁸ for 256).
const fieldIDLen = 5

func newFieldID() string {
	var b [fieldIDLen]byte
	_, _ = rand.Read(b[:])
	return string(b[:])
}

// prevFidHex is the hex of the field id a write replaces: the one it writes
// (no new incarnation) is encoded once, not twice, on every Apply.
func prevFidHex(prev, cur string) string {
	if prev == cur {
		return "" // regScript compares ARGV[4] first; "" never matches an entry
	}
	return hex.EncodeToString([]byte(prev))
}

// registryFieldID is the field id the registry names for the instance
// ("" when it names none, or the entry is another name's, or Redis cannot
// be read: then nothing can be told to be the instance's).
func (r *Redis) registryFieldID(ctx context.Context, id, instance string) string {
	v, err := r.rdb.HGet(ctx, r.regKey(), id).Result()
	if err != nil {
		return ""
	}
	_, fid, name, ok := parseRegEntry(v)
	if !ok || name != instance {
		return ""
	}
	return string(fid[:])
}

// fieldBits is a block field's tier bits.
func fieldBits(s string) tiers.Set {
	return parseBits(s) & allTiers
}

// Purge implements Index: the instance's engine-hash log lists every block
// key it holds a field in, so no scan of the keyspace is needed.
func (r *Redis) Purge(ctx context.Context, instance string) error {
	m := r.maps.get(instance)
	m.mu.Lock()
	defer m.mu.Unlock()
	defer r.maps.release(m)
	r.maps.forget(m)
	id := instID(instance)
	var chunks *redis.StringSliceCmd
	var fidCmd *redis.StringCmd
	_, err := r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		chunks = p.LRange(ctx, r.logKey(id), 0, -1)
		fidCmd = p.HGet(ctx, r.metaKey(id), fieldField)
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return r.failed(fmt.Errorf("kvindex: redis: purge %s: read map: %w", instance, err))
	}
	fid := fidCmd.Val()
	if fid == "" {
		fid = r.registryFieldID(ctx, id, instance) // the metadata lost, the log not
	}
	vals := make(map[uint64]mapVal)
	if fid != "" { // none: no block field can be told to be the instance's
		_ = replayLog(strings.Join(chunks.Val(), ""), vals) // a partial record: purge what is whole
	}
	pipe := r.rdb.Pipeline()
	fidArg := any(fid)
	for _, v := range vals {
		_ = pipe.Process(ctx, onceCmd{redis.NewCmd(ctx, "hdel", r.blockKey(v.key), fidArg)})
		if pipe.Len() >= 8192 {
			if _, err := pipe.Exec(ctx); err != nil {
				return r.failed(fmt.Errorf("kvindex: redis: purge %s: %w", instance, err))
			}
		}
	}
	// The log before the metadata: a purge cut short between the two
	// leaves metadata without a log (an empty map), never a map without
	// its field id.
	for _, args := range [][]any{{"del", r.logKey(id)}, {"del", r.metaKey(id)}, {"hdel", r.regKey(), id}} {
		_ = pipe.Process(ctx, onceCmd{redis.NewCmd(ctx, args...)})
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return r.failed(fmt.Errorf("kvindex: redis: purge %s: %w", instance, err))
	}
	return nil
}

// Sweep purges every instance whose last event is older than the TTL
// (lookups ignore them already): block keys carry no TTL, so an instance
// that died without being purged by a router's consumer is removed here.
// It returns the purged instances' names.
func (r *Redis) Sweep(ctx context.Context) ([]string, error) {
	reg, err := r.rdb.HGetAll(ctx, r.regKey()).Result()
	if err != nil {
		return nil, r.failed(fmt.Errorf("kvindex: redis: sweep: %w", err))
	}
	cutoff := r.now().Add(-r.ttl).UnixMilli()
	var out []string
	for id, v := range reg {
		ms, _, name, ok := parseRegEntry(v)
		if ok && ms >= cutoff {
			continue
		}
		if !ok || instID(name) != id {
			// Not written by this model: drop the entry alone.
			if err := r.rdb.HDel(ctx, r.regKey(), id).Err(); err != nil {
				return out, r.failed(fmt.Errorf("kvindex: redis: sweep: %w", err))
			}
			continue
		}
		if err := r.Purge(ctx, name); err != nil {
			return out, err
		}
		out = append(out, name)
	}
	return out, nil
}

// Instances implements Index. Instances silent for longer than the TTL are
// still listed (with their last event time) until purged.
func (r *Redis) Instances(ctx context.Context) ([]InstanceStats, error) {
	reg, err := r.rdb.HGetAll(ctx, r.regKey()).Result()
	if err != nil {
		return nil, r.failed(fmt.Errorf("kvindex: redis: instances: %w", err))
	}
	if len(reg) == 0 {
		return nil, nil
	}
	fields := []string{fieldTier + "0", fieldTier + "1", fieldTier + "2", fieldTier + "3"}
	pipe := r.rdb.Pipeline()
	out := make([]InstanceStats, 0, len(reg))
	cmds := make([]*redis.SliceCmd, 0, len(reg))
	for id, v := range reg {
		ms, _, name, ok := parseRegEntry(v)
		if !ok {
			continue
		}
		out = append(out, InstanceStats{Instance: name, LastEvent: time.UnixMilli(ms)})
		cmds = append(cmds, pipe.HMGet(ctx, r.metaKey(id), fields...))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, r.failed(fmt.Errorf("kvindex: redis: instances: %w", err))
	}
	for i, c := range cmds {
		for t, v := range c.Val() {
			if s, ok := v.(string); ok {
				n, _ := strconv.Atoi(s)
				out[i].Blocks[t] = n
			}
		}
	}
	return out, nil
}

// Len implements Index: the sum of the instances' entry counters.
func (r *Redis) Len(ctx context.Context) (int, error) {
	reg, err := r.rdb.HKeys(ctx, r.regKey()).Result()
	if err != nil {
		return 0, r.failed(fmt.Errorf("kvindex: redis: len: %w", err))
	}
	if len(reg) == 0 {
		return 0, nil
	}
	pipe := r.rdb.Pipeline()
	cmds := make([]*redis.StringCmd, len(reg))
	for i, id := range reg {
		cmds[i] = pipe.HGet(ctx, r.metaKey(id), fieldEntries)
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, r.failed(fmt.Errorf("kvindex: redis: len: %w", err))
	}
	n := 0
	for _, c := range cmds {
		v, _ := c.Int()
		n += v
	}
	return n, nil
}
