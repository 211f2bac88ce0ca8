package kvindex

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// An instance's first alias (a second engine hash for a block it already
// holds under another) comes after it holds many blocks: from then on
// its entries are indexed by block node too, a table built at that moment
// from every live entry. Seen on the real binaries (kvbridge fed a batch
// of 2,000 one-block stores whose token blocks repeat): the table was
// made with 16 slots whatever the entries, the rebuild probed for a free
// slot forever once they were full, and the consumer's shard hung
// holding the index (admin calls on the pool hung with it).
func TestMemoryFirstAliasAfterManyBlocks(t *testing.T) {
	m, err := NewMemory(MemoryConfig{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	const n, bs = 100, 4
	block := func(i int) []uint32 {
		toks := make([]uint32, bs)
		for k := range toks {
			toks[k] = uint32(i*bs + k + 1)
		}
		return toks
	}
	var evs []events.Event
	for i := 0; i < n; i++ {
		evs = append(evs, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{uint64(1000 + i)}, TokenIDs: block(i), BlockSize: bs})
	}
	// Block 0's tokens again under a new engine hash: an alias.
	evs = append(evs, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{99999}, TokenIDs: block(0), BlockSize: bs})
	done := make(chan error, 1)
	go func() {
		_, err := m.Apply(context.Background(), "e0", evs[:n])
		if err == nil {
			_, err = m.Apply(context.Background(), "e0", evs[n:])
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("Apply of the first alias after %d blocks has not returned in 30s (a table rebuilt into too few slots probes forever)", n)
	}
	st, err := m.Instances(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != 1 || st[0].Blocks[tiers.GPU] != n+1 {
		t.Fatalf("instances %+v: want e0 with %d GPU blocks (the engine's: the alias is a block of its own)", st, n+1)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := memoryInvariantsLocked(m); err != nil {
		t.Fatal(err)
	}
}
