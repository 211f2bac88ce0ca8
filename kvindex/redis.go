package kvindex

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// DefaultRedisTTL is the Redis backend's default key lifetime. Every key
// written by Apply gets it, refreshed by every write, so keys of an
// instance that died without being purged age out. It must exceed the time
// a block stays cached on a live instance without being stored again (vLLM
// reports a block once, when it is stored, however often it is hit later),
// hence a day rather than minutes; routers purge lost instances explicitly.
const DefaultRedisTTL = 24 * time.Hour

// DefaultRedisPrefix is the key prefix when none is configured.
const DefaultRedisPrefix = "kvindex"

// RedisConfig configures the Redis backend. The zero value is valid, but
// pools sharing one Redis must each set their own Prefix.
type RedisConfig struct {
	// Prefix starts every key of this pool's index; "" = DefaultRedisPrefix.
	// Keys: <prefix>:b:<key hex> (one hash per block key: instance → tier
	// bits), <prefix>:i:<instance> (engine hash → key and tier bits, plus
	// counters), <prefix>:r (instance → last event, unix ms).
	Prefix string
	// Model is the pool's model name, folded into chain roots (see Root).
	Model string
	// BlockSize in tokens; 0 = learn it from the first event that has one.
	BlockSize int
	// TTL of every key; 0 = DefaultRedisTTL. Lookups also ignore instances
	// whose last event is older than TTL.
	TTL time.Duration
	// Now is the clock; nil = time.Now.
	Now func() time.Time
	// WriterLease is how long a router keeps the right to write an
	// instance after its last write, when routers share the index through
	// ApplyAt; 0 = DefaultWriterLease.
	WriterLease time.Duration
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
	if c.TTL > 0 && c.TTL < time.Second {
		return fmt.Errorf("%w: redis: ttl %v below Redis' 1s resolution", ErrConfig, c.TTL)
	}
	if strings.ContainsAny(c.Prefix, "{}") {
		// A hash tag in the prefix would put the whole index in one
		// Cluster slot.
		return fmt.Errorf("%w: redis: prefix %q must not contain a hash tag", ErrConfig, c.Prefix)
	}
	return nil
}

// Redis is the Index backend shared by router replicas. Every command
// touches a single key, so it works on Redis Cluster, and block keys spread
// over all slots. Writes for one Apply go out in one pipeline after one
// read of the instance's engine-hash map; a lookup takes at most two
// pipelined round trips.
//
// Apply for one instance must come from one writer at a time (the event
// consumer shards by instance); replicas that all apply the same stream
// write the same values.
type Redis struct {
	rdb    redis.UniversalClient
	prefix string
	model  string
	ttl    time.Duration
	now    func() time.Time
	bs     blockSizer

	exact    bool          // ExactLookup
	lease    time.Duration // WriterLease
	token    string        // this index's writer-lease token (random)
	leaseArg any           // lease in ms, boxed once
	ttlArg   any           // TTL in seconds, boxed once
	bitsArg  [256]any      // tier-bit values as Redis strings, boxed once

	pool     sync.Pool   // *redisOverlay, reused across Apply calls
	bsStored atomic.Bool // the learned block size is in <prefix>:bs
}

var _ Index = (*Redis)(nil)

// NewRedis returns a Redis-backed index using client (a *redis.Client,
// *redis.ClusterClient or ring; the caller owns and closes it).
func NewRedis(client redis.UniversalClient, cfg RedisConfig) (*Redis, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: redis: nil client", ErrConfig)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &Redis{rdb: client, prefix: cfg.Prefix, model: cfg.Model, ttl: cfg.TTL, now: cfg.Now, exact: cfg.ExactLookup}
	if r.prefix == "" {
		r.prefix = DefaultRedisPrefix
	}
	if r.ttl == 0 {
		r.ttl = DefaultRedisTTL
	}
	if r.now == nil {
		r.now = time.Now
	}
	r.bs.configured = cfg.BlockSize
	r.pool.New = func() any { return &redisOverlay{} }
	r.ttlArg = int64(r.ttl / time.Second)
	r.lease = cfg.WriterLease
	if r.lease == 0 {
		r.lease = DefaultWriterLease
	}
	r.leaseArg = r.lease.Milliseconds()
	r.token = newToken()
	for i := range r.bitsArg {
		r.bitsArg[i] = strconv.Itoa(i)
	}
	return r, nil
}

// Instance-map counter fields; engine-hash fields are 16 hex digits, so
// these never collide with them.
const (
	fieldEntries = "#n"
	fieldTier    = "#t" // + tier digit
)

func (r *Redis) blockKey(k Key) string {
	var b [64]byte
	s := append(append(b[:0], r.prefix...), ":b:"...)
	return string(appendHex(s, uint64(k)))
}

func (r *Redis) instKey(instance string) string { return r.prefix + ":i:" + instance }
func (r *Redis) regKey() string                 { return r.prefix + ":r" }

func appendHex(b []byte, v uint64) []byte {
	const digits = "0123456789abcdef"
	for i := 60; i >= 0; i -= 4 {
		b = append(b, digits[(v>>uint(i))&0xf])
	}
	return b
}

func hexField(v uint64) string {
	var b [16]byte
	return string(appendHex(b[:0], v))
}

func parseHex(s string) (uint64, bool) {
	if len(s) != 16 {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 16, 64)
	return v, err == nil
}

// mapVal is an instance-map value: the router key and tier bits of an
// engine hash, as 16 hex digits then 2.
type mapVal struct {
	key  Key
	bits tiers.Set
}

func (v mapVal) encode() string {
	var b [18]byte
	out := appendHex(b[:0], uint64(v.key))
	const digits = "0123456789abcdef"
	out = append(out, digits[v.bits>>4], digits[v.bits&0xf])
	return string(out)
}

func decodeMapVal(s string) (mapVal, bool) {
	if len(s) != 18 {
		return mapVal{}, false
	}
	k, ok := parseHex(s[:16])
	if !ok {
		return mapVal{}, false
	}
	b, err := strconv.ParseUint(s[16:], 16, 8)
	if err != nil {
		return mapVal{}, false
	}
	return mapVal{key: Key(k), bits: tiers.Set(b)}, true
}

// BlockSize implements Index.
func (r *Redis) BlockSize() int { return r.bs.get() }

// redisOverlay is one Apply's view of an instance's engine-hash map: the
// prefetched values under the changes made so far, flushed at the end.
type redisOverlay struct {
	pre     map[uint64]mapVal // prefetched from Redis (absent = unmapped)
	cur     map[uint64]mapVal // changed in this Apply; bits 0 = deleted
	cleared bool              // AllBlocksCleared seen: pre no longer counts
	args    []any             // the HMGET command; args[fieldAt[h]] is h's boxed field
	fieldAt map[uint64]int
	scratch []Key
}

func (o *redisOverlay) reset() {
	if o.pre == nil {
		o.pre, o.cur, o.fieldAt = make(map[uint64]mapVal), make(map[uint64]mapVal), make(map[uint64]int)
	}
	clear(o.pre)
	clear(o.cur)
	clear(o.fieldAt)
	o.cleared = false
	clear(o.args) // drop references to the last Apply's strings
	o.args = o.args[:0]
}

// mention adds h to the engine hashes to read.
func (o *redisOverlay) mention(h uint64) {
	if _, dup := o.fieldAt[h]; !dup {
		o.fieldAt[h] = len(o.args)
		o.args = append(o.args, hexField(h))
	}
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

// Apply implements Index: one HMGET of the engine hashes the events name,
// the events applied to that snapshot in memory, then one pipeline:
// mapScript's commit on the instance map (its fields and counters, in one
// atomic step) and single-key writes of the block keys (plus an HSCAN of
// the instance's map when the batch clears the instance). Apply takes no
// writer lease and leaves the instance's position alone: routers sharing
// an index use ApplyAt.
func (r *Redis) Apply(ctx context.Context, instance string, evs []events.Event) (ApplyResult, error) {
	res, err := r.apply(ctx, instance, nil, evs)
	return res.ApplyResult, err
}

// apply is Apply (g nil), ApplyAt and LoadAt. With a guard the read round
// trip also runs mapScript's begin (position and lease checks, lease
// taken) ahead of the HMGET, on the same connection: once the lease is
// ours nobody else changes the map, so the HMGET that follows reads the
// state the commit's counter deltas are computed from.
//
// Arguments are passed pre-boxed (one interface value per engine-hash
// field, block key, instance name and tier value, shared by every command
// that uses it): go-redis otherwise boxes each argument of each command,
// and at hundreds of thousands of blocks a second the client's allocations,
// not Redis, set the pace.
func (r *Redis) apply(ctx context.Context, instance string, g *seqGuard, evs []events.Event) (SeqResult, error) {
	var res SeqResult
	o := r.pool.Get().(*redisOverlay)
	defer r.pool.Put(o)
	o.reset()

	ikey := r.instKey(instance)
	token, expected, newPos := "", "*", ""
	if g != nil {
		token, expected, newPos = r.token, g.expected(), strconv.FormatUint(g.seq, 10)
	}
	started := time.Now()
	// HMGET ikey field...: fieldAt[h] is the index of h's boxed field.
	o.args = append(o.args[:0], "hmget", ikey)
	for i := range evs {
		ev := &evs[i]
		if ev.Kind != events.BlockStored && ev.Kind != events.BlockRemoved {
			continue
		}
		eventHashes(ev, &r.bs, o.mention)
	}
	// A load replaces the state: nothing to read (the fields are
	// mentioned for their strings).
	read := len(o.args) > 2 && (g == nil || !g.load)
	if g != nil || read {
		var begin *redis.SliceCmd
		var hmget *redis.Cmd
		_, err := r.pipelined(ctx, func(p redis.Pipeliner) {
			begin, hmget = nil, nil
			if g != nil {
				begin = redis.NewSliceCmd(ctx, "evalsha", mapScript.Hash(), 1, ikey, "b", token, r.leaseArg, r.ttlArg, expected, newPos)
				_ = p.Process(ctx, begin)
			}
			if read {
				hmget = p.Do(ctx, o.args...)
			}
		})
		if err != nil {
			return res, fmt.Errorf("kvindex: redis: read engine-hash map of %s: %w", instance, err)
		}
		if begin != nil {
			st, pos, err := scriptStatus(begin.Val())
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
		}
		if hmget != nil {
			vals, _ := hmget.Slice()
			for h, i := range o.fieldAt {
				if i-2 >= len(vals) {
					continue
				}
				if s, ok := vals[i-2].(string); ok {
					if mv, ok := decodeMapVal(s); ok && mv.bits != 0 {
						o.pre[h] = mv
					}
				}
			}
		}
	}
	if g != nil && g.load {
		o.clearAll()
	}
	o.scratch = applyEvents(o, r.model, &r.bs, evs, &res.ApplyResult, o.scratch)

	var old map[uint64]mapVal // the whole map before a clear
	if o.cleared {
		var err error
		if old, err = r.readMap(ctx, ikey); err != nil {
			return res, err
		}
	}
	if g != nil && time.Since(started) > r.lease/2 {
		// Another router may take the instance over once the lease runs
		// out; writing block keys now could interleave with its writes.
		return res, fmt.Errorf("%w (%s, %v since the read)", errLeaseTooOld, instance, time.Since(started).Round(time.Millisecond))
	}
	now := r.now()
	pipe := r.rdb.Pipeline()
	inst := any(instance)
	// One backing array for every block-key command's arguments.
	w := make([]any, 0, 5*len(o.cur)+len(old)*3+32)
	cmd := func(args ...any) {
		start := len(w)
		w = append(w, args...)
		pipe.Do(ctx, w[start:len(w):len(w)]...)
	}
	var dEntries int64
	var dTier [tiers.Count]int64
	account := func(v mapVal, sign int64) {
		if v.bits == 0 {
			return
		}
		dEntries += sign
		for t := range tiers.Count {
			if v.bits&(1<<t) != 0 {
				dTier[t] += sign
			}
		}
	}
	if o.cleared {
		// Drop this instance's field from every block it held, except
		// those the events re-stored after the clear (written below).
		for h, v := range old {
			if nv, ok := o.cur[h]; !ok || nv.bits == 0 || nv.key != v.key {
				cmd("hdel", r.blockKey(v.key), inst)
			}
		}
	}
	reset := "0"
	if o.cleared {
		reset = "1"
	}
	// mapScript commit: the header, then field, value pairs to set, then
	// fields to delete; the deltas and the pair count are filled in last.
	const nSetAt = 16
	commit := make([]any, 0, nSetAt+1+2*len(o.cur))
	commit = append(commit, "evalsha", mapScript.Hash(), 1, ikey, "c", token, r.leaseArg, r.ttlArg, expected, newPos,
		reset, nil, nil, nil, nil, nil, nil)
	var del []any
	for h, v := range o.cur {
		pv, had := o.pre[h]
		if o.cleared {
			had = false
		}
		if had {
			account(pv, -1)
		}
		account(v, +1)
		if had && (v.bits == 0 || pv.key != v.key) {
			cmd("hdel", r.blockKey(pv.key), inst)
		}
		field := o.args[o.fieldAt[h]]
		if v.bits == 0 {
			if had {
				del = append(del, field)
			}
			continue
		}
		bk := any(r.blockKey(v.key))
		cmd("hset", bk, inst, r.bitsArg[v.bits])
		cmd("expire", bk, r.ttlArg)
		commit = append(commit, field, v.encode())
	}
	commit[nSetAt-5], commit[nSetAt-4], commit[nSetAt-3], commit[nSetAt-2], commit[nSetAt-1] = dEntries, dTier[0], dTier[1], dTier[2], dTier[3]
	commit[nSetAt] = (len(commit) - nSetAt - 1) / 2
	commit = append(commit, del...)
	commitCmd := redis.NewSliceCmd(ctx, commit...)
	_ = pipe.Process(ctx, commitCmd)
	pipe.HSet(ctx, r.regKey(), instance, strconv.FormatInt(now.UnixMilli(), 10))
	pipe.Expire(ctx, r.regKey(), r.ttl)
	storeBS := r.bs.configured == 0 && r.bs.get() != 0 && !r.bsStored.Load()
	if storeBS {
		// For routers that start while the pool is idle (see Epoch).
		pipe.SetNX(ctx, r.bsKey(), r.bs.get(), 0)
	}
	_, err := pipe.Exec(ctx)
	if err == nil && storeBS {
		r.bsStored.Store(true)
	}
	if err != nil && hasNoScript([]redis.Cmder{commitCmd}) {
		// A Redis that never ran the script (new, restarted): load it and
		// send the commit again; the block-key writes went through.
		if err = mapScript.Load(ctx, r.rdb).Err(); err == nil {
			commitCmd = redis.NewSliceCmd(ctx, commit...)
			err = r.rdb.Process(ctx, commitCmd)
		}
	}
	if err != nil {
		return res, fmt.Errorf("kvindex: redis: write %d changes of %s: %w", len(o.cur), instance, err)
	}
	st, pos, err := scriptStatus(commitCmd.Val())
	if err != nil {
		return res, err
	}
	if st != SeqApplied {
		// Lost the lease or the map between the two round trips (Redis
		// restarted, a purge): the block-key writes went out regardless.
		return res, fmt.Errorf("%w: %s is %s at %s", errMoved, instance, st, pos)
	}
	res.Status, res.Position = SeqApplied, pos
	return res, nil
}

// readMap reads an instance's whole engine-hash map with HSCAN (one key,
// so it is fine on Cluster and never blocks Redis on a huge hash).
func (r *Redis) readMap(ctx context.Context, ikey string) (map[uint64]mapVal, error) {
	out := make(map[uint64]mapVal)
	var cursor uint64
	for {
		kv, next, err := r.rdb.HScan(ctx, ikey, cursor, "", 4096).Result()
		if err != nil {
			return nil, fmt.Errorf("kvindex: redis: scan %s: %w", ikey, err)
		}
		for i := 0; i+1 < len(kv); i += 2 {
			h, ok := parseHex(kv[i])
			if !ok {
				continue // a counter field
			}
			if v, ok := decodeMapVal(kv[i+1]); ok {
				out[h] = v
			}
		}
		if cursor = next; cursor == 0 {
			return out, nil
		}
	}
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
	probes := probePositions(len(keys))
	pipe := r.rdb.Pipeline()
	reg := pipe.HGetAll(ctx, r.regKey())
	pcmds := make([]*redis.MapStringStringCmd, len(probes))
	for i, p := range probes {
		pcmds[i] = pipe.HGetAll(ctx, r.blockKey(keys[p]))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("kvindex: redis: lookup: %w", err)
	}
	cutoff := r.now().Add(-r.ttl).UnixMilli()
	first := pcmds[0].Val()
	if len(first) == 0 {
		return nil, nil
	}
	regv := reg.Val()
	type cand struct {
		name  string
		bound int         // first probed position it lacks (or len(keys))
		bits  []tiers.Set // per position below bound, once known
	}
	var cands []cand
	for inst := range first {
		ms, err := strconv.ParseInt(regv[inst], 10, 64)
		if err != nil || ms < cutoff {
			continue // purged, or silent for longer than the TTL
		}
		c := cand{name: inst, bound: len(keys)}
		for i, p := range probes {
			if _, ok := pcmds[i].Val()[inst]; !ok {
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
			b := parseBits(pcmds[i].Val()[c.name])
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
				names[i] = cands[ci].name
			}
			lastWho = who
		}
		fills = append(fills, pipe.HMGet(ctx, r.blockKey(keys[p]), names...))
		fillPos = append(fillPos, p)
	}
	if fills != nil {
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("kvindex: redis: lookup fill: %w", err)
		}
		for fi, cmd := range fills {
			p := fillPos[fi]
			for i, v := range cmd.Val() {
				s, _ := v.(string)
				cands[needers[p][i]].bits[p] = parseBits(s)
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

// Purge implements Index: the instance's own map lists every block key it
// holds a field in, so no scan of the keyspace is needed.
func (r *Redis) Purge(ctx context.Context, instance string) error {
	ikey := r.instKey(instance)
	m, err := r.readMap(ctx, ikey)
	if err != nil {
		return err
	}
	pipe := r.rdb.Pipeline()
	for _, v := range m {
		pipe.HDel(ctx, r.blockKey(v.key), instance)
		if pipe.Len() >= 8192 {
			if _, err := pipe.Exec(ctx); err != nil {
				return fmt.Errorf("kvindex: redis: purge %s: %w", instance, err)
			}
		}
	}
	pipe.Del(ctx, ikey)
	pipe.HDel(ctx, r.regKey(), instance)
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("kvindex: redis: purge %s: %w", instance, err)
	}
	return nil
}

// Instances implements Index. Instances silent for longer than the TTL are
// still listed (with their last event time) until purged.
func (r *Redis) Instances(ctx context.Context) ([]InstanceStats, error) {
	reg, err := r.rdb.HGetAll(ctx, r.regKey()).Result()
	if err != nil {
		return nil, fmt.Errorf("kvindex: redis: instances: %w", err)
	}
	if len(reg) == 0 {
		return nil, nil
	}
	fields := []string{fieldTier + "0", fieldTier + "1", fieldTier + "2", fieldTier + "3"}
	pipe := r.rdb.Pipeline()
	out := make([]InstanceStats, 0, len(reg))
	cmds := make([]*redis.SliceCmd, 0, len(reg))
	for inst, ms := range reg {
		s := InstanceStats{Instance: inst}
		if v, err := strconv.ParseInt(ms, 10, 64); err == nil {
			s.LastEvent = time.UnixMilli(v)
		}
		out = append(out, s)
		cmds = append(cmds, pipe.HMGet(ctx, r.instKey(inst), fields...))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("kvindex: redis: instances: %w", err)
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
		return 0, fmt.Errorf("kvindex: redis: len: %w", err)
	}
	if len(reg) == 0 {
		return 0, nil
	}
	pipe := r.rdb.Pipeline()
	cmds := make([]*redis.StringCmd, len(reg))
	for i, inst := range reg {
		cmds[i] = pipe.HGet(ctx, r.instKey(inst), fieldEntries)
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, fmt.Errorf("kvindex: redis: len: %w", err)
	}
	n := 0
	for _, c := range cmds {
		v, _ := c.Int()
		n += v
	}
	return n, nil
}
