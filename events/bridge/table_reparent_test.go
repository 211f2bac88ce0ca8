package bridge

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
)

// reparentBlocks are 16-token blocks a, b, c of one prompt (tokens 100a+j).
func reparentTokens(blocks ...int) []uint32 {
	var out []uint32
	for _, b := range blocks {
		for j := range 16 {
			out = append(out, uint32(100*b+j))
		}
	}
	return out
}

// TestTableSnapshotFollowsReparentedStore: a block stored again under another
// parent is keyed by the index under that parent (kvindex re-keys the hash),
// so the table must record that parent too, or a router that rebuilds from
// the bridge's snapshot (a restart, a new replica, a wiped stream) holds
// chains the live routers do not. llm-d-inference-sim (eec055a,
// pkg/kv-cache/block_cache.go startRequest) sends such stores: it evicts one
// request's blocks in Go map order, so a prompt's last block can outlive its
// first two, and the store that brings those back names the request's last
// cached block (the third) as their parent. Found live (docs/BENCHMARKS.md §3,
// Session 36): after a router restart, 42 of 64 indexed blocks of one sim
// were stale.
func TestTableSnapshotFollowsReparentedStore(t *testing.T) {
	ctx := context.Background()
	gpu := "GPU"
	batches := [][]events.Event{
		{{Kind: events.BlockStored, BlockHashes: []uint64{11, 12, 13}, TokenIDs: reparentTokens(1, 2, 3), BlockSize: 16, Medium: gpu}},
		// Map order: the first two go, the third stays (its parent a ghost).
		{{Kind: events.BlockRemoved, BlockHashes: []uint64{11}, Medium: gpu}, {Kind: events.BlockRemoved, BlockHashes: []uint64{12}, Medium: gpu}},
		// The prompt again: blocks 1 and 2 are new, 3 is cached, and the
		// sim names 3 as their parent.
		{{Kind: events.BlockStored, BlockHashes: []uint64{11, 12}, ParentHash: 13, HasParent: true, TokenIDs: reparentTokens(1, 2), BlockSize: 16, Medium: gpu}},
		// A later prompt through the re-stored blocks, as the sim sends it.
		{{Kind: events.BlockStored, BlockHashes: []uint64{14}, ParentHash: 12, HasParent: true, TokenIDs: reparentTokens(4), BlockSize: 16, Medium: gpu}},
	}
	live, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m", BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	tab := NewTable(0)
	for _, b := range batches {
		if _, err := live.Apply(ctx, "e", b); err != nil {
			t.Fatal(err)
		}
		tab.Apply(b)
	}
	rebuilt, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m", BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rebuilt.Apply(ctx, "e", tab.Events()); err != nil {
		t.Fatal(err)
	}
	root := kvindex.Root("m", "", "")
	for _, chain := range [][]int{{1, 2, 3}, {1, 2, 3, 4}, {3, 1, 2}, {3, 1, 2, 4}, {1, 2, 4}} {
		keys := kvindex.AppendKeys(nil, root, reparentTokens(chain...), 16)
		a, err := live.Lookup(ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		b, err := rebuilt.Lookup(ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Errorf("prompt of blocks %v: live index %v, index rebuilt from the snapshot %v", chain, a, b)
		}
	}
	// The counts may differ: the live index still holds blocks no prompt
	// reaches (stored under a parent chain that does not lead to them from
	// a root); a cycle of parents, as here, leaves them out of a rebuilt
	// one. What routing reads, the lookups, is the same.
}
