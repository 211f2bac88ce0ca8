package kvindex

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// This file uses only the Redis backend's public API, so that it runs
// unchanged against an older tree: docs/BENCHMARKS.md compares data models
// side by side with it.

// BenchmarkRedisMemory fills a redis-server of its own (nothing else in
// it) with a 16-instance slice of the llm-d shape (16 × chains × 512
// blocks, one holder per block) and reports the server's memory per
// (block, instance) entry: the INFO used_memory delta over the entries.
// Redis' main hash table doubles when its keys reach its size, so its
// buckets cost 8 to 16 bytes per key depending on where the key count
// lies between two powers of two: chains=8 is 65,536 block keys (a table
// just doubled: 16 B), chains=12 is 98,304 (12 B, the middle).
func BenchmarkRedisMemory(b *testing.B) {
	for _, chains := range []int{8, 12} {
		b.Run(fmt.Sprintf("chains=%d", chains), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				srv := testenv.StartRedis(b)
				c := redis.NewClient(&redis.Options{Addr: srv.Addr})
				r, err := NewRedis(c, RedisConfig{Prefix: "kvindex", Model: testModel, TTL: time.Hour})
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				// The script cache and the registry are per server, not
				// per entry.
				mustApply(b, r, "warm-up", events.Event{Kind: events.AllBlocksCleared})
				before := usedMemory(b, c)
				s := newShape(16, chains, shapeBlocks, shapeBlocks)
				s.fill(b, r, chains)
				n, err := r.Len(ctx)
				if err != nil || n != 16*chains*shapeBlocks {
					b.Fatalf("Len = %d, %v", n, err)
				}
				// Let the server finish rehashing its main table (it moves
				// buckets 1 ms per 100 ms when idle): both tables would
				// otherwise be counted.
				time.Sleep(time.Second)
				b.ReportMetric(float64(usedMemory(b, c)-before)/float64(n), "serverB/entry")
				_ = c.Close()
				srv.Kill()
			}
		})
	}
}

func usedMemory(b testing.TB, c *redis.Client) int64 {
	info, err := c.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	b.Fatal("no used_memory in INFO memory")
	return 0
}

// BenchmarkRedisLookupHolders looks up a 512-block chain held whole by
// 1, 9 or 64 of 64 instances (each also holding 2 chains of its own), with
// the default (prefix-closed) lookup; wall, client CPU and Redis CPU per
// lookup.
func BenchmarkRedisLookupHolders(b *testing.B) {
	r, err := NewRedis(redisClient(b), RedisConfig{Prefix: testenv.UniqueName(b), Model: testModel, TTL: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	s := newShape(shapeInstances, 2, shapeBlocks, shapeBlocks)
	s.fill(b, r, 2)
	ctx := context.Background()
	for _, holders := range []int{1, 9, 64} {
		salt := fmt.Sprintf("shared-%d", holders)
		for i := 0; i < holders; i++ {
			ev := s.ev(0, 0)
			ev.CacheSalt = salt
			hs := make([]uint64, len(ev.BlockHashes))
			for j := range hs {
				hs[j] = uint64(holders)<<40 + uint64(j)
			}
			ev.BlockHashes = hs
			mustApply(b, r, fmt.Sprintf("pod-%d", i), ev)
		}
		keys := Keys(Root(testModel, "", salt), s.tokens, shapeBS)
		b.Run(fmt.Sprintf("holders=%d", holders), func(b *testing.B) {
			b.ReportAllocs()
			n := 0
			cpu0, srv0 := cputime.Process(), redisCPU(b, r)
			for b.Loop() {
				ms, err := r.Lookup(ctx, keys)
				if err != nil || len(ms) != holders || ms[0].Blocks[0] != shapeBlocks {
					b.Fatalf("lookup = %+v, %v", ms, err)
				}
				n++
			}
			b.ReportMetric(float64(cputime.Process()-cpu0)/float64(n), "client-cpu-ns/op")
			b.ReportMetric(float64(redisCPU(b, r)-srv0)/float64(n), "server-cpu-ns/op")
		})
	}
}

// BenchmarkRedisTakeover is the cost of a change of writer: two routers
// share the index and, each time the instance's lease has run out, the
// other one applies the next message (one block stored or removed) to an instance
// holding `blocks` blocks. Since a takeover starts a new incarnation
// (Session 19) that write rewrites the instance's map under a new field
// id; before, it was the begin round trip and a one-block pipeline. The
// wait for the lease is outside the timer and uses no CPU.
func BenchmarkRedisTakeover(b *testing.B) {
	for _, blocks := range []int{4096, 32768} {
		b.Run(fmt.Sprintf("blocks=%d", blocks), func(b *testing.B) {
			ctx := context.Background()
			prefix := testenv.UniqueName(b)
			const lease = 250 * time.Millisecond // over a 32k-block rewrite's build, which must start within half of it
			addr := testenv.Redis(b)
			var rs [2]*Redis
			for i := range rs {
				c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 8})
				b.Cleanup(func() { _ = c.Close() })
				r, err := NewRedis(c, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4, WriterLease: lease, TTL: time.Hour})
				if err != nil {
					b.Fatal(err)
				}
				rs[i] = r
			}
			root := Root(testModel, "", "")
			held := newChain(root, blocks, 4, 1, 1)
			extra := newChain(root, 1, 4, 2, 1<<32)
			if res, err := rs[0].LoadAt(ctx, "i", 1, []events.Event{held.stored(0, blocks)}); err != nil || res.Status != SeqApplied {
				b.Fatalf("load: %+v %v", res, err)
			}
			seq := uint64(1)
			n := 0
			var cpu, srv time.Duration
			for b.Loop() {
				b.StopTimer()
				time.Sleep(lease + 5*time.Millisecond)
				w := rs[n%2]
				cpu0, srv0 := cputime.Process(), redisCPU(b, w)
				b.StartTimer()
				ev := extra.stored(0, 1) // stored, removed, stored...
				if n%2 == 1 {
					ev = extra.removed("GPU", 0, 1)
				}
				res, err := w.ApplyAt(ctx, "i", Position{Seq: seq, Seeded: true}, seq+1, []events.Event{ev})
				b.StopTimer()
				if err != nil || res.Status != SeqApplied {
					b.Fatalf("takeover %d: %+v %v", n, res, err)
				}
				cpu, srv = cpu+cputime.Process()-cpu0, srv+redisCPU(b, w)-srv0
				b.StartTimer()
				seq++
				n++
			}
			b.ReportMetric(float64(cpu)/float64(n), "client-cpu-ns/op")
			b.ReportMetric(float64(srv)/float64(n), "server-cpu-ns/op")
		})
	}
}

// BenchmarkRedisRewound is the cost of one rewind check on one Redis: the
// consumer runs it once a check interval (1 s), per router. Since session
// 31 it is one script (INCR, PEXPIRE, INFO server for the run_id) where it
// was a pipelined INCR and PEXPIRE.
func BenchmarkRedisRewound(b *testing.B) {
	r, err := NewRedis(redisClient(b), RedisConfig{Prefix: testenv.UniqueName(b), Model: testModel})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportAllocs()
	n := 0
	cpu0, srv0 := cputime.Process(), redisCPU(b, r)
	for b.Loop() {
		if back, err := r.Rewound(ctx); err != nil || back {
			b.Fatalf("Rewound = %v, %v", back, err)
		}
		n++
	}
	b.ReportMetric(float64(cputime.Process()-cpu0)/float64(n), "client-cpu-ns/op")
	b.ReportMetric(float64(redisCPU(b, r)-srv0)/float64(n), "server-cpu-ns/op")
}
