package kvindex

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
)

// The heavy-sharing shape (issue 15, "Mooncake-like"): every one of N
// instances holds the same first 64 blocks (a fleet-wide system prompt),
// then its own continuation to 512 blocks. The lookup is one instance's
// whole 512-block chain: all N match 64 blocks, one matches 512.
const (
	sharedBlocks = 64
	sharedChain  = 512
)

// fillShared builds the heavy-sharing shape for n instances into idx and
// returns instance 0's chain keys.
func fillShared(tb testing.TB, idx Index, n int) []Key {
	tokens := seqTokens(sharedBlocks*shapeBS, 1)
	var query []Key
	for i := 0; i < n; i++ {
		toks := append(slices.Clone(tokens), seqTokens((sharedChain-sharedBlocks)*shapeBS, uint32(i+2))...)
		base := uint64(i) << 32
		hs := make([]uint64, sharedChain)
		for b := range hs {
			hs[b] = base + uint64(b)
		}
		inst := fmt.Sprintf("pod-%d", i)
		mustApply(tb, idx, inst,
			events.Event{Kind: events.BlockStored, BlockSize: shapeBS, Medium: "GPU",
				TokenIDs: toks[:sharedBlocks*shapeBS], BlockHashes: hs[:sharedBlocks]},
			events.Event{Kind: events.BlockStored, BlockSize: shapeBS, Medium: "GPU",
				TokenIDs: toks[sharedBlocks*shapeBS:], BlockHashes: hs[sharedBlocks:],
				ParentHash: hs[sharedBlocks-1], HasParent: true})
		if i == 0 {
			query = Keys(Root(testModel, "", ""), toks, shapeBS)
		}
	}
	return query
}

// BenchmarkMemoryLookupShared is the heavy-sharing lookup at 8, 64 and 256
// instances: its CPU time per lookup should not grow with N (docs/BENCHMARKS.md).
func BenchmarkMemoryLookupShared(b *testing.B) {
	for _, n := range []int{8, 64, 256} {
		b.Run(fmt.Sprintf("instances=%d", n), func(b *testing.B) {
			m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 2 * n * sharedChain})
			if err != nil {
				b.Fatal(err)
			}
			query := fillShared(b, m, n)
			ctx := context.Background()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			times := cputime.NewOpTimes(1 << 16)
			b.ReportAllocs()
			for b.Loop() {
				t0 := times.Start()
				ms, err := m.Lookup(ctx, query)
				times.Stop(t0)
				if err != nil || len(ms) != n {
					b.Fatalf("lookup: %d matches, %v", len(ms), err)
				}
			}
			times.Report(b, "cpu-ns")
		})
	}
}

// TestMemoryLookupShared checks the heavy-sharing shape's answer: every
// instance matches the shared 64 blocks, instance 0 its whole chain, at
// sizes where the block map keeps holders inline, as lists and as sets.
func TestMemoryLookupShared(t *testing.T) {
	for _, n := range []int{1, 5, 40, 300} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			m, err := NewMemory(MemoryConfig{Model: testModel})
			if err != nil {
				t.Fatal(err)
			}
			want := map[string][4]int{"pod-0": all(sharedChain)}
			for i := 1; i < n; i++ {
				want[fmt.Sprintf("pod-%d", i)] = all(sharedBlocks)
			}
			checkLookup(t, m, query{fillShared(t, m, n), want}, "shared")
			checkMemory(t, m)
		})
	}
}
