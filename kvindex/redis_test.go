package kvindex

import (
	"context"
	"errors"
	"fmt"
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
	"set": true, "get": true,
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
		if n, _ := c.Args()[2].(int); n != 1 || len(c.Args()) < 4 {
			h.t.Errorf("%s with %v keys: a script must touch one key (one Cluster slot)", name, c.Args()[2])
			return
		}
		keyArgs = c.Args()[3:4]
	}
	for _, a := range keyArgs {
		if s, ok := a.(string); ok && strings.ContainsAny(s, "{}") {
			h.t.Errorf("key %q has a hash tag", s)
		}
	}
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

	// Every key carries a TTL.
	ctx := context.Background()
	for _, k := range []string{r.blockKey(c.keys[0]), r.instKey("quiet"), r.regKey()} {
		ttl, err := r.rdb.TTL(ctx, k).Result()
		if err != nil || ttl <= 0 || ttl > time.Hour {
			t.Fatalf("TTL(%s) = %v, %v; want (0, 1h]", k, ttl, err)
		}
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

func FuzzDecodeMapVal(f *testing.F) {
	f.Add(mapVal{key: 0x0123456789abcdef, bits: 3}.encode())
	f.Add("")
	f.Add("zz23456789abcdef03")
	f.Fuzz(func(t *testing.T, s string) {
		v, ok := decodeMapVal(s)
		if ok && v.encode() != strings.ToLower(s) {
			t.Fatalf("decode(%q) = %+v re-encodes to %q", s, v, v.encode())
		}
		_ = parseBits(s)
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
