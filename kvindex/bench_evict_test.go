package kvindex

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkMemoryFullCacheStep is the memory index's part of a full
// cache's engine step (BenchmarkConsumerFleet's msg=50blocks/stores=1/evict
// without NATS and decoding): 256 instances each hold 4,096 blocks, and
// each op applies, to the next instance round-robin, one step's batch — one
// 50-block BlockStored continuing the instance's chain and 50 one-block
// BlockRemoved of its oldest blocks — in one Apply. cpu-ns/op is per step.
// removals=joined: the 50 removals as one 50-hash BlockRemoved, as the
// router's consumer decodes them (events.Decoder.JoinRemovals).
func BenchmarkMemoryFullCacheStep(b *testing.B) {
	for _, joined := range []bool{false, true} {
		name := "removals=each"
		if joined {
			name = "removals=joined"
		}
		b.Run(name, func(b *testing.B) { benchFullCacheStep(b, joined) })
	}
}

func benchFullCacheStep(b *testing.B, joined bool) {
	const instances, held, step = 256, 4096, 50
	ctx := context.Background()
	m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 4 * instances * held})
	if err != nil {
		b.Fatal(err)
	}
	names := make([]string, instances)
	hash := func(inst, pos int) uint64 { return uint64(inst+1)<<40 | uint64(pos) }
	tokens := func(inst, pos, n int) []uint32 {
		t := make([]uint32, 16*n)
		for i := range t {
			t[i] = uint32(1000 + (inst*7919+(pos*16+i)*31)%127000)
		}
		return t
	}
	for inst := range names {
		names[inst] = fmt.Sprintf("e%d", inst)
		ev := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: tokens(inst, 0, held)}
		for j := range held {
			ev.BlockHashes = append(ev.BlockHashes, hash(inst, j))
		}
		if _, err := m.Apply(ctx, names[inst], []events.Event{ev}); err != nil {
			b.Fatal(err)
		}
	}
	next := make([]int, instances) // each instance's next block position
	for i := range next {
		next[i] = held
	}
	batch := func(inst int) []events.Event {
		pos := next[inst]
		st := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: tokens(inst, pos, step),
			ParentHash: hash(inst, pos-1), HasParent: true}
		evs := []events.Event{st}
		for j := range step {
			evs[0].BlockHashes = append(evs[0].BlockHashes, hash(inst, pos+j))
			h := hash(inst, pos-held+j)
			if joined && j > 0 {
				evs[1].BlockHashes = append(evs[1].BlockHashes, h)
				continue
			}
			evs = append(evs, events.Event{Kind: events.BlockRemoved, Medium: "GPU", BlockHashes: []uint64{h}})
		}
		next[inst] += step
		return evs
	}
	// Batches are made off the clock, a round over the fleet at a time;
	// cpu-ns/op counts only the Applies.
	var cpu time.Duration
	batches := make([][]events.Event, instances)
	b.ResetTimer()
	for i := 0; i < b.N; {
		b.StopTimer()
		n := min(instances, b.N-i)
		for inst := range n {
			batches[inst] = batch(inst)
		}
		b.StartTimer()
		cpu0 := cputime.Process()
		for inst := range n {
			res, err := m.Apply(ctx, names[inst], batches[inst])
			if err != nil || res.Removed != step || res.Stored != step {
				b.Fatalf("step %d: %+v, %v", i+inst, res, err)
			}
		}
		cpu += cputime.Process() - cpu0
		i += n
	}
	b.StopTimer()
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}
