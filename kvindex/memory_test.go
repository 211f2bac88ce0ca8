package kvindex

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

func newMemoryForTest(t *testing.T, cfg factoryConfig) Index {
	m, err := NewMemory(MemoryConfig{Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestMemoryContract(t *testing.T) { testIndexContract(t, newMemoryForTest) }

func TestMemoryConfig(t *testing.T) {
	cases := []struct {
		name string
		cfg  MemoryConfig
		ok   bool
	}{
		{"zero value", MemoryConfig{}, true},
		{"negative block size", MemoryConfig{BlockSize: -16}, false},
		{"negative capacity", MemoryConfig{Capacity: -1}, false},
		{"capacity beyond int32 indices", MemoryConfig{Capacity: math.MaxInt32}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := NewMemory(c.cfg)
			if (err == nil) != c.ok || err != nil && !errors.Is(err, ErrConfig) {
				t.Fatalf("NewMemory(%+v) = %v, want ok=%v", c.cfg, err, c.ok)
			}
		})
	}
}

// lruScene is the capacity scenario TestMemoryCapacityLRU and
// TestReuseReportRefreshesRecency share: a Memory of 100 blocks on a
// clock that tick moves a second on, holding chain a (50 blocks) stored a
// second before chain b (50 blocks), a second ago; chain c (20 blocks) is
// not stored and overflows it.
type lruScene struct {
	m       *Memory
	a, b, c chain
	tick    func()
}

func newLRUScene(t *testing.T) lruScene {
	t.Helper()
	root := Root(testModel, "", "")
	clock := time.Unix(1_800_000_000, 0)
	m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 100, Now: func() time.Time { return clock }})
	if err != nil {
		t.Fatal(err)
	}
	s := lruScene{m: m, a: newChain(root, 50, 4, 1, 1000), b: newChain(root, 50, 4, 2, 2000), c: newChain(root, 20, 4, 3, 3000),
		tick: func() { clock = clock.Add(time.Second) }}
	mustApply(t, m, "a", s.a.stored(0, 50))
	s.tick()
	mustApply(t, m, "b", s.b.stored(0, 50))
	s.tick()
	return s
}

func TestMemoryCapacityLRU(t *testing.T) {
	type want map[string][tiers.Count]int
	cases := []struct {
		name        string
		hitA        bool // look chain a up before c arrives
		wantA       want
		wantB       want
		wantC       want
		wantEvicted int64
	}{
		// a is oldest: its last 20 blocks go, its first 30 still match.
		{"oldest stored goes first, from the chain's end", false, want{"a": all(30)}, want{"b": all(50)}, want{"c": all(20)}, 20},
		// a was matched since it was stored: it gets a second chance, b pays.
		{"a lookup hit gives a second chance", true, want{"a": all(50)}, want{"b": all(30)}, want{"c": all(20)}, 20},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newLRUScene(t)
			m, a, b, c := s.m, s.a, s.b, s.c
			if tc.hitA {
				checkLookup(t, m, query{a.keys, want{"a": all(50)}}, "hit a")
			}
			mustApply(t, m, "c", c.stored(0, 20))
			checkLookup(t, m, query{a.keys, tc.wantA}, "a")
			checkLookup(t, m, query{b.keys, tc.wantB}, "b")
			checkLookup(t, m, query{c.keys, tc.wantC}, "c")
			if n, _ := m.Len(context.Background()); n != 100 {
				t.Fatalf("Len = %d, want capacity 100", n)
			}
			if m.Evicted() != tc.wantEvicted {
				t.Fatalf("Evicted = %d, want %d", m.Evicted(), tc.wantEvicted)
			}
		})
	}
}

func TestMemoryCapacityChurn(t *testing.T) {
	// Far more stores than capacity, over many instances: the bound holds
	// and the structures stay consistent (every held key is found).
	m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 1000})
	if err != nil {
		t.Fatal(err)
	}
	root := Root(testModel, "", "")
	for i := 0; i < 200; i++ {
		c := newChain(root, 32, 4, uint32(i), uint64(i)*100)
		mustApply(t, m, fmt.Sprintf("i%d", i%7), c.stored(0, 32))
		if n, _ := m.Len(context.Background()); n > 1000 {
			t.Fatalf("Len = %d over capacity after %d chains", n, i)
		}
	}
	total := 0
	stats, _ := m.Instances(context.Background())
	for _, s := range stats {
		total += s.Blocks[tiers.GPU]
	}
	if n, _ := m.Len(context.Background()); n != total || n != 1000 {
		t.Fatalf("Len = %d, GPU blocks over instances = %d, want both 1000", n, total)
	}
}

// TestMemoryLookupSharedThenOne covers a lookup leaving a holder set (a
// prefix every instance holds) for a block one instance holds: the others'
// runs end there, and the one goes on in the tiers it holds the rest in,
// or ends too when it no longer matches.
func TestMemoryLookupSharedThenOne(t *testing.T) {
	const sharers, shared, n = 100, 10, 20
	root := Root(testModel, "", "")
	c := newChain(root, n, 4, 1, 1000)
	cases := []struct {
		name string
		x    []events.Event // the one instance's events after storing all n blocks
		want [tiers.Count]int
	}{
		{"holds the rest on GPU", nil, all(n)},
		{"holds the rest on CPU only", []events.Event{c.tierStored("CPU", shared, n), c.removed("GPU", shared, n)}, blocks(shared, n, n, n)},
		{"lost a block inside the prefix", []events.Event{c.removed("GPU", 5, shared)}, all(5)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			m, err := NewMemory(MemoryConfig{Model: testModel, BlockSize: 4})
			if err != nil {
				t.Fatal(err)
			}
			for i := range sharers {
				if _, err := m.Apply(ctx, fmt.Sprintf("s%d", i), []events.Event{c.stored(0, shared)}); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := m.Apply(ctx, "x", append([]events.Event{c.stored(0, n)}, tc.x...)); err != nil {
				t.Fatal(err)
			}
			ms, err := m.Lookup(ctx, c.keys)
			if err != nil {
				t.Fatal(err)
			}
			if len(ms) != sharers+1 {
				t.Fatalf("%d matches, want %d", len(ms), sharers+1)
			}
			for _, mt := range ms {
				want := all(shared)
				if mt.Instance == "x" {
					want = tc.want
				}
				if mt.Blocks != want {
					t.Errorf("%s: %v, want %v", mt.Instance, mt.Blocks, want)
				}
			}
		})
	}
}

// TestMemorySizeEmpty: an instance that starts empty gets its engine-hash
// table sized, before its first stores, for the larger of its first
// event's blocks and what its peers hold on average, so it fills without
// a rebuild; the size is the one doubling would reach, so a full instance
// costs no more memory. Its blocks all stay findable.
func TestMemorySizeEmpty(t *testing.T) {
	ctx := context.Background()
	s := newShape(4, 2, 256, 16) // 4 instances × 2 chains × 256 blocks
	m, err := NewMemory(MemoryConfig{Model: testModel})
	if err != nil {
		t.Fatal(err)
	}
	rebuilds := func(name string, chains []int) (sizes []int) {
		one := make([]events.Event, 1)
		for _, c := range chains {
			for k := range s.perChain() {
				one[0] = s.ev(c, k)
				if _, err := m.Apply(ctx, name, one); err != nil {
					t.Fatal(err)
				}
				n := len(m.insts[name].byHash.slots)
				if len(sizes) == 0 || sizes[len(sizes)-1] != n {
					sizes = append(sizes, n)
				}
			}
		}
		return sizes
	}
	var grown table
	grown.presize(512)
	final := len(grown.slots) // what doubling reaches for 512 entries
	// The first instance has no peers: its table grows a doubling at a time.
	if got := rebuilds("pod-0", []int{0, 1}); len(got) < 3 || got[len(got)-1] != final {
		t.Fatalf("first instance's table sizes %v, want several doublings up to %d", got, final)
	}
	// The next ones start at their peers' size and never rebuild.
	for i := 1; i < 4; i++ {
		if got := rebuilds(fmt.Sprintf("pod-%d", i), []int{2 * i, 2*i + 1}); len(got) != 1 || got[0] != final {
			t.Fatalf("pod-%d table sizes %v, want [%d]", i, got, final)
		}
	}
	// Purged, then loaded as one event (a snapshot): sized for it at once.
	if err := m.Purge(ctx, "pod-3"); err != nil {
		t.Fatal(err)
	}
	big := s.ev(6, 0)
	big.TokenIDs, big.BlockHashes = s.tokens[:256*shapeBS], s.hashes[6*256:7*256]
	if _, err := m.Apply(ctx, "pod-3", []events.Event{big}); err != nil {
		t.Fatal(err)
	}
	if got := len(m.insts["pod-3"].byHash.slots); got != final {
		t.Fatalf("reloaded instance's table has %d slots, want %d (its peers' size)", got, final)
	}
	for i := range 4 {
		for c := range 2 {
			if i == 3 && c == 1 {
				continue // not reloaded
			}
			ms, err := m.Lookup(ctx, s.keys(i, c))
			if err != nil {
				t.Fatal(err)
			}
			if len(ms) != 1 || ms[0].Instance != fmt.Sprintf("pod-%d", i) || ms[0].Blocks[tiers.GPU] != 256 {
				t.Fatalf("pod-%d chain %d: matches %+v, want its 256 blocks", i, c, ms)
			}
		}
	}
	if n, _ := m.Len(ctx); n != 7*256 {
		t.Fatalf("Len = %d, want %d", n, 7*256)
	}
}

// TestMemoryPurgeDuringBatch purges an instance while Apply is between
// the events of one of its batches (Apply releases the lock after each
// event), and gives the freed slot to another instance: the rest of the
// batch must go to the instance re-created under the name, never to the
// purged one, whose slot is now the other instance's.
func TestMemoryPurgeDuringBatch(t *testing.T) {
	m, err := NewMemory(MemoryConfig{Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// Long batches: the purging goroutine gets the lock between two events
	// once the mutex hands it over (a waiter starved for 1 ms).
	const n = 4000
	batch := make([]events.Event, n)
	for i := range batch {
		// Chains of one block each: an event after a purge stores whatever
		// came before it.
		batch[i] = events.Event{Kind: events.BlockStored, BlockSize: 4, Medium: "GPU",
			TokenIDs: []uint32{uint32(i), 1, 2, 3}, BlockHashes: []uint64{uint64(100 + i)}}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 20 {
			if _, err := m.Apply(ctx, "a", batch); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	other := []events.Event{{Kind: events.BlockStored, BlockSize: 4, Medium: "GPU",
		TokenIDs: []uint32{9, 9, 9, 9}, BlockHashes: []uint64{7}}}
	for purged := 0; ; purged++ {
		select {
		case <-done:
			checkMemory(t, m)
			if purged == 0 {
				t.Log("no purge landed during the batches")
			}
			return
		default:
		}
		if err := m.Purge(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if err := m.Purge(ctx, "b"); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Apply(ctx, "b", other); err != nil {
			t.Fatal(err)
		}
		if err := memoryInvariants(m); err != nil {
			t.Fatal(err)
		}
	}
}

// TestMediumTier: the fast path answers as tiers.FromMedium does.
func TestMediumTier(t *testing.T) {
	for _, med := range []string{"", "GPU", "gpu", "Gpu", "CPU", "cpu_pinned", "DISK", "LMCACHE", "GPU ", "HBM"} {
		gt, gk := mediumTier(med)
		wt, wk := tiers.FromMedium(med)
		if gt != wt || gk != wk {
			t.Errorf("mediumTier(%q) = %v, %v; FromMedium: %v, %v", med, gt, gk, wt, wk)
		}
	}
}
