package kvindex

import (
	"context"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// The peers' KV-event mistakes, each as a regression test run against both
// backends (memory and Redis).

func TestEngineRegressionsMemory(t *testing.T) { testEngineRegressions(t, newMemoryForTest) }
func TestEngineRegressionsRedis(t *testing.T)  { testEngineRegressions(t, newRedisForTest) }

func testEngineRegressions(t *testing.T, newIndex factory) {
	root := Root(testModel, "", "")

	// llm-d/llm-d-router#2889: one 64-token CPU block over a 16-token pool
	// must not score as four independent 16-token hits: a request that
	// matches only part of the block gets no credit for it.
	t.Run("large CPU block is one unit (llm-d-router#2889)", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: 16})
		c := newChain(root, 8, 16, 7, 100) // 8 pool blocks = two 64-token units
		ev := events.Event{Kind: events.BlockStored, BlockHashes: []uint64{900, 901}, TokenIDs: c.tokens,
			BlockSize: 64, Medium: "CPU", GroupIdx: 0, SpecKind: "full_attention"}
		if res := mustApply(t, idx, "i1", ev); res.Stored != 2 || res.Invalid != 0 {
			t.Fatalf("apply = %+v", res)
		}
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": blocks(0, 8, 8, 8)}}, "whole units")
		// Six blocks of the prompt match: only the first unit (4 blocks) is loadable.
		checkLookup(t, idx, query{c.keys[:6], map[string][tiers.Count]int{"i1": blocks(0, 4, 4, 4)}}, "one and a half units")
		// Two blocks: part of one unit, nothing loadable.
		checkLookup(t, idx, query{c.keys[:2], nil}, "half a unit")
		// Removing the engine block removes its four router blocks.
		rm := events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{901}, Medium: "CPU"}
		if res := mustApply(t, idx, "i1", rm); res.Removed != 1 {
			t.Fatalf("remove = %+v", res)
		}
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": blocks(0, 4, 4, 4)}}, "second unit removed")
		if n, err := idx.Len(context.Background()); err != nil || n != 4 {
			t.Fatalf("Len = %d, %v; want 4 (the removed unit's interior blocks go too)", n, err)
		}
		// A GPU prefix counts as it is; the CPU unit beyond it only whole.
		gpu := c.stored(0, 3)
		gpu.BlockHashes = []uint64{1, 2, 3}
		mustApply(t, idx, "i1", gpu)
		checkLookup(t, idx, query{c.keys[:7], map[string][tiers.Count]int{"i1": blocks(3, 4, 4, 4)}}, "GPU prefix, then units")
		// A chunk that is not whole pool blocks cannot be keyed: dropped, counted.
		odd := ev
		odd.BlockHashes, odd.BlockSize, odd.TokenIDs = []uint64{902}, 40, c.tokens[:40]
		if res := mustApply(t, idx, "i2", odd); res.Invalid != 1 || res.Stored != 0 {
			t.Fatalf("40-token block over 16: %+v", res)
		}
	})

	// llm-d/llm-d-router#878: CPU offload stores carry hashes only (no
	// tokens, no parent, block_size 0). They are still indexed, through
	// the hash → key map the GPU stores built; unknown hashes are counted,
	// never an error.
	t.Run("tokenless CPU stores are indexed (llm-d-router#878)", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: 16})
		c := newChain(root, 4, 16, 3, 10)
		mustApply(t, idx, "i1", c.stored(0, 4))
		cpu := events.Event{Kind: events.BlockStored, BlockHashes: slices.Clone(c.hashes), Medium: "CPU"}
		unknown := events.Event{Kind: events.BlockStored, BlockHashes: []uint64{12686426958405996318, 6269600025196600361}, Medium: "CPU"}
		res := mustApply(t, idx, "i1", cpu, unknown, c.removed("GPU", 2, 4))
		if res.Stored != 4 || res.Unmapped != 2 || res.Invalid != 0 || res.Removed != 2 {
			t.Fatalf("apply = %+v", res)
		}
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": blocks(2, 4, 4, 4)}}, "GPU then CPU")
	})

	// llm-d/llm-d-router#2362: a hybrid model's sparse groups (DeepSeek-V4:
	// group 0 mla_attention with 256-token blocks, groups 1-4
	// sliding_window_mla with 64, 64, 4 and 8) send the full token span with
	// only the hashes still resident. They must not create prefix residency,
	// nor overwrite group 0's hash mapping (vLLM hashes every group alike).
	t.Run("hybrid sparse groups add no residency (llm-d-router#2362)", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: 16})
		c := newChain(root, 32, 16, 5, 0) // 512 tokens: two 256-token group-0 blocks
		g0 := events.Event{Kind: events.BlockStored, BlockHashes: []uint64{7001, 7002}, TokenIDs: c.tokens,
			BlockSize: 256, Medium: "GPU", GroupIdx: 0, SpecKind: "mla_attention"}
		var evs []events.Event
		for g, bs := range []int{64, 64, 4, 8} {
			evs = append(evs, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{7002},
				TokenIDs: c.tokens, BlockSize: bs, Medium: "GPU", GroupIdx: g + 1, SpecKind: "sliding_window_mla", SlidingWindow: 128})
		}
		res := mustApply(t, idx, "i1", append([]events.Event{g0}, evs...)...)
		if res.Stored != 2 || res.Skipped != 4 || res.Invalid != 0 {
			t.Fatalf("apply = %+v", res)
		}
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(32)}}, "group 0 only")
		// Only group 0 stored; a prompt sharing 20 blocks uses one unit.
		checkLookup(t, idx, query{c.keys[:20], map[string][tiers.Count]int{"i1": all(16)}}, "partial unit")
		// A sliding-window group's eviction says nothing about the prefix.
		swRm := events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{7002}, Medium: "GPU", GroupIdx: 2, SpecKind: "sliding_window_mla"}
		mustApply(t, idx, "i1", swRm)
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(32)}}, "sliding removal ignored")
		// Dropped blocks are counted as blocks (the metric
		// kvrouter_events_blocks_dropped_total), whatever the number of
		// events they came in: a joined run of one-block removals too.
		swRm.BlockHashes = []uint64{7002, 7001, 7002}
		if res := mustApply(t, idx, "i1", swRm); res.Skipped != 3 {
			t.Fatalf("a three-block removal of a sliding-window group: apply = %+v, want 3 skipped", res)
		}
		// Another full-attention group losing a block loses the prefix
		// from there: every full-attention group must hold it.
		faRm := events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{7002}, Medium: "GPU", GroupIdx: 5, SpecKind: "full_attention"}
		mustApply(t, idx, "i1", faRm)
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(16)}}, "full-attention group removal")
	})

	// A hybrid model whose attention is not group 0 (Kimi-K3: three mamba
	// groups, MLA attention in group 3; AMD-AGI/Infera#98). The mamba
	// groups send the whole chunk's tokens with one surviving hash; the
	// attention group's blocks are indexed, the mamba ones never.
	t.Run("attention in a later group, mamba before it", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: 16})
		c := newChain(root, 5, 16, 11, 500)
		var evs []events.Event
		for g := 0; g < 3; g++ {
			evs = append(evs, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{c.hashes[4]}, TokenIDs: c.tokens,
				BlockSize: 16, Medium: "GPU", GroupIdx: g, SpecKind: "mamba"})
		}
		attn := c.stored(0, 5)
		attn.GroupIdx, attn.SpecKind = 3, "mla_attention"
		evs = append(evs, attn)
		res := mustApply(t, idx, "i1", evs...)
		if res.Stored != 5 || res.Skipped != 3 || res.Invalid != 0 {
			t.Fatalf("apply = %+v", res)
		}
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(5)}}, "attention group indexed")
		// Another full-attention group's stores are not applied; its removals are.
		other := c.stored(0, 5)
		other.GroupIdx, other.SpecKind = 4, "full_attention"
		if res := mustApply(t, idx, "i2", other); res.Skipped != 5 || res.Stored != 0 {
			t.Fatalf("second full-attention group's store = %+v, want skipped", res)
		}
		rm := c.removed("GPU", 3, 5)
		rm.GroupIdx, rm.SpecKind = 4, "full_attention"
		mustApply(t, idx, "i1", rm)
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(3)}}, "removal from another full group")
	})

	// vllm-project/vllm#58119: partial cache events can reference a parent
	// hash that was never reported. Such events are dropped and counted as
	// orphans; they are never keyed as if they started the prompt, and the
	// chain they would extend stays as it was.
	t.Run("unreported parents are orphans (vllm#58119)", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: 16})
		c := newChain(root, 6, 16, 9, 40)
		mustApply(t, idx, "i1", c.stored(0, 2))
		orphan := c.stored(3, 6) // parent hash c.hashes[2] was never stored
		res := mustApply(t, idx, "i1", orphan)
		if res.Orphans != 3 || res.Stored != 0 {
			t.Fatalf("apply = %+v", res)
		}
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(2)}}, "orphan not indexed")
		// Its tokens keyed from the root would be another prompt: nothing there either.
		checkLookup(t, idx, query{Keys(root, c.tokens[3*16:], 16), nil}, "orphan not rooted")
		// Once the parent arrives, later stores chain on as usual.
		mustApply(t, idx, "i1", c.stored(2, 3), c.stored(3, 6))
		checkLookup(t, idx, query{c.keys, map[string][tiers.Count]int{"i1": all(6)}}, "parent arrived")
	})
}

// vLLM's full report mode (vllm-project/vllm#45261) sends BlockStored
// again for blocks a request reused from the prefix cache. Such a report
// adds nothing (the placement is known) but refreshes the blocks' recency,
// so a bounded index keeps the prefixes engines are using.
func TestReuseReportRefreshesRecency(t *testing.T) {
	s := newLRUScene(t)
	m, a, b, c := s.m, s.a, s.b, s.c
	// The reuse report of a's whole prefix: no new placement.
	if res := mustApply(t, m, "a", a.stored(0, 50)); res.Stored != 0 || res.Invalid != 0 {
		t.Fatalf("reuse report = %+v, want nothing added", res)
	}
	s.tick()
	mustApply(t, m, "c", c.stored(0, 20))
	type want map[string][tiers.Count]int
	checkLookup(t, m, query{a.keys, want{"a": all(50)}}, "reported a kept")
	checkLookup(t, m, query{b.keys, want{"b": all(30)}}, "unreported b trimmed")
}
