package kvindex

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// factoryConfig is what the contract suite asks of a backend factory.
type factoryConfig struct {
	Model     string
	BlockSize int
	Now       func() time.Time
}

// factory returns a new, empty index for one test.
type factory func(t *testing.T, cfg factoryConfig) Index

const testModel = "llama-test"

// chain is a test prompt: tokens, their block keys from a root, and the
// engine hashes an instance reports for its blocks.
type chain struct {
	tokens []uint32
	keys   []Key
	hashes []uint64
	bs     int
}

// newChain builds a chain of n blocks of size bs whose engine hashes start
// at base (engine hashes are arbitrary to the index).
func newChain(root Key, n, bs int, seed uint32, base uint64) chain {
	c := chain{tokens: seqTokens(n*bs, seed), bs: bs}
	c.keys = Keys(root, c.tokens, bs)
	for i := 0; i < n; i++ {
		c.hashes = append(c.hashes, base+uint64(i))
	}
	return c
}

// stored is a GPU BlockStored of blocks [from, to) of c.
func (c chain) stored(from, to int) events.Event {
	ev := events.Event{
		Kind:        events.BlockStored,
		BlockHashes: slices.Clone(c.hashes[from:to]),
		TokenIDs:    slices.Clone(c.tokens[from*c.bs : to*c.bs]),
		BlockSize:   c.bs,
		Medium:      "GPU",
	}
	if from > 0 {
		ev.ParentHash, ev.HasParent = c.hashes[from-1], true
	}
	return ev
}

func (c chain) tierStored(medium string, from, to int) events.Event {
	return events.Event{Kind: events.BlockStored, BlockHashes: slices.Clone(c.hashes[from:to]), Medium: medium}
}

func (c chain) removed(medium string, from, to int) events.Event {
	return events.Event{Kind: events.BlockRemoved, BlockHashes: slices.Clone(c.hashes[from:to]), Medium: medium}
}

func cleared() events.Event { return events.Event{Kind: events.AllBlocksCleared} }

// blocks builds a Match's Blocks from per-tier counts GPU, CPU, Disk, Shared.
func blocks(g, c, d, s int) [tiers.Count]int { return [tiers.Count]int{g, c, d, s} }

// all is a match of n blocks in GPU (so also in every slower tier's count).
func all(n int) [tiers.Count]int { return blocks(n, n, n, n) }

type step struct {
	inst  string
	evs   []events.Event
	purge bool
	want  ApplyResult // counts compared; InvalidErr checked by wantErr
	// wantErr, when set, must be wrapped by the result's InvalidErr.
	wantErr error
}

type query struct {
	keys []Key
	want map[string][tiers.Count]int
}

func sortMatches(ms []Match) {
	slices.SortFunc(ms, func(a, b Match) int { return strings.Compare(a.Instance, b.Instance) })
}

func checkLookup(t *testing.T, idx Index, q query, label string) {
	t.Helper()
	got, err := idx.Lookup(context.Background(), q.keys)
	if err != nil {
		t.Fatalf("%s: lookup: %v", label, err)
	}
	sortMatches(got)
	gotm := map[string][tiers.Count]int{}
	for _, m := range got {
		if _, dup := gotm[m.Instance]; dup {
			t.Fatalf("%s: instance %s listed twice", label, m.Instance)
		}
		gotm[m.Instance] = m.Blocks
	}
	if len(gotm) != len(q.want) {
		t.Fatalf("%s: lookup = %v, want %v", label, gotm, q.want)
	}
	for k, v := range q.want {
		if gotm[k] != v {
			t.Fatalf("%s: lookup = %v, want %v", label, gotm, q.want)
		}
	}
}

func countsOnly(r ApplyResult) ApplyResult { r.InvalidErr = nil; return r }

func testIndexContract(t *testing.T, newIndex factory) {
	root := Root(testModel, "", "")
	a := newChain(root, 8, 4, 1, 1000)  // chain A, engine hashes 1000..
	a2 := newChain(root, 8, 4, 1, 5000) // chain A as another instance hashes it
	b := newChain(root, 4, 4, 99, 2000) // an unrelated chain
	lora := newChain(Root(testModel, "sql-lora", ""), 4, 4, 1, 3000)
	salted := newChain(Root(testModel, "", "tenant-x"), 4, 4, 1, 4000)
	loraEv := lora.stored(0, 4)
	loraEv.LoraName = "sql-lora"
	saltEv := salted.stored(0, 4)
	saltEv.CacheSalt = "tenant-x"
	withGroup := a.stored(0, 4)
	withGroup.GroupIdx = 1
	sliding := a.stored(0, 4)
	sliding.SpecKind = "sliding_window"
	fullAttn := a.stored(0, 4)
	fullAttn.SpecKind = "full_attention"
	badTokens := a.stored(0, 4)
	badTokens.TokenIDs = badTokens.TokenIDs[:15]
	fewTokens := a.stored(0, 4)
	fewTokens.TokenIDs = fewTokens.TokenIDs[:12]
	otherBS := a.stored(0, 2)
	otherBS.BlockSize = 8
	noBS := a.stored(0, 4)
	noBS.BlockSize = 0
	loraByID := lora.stored(0, 4)
	loraByID.LoraID, loraByID.HasLoraID = 7, true
	unknownKind := events.Event{Kind: 99, BlockHashes: []uint64{1}}

	cases := []struct {
		name      string
		blockSize int // configured; 0 = learn
		steps     []step
		queries   []query
		wantLen   int
		wantTiers map[string][tiers.Count]int // Instances() per-tier block counts
	}{
		{
			name:    "stored chain from root",
			steps:   []step{{inst: "i1", evs: []events.Event{a.stored(0, 8)}, want: ApplyResult{Stored: 8}}},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(8)}}, {a.keys[:3], map[string][tiers.Count]int{"i1": all(3)}}},
			wantLen: 8, wantTiers: map[string][tiers.Count]int{"i1": {8, 0, 0, 0}},
		},
		{
			name: "chain continued through parent",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 3)}, want: ApplyResult{Stored: 3}},
				{inst: "i1", evs: []events.Event{a.stored(3, 5), a.stored(5, 8)}, want: ApplyResult{Stored: 5}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(8)}}},
			wantLen: 8,
		},
		{
			name: "orphan: parent never seen drops the event",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(3, 6)}, want: ApplyResult{Orphans: 3}},
				{inst: "i1", evs: []events.Event{a.stored(0, 2)}, want: ApplyResult{Stored: 2}},
				// Block 2 missing: block 3's parent is unknown, still an orphan.
				{inst: "i1", evs: []events.Event{a.stored(3, 4)}, want: ApplyResult{Orphans: 1}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(2)}}, {a.keys[3:], nil}},
			wantLen: 2,
		},
		{
			name: "parent known only to another instance is an orphan",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 4)}, want: ApplyResult{Stored: 4}},
				{inst: "i2", evs: []events.Event{a.stored(4, 8)}, want: ApplyResult{Orphans: 4}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(4)}}},
			wantLen: 4,
		},
		{
			name: "two instances, different engine hashes, same keys",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 8)}, want: ApplyResult{Stored: 8}},
				{inst: "i2", evs: []events.Event{a2.stored(0, 3)}, want: ApplyResult{Stored: 3}},
				{inst: "i3", evs: []events.Event{b.stored(0, 4)}, want: ApplyResult{Stored: 4}},
			},
			queries: []query{
				{a.keys, map[string][tiers.Count]int{"i1": all(8), "i2": all(3)}},
				{b.keys, map[string][tiers.Count]int{"i3": all(4)}},
				// A match runs from the first key: i3 holds only b's first block.
				{append([]Key{b.keys[0]}, a.keys...), map[string][tiers.Count]int{"i3": all(1)}},
			},
			wantLen: 15,
		},
		{
			name: "CPU offload placed through the engine-hash map",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 6)}, want: ApplyResult{Stored: 6}},
				{inst: "i1", evs: []events.Event{a.tierStored("CPU", 0, 6)}, want: ApplyResult{Stored: 6}},
				{inst: "i1", evs: []events.Event{a.removed("GPU", 2, 6)}, want: ApplyResult{Removed: 4}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": blocks(2, 6, 6, 6)}}},
			wantLen: 6, wantTiers: map[string][tiers.Count]int{"i1": {2, 6, 0, 0}},
		},
		{
			name: "tokenless store of unmapped hashes is dropped",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 2)}, want: ApplyResult{Stored: 2}},
				{inst: "i1", evs: []events.Event{a.tierStored("CPU_PINNED", 0, 5)}, want: ApplyResult{Stored: 2, Unmapped: 3}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(2)}}},
			wantLen: 2,
		},
		{
			name: "removal keeps the mapping while another tier holds the block",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 4), a.tierStored("CPU", 0, 4)}, want: ApplyResult{Stored: 8}},
				{inst: "i1", evs: []events.Event{a.removed("GPU", 0, 4)}, want: ApplyResult{Removed: 4}},
				// Still mapped: back onto GPU through the map, then CPU dropped.
				{inst: "i1", evs: []events.Event{a.tierStored("GPU", 0, 4), a.removed("CPU", 0, 4)}, want: ApplyResult{Stored: 4, Removed: 4}},
				// Last tier gone: the mapping goes too.
				{inst: "i1", evs: []events.Event{a.removed("GPU", 0, 4), a.tierStored("CPU", 0, 4)}, want: ApplyResult{Removed: 4, Unmapped: 4}},
			},
			queries: []query{{a.keys, nil}},
			wantLen: 0, wantTiers: map[string][tiers.Count]int{"i1": {0, 0, 0, 0}},
		},
		{
			name: "removing a tier not held, or an unknown hash, drops nothing",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 4)}, want: ApplyResult{Stored: 4}},
				{inst: "i1", evs: []events.Event{a.removed("CPU", 0, 2), b.removed("GPU", 0, 1)}, want: ApplyResult{Unmapped: 3}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(4)}}},
			wantLen: 4,
		},
		{
			name: "a gap ends the match; tiers are cumulative",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 8), a.tierStored("DISK", 0, 8), a.removed("GPU", 3, 4), a.removed("GPU", 5, 8)}, want: ApplyResult{Stored: 16, Removed: 4}},
				{inst: "i2", evs: []events.Event{a2.stored(0, 8), a2.tierStored("SHARED", 4, 8), a2.removed("GPU", 2, 8)}, want: ApplyResult{Stored: 12, Removed: 6}},
				{inst: "i3", evs: []events.Event{b.stored(0, 4), b.removed("GPU", 1, 2)}, want: ApplyResult{Stored: 4, Removed: 1}},
			},
			queries: []query{
				{a.keys, map[string][tiers.Count]int{"i1": blocks(3, 3, 8, 8), "i2": blocks(2, 2, 2, 2)}},
				{b.keys, map[string][tiers.Count]int{"i3": all(1)}},
			},
			wantLen: 8 + 6 + 3,
			wantTiers: map[string][tiers.Count]int{
				"i1": {4, 0, 8, 0}, "i2": {2, 0, 0, 4}, "i3": {3, 0, 0, 0},
			},
		},
		{
			name: "clear drops only that instance",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 8), a.tierStored("CPU", 0, 8)}, want: ApplyResult{Stored: 16}},
				{inst: "i2", evs: []events.Event{a2.stored(0, 4)}, want: ApplyResult{Stored: 4}},
				{inst: "i1", evs: []events.Event{cleared()}, want: ApplyResult{Cleared: 1}},
				// Mappings are gone too: a CPU store after the clear is unmapped.
				{inst: "i1", evs: []events.Event{a.tierStored("CPU", 0, 1)}, want: ApplyResult{Unmapped: 1}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i2": all(4)}}},
			wantLen: 4, wantTiers: map[string][tiers.Count]int{"i1": {}, "i2": {4, 0, 0, 0}},
		},
		{
			name: "clear then re-store in one batch",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 8)}, want: ApplyResult{Stored: 8}},
				{inst: "i1", evs: []events.Event{a.stored(0, 2), cleared(), a.stored(0, 3), b.stored(0, 1)}, want: ApplyResult{Stored: 4, Cleared: 1}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(3)}}, {b.keys, map[string][tiers.Count]int{"i1": all(1)}}},
			wantLen: 4,
		},
		{
			name: "purge forgets the instance",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 8)}, want: ApplyResult{Stored: 8}},
				{inst: "i2", evs: []events.Event{a2.stored(0, 8)}, want: ApplyResult{Stored: 8}},
				{inst: "i1", purge: true},
				{inst: "never-seen", purge: true},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i2": all(8)}}},
			wantLen: 8, wantTiers: map[string][tiers.Count]int{"i2": {8, 0, 0, 0}},
		},
		{
			name: "purged instance comes back empty",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 8)}, want: ApplyResult{Stored: 8}},
				{inst: "i1", purge: true},
				{inst: "i1", evs: []events.Event{a.stored(4, 8)}, want: ApplyResult{Orphans: 4}},
				{inst: "i1", evs: []events.Event{b.stored(0, 2)}, want: ApplyResult{Stored: 2}},
			},
			queries: []query{{a.keys, nil}, {b.keys, map[string][tiers.Count]int{"i1": all(2)}}},
			wantLen: 2,
		},
		{
			name: "LoRA adapter and cache salt change the root",
			steps: []step{
				{inst: "i1", evs: []events.Event{loraEv, saltEv}, want: ApplyResult{Stored: 8}},
				{inst: "i2", evs: []events.Event{a.stored(0, 4)}, want: ApplyResult{Stored: 4}},
			},
			queries: []query{
				{lora.keys, map[string][tiers.Count]int{"i1": all(4)}},
				{salted.keys, map[string][tiers.Count]int{"i1": all(4)}},
				{a.keys[:4], map[string][tiers.Count]int{"i2": all(4)}}, // same tokens, base model
			},
			wantLen: 12,
		},
		{
			name: "adapter known only by id does not alias the base model",
			steps: []step{
				{inst: "i1", evs: []events.Event{loraByID}, want: ApplyResult{Stored: 4}},
			},
			queries: []query{{a.keys[:4], nil}, {lora.keys, nil}},
			wantLen: 4,
		},
		{
			name: "non-full-attention groups are skipped",
			steps: []step{
				{inst: "i1", evs: []events.Event{withGroup, sliding, fullAttn}, want: ApplyResult{Skipped: 8, Stored: 4}}, // two events of 4 blocks: blocks counted
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(4)}}},
			wantLen: 4,
		},
		{
			name:      "malformed token counts are counted, not applied",
			blockSize: 4,
			steps: []step{
				{inst: "i1", evs: []events.Event{badTokens, fewTokens, a.stored(0, 2)}, want: ApplyResult{Invalid: 2, Stored: 2}, wantErr: ErrTokenCount},
				{inst: "i1", evs: []events.Event{unknownKind}, want: ApplyResult{Invalid: 1}, wantErr: ErrEventKind},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(2)}}},
			wantLen: 2,
		},
		{
			name:      "block size contradicting the configured one",
			blockSize: 4,
			steps: []step{
				{inst: "i1", evs: []events.Event{otherBS, noBS}, want: ApplyResult{Invalid: 1, Stored: 4}, wantErr: ErrBlockSize},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(4)}}},
			wantLen: 4,
		},
		{
			name: "block size learned from the first event",
			steps: []step{
				{inst: "i1", evs: []events.Event{noBS}, want: ApplyResult{Invalid: 1}, wantErr: ErrBlockSize},
				{inst: "i1", evs: []events.Event{a.stored(0, 2), otherBS, a.stored(2, 4)}, want: ApplyResult{Stored: 4, Invalid: 1}, wantErr: ErrBlockSize},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(4)}}},
			wantLen: 4,
		},
		{
			name: "unknown medium is counted and kept in the documented tier",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 4), a.tierStored("HOLOGRAPHIC", 0, 4), a.removed("GPU", 0, 4)}, want: ApplyResult{Stored: 8, Removed: 4, UnknownMedium: 4}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": blocks(0, 4, 4, 4)}}},
			wantLen: 4,
		},
		{
			name: "duplicate stores are idempotent",
			steps: []step{
				{inst: "i1", evs: []events.Event{a.stored(0, 4), a.stored(0, 4), a.stored(2, 4)}, want: ApplyResult{Stored: 4}},
			},
			queries: []query{{a.keys, map[string][tiers.Count]int{"i1": all(4)}}},
			wantLen: 4,
		},
		{
			name:    "empty lookups and batches",
			steps:   []step{{inst: "i1", evs: nil}},
			queries: []query{{nil, nil}, {a.keys, nil}},
			wantLen: 0,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			clock := time.Unix(1_800_000_000, 0)
			idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: c.blockSize, Now: func() time.Time { return clock }})
			if c.blockSize > 0 && idx.BlockSize() != c.blockSize {
				t.Fatalf("BlockSize() = %d, want configured %d", idx.BlockSize(), c.blockSize)
			}
			for i, s := range c.steps {
				clock = clock.Add(time.Second)
				if s.purge {
					if err := idx.Purge(ctx, s.inst); err != nil {
						t.Fatalf("step %d: purge: %v", i, err)
					}
					continue
				}
				res, err := idx.Apply(ctx, s.inst, s.evs)
				if err != nil {
					t.Fatalf("step %d: apply: %v", i, err)
				}
				if countsOnly(res) != s.want {
					t.Fatalf("step %d: result %+v, want %+v", i, countsOnly(res), s.want)
				}
				if (s.wantErr != nil) != (res.InvalidErr != nil) || s.wantErr != nil && !errors.Is(res.InvalidErr, s.wantErr) {
					t.Fatalf("step %d: InvalidErr = %v, want %v", i, res.InvalidErr, s.wantErr)
				}
			}
			for i, q := range c.queries {
				checkLookup(t, idx, q, "query "+string(rune('0'+i)))
			}
			if n, err := idx.Len(ctx); err != nil || n != c.wantLen {
				t.Fatalf("Len = %d, %v; want %d", n, err, c.wantLen)
			}
			stats, err := idx.Instances(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range stats {
				if want, ok := c.wantTiers[s.Instance]; ok && s.Blocks != want {
					t.Fatalf("Instances %s blocks = %v, want %v", s.Instance, s.Blocks, want)
				}
				if !s.LastEvent.After(time.Unix(1_800_000_000, 0)) || s.LastEvent.After(clock) {
					t.Fatalf("Instances %s LastEvent = %v, want within the test clock", s.Instance, s.LastEvent)
				}
			}
			for inst := range c.wantTiers {
				if !slices.ContainsFunc(stats, func(s InstanceStats) bool { return s.Instance == inst }) {
					t.Fatalf("Instances lacks %s: %+v", inst, stats)
				}
			}
		})
	}
	t.Run("block size learned and exposed", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel})
		if idx.BlockSize() != 0 {
			t.Fatalf("BlockSize() = %d before any event, want 0", idx.BlockSize())
		}
		if _, err := idx.Apply(context.Background(), "i1", []events.Event{a.stored(0, 1)}); err != nil {
			t.Fatal(err)
		}
		if idx.BlockSize() != 4 {
			t.Fatalf("BlockSize() = %d, want 4 learned", idx.BlockSize())
		}
	})
	t.Run("last event time per instance", func(t *testing.T) {
		clock := time.Unix(1_900_000_000, 0)
		idx := newIndex(t, factoryConfig{Model: testModel, Now: func() time.Time { return clock }})
		ctx := context.Background()
		mustApply(t, idx, "i1", a.stored(0, 1))
		clock = clock.Add(time.Minute)
		mustApply(t, idx, "i2", b.stored(0, 1))
		stats, err := idx.Instances(ctx)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]time.Time{"i1": time.Unix(1_900_000_000, 0), "i2": time.Unix(1_900_000_060, 0)}
		if len(stats) != 2 {
			t.Fatalf("Instances = %+v", stats)
		}
		for _, s := range stats {
			if !s.LastEvent.Equal(want[s.Instance]) {
				t.Fatalf("%s LastEvent %v, want %v", s.Instance, s.LastEvent, want[s.Instance])
			}
		}
	})
	t.Run("concurrent writers, lookups and purges", func(t *testing.T) {
		testIndexConcurrent(t, newIndex(t, factoryConfig{Model: testModel}))
	})
	t.Run("cancelled context", func(t *testing.T) {
		idx := newIndex(t, factoryConfig{Model: testModel})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := idx.Apply(ctx, "i1", []events.Event{a.stored(0, 1)}); err == nil {
			t.Fatal("Apply with a cancelled context succeeded")
		}
		if _, err := idx.Lookup(ctx, a.keys); err == nil {
			t.Fatal("Lookup with a cancelled context succeeded")
		}
	})
}

func mustApply(t testing.TB, idx Index, inst string, evs ...events.Event) ApplyResult {
	t.Helper()
	res, err := idx.Apply(context.Background(), inst, evs)
	if err != nil {
		t.Fatalf("apply %s: %v", inst, err)
	}
	return res
}

// testIndexConcurrent runs appliers (one goroutine per instance, as the
// consumer shards them), lookups, Instances and a flapping instance
// (applied, purged, again) at once; run under -race. Sized so that a
// Redis-backed index finishes in about a second.
func testIndexConcurrent(t *testing.T, idx Index) {
	ctx := context.Background()
	root := Root(testModel, "", "")
	shared := newChain(root, 64, 4, 1, 0)
	var wg sync.WaitGroup
	const writers, rounds = 4, 25
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inst := fmt.Sprintf("w%d", w)
			c := newChain(root, 64, 4, 1, uint64(w+1)*1_000_000)
			for i := 0; i < rounds; i++ {
				tryApply(t, idx, inst, c.stored(0, 32), c.stored(32, 64), c.tierStored("CPU", 0, 64), c.removed("GPU", 40, 64))
				if i%7 == 6 {
					tryApply(t, idx, inst, cleared())
				}
			}
			tryApply(t, idx, inst, c.stored(0, 64))
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < rounds/2; i++ {
			tryApply(t, idx, "flap", shared.stored(0, 64))
			if err := idx.Purge(ctx, "flap"); err != nil {
				t.Error(err)
			}
		}
	}()
	stop := make(chan struct{})
	var readers sync.WaitGroup
	for r := 0; r < 2; r++ {
		readers.Add(1)
		go func() {
			defer readers.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				ms, err := idx.Lookup(ctx, shared.keys)
				if err != nil {
					t.Error(err)
					return
				}
				for _, x := range ms {
					if x.Blocks[tiers.GPU] > x.Blocks[tiers.CPU] || x.Blocks[tiers.CPU] > 64 {
						t.Errorf("inconsistent match %+v", x)
					}
				}
				if _, err := idx.Instances(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	readers.Wait()
	want := map[string][tiers.Count]int{}
	for w := 0; w < writers; w++ {
		want[fmt.Sprintf("w%d", w)] = all(64)
	}
	checkLookup(t, idx, query{shared.keys, want}, "final")
	if n, _ := idx.Len(ctx); n != writers*64 {
		t.Fatalf("Len = %d, want %d", n, writers*64)
	}
	if m, ok := idx.(*Memory); ok {
		checkMemory(t, m)
	}
}

// tryApply is mustApply for goroutines other than the test's own.
func tryApply(t testing.TB, idx Index, inst string, evs ...events.Event) {
	if _, err := idx.Apply(context.Background(), inst, evs); err != nil {
		t.Errorf("apply %s: %v", inst, err)
	}
}
