package kvindex

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// The llm-d shape: 64 instances, each holding 30 chains of 512 blocks of
// 16 tokens (983,040 (block, instance) entries). Chains are made distinct
// by a per-chain cache salt over one shared token array, so the fixture
// itself stays small next to the index being measured.
const (
	shapeInstances = 64
	shapeChains    = 30
	shapeBlocks    = 512
	shapeBS        = 16
)

// shape holds its events as flat, pointer-free arrays and makes each
// event when it is applied (ev), as the consumer decodes one message at a
// time: 61,440 prebuilt 16-block events, each with its own slices, were a
// heap the collector scanned on every cycle of a build, and that CPU time
// counted as the index's (docs/BENCHMARKS.md §10, "Quiet machine, session 6").
type shape struct {
	tokens      []uint32
	hashes      []uint64 // [chain*blocksPer+block]: each chain's engine block hashes
	salts       []string // [chain]: chains are instance*chains+chain
	blocksPer   int
	eventBlocks int
}

func newShape(instances, chains, blocksPer, eventBlocks int) *shape {
	s := &shape{tokens: seqTokens(blocksPer*shapeBS, 1), blocksPer: blocksPer, eventBlocks: eventBlocks}
	s.hashes = make([]uint64, 0, instances*chains*blocksPer)
	for i := 0; i < instances; i++ {
		for c := 0; c < chains; c++ {
			s.salts = append(s.salts, fmt.Sprintf("i%d-c%d", i, c))
			base := uint64(i*chains+c) << 20
			for b := 0; b < blocksPer; b++ {
				s.hashes = append(s.hashes, base+uint64(b))
			}
		}
	}
	return s
}

// chains is how many chains the shape has (instances × chains).
func (s *shape) chains() int { return len(s.salts) }

// perChain is how many events store one chain.
func (s *shape) perChain() int { return (s.blocksPer + s.eventBlocks - 1) / s.eventBlocks }

// ev is chain's k-th BlockStored event.
func (s *shape) ev(chain, k int) events.Event {
	from := k * s.eventBlocks
	to := min(from+s.eventBlocks, s.blocksPer)
	hs := s.hashes[chain*s.blocksPer : (chain+1)*s.blocksPer]
	ev := events.Event{Kind: events.BlockStored, BlockSize: shapeBS, Medium: "GPU", CacheSalt: s.salts[chain],
		TokenIDs: s.tokens[from*shapeBS : to*shapeBS], BlockHashes: hs[from:to:to]}
	if from > 0 {
		ev.ParentHash, ev.HasParent = hs[from-1], true
	}
	return ev
}

func (s *shape) keys(inst, chain int) []Key {
	return Keys(Root(testModel, "", fmt.Sprintf("i%d-c%d", inst, chain)), s.tokens, shapeBS)
}

// fillCommon stores on every instance the first chain's blocks salted
// "common" (a fleet-wide system prompt), and returns its keys.
func (s *shape) fillCommon(b testing.TB, idx Index) []Key {
	for i := 0; i < shapeInstances; i++ {
		ev := s.ev(0, 0)
		ev.CacheSalt = "common"
		hs := make([]uint64, len(ev.BlockHashes))
		for j := range hs {
			hs[j] = uint64(1<<40) + uint64(j)
		}
		ev.BlockHashes = hs
		mustApply(b, idx, fmt.Sprintf("pod-%d", i), ev)
	}
	return Keys(Root(testModel, "", "common"), s.tokens, shapeBS)
}

func (s *shape) fill(b testing.TB, idx Index, chains int) {
	ctx := context.Background()
	names := make([]string, s.chains()/chains+1)
	for i := range names {
		names[i] = fmt.Sprintf("pod-%d", i)
	}
	one := make([]events.Event, 1)
	for n := range s.chains() {
		// One Apply per event, as the consumer applies one engine batch.
		for k := range s.perChain() {
			one[0] = s.ev(n, k)
			if _, err := idx.Apply(ctx, names[n/chains], one); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkMemoryBuild applies the whole llm-d shape (983,040 blocks) per
// op into a fresh index; it reports stored blocks/s and heap bytes per
// (block, instance) entry. Run with -cpu 1 for the one-core figure.
func BenchmarkMemoryBuild(b *testing.B) {
	for _, evBlocks := range []int{512, 16} {
		b.Run(fmt.Sprintf("event=%dblocks", evBlocks), func(b *testing.B) {
			s := newShape(shapeInstances, shapeChains, shapeBlocks, evBlocks)
			entries := shapeInstances * shapeChains * shapeBlocks
			var perEntry float64
			var cpu time.Duration
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				before := cputime.LiveHeap()
				m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 2 * entries})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				cpu0 := cputime.Process()
				s.fill(b, m, shapeChains)
				cpu += cputime.Process() - cpu0
				b.StopTimer()
				if n, _ := m.Len(context.Background()); n != entries {
					b.Fatalf("Len = %d, want %d", n, entries)
				}
				perEntry = float64(cputime.LiveHeap()-before) / float64(entries)
				runtime.KeepAlive(m)
				b.StartTimer()
			}
			b.ReportMetric(float64(entries)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
			if cpu > 0 {
				b.ReportMetric(float64(entries)*float64(b.N)/cpu.Seconds(), "blocks/cpu-s")
			}
			b.ReportMetric(perEntry, "heapB/entry")
		})
	}
}

// BenchmarkMemoryBuildInterleaved is BenchmarkMemoryBuild at 16-block
// events with every instance filling at once (a fleet starting cold): the
// events go round-robin over the instances, so no instance has full peers
// when it starts and each engine-hash table grows from empty.
func BenchmarkMemoryBuildInterleaved(b *testing.B) {
	s := newShape(shapeInstances, shapeChains, shapeBlocks, 16)
	entries := shapeInstances * shapeChains * shapeBlocks
	ctx := context.Background()
	names := make([]string, shapeInstances)
	for i := range names {
		names[i] = fmt.Sprintf("pod-%d", i)
	}
	one := make([]events.Event, 1)
	var cpu time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 2 * entries})
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		cpu0 := cputime.Process()
		for c := range shapeChains {
			for k := range s.perChain() {
				for inst := range shapeInstances {
					one[0] = s.ev(inst*shapeChains+c, k)
					if _, err := m.Apply(ctx, names[inst], one); err != nil {
						b.Fatal(err)
					}
				}
			}
		}
		cpu += cputime.Process() - cpu0
		b.StopTimer()
		if n, _ := m.Len(ctx); n != entries {
			b.Fatalf("Len = %d, want %d", n, entries)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(entries)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
	if cpu > 0 {
		b.ReportMetric(float64(entries)*float64(b.N)/cpu.Seconds(), "blocks/cpu-s")
	}
}

// BenchmarkMemoryLookup512 looks up a 512-block chain in the full shape.
func BenchmarkMemoryLookup512(b *testing.B) {
	s := newShape(shapeInstances, shapeChains, shapeBlocks, shapeBlocks)
	m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 2 * shapeInstances * shapeChains * shapeBlocks})
	if err != nil {
		b.Fatal(err)
	}
	s.fill(b, m, shapeChains)
	common := s.fillCommon(b, m)
	miss := Keys(Root(testModel, "", "nobody"), s.tokens, shapeBS)
	cases := []struct {
		name string
		keys [][]Key
		want int // matches per lookup
	}{
		{"one-holder", [][]Key{s.keys(7, 3), s.keys(40, 29), s.keys(63, 0), s.keys(0, 15)}, 1},
		{"miss", [][]Key{miss}, 0},
		{"all-64-hold", [][]Key{common}, shapeInstances},
	}
	ctx := context.Background()
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			i := 0
			report := cputime.Report(b)
			for b.Loop() {
				ms, err := m.Lookup(ctx, c.keys[i%len(c.keys)])
				if err != nil || len(ms) != c.want || c.want > 0 && ms[0].Blocks[0] != shapeBlocks {
					b.Fatalf("lookup = %+v, %v", ms, err)
				}
				i++
			}
			report(i)
		})
	}
}

// BenchmarkMemoryApplyParallel applies 16-block events from all cores at
// once, each goroutine its own instances (as the consumer shards them).
func BenchmarkMemoryApplyParallel(b *testing.B) {
	s := newShape(shapeInstances, 4, shapeBlocks, 16)
	m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 1 << 24})
	if err != nil {
		b.Fatal(err)
	}
	var next int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		id := int(atomicAdd(&next))
		inst := fmt.Sprintf("pod-%d", id)
		k := 0
		one := make([]events.Event, 1)
		for pb.Next() {
			one[0] = s.ev((id*4+k/32)%s.chains(), k%32)
			if _, err := m.Apply(context.Background(), inst, one); err != nil {
				b.Error(err)
				return
			}
			k++
		}
	})
	b.ReportMetric(float64(16*b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// redisShape sizes the Redis benchmarks: the Redis index's cost per
// operation does not grow with its size (hash lookups), so a smaller
// fleet keeps setup short.
func BenchmarkRedisApply(b *testing.B) {
	// "event=N" is the single-writer Apply; "shared/event=N" is ApplyAt,
	// what routers sharing the index use: positions and a writer lease,
	// one writer (the others skip a message after one round trip).
	for _, shared := range []bool{false, true} {
		for _, evBlocks := range []int{512, 64} {
			name := fmt.Sprintf("event=%dblocks", evBlocks)
			if shared {
				name = "shared/" + name
			}
			b.Run(name, func(b *testing.B) {
				r, err := NewRedis(redisClient(b), RedisConfig{Prefix: testenv.UniqueName(b), Model: testModel, TTL: time.Hour})
				if err != nil {
					b.Fatal(err)
				}
				s := newShape(16, 8, shapeBlocks, evBlocks)
				perChain := s.perChain()
				ctx := context.Background()
				pos := map[string]Position{}
				one := make([]events.Event, 1)
				b.ReportAllocs()
				n := 0
				cpu0, srv0 := cputime.Process(), redisCPU(b, r)
				for b.Loop() {
					chain := (n / perChain) % s.chains()
					inst := fmt.Sprintf("pod-%d", chain/8)
					one[0] = s.ev(chain, n%perChain)
					evs := one
					if shared {
						from := pos[inst]
						if !from.Seeded {
							from = Position{Seeded: true}
							if _, err := r.LoadAt(ctx, inst, 0, nil); err != nil {
								b.Fatal(err)
							}
						}
						res, err := r.ApplyAt(ctx, inst, from, uint64(n+1), evs)
						if err != nil || res.Status != SeqApplied {
							b.Fatalf("ApplyAt = %v, %v", res.Status, err)
						}
						pos[inst] = res.Position
					} else if _, err := r.Apply(ctx, inst, evs); err != nil {
						b.Fatal(err)
					}
					n++
				}
				blocks := float64(evBlocks * n)
				b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
				b.ReportMetric(blocks/(cputime.Process()-cpu0).Seconds(), "blocks/client-cpu-s")
				b.ReportMetric(blocks/(redisCPU(b, r)-srv0).Seconds(), "blocks/server-cpu-s")
			})
		}
	}
}

func BenchmarkRedisLookup512(b *testing.B) {
	client := redisClient(b)
	prefix := testenv.UniqueName(b)
	r, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, TTL: time.Hour, ExactLookup: true})
	if err != nil {
		b.Fatal(err)
	}
	fast, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, TTL: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	s := newShape(shapeInstances, 2, shapeBlocks, shapeBlocks)
	s.fill(b, r, 2)
	miss := Keys(Root(testModel, "", "nobody"), s.tokens, shapeBS)
	common := s.fillCommon(b, r)
	cases := []struct {
		name string
		idx  *Redis
		keys []Key
		want int
	}{
		{"exact/one-holder", r, s.keys(17, 1), 1},
		{"exact/miss", r, miss, 0},
		{"exact/all-64-hold", r, common, shapeInstances},
		{"prefix-closed/one-holder", fast, s.keys(17, 1), 1},
		{"prefix-closed/all-64-hold", fast, common, shapeInstances},
	}
	ctx := context.Background()
	for _, c := range cases {
		r := c.idx
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			n := 0
			cpu0, srv0 := cputime.Process(), redisCPU(b, r)
			for b.Loop() {
				ms, err := r.Lookup(ctx, c.keys)
				if err != nil || len(ms) != c.want || c.want > 0 && ms[0].Blocks[0] != shapeBlocks {
					b.Fatalf("lookup = %+v, %v", ms, err)
				}
				n++
			}
			b.ReportMetric(float64(cputime.Process()-cpu0)/float64(n), "client-cpu-ns/op")
			b.ReportMetric(float64(redisCPU(b, r)-srv0)/float64(n), "server-cpu-ns/op")
		})
	}
}

func atomicAdd(p *int64) int64 { return atomic.AddInt64(p, 1) - 1 }

// redisCPU is the CPU time the Redis server has used (INFO cpu).
func redisCPU(b *testing.B, r *Redis) time.Duration {
	info, err := r.rdb.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}
