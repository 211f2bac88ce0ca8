package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/tiers"
)

// TestRouterIndexSeesTheCache feeds the engine's events to the router's
// memory index, which keys blocks with its own xxhash chain from the
// events' token ids, and checks that for every prompt the index's match per
// tier equals what the engine holds. This is the property exact routing
// rests on: the engine hashes differ from router keys, yet the events carry
// enough to map one to the other, including CPU-tier blocks that arrive as
// bare hashes.
func TestRouterIndexSeesTheCache(t *testing.T) {
	for _, wt := range []bool{false, true} {
		t.Run(fmt.Sprintf("write_through=%v", wt), func(t *testing.T) { testRouterIndexSeesTheCache(t, wt) })
	}
}

func testRouterIndexSeesTheCache(t *testing.T, writeThrough bool) {
	ctx := context.Background()
	const model = "m"
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: model, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	var applyErr error
	cpuBlocks := 40
	if writeThrough {
		// Written-through blocks are mostly still on the GPU; a CPU tier
		// larger than the GPU's is what makes CPU-only prefixes common.
		cpuBlocks = 150
	}
	e, err := New(Config{Model: model, GPUBlocks: 60, CPUBlocks: cpuBlocks, MaxNumBatchedTokens: 256, CPUWriteThrough: writeThrough}, func(b events.Batch) {
		res, err := idx.Apply(ctx, "i0", b.Events)
		if err == nil && (res.Orphans > 0 || res.Unmapped > 0) {
			err = fmt.Errorf("index could not place events: %+v", res)
		}
		if err != nil && applyErr == nil {
			applyErr = err
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.LoadLoRA("a", ""); err != nil {
		t.Fatal(err)
	}
	type req struct {
		p          []uint32
		lora, salt string
	}
	var reqs []req
	rng := rand.New(rand.NewPCG(3, 4))
	now := time.Duration(0)
	var ups []Update
	for id := uint64(1); id <= 300; id++ {
		now += time.Duration(rng.IntN(40)) * time.Millisecond
		for {
			next, ok := e.NextEventTime()
			if !ok || next > now {
				break
			}
			ups = e.Advance(next, ups[:0])
		}
		r := req{p: concat(prompt(rng.IntN(6), 16*rng.IntN(8)), prompt(int(id)+50, 1+rng.IntN(50)))}
		if rng.IntN(4) == 0 {
			r.lora = "a"
		}
		if rng.IntN(4) == 0 {
			r.salt = "tenant"
		}
		if err := e.Submit(Request{ID: id, Prompt: r.p, MaxTokens: 1 + rng.IntN(20), LoRA: r.lora, CacheSalt: r.salt}, now); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	for {
		next, ok := e.NextEventTime()
		if !ok {
			break
		}
		ups = e.Advance(next, ups[:0])
	}
	if applyErr != nil {
		t.Fatal(applyErr)
	}
	gpuSet, cpuSet := e.CachedBlocks()
	checked, withCPU := 0, 0
	for _, r := range reqs {
		hashes := e.PromptHashes(r.p, r.lora, r.salt)
		var wantGPU, wantAny int
		for wantGPU < len(hashes) && contains(gpuSet, hashes[wantGPU]) {
			wantGPU++
		}
		for wantAny < len(hashes) && (contains(gpuSet, hashes[wantAny]) || contains(cpuSet, hashes[wantAny])) {
			wantAny++
		}
		keys := kvindex.Keys(kvindex.Root(model, r.lora, r.salt), r.p, 16)
		ms, err := idx.Lookup(ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		var got kvindex.Match
		if len(ms) == 1 {
			got = ms[0]
		}
		if got.Blocks[tiers.GPU] != wantGPU || got.Blocks[tiers.CPU] != wantAny {
			t.Fatalf("prompt of %d tokens (lora %q salt %q): index GPU %d, GPU+CPU %d; engine %d, %d",
				len(r.p), r.lora, r.salt, got.Blocks[tiers.GPU], got.Blocks[tiers.CPU], wantGPU, wantAny)
		}
		if wantAny > 0 {
			checked++
		}
		if wantAny > wantGPU {
			withCPU++
		}
	}
	if checked < 20 || withCPU == 0 {
		t.Fatalf("workload too weak: %d prompts with cached blocks, %d with CPU-tier blocks", checked, withCPU)
	}
}

func contains(sorted []uint64, h uint64) bool {
	_, ok := slices.BinarySearch(sorted, h)
	return ok
}
