package sim

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

// harness drives an engine in virtual time and keeps what it emitted.
type harness struct {
	t       testing.TB
	e       *Engine
	batches []events.Batch
	ups     []Update
	model   *replayModel
}

func newHarness(t testing.TB, cfg Config) *harness {
	t.Helper()
	h := &harness{t: t, model: newReplayModel()}
	e, err := New(cfg, func(b events.Batch) {
		h.batches = append(h.batches, b)
		if err := h.model.apply(b, cfg.BlockSizeOrDefault()); err != nil {
			t.Fatalf("event stream inconsistent with the cache: %v (batch %+v)", err, b)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	h.e = e
	return h
}

func (h *harness) submit(r Request, at time.Duration) {
	h.t.Helper()
	if err := h.e.Submit(r, at); err != nil {
		h.t.Fatalf("submit %d: %v", r.ID, err)
	}
}

// runUntil advances through every engine event up to limit.
func (h *harness) runUntil(limit time.Duration) {
	for {
		next, ok := h.e.NextEventTime()
		if !ok || next > limit {
			h.ups = h.e.Advance(limit, h.ups)
			return
		}
		h.ups = h.e.Advance(next, h.ups)
	}
}

// drain runs until the engine is idle, leaving its clock at the last event.
func (h *harness) drain() {
	for {
		next, ok := h.e.NextEventTime()
		if !ok {
			h.ups = h.e.Advance(h.e.Now(), h.ups)
			return
		}
		h.ups = h.e.Advance(next, h.ups)
	}
}

func (h *harness) find(id uint64, k UpdateKind) Update {
	h.t.Helper()
	for _, u := range h.ups {
		if u.ID == id && u.Kind == k {
			return u
		}
	}
	h.t.Fatalf("no %v update for request %d", k, id)
	return Update{}
}

// checkModel asserts the replayed events describe exactly the cache.
func (h *harness) checkModel() {
	h.t.Helper()
	g, c := h.e.CachedBlocks()
	mg, mc := h.model.sorted()
	if !slices.Equal(g, mg) {
		h.t.Fatalf("GPU blocks: cache has %d, events say %d", len(g), len(mg))
	}
	if !slices.Equal(c, mc) {
		h.t.Fatalf("CPU blocks: cache has %d, events say %d", len(c), len(mc))
	}
}

// replayModel is what a listener knows from the events alone: which engine
// hashes are on which tier. apply rejects anything a faithful engine never
// sends (a store of a block already there, a removal of a block not there,
// a GPU store whose parent is not on the GPU, tokens not matching blocks).
type replayModel struct{ tier [2]map[uint64]bool }

func newReplayModel() *replayModel {
	return &replayModel{tier: [2]map[uint64]bool{{}, {}}}
}

func (m *replayModel) apply(b events.Batch, bs int) error {
	for _, ev := range b.Events {
		switch ev.Kind {
		case events.AllBlocksCleared:
			m.tier = [2]map[uint64]bool{{}, {}}
		case events.BlockStored:
			t := gpu
			if ev.Medium == MediumCPU {
				t = cpu
				if len(ev.TokenIDs) != 0 || ev.HasParent || ev.BlockSize != 0 {
					return fmt.Errorf("CPU store carries tokens/parent/block size")
				}
			} else {
				if len(ev.TokenIDs) != len(ev.BlockHashes)*bs || ev.BlockSize != bs {
					return fmt.Errorf("GPU store: %d tokens for %d blocks", len(ev.TokenIDs), len(ev.BlockHashes))
				}
				if ev.HasParent && !m.tier[gpu][ev.ParentHash] {
					return fmt.Errorf("GPU store with parent %x not on GPU", ev.ParentHash)
				}
			}
			for _, h := range ev.BlockHashes {
				if m.tier[t][h] {
					return fmt.Errorf("store of %x already on tier %d", h, t)
				}
				m.tier[t][h] = true
			}
		case events.BlockRemoved:
			t := gpu
			if ev.Medium == MediumCPU {
				t = cpu
			}
			for _, h := range ev.BlockHashes {
				if !m.tier[t][h] {
					return fmt.Errorf("removal of %x not on tier %d", h, t)
				}
				delete(m.tier[t], h)
			}
		}
	}
	return nil
}

func (m *replayModel) sorted() (g, c []uint64) {
	for h := range m.tier[gpu] {
		g = append(g, h)
	}
	for h := range m.tier[cpu] {
		c = append(c, h)
	}
	slices.Sort(g)
	slices.Sort(c)
	return g, c
}

// prompt returns n tokens: a shared prefix (seeded by base) then distinct ones.
func prompt(base, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(base*1_000_003 + i)
	}
	return p
}

func concat(a, b []uint32) []uint32 { return append(slices.Clone(a), b...) }

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero value means defaults", Config{}, true},
		{"negative block size", Config{BlockSize: -1}, false},
		{"negative GPU blocks", Config{GPUBlocks: -5}, false},
		{"negative CPU blocks", Config{CPUBlocks: -1}, false},
		{"negative budget", Config{MaxNumBatchedTokens: -1}, false},
		{"negative seqs", Config{MaxNumSeqs: -1}, false},
		{"negative rank", Config{DPRank: -1}, false},
		{"tiny model len", Config{MaxModelLen: 1}, false},
		{"negative FLOPS", Config{Timing: Timing{FLOPS: -1}}, false},
		{"negative overhead", Config{Timing: Timing{StepOverhead: -time.Millisecond}}, false},
		{"CPU tier", Config{CPUBlocks: 100}, true},
		{"xxhash", Config{HashAlgo: HashXXH64}, true},
		{"unknown hash", Config{HashAlgo: 9}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg, nil)
			if tc.ok != (err == nil) {
				t.Fatalf("New(%+v) error = %v, want ok=%v", tc.cfg, err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrConfig) {
				t.Fatalf("error %v does not wrap ErrConfig", err)
			}
		})
	}
	e, _ := New(Config{}, nil)
	if c := e.Config(); c.GPUBlocks != 84375 || c.BlockSize != 16 || c.MaxNumBatchedTokens != 8192 {
		t.Fatalf("defaults: %+v", c)
	}
}

func TestSubmitRejects(t *testing.T) {
	e, err := New(Config{GPUBlocks: 8, MaxModelLen: 1000}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Submit(Request{ID: 1, Prompt: prompt(1, 16), MaxTokens: 1}, 0); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		r    Request
		want error
	}{
		{"empty prompt", Request{ID: 2, MaxTokens: 1}, ErrEmptyPrompt},
		{"no output", Request{ID: 2, Prompt: prompt(1, 4)}, ErrBadMaxTokens},
		{"beyond cache", Request{ID: 2, Prompt: prompt(1, 8*16), MaxTokens: 1}, ErrTooLong},
		{"beyond model len", Request{ID: 2, Prompt: prompt(1, 10), MaxTokens: 1000}, ErrTooLong},
		{"unknown adapter", Request{ID: 2, Prompt: prompt(1, 4), MaxTokens: 1, LoRA: "nope"}, ErrUnknownAdapter},
		{"duplicate id", Request{ID: 1, Prompt: prompt(1, 4), MaxTokens: 1}, ErrDuplicateID},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := e.Submit(tc.r, 0); !errors.Is(err, tc.want) {
				t.Fatalf("Submit error = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestPrefixHitAndEvents(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 64})
	a := prompt(1, 64)
	h.submit(Request{ID: 1, Prompt: a, MaxTokens: 1}, 0)
	h.drain()
	if got := h.find(1, Finished).CachedTokens; got != 0 {
		t.Fatalf("first request cached %d tokens, want 0", got)
	}
	if len(h.batches) != 1 || len(h.batches[0].Events) != 1 {
		t.Fatalf("want one batch with one BlockStored, got %+v", h.batches)
	}
	ev := h.batches[0].Events[0]
	want := h.e.PromptHashes(a, "", "")
	if ev.Kind != events.BlockStored || !slices.Equal(ev.BlockHashes, want) || ev.HasParent ||
		!slices.Equal(ev.TokenIDs, a) || ev.Medium != "GPU" || ev.BlockSize != 16 || !h.batches[0].HasDPRank {
		t.Fatalf("BlockStored = %+v, want 4 hashes %x, no parent, the prompt's tokens", ev, want)
	}

	// Same prompt again: (64-1)/16 = 3 blocks hit; the 4th is recomputed and
	// deduplicated, so no new event.
	h.submit(Request{ID: 2, Prompt: a, MaxTokens: 1}, time.Second)
	// Extension: 4 shared blocks, 2 new, parent = block 3.
	b := concat(a, prompt(2, 40))
	h.submit(Request{ID: 3, Prompt: b, MaxTokens: 1}, 2*time.Second)
	h.drain()
	if got := h.find(2, Finished).CachedTokens; got != 48 {
		t.Fatalf("repeat cached %d tokens, want 48", got)
	}
	if got := h.find(3, Finished).CachedTokens; got != 64 {
		t.Fatalf("extension cached %d tokens, want 64", got)
	}
	if len(h.batches) != 2 {
		t.Fatalf("want 2 batches, got %d", len(h.batches))
	}
	ev = h.batches[1].Events[0]
	bh := h.e.PromptHashes(b, "", "")
	if !ev.HasParent || ev.ParentHash != bh[3] || !slices.Equal(ev.BlockHashes, bh[4:6]) || !slices.Equal(ev.TokenIDs, b[64:96]) {
		t.Fatalf("extension BlockStored = %+v", ev)
	}
	s := h.e.Stats()
	if s.PrefixQueries != 64+64+104 || s.PrefixHits != 48+64 {
		t.Fatalf("prefix counters queries=%d hits=%d", s.PrefixQueries, s.PrefixHits)
	}
	h.checkModel()
}

func TestLRUEvictionTailFirst(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 8})
	a, b, c := prompt(1, 64), prompt(2, 64), prompt(3, 48)
	for i, p := range [][]uint32{a, b} {
		h.submit(Request{ID: uint64(i + 1), Prompt: p, MaxTokens: 1}, time.Duration(i)*time.Second)
		h.drain()
	}
	h.batches = nil
	// c needs 3 blocks; a's blocks were freed first, tail first, so a's
	// last three blocks go, in the order 3, 2, 1.
	h.submit(Request{ID: 3, Prompt: c, MaxTokens: 1}, 5*time.Second)
	h.drain()
	ah := h.e.PromptHashes(a, "", "")
	var removed []uint64
	for _, ev := range h.batches[0].Events {
		if ev.Kind == events.BlockRemoved {
			if len(ev.BlockHashes) != 1 || ev.Medium != "GPU" {
				t.Fatalf("BlockRemoved %+v: want one GPU block per event", ev)
			}
			removed = append(removed, ev.BlockHashes[0])
		}
	}
	if want := []uint64{ah[3], ah[2], ah[1]}; !slices.Equal(removed, want) {
		t.Fatalf("evicted %x, want %x", removed, want)
	}
	if h.batches[0].Events[len(h.batches[0].Events)-1].Kind != events.BlockStored {
		t.Fatal("evictions must precede the store that caused them")
	}
	// b is untouched: a repeat of b hits 3 blocks.
	h.submit(Request{ID: 4, Prompt: b, MaxTokens: 1}, 6*time.Second)
	h.drain()
	if got := h.find(4, Finished).CachedTokens; got != 48 {
		t.Fatalf("b after eviction of a: cached %d, want 48", got)
	}
	h.checkModel()
}

func TestPinnedBlocksAndQueueing(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 10})
	// Request 1 holds 5 blocks for a long decode; request 2 needs 6 blocks
	// and cannot start until 1 finishes: its blocks are pinned.
	h.submit(Request{ID: 1, Prompt: prompt(1, 64), MaxTokens: 16}, 0)
	h.submit(Request{ID: 2, Prompt: prompt(2, 90), MaxTokens: 1}, 0)
	h.drain()
	f1 := h.find(1, Finished)
	ft2 := h.find(2, FirstToken)
	if ft2.At <= f1.At-time.Nanosecond && ft2.At < f1.At {
		t.Fatalf("request 2 got its first token at %v, before request 1 released its blocks at %v", ft2.At, f1.At)
	}
	if h.e.Stats().Preemptions != 0 {
		t.Fatal("no preemption expected: request 2 waits")
	}
	// Request 1's prompt blocks survived while pinned: they were evicted
	// only afterwards, if at all, never while request 1 ran.
	h.checkModel()
}

func TestPreemptionUnderPressure(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 12})
	// Four requests fit at admission (2 blocks each) but grow to 5 blocks
	// each while decoding: the newest get preempted and recomputed.
	for i := range 4 {
		h.submit(Request{ID: uint64(i + 1), Prompt: prompt(i+1, 20), MaxTokens: 60}, 0)
	}
	h.drain()
	for i := range 4 {
		if u := h.find(uint64(i+1), Finished); u.OutputTokens != 60 {
			t.Fatalf("request %d finished with %d tokens", i+1, u.OutputTokens)
		}
	}
	if h.e.Stats().Preemptions == 0 {
		t.Fatal("expected preemptions with 12 blocks for 4×5")
	}
	if s := h.e.Stats(); s.Running+s.Waiting+s.Loading != 0 || s.KVUsage != 0 {
		t.Fatalf("engine not idle after drain: %+v", s)
	}
	h.checkModel()
}

func TestCPUOffloadDemoteAndPromote(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 8, CPUBlocks: 6})
	a, b := prompt(1, 64), prompt(2, 64)
	h.submit(Request{ID: 1, Prompt: a, MaxTokens: 1}, 0)
	h.drain()
	h.submit(Request{ID: 2, Prompt: b, MaxTokens: 1}, time.Second)
	h.drain()
	h.batches = nil
	// c evicts a's 4 blocks: each is stored on CPU (hashes only) before its
	// GPU removal.
	h.submit(Request{ID: 3, Prompt: prompt(3, 64), MaxTokens: 1}, 2*time.Second)
	h.drain()
	ah := h.e.PromptHashes(a, "", "")
	var kinds []string
	for _, ev := range h.batches[0].Events {
		kinds = append(kinds, ev.Kind.String()+"/"+ev.Medium)
	}
	want := []string{"BlockStored/CPU", "BlockRemoved/GPU", "BlockStored/CPU", "BlockRemoved/GPU",
		"BlockStored/CPU", "BlockRemoved/GPU", "BlockStored/CPU", "BlockRemoved/GPU", "BlockStored/GPU"}
	if !slices.Equal(kinds, want) {
		t.Fatalf("events %v, want %v", kinds, want)
	}
	_, cpuHashes := h.e.CachedBlocks()
	if len(cpuHashes) != 4 || !slices.Contains(cpuHashes, ah[0]) {
		t.Fatalf("CPU tier holds %x, want a's blocks %x", cpuHashes, ah)
	}
	h.checkModel()

	// a again: 3 blocks come back from the CPU at the transfer cost; they
	// are announced as GPU stores with tokens and the right parent.
	h.batches = nil
	start := 10 * time.Second
	h.submit(Request{ID: 4, Prompt: a, MaxTokens: 1}, start)
	h.drain()
	u := h.find(4, FirstToken)
	if u.CachedTokens != 48 || u.CPUCachedTokens != 48 {
		t.Fatalf("CPU hit: cached %d, from CPU %d; want 48, 48", u.CachedTokens, u.CPUCachedTokens)
	}
	rate := float64(defaultCPULoadTokensPerSec)
	load := time.Duration(48 / rate * 1e9)
	if u.At-start < load {
		t.Fatalf("TTFT %v shorter than the CPU→GPU copy %v", u.At-start, load)
	}
	// The blocks evicted to make room for the copy are announced when the
	// copy is scheduled (an empty step), not held back until it completes.
	if len(h.batches) < 2 || h.batches[0].TS != start.Seconds() {
		t.Fatalf("want the evictions announced at %v, then the promotion; got %d batches", start, len(h.batches))
	}
	for _, ev := range h.batches[0].Events {
		if ev.Kind == events.BlockStored && ev.Medium == MediumGPU {
			t.Fatalf("GPU store %x announced before the copy completed", ev.BlockHashes)
		}
	}
	var promoted []uint64
	for _, b := range h.batches {
		for _, ev := range b.Events {
			if ev.Kind == events.BlockStored && ev.Medium == MediumGPU {
				if promoted == nil && (ev.HasParent || !slices.Equal(ev.TokenIDs, a[:len(ev.BlockHashes)*16])) {
					t.Fatalf("promotion store %+v: want blocks from 0 with their tokens", ev)
				}
				promoted = append(promoted, ev.BlockHashes...)
			}
		}
	}
	if !slices.Equal(promoted[:3], ah[:3]) {
		t.Fatalf("promoted %x, want %x", promoted, ah[:3])
	}
	if h.e.Stats().CPUHitTokens != 48 {
		t.Fatalf("CPU hit tokens %d", h.e.Stats().CPUHitTokens)
	}
	h.checkModel()
}

func TestCPUTierEviction(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 4, CPUBlocks: 4})
	for i := range 4 {
		h.submit(Request{ID: uint64(i + 1), Prompt: prompt(i+1, 48), MaxTokens: 1}, time.Duration(i)*time.Second)
		h.drain()
	}
	cpuRemoved := 0
	for _, b := range h.batches {
		for _, ev := range b.Events {
			if ev.Kind == events.BlockRemoved && ev.Medium == MediumCPU {
				cpuRemoved++
			}
		}
	}
	// 12 blocks made, 4 on GPU, 4 on CPU: 4 fell off the CPU tier.
	if cpuRemoved != 4 {
		t.Fatalf("CPU removals %d, want 4", cpuRemoved)
	}
	g, c := h.e.CachedBlocks()
	if len(g) != 4 || len(c) != 4 {
		t.Fatalf("GPU %d CPU %d blocks, want 4 and 4", len(g), len(c))
	}
	h.checkModel()
}

func TestLoRAAndSaltIsolate(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 64})
	if _, err := h.e.LoadLoRA("sql", "/adapters/sql"); err != nil {
		t.Fatal(err)
	}
	if _, err := h.e.LoadLoRA("sql", "/x"); !errors.Is(err, ErrAdapterExists) {
		t.Fatalf("double load: %v", err)
	}
	p := prompt(1, 48)
	reqs := []Request{
		{ID: 1, Prompt: p, MaxTokens: 1},
		{ID: 2, Prompt: p, MaxTokens: 1, LoRA: "sql"},
		{ID: 3, Prompt: p, MaxTokens: 1, CacheSalt: "tenant-a"},
		{ID: 4, Prompt: p, MaxTokens: 1, CacheSalt: "tenant-a"},
	}
	for i, r := range reqs {
		h.submit(r, time.Duration(i)*time.Second)
		h.drain()
	}
	for id, want := range map[uint64]int{1: 0, 2: 0, 3: 0, 4: 32} {
		if got := h.find(id, Finished).CachedTokens; got != want {
			t.Fatalf("request %d cached %d, want %d", id, got, want)
		}
	}
	base, lora, salted := h.batches[0].Events[0], h.batches[1].Events[0], h.batches[2].Events[0]
	if base.BlockHashes[0] == lora.BlockHashes[0] || base.BlockHashes[0] == salted.BlockHashes[0] ||
		base.BlockHashes[1] == salted.BlockHashes[1] {
		t.Fatal("adapter or salt did not change the hash chain")
	}
	if lora.LoraName != "sql" || !lora.HasLoraID || lora.LoraID != 1 || base.HasLoraID {
		t.Fatalf("LoRA fields: %+v / %+v", lora, base)
	}
	if salted.CacheSalt != "tenant-a" || base.CacheSalt != "" {
		t.Fatalf("salt fields: %+v", salted)
	}
	if err := h.e.UnloadLoRA("sql"); err != nil {
		t.Fatal(err)
	}
	if err := h.e.Submit(Request{ID: 9, Prompt: p, MaxTokens: 1, LoRA: "sql"}, 10*time.Second); !errors.Is(err, ErrUnknownAdapter) {
		t.Fatalf("after unload: %v", err)
	}
	if got := h.e.LoRAs(); len(got) != 0 {
		t.Fatalf("LoRAs after unload: %v", got)
	}
	h.checkModel()
}

func TestResetPrefixCache(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 64})
	h.submit(Request{ID: 1, Prompt: prompt(1, 48), MaxTokens: 50}, 0)
	h.runUntil(20 * time.Millisecond)
	if err := h.e.ResetPrefixCache(20 * time.Millisecond); !errors.Is(err, ErrBusy) {
		t.Fatalf("reset while running: %v, want ErrBusy", err)
	}
	h.drain()
	if err := h.e.ResetPrefixCache(h.e.Now()); err != nil {
		t.Fatal(err)
	}
	last := h.batches[len(h.batches)-1]
	if len(last.Events) != 1 || last.Events[0].Kind != events.AllBlocksCleared {
		t.Fatalf("last batch %+v, want AllBlocksCleared", last)
	}
	if g, c := h.e.CachedBlocks(); len(g)+len(c) != 0 {
		t.Fatal("cache not empty after reset")
	}
	h.submit(Request{ID: 2, Prompt: prompt(1, 48), MaxTokens: 1}, h.e.Now()+time.Second)
	h.drain()
	if h.find(2, Finished).CachedTokens != 0 {
		t.Fatal("hit after reset")
	}
	h.checkModel()
}

func TestAbortFreesBlocks(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 100})
	h.submit(Request{ID: 1, Prompt: prompt(1, 100), MaxTokens: 1000 - 100}, 0)
	h.runUntil(50 * time.Millisecond)
	if h.e.Stats().KVUsage == 0 {
		t.Fatal("running request holds no blocks")
	}
	if !h.e.Abort(1, 50*time.Millisecond) {
		t.Fatal("abort of a running request failed")
	}
	if h.e.Abort(1, 50*time.Millisecond) {
		t.Fatal("second abort succeeded")
	}
	h.drain()
	h.find(1, Aborted)
	if s := h.e.Stats(); s.KVUsage != 0 || s.Running != 0 {
		t.Fatalf("after abort: %+v", s)
	}
	h.checkModel()
}

// TestRandomWorkloadEventsMatchCache runs a mixed random workload (shared
// prefixes, LoRA, salts, CPU tier, aborts, resets, pressure) and checks
// after every batch that the events are consistent, and at the end that
// replaying them gives exactly the cache.
func TestRandomWorkloadEventsMatchCache(t *testing.T) {
	for _, cfg := range []Config{
		{GPUBlocks: 40, MaxNumBatchedTokens: 64},
		{GPUBlocks: 40, CPUBlocks: 30, MaxNumBatchedTokens: 128, MaxNumSeqs: 4},
		{GPUBlocks: 200, CPUBlocks: 15, BlockSize: 4},
		{GPUBlocks: 40, CPUBlocks: 30, MaxNumBatchedTokens: 128, CPUWriteThrough: true},
		{GPUBlocks: 60, CPUBlocks: 10, BlockSize: 4, CPUWriteThrough: true, HashAlgo: HashXXH64},
	} {
		t.Run(fmt.Sprintf("gpu%d_cpu%d_bs%d_wt%v", cfg.GPUBlocks, cfg.CPUBlocks, cfg.BlockSize, cfg.CPUWriteThrough), func(t *testing.T) {
			h := newHarness(t, cfg)
			if _, err := h.e.LoadLoRA("a", ""); err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			now := time.Duration(0)
			live := []uint64{}
			for id := uint64(1); id <= 400; id++ {
				now += time.Duration(rng.IntN(30)) * time.Millisecond
				h.runUntil(now)
				switch x := rng.IntN(100); {
				case x < 5 && len(live) > 0:
					h.e.Abort(live[rng.IntN(len(live))], now)
				case x < 7:
					_ = h.e.ResetPrefixCache(now) // may be busy; both are fine
				}
				p := concat(prompt(rng.IntN(5), rng.IntN(100)), prompt(int(id)+100, 1+rng.IntN(60)))
				r := Request{ID: id, Prompt: p, MaxTokens: 1 + rng.IntN(40)}
				if rng.IntN(4) == 0 {
					r.LoRA = "a"
				}
				if rng.IntN(5) == 0 {
					r.CacheSalt = fmt.Sprint("s", rng.IntN(2))
				}
				if err := h.e.Submit(r, now); err != nil {
					if errors.Is(err, ErrTooLong) {
						continue
					}
					t.Fatal(err)
				}
				live = append(live, id)
			}
			h.drain()
			h.checkModel()
			done := 0
			for _, u := range h.ups {
				if u.Kind == Finished || u.Kind == Aborted {
					done++
				}
			}
			if done != len(live) {
				t.Fatalf("%d requests ended, %d submitted", done, len(live))
			}
			if s := h.e.Stats(); s.KVUsage != 0 || s.Running+s.Waiting+s.Loading != 0 {
				t.Fatalf("engine not idle: %+v", s)
			}
		})
	}
}

func TestCPUWriteThrough(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 8, CPUBlocks: 16, CPUWriteThrough: true})
	a := prompt(1, 64)
	h.submit(Request{ID: 1, Prompt: a, MaxTokens: 1}, 0)
	h.drain()
	// Computed blocks go to the CPU tier at once, announced after their GPU store.
	var kinds []string
	for _, ev := range h.batches[0].Events {
		kinds = append(kinds, ev.Kind.String()+"/"+ev.Medium)
	}
	if want := []string{"BlockStored/GPU", "BlockStored/CPU"}; !slices.Equal(kinds, want) {
		t.Fatalf("events %v, want %v", kinds, want)
	}
	g, c := h.e.CachedBlocks()
	if len(g) != 4 || len(c) != 4 {
		t.Fatalf("GPU %d CPU %d blocks, want 4 and 4", len(g), len(c))
	}
	// Evicting them from the GPU sends only the GPU removals.
	h.batches = nil
	h.submit(Request{ID: 2, Prompt: prompt(2, 64), MaxTokens: 1}, time.Second)
	h.submit(Request{ID: 3, Prompt: prompt(3, 64), MaxTokens: 1}, time.Second)
	h.drain()
	for _, b := range h.batches {
		for _, ev := range b.Events {
			if ev.Kind == events.BlockRemoved && ev.Medium == MediumCPU {
				t.Fatalf("CPU removal with room to spare: %+v", ev)
			}
		}
	}
	// a is then served from the CPU tier.
	h.submit(Request{ID: 4, Prompt: a, MaxTokens: 1}, 2*time.Second)
	h.drain()
	if u := h.find(4, Finished); u.CPUCachedTokens != 48 {
		t.Fatalf("CPU-cached tokens %d, want 48", u.CPUCachedTokens)
	}
	h.checkModel()
}

func TestActiveLoRAs(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 100, MaxNumSeqs: 1})
	for _, n := range []string{"a", "b"} {
		if _, err := h.e.LoadLoRA(n, ""); err != nil {
			t.Fatal(err)
		}
	}
	h.submit(Request{ID: 1, Prompt: prompt(1, 32), MaxTokens: 50, LoRA: "a"}, 0)
	h.submit(Request{ID: 2, Prompt: prompt(2, 32), MaxTokens: 50, LoRA: "b"}, 0)
	h.submit(Request{ID: 3, Prompt: prompt(3, 32), MaxTokens: 50}, 0)
	r, w := h.e.ActiveLoRAs()
	if !slices.Equal(r, []string{"a"}) || !slices.Equal(w, []string{"b"}) {
		t.Fatalf("running %v waiting %v, want [a] [b] (one sequence at a time)", r, w)
	}
	h.drain()
	if r, w := h.e.ActiveLoRAs(); len(r)+len(w) != 0 {
		t.Fatalf("after drain: %v %v", r, w)
	}
}

// TestBacklogAt: what a request arriving finds ahead of it — the rest of the
// step in progress and the prompt tokens not yet computed, a waiting
// request's whole prompt — and nothing on an idle engine.
func TestBacklogAt(t *testing.T) {
	h := newHarness(t, Config{MaxNumBatchedTokens: 64})
	if b := h.e.BacklogAt(0); b != (Backlog{}) {
		t.Fatalf("idle engine: backlog %+v, want none", b)
	}
	// 160 prompt tokens at 64 a step: the first step takes 64 of them, so
	// 96 are left to compute while it runs, and a second request waits
	// whole behind it.
	h.submit(Request{ID: 1, Prompt: prompt(1, 160), MaxTokens: 4}, 0)
	next, ok := h.e.NextEventTime()
	if !ok || next <= 0 {
		t.Fatalf("no step in progress after a submit: next %v, %v", next, ok)
	}
	b := h.e.BacklogAt(next / 4)
	if b.StepLeft != next-next/4 || b.PrefillTokens != 96 {
		t.Fatalf("one request in its first chunk: backlog %+v, want step left %v and 96 tokens", b, next-next/4)
	}
	h.submit(Request{ID: 2, Prompt: prompt(2, 40), MaxTokens: 1}, next/4)
	if b := h.e.BacklogAt(next / 4); b.PrefillTokens != 96+40 {
		t.Fatalf("a waiting request counted as %d tokens ahead, want its whole prompt (%d in all)", b.PrefillTokens, 96+40)
	}
	// Past the step's end by the driver's clock, before the engine is
	// advanced: no step time is left.
	if b := h.e.BacklogAt(next + time.Millisecond); b.StepLeft != 0 {
		t.Fatalf("past the step's end: %v left", b.StepLeft)
	}
	h.drain()
	if b := h.e.BacklogAt(h.e.Now()); b != (Backlog{}) {
		t.Fatalf("drained engine: backlog %+v, want none", b)
	}
}
