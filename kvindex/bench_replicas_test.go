package kvindex

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// BenchmarkRedisApplyTwoRouters is the Redis cost of one stream applied by
// two routers sharing the index, per block of the stream: every message
// goes to both, one after the other (the second finds it applied).
func BenchmarkRedisApplyTwoRouters(b *testing.B) {
	const evBlocks = 512
	client := redisClient(b)
	prefix := testenv.UniqueName(b)
	var rs [2]*Redis
	var from [2]map[string]uint64 // per router: the instance's last message
	for i := range rs {
		r, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, TTL: time.Hour})
		if err != nil {
			b.Fatal(err)
		}
		rs[i], from[i] = r, map[string]uint64{}
	}
	s := newShape(16, 8, shapeBlocks, evBlocks)
	perChain := s.perChain()
	ctx := context.Background()
	one := make([]events.Event, 1)
	b.ReportAllocs()
	n := 0
	cpu0, srv0 := cputime.Process(), redisCPU(b, rs[0])
	for b.Loop() {
		chain := (n / perChain) % s.chains()
		inst := fmt.Sprintf("pod-%d", chain/8)
		one[0] = s.ev(chain, n%perChain)
		evs := one
		for i, r := range rs {
			applyForBench(b, ctx, r, from[i], inst, uint64(n+1), evs)
		}
		n++
	}
	blocks := float64(evBlocks * n)
	b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
	b.ReportMetric(blocks/(cputime.Process()-cpu0).Seconds(), "blocks/client-cpu-s")
	b.ReportMetric(blocks/(redisCPU(b, rs[0])-srv0).Seconds(), "blocks/server-cpu-s")
}
