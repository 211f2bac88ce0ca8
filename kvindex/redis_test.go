package kvindex

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
)

// redisClient returns a client of the test's Redis server.
func redisClient(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: testenv.Redis(t), PoolSize: 8})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// newRedisForTest is the contract and property tests' factory: exact
// lookups, so that random holes in chains are answered like the reference.
func newRedisForTest(t *testing.T, cfg factoryConfig) Index {
	r, err := NewRedis(redisClient(t), RedisConfig{Prefix: testenv.UniqueName(t), Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now, ExactLookup: true})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestRedisContract(t *testing.T) { testIndexContract(t, newRedisForTest) }

// tripCounter is a go-redis hook counting round trips (a single command or
// a pipeline each) and checking that every command touches one key, as
// Redis Cluster requires of commands whose keys may lie in different slots.
type tripCounter struct {
	t     testing.TB
	mu    sync.Mutex // guards trips, names
	trips int
	names map[string]int
}

func (h *tripCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *tripCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if os.Getenv("KVINDEX_TRACE") != "" {
			h.t.Logf("command %s", cmd.Name())
		}
		if !connSetup(cmd) {
			h.record(cmd)
			h.mu.Lock()
			h.trips++
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *tripCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if os.Getenv("KVINDEX_TRACE") != "" {
			h.t.Logf("pipeline of %d, first %s", len(cmds), cmds[0].Name())
		}
		if len(cmds) > 0 && !connSetup(cmds[0]) {
			for _, c := range cmds {
				h.record(c)
			}
			h.mu.Lock()
			h.trips++
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// singleKey lists the commands the backend may send: each takes exactly
// one key (its first argument).
var singleKey = map[string]bool{
	"hgetall": true, "hmget": true, "hset": true, "hdel": true, "expire": true,
	"hincrby": true, "hscan": true, "hkeys": true, "hget": true, "del": true, "ttl": true,
	"set": true, "get": true, "setnx": true, "exists": true, "lrange": true,
	// Scripts: checked below to name exactly one key.
	"evalsha": true, "eval": true,
}

// connSetup reports commands go-redis sends when it opens a connection:
// not the backend's round trips.
func connSetup(c redis.Cmder) bool {
	switch c.Name() {
	case "hello", "client", "auth", "select":
		return true
	case "script":
		// SCRIPT LOAD: once per server (or after a restart), keyless.
		return true
	}
	return false
}

func (h *tripCounter) record(c redis.Cmder) {
	name := c.Name()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.names == nil {
		h.names = map[string]int{}
	}
	h.names[name]++
	if !singleKey[name] {
		h.t.Errorf("command %s is not a known single-key command", name)
	}
	if name == "del" && len(c.Args()) != 2 {
		h.t.Errorf("DEL with %d keys: not allowed across Cluster slots", len(c.Args())-1)
	}
	keyArgs := c.Args()[1:2]
	if name == "evalsha" || name == "eval" {
		n, _ := c.Args()[2].(int)
		if n < 1 || len(c.Args()) < 3+n {
			h.t.Errorf("%s with %v keys", name, c.Args()[2])
			return
		}
		keyArgs = c.Args()[3 : 3+n]
	}
	// Block keys and the pool's keys have no hash tag (they spread over
	// every slot); an instance's keys share one, so a script on several of
	// them stays on one slot.
	tag := ""
	for i, a := range keyArgs {
		s, _ := a.(string)
		t := hashTag(s)
		if t != "" && !strings.Contains(s, ":"+redisLayout+":i:{") && !strings.Contains(s, ":"+redisLayout+":l:{") {
			h.t.Errorf("key %q has a hash tag", s)
		}
		if i > 0 && (t == "" || t != tag) {
			h.t.Errorf("%s on keys %v: not one hash tag (one Cluster slot)", name, keyArgs)
		}
		tag = t
	}
}

// hashTag is the part of a key Redis Cluster hashes when it is not the
// whole key (https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#hash-tags).
func hashTag(k string) string {
	i := strings.IndexByte(k, '{')
	if i < 0 {
		return ""
	}
	j := strings.IndexByte(k[i+1:], '}')
	if j <= 0 {
		return ""
	}
	return k[i+1 : i+1+j]
}

func (h *tripCounter) take() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.trips
	h.trips = 0
	return n
}

func newCountedRedis(t *testing.T, cfg RedisConfig) (*Redis, *tripCounter) {
	c := redisClient(t)
	h := &tripCounter{t: t}
	c.AddHook(h)
	if cfg.Prefix == "" {
		cfg.Prefix = testenv.UniqueName(t)
	}
	r, err := NewRedis(c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r, h
}

func TestRedisRoundTrips(t *testing.T) {
	ctx := context.Background()
	root := Root(testModel, "", "")
	c := newChain(root, 512, 16, 11, 1)
	half := newChain(root, 512, 16, 11, 100_000) // same tokens, another instance's hashes
	holey := newChain(root, 512, 16, 11, 200_000)
	offload := newChain(root, 512, 16, 11, 300_000)
	for _, exact := range []bool{true, false} {
		prefixClosed := !exact
		t.Run(fmt.Sprintf("exact=%v", exact), func(t *testing.T) {
			r, trips := newCountedRedis(t, RedisConfig{Model: testModel, ExactLookup: exact})
			// A Redis that has not cached the script yet answers the
			// first write with NOSCRIPT: SCRIPT LOAD, then the write again.
			mustApply(t, r, "warm-up", cleared())
			trips.take()
			mustApply(t, r, "full", c.stored(0, 512))
			if n := trips.take(); n != 2 {
				t.Fatalf("Apply of one event took %d round trips, want 2 (read map, write pipeline)", n)
			}
			// The writer now holds the instance's map: one round trip.
			mustApply(t, r, "full", c.tierStored("CPU", 0, 8))
			if n := trips.take(); n != 1 {
				t.Fatalf("second Apply took %d round trips, want 1 (write pipeline)", n)
			}
			mustApply(t, r, "full", c.removed("CPU", 0, 8))
			trips.take()
			mustApply(t, r, "half", half.stored(0, 200))
			// Not prefix-closed: blocks 0..299 then a hole at 300, then 301..511.
			mustApply(t, r, "holey", holey.stored(0, 512), holey.removed("GPU", 300, 301))
			// GPU 0..99, CPU 0..449: tiers change between probes.
			mustApply(t, r, "offload", offload.stored(0, 450), offload.tierStored("CPU", 0, 450), offload.removed("GPU", 100, 450))
			trips.take()

			holeyWant, fullTrips := all(300), 2
			if prefixClosed {
				// The hole lies between two probes that both hold GPU: the
				// prefix-closed lookup does not see it, by design.
				holeyWant = all(512)
			}
			cases := []struct {
				name      string
				keys      []Key
				want      map[string][tiers.Count]int
				wantTrips int
			}{
				{"512 blocks, four instances", c.keys, map[string][tiers.Count]int{"full": all(512), "half": all(200), "holey": holeyWant, "offload": blocks(100, 450, 450, 450)}, fullTrips},
				{"unknown chain", Keys(root, seqTokens(512*16, 999), 16), nil, 1},
				{"one block", c.keys[:1], map[string][tiers.Count]int{"full": all(1), "half": all(1), "holey": all(1), "offload": all(1)}, 1},
				{"two blocks", c.keys[:2], map[string][tiers.Count]int{"full": all(2), "half": all(2), "holey": all(2), "offload": all(2)}, 1},
			}
			for _, tc := range cases {
				checkLookup(t, r, query{tc.keys, tc.want}, tc.name)
				if n := trips.take(); n > tc.wantTrips || n < 1 {
					t.Fatalf("%s: lookup took %d round trips, want at most %d", tc.name, n, tc.wantTrips)
				}
			}
			// Only "full" holds the whole chain: all probes hit, so the
			// prefix-closed lookup is done in one round trip.
			if err := r.Purge(ctx, "half"); err != nil {
				t.Fatal(err)
			}
			for _, inst := range []string{"holey", "offload"} {
				if err := r.Purge(ctx, inst); err != nil {
					t.Fatal(err)
				}
			}
			trips.take()
			checkLookup(t, r, query{c.keys, map[string][tiers.Count]int{"full": all(512)}}, "after purges")
			want := 2
			if prefixClosed {
				want = 1
			}
			if n := trips.take(); n != want {
				t.Fatalf("full-chain lookup took %d round trips, want %d", n, want)
			}
		})
	}
}

func TestRedisSilentInstanceAgesOut(t *testing.T) {
	clock := time.Unix(1_800_000_000, 0)
	r, _ := newCountedRedis(t, RedisConfig{Model: testModel, TTL: time.Hour, Now: func() time.Time { return clock }})
	root := Root(testModel, "", "")
	c := newChain(root, 4, 4, 1, 10)
	mustApply(t, r, "quiet", c.stored(0, 4))
	clock = clock.Add(50 * time.Minute)
	mustApply(t, r, "busy", c.stored(0, 4))
	checkLookup(t, r, query{c.keys, map[string][tiers.Count]int{"quiet": all(4), "busy": all(4)}}, "both fresh")
	clock = clock.Add(20 * time.Minute) // quiet: 70 min silent; busy: 20
	checkLookup(t, r, query{c.keys, map[string][tiers.Count]int{"busy": all(4)}}, "quiet aged out")

	// Block keys carry no TTL: Sweep purges instances silent for longer
	// than the TTL, keys and all.
	ctx := context.Background()
	bk := r.blockKey(c.keys[0])
	if ttl, err := r.rdb.TTL(ctx, bk).Result(); err != nil || ttl != -1 {
		t.Fatalf("TTL(%s) = %v, %v; want none", bk, ttl, err)
	}
	gone, err := r.Sweep(ctx)
	if err != nil || len(gone) != 1 || gone[0] != "quiet" {
		t.Fatalf("Sweep = %v, %v; want [quiet]", gone, err)
	}
	busy, _ := r.rdb.HGet(ctx, r.metaKey(instID("busy")), fieldField).Result()
	if f, err := r.rdb.HKeys(ctx, bk).Result(); err != nil || len(f) != 1 || f[0] != busy || busy == "" {
		t.Fatalf("block key fields after sweep = %q, %v; want busy's field id (%q) alone", f, err, busy)
	}
	for _, k := range []string{r.metaKey(instID("quiet")), r.logKey(instID("quiet"))} {
		if n, err := r.rdb.Exists(ctx, k).Result(); err != nil || n != 0 {
			t.Fatalf("%s exists after sweep: %d, %v", k, n, err)
		}
	}
	if st, err := r.Instances(ctx); err != nil || len(st) != 1 || st[0].Instance != "busy" || st[0].Blocks[0] != 4 {
		t.Fatalf("Instances after sweep = %+v, %v", st, err)
	}
}

func TestRedisConfig(t *testing.T) {
	c := redisClient(t)
	cases := []struct {
		name string
		cfg  RedisConfig
		ok   bool
	}{
		{"zero value", RedisConfig{}, true},
		{"negative block size", RedisConfig{BlockSize: -1}, false},
		{"negative ttl", RedisConfig{TTL: -time.Second}, false},
		{"sub-second ttl", RedisConfig{TTL: time.Millisecond}, false},
		{"hash tag in prefix", RedisConfig{Prefix: "{pool}"}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewRedis(c, tc.cfg)
			if (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrConfig) {
				t.Fatalf("NewRedis(%+v) = %v, want ok=%v", tc.cfg, err, tc.ok)
			}
		})
	}
	if _, err := NewRedis(nil, RedisConfig{}); !errors.Is(err, ErrConfig) {
		t.Fatalf("nil client: %v", err)
	}
}

func TestRedisUnavailable(t *testing.T) {
	// A dead server is an error from every method, never a panic or a hang.
	c := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)), MaxRetries: -1, DialTimeout: 200 * time.Millisecond, DialerRetries: 1})
	defer c.Close()
	r, err := NewRedis(c, RedisConfig{Prefix: testenv.UniqueName(t), BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ch := newChain(Root("", "", ""), 2, 4, 1, 1)
	if _, err := r.Apply(ctx, "i", []events.Event{ch.stored(0, 2)}); err == nil {
		t.Fatal("Apply succeeded without a server")
	}
	if _, err := r.Lookup(ctx, ch.keys); err == nil {
		t.Fatal("Lookup succeeded without a server")
	}
	if err := r.Purge(ctx, "i"); err == nil {
		t.Fatal("Purge succeeded without a server")
	}
	if _, err := r.Instances(ctx); err == nil {
		t.Fatal("Instances succeeded without a server")
	}
	if _, err := r.Len(ctx); err == nil {
		t.Fatal("Len succeeded without a server")
	}
}

func FuzzReplayLog(f *testing.F) {
	f.Add(string(appendLogRecord(appendLogRecord(nil, 1, mapVal{key: 0x0123456789abcdef, bits: 3}), 1, mapVal{})))
	f.Add("")
	f.Add("short")
	f.Add(string(appendLogRecord(nil, 7, mapVal{key: 9, bits: 0xff})) + "x")
	f.Fuzz(func(t *testing.T, log string) {
		vals := map[uint64]mapVal{}
		err := replayLog(log, vals)
		if (err != nil) != (len(log)%logRecord != 0) {
			t.Fatalf("replayLog(%d bytes) = %v", len(log), err)
		}
		// Written back whole, the map replays to itself.
		var out []byte
		for h, v := range vals {
			if v.bits == 0 || v.bits&^allTiers != 0 {
				t.Fatalf("entry %x has bits %b", h, v.bits)
			}
			out = appendLogRecord(out, h, v)
		}
		again := map[uint64]mapVal{}
		if err := replayLog(string(out), again); err != nil || !maps.Equal(vals, again) {
			t.Fatalf("rewritten log replays to %v (%v), want %v", again, err, vals)
		}
		_ = parseBits(log)
		if _, fid, _, ok := parseRegEntry(log); ok {
			if f, fok := regFieldID(log); !fok || f != fid {
				t.Fatalf("parseRegEntry(%q) has field id %x, regFieldID %x (%v)", log, fid, f, fok)
			}
		}
		_ = fieldBits(log)
	})
}

// The contract's chains are short enough that every position is a probe or
// lies between probes with different tiers, so the default (prefix-closed)
// lookup must answer it exactly too.
func TestRedisContractDefaultLookup(t *testing.T) {
	testIndexContract(t, func(t *testing.T, cfg factoryConfig) Index {
		r, err := NewRedis(redisClient(t), RedisConfig{Prefix: testenv.UniqueName(t), Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now})
		if err != nil {
			t.Fatal(err)
		}
		return r
	})
}

// The writer's in-process copy of the engine-hash maps is bounded: with
// room for a few entries (evicted at nearly every Apply) or none, every
// answer is still the reference model's.
func TestRedisPropertyMapCache(t *testing.T) {
	for _, limit := range []int{-1, 40} {
		t.Run(fmt.Sprintf("limit=%d", limit), func(t *testing.T) {
			testIndexProperty(t, func(t *testing.T, cfg factoryConfig) Index {
				r, err := NewRedis(redisClient(t), RedisConfig{Prefix: testenv.UniqueName(t), Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now, ExactLookup: true, MapCache: limit})
				if err != nil {
					t.Fatal(err)
				}
				return r
			}, 3, 250, 4)
		})
	}
}

// A second writer of one instance (outside the single-writer contract, or
// a router that lost track) changes the map's generation: the first
// writer's next Apply fails with a clear error instead of counting from a
// stale copy, and the one after reads the map again and is right.
func TestRedisStaleMapCopy(t *testing.T) {
	client := redisClient(t)
	prefix := testenv.UniqueName(t)
	var rs [2]*Redis
	for i := range rs {
		r, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel})
		if err != nil {
			t.Fatal(err)
		}
		rs[i] = r
	}
	ctx := context.Background()
	c := newChain(Root(testModel, "", ""), 8, 4, 3, 1)
	mustApply(t, rs[0], "pod", c.stored(0, 4))
	mustApply(t, rs[1], "pod", c.stored(4, 8))
	if _, err := rs[0].Apply(ctx, "pod", []events.Event{c.removed("GPU", 6, 8)}); !errors.Is(err, errMoved) {
		t.Fatalf("Apply from a stale copy = %v, want errMoved", err)
	}
	mustApply(t, rs[0], "pod", c.removed("GPU", 6, 8))
	checkLookup(t, rs[0], query{c.keys, map[string][tiers.Count]int{"pod": all(6)}}, "after the re-read")
	if n, _ := rs[0].Len(ctx); n != 6 {
		t.Fatalf("Len = %d, want 6", n)
	}
	if st, _ := rs[1].Instances(ctx); len(st) != 1 || st[0].Blocks != blocks(6, 0, 0, 0) {
		t.Fatalf("Instances = %+v", st)
	}
}

// Two names with one id (instID keeps 40 bits of a hash) are reported,
// not merged silently: the registry entry of the id names the other one.
func TestRedisInstanceIDCollision(t *testing.T) {
	r, _ := newCountedRedis(t, RedisConfig{Model: testModel})
	ctx := context.Background()
	// What a colliding "other" would have registered under pod's id.
	if err := r.rdb.HSet(ctx, r.regKey(), instID("pod"), "1 0000000000 other").Err(); err != nil {
		t.Fatal(err)
	}
	c := newChain(Root(testModel, "", ""), 4, 4, 3, 1)
	if _, err := r.Apply(ctx, "pod", []events.Event{c.stored(0, 4)}); !errors.Is(err, ErrInstanceID) || !strings.Contains(err.Error(), `"other"`) {
		t.Fatalf("Apply = %v, want ErrInstanceID naming other", err)
	}
	if v, _ := r.rdb.HGet(ctx, r.regKey(), instID("pod")).Result(); v != "1 0000000000 other" {
		t.Fatalf("registry entry overwritten: %q", v)
	}
}

// A Redis that has one of the backend's scripts cached but not another
// (flushed in between, or another version of kvrouter loaded the first)
// refuses only that one: the write still succeeds once, without running
// the commit twice.
func TestRedisOneScriptMissing(t *testing.T) {
	srv := testenv.StartRedis(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	if err := mapScript.Load(ctx, c).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := NewRedis(c, RedisConfig{Prefix: testenv.UniqueName(t), Model: testModel})
	if err != nil {
		t.Fatal(err)
	}
	ch := newChain(Root(testModel, "", ""), 4, 4, 3, 1)
	mustApply(t, r, "pod", ch.stored(0, 4))
	mustApply(t, r, "pod", ch.removed("GPU", 3, 4))
	checkLookup(t, r, query{ch.keys, map[string][tiers.Count]int{"pod": all(3)}}, "after the reload")
}
