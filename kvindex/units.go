package kvindex

import (
	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// Engine blocks larger than the pool's block size.
//
// An offload tier may hold KV in units larger than the GPU's blocks: LMCache
// stores 256-token chunks, vLLM's OffloadingConnector groups blocks_per_chunk
// GPU blocks, a hybrid model's full-attention group may use 256-token blocks
// over a 16-token pool. Such an event (block_size = k × the pool's block
// size) is keyed as k router blocks per engine block; the engine hash is
// mapped to the last of them and each interior one to a derived hash
// (unitHash), so that removing or re-tiering the engine block moves all k.
//
// The engine can load such a unit only whole. A request that matches part
// of one must not be credited with it (llm-d/llm-d-router#2889: one 64-token
// CPU block scored as four 16-token hits), so each tier remembers the
// largest unit it has been stored in (blocks per unit), and Lookup cuts each
// tier's reach down to a unit boundary (roundUnits). Units are aligned to
// block 0, as both LMCache's chunks and vLLM's offload groups are.

// unitHash derives the engine-hash stand-in of interior block i (0-based,
// i < k-1) of the unit whose engine hash is h. A collision with a real
// engine hash would need a 64-bit coincidence.
func unitHash(h uint64, i int) uint64 {
	var b [16]byte
	for j := 0; j < 8; j++ {
		b[j] = byte(h >> (8 * j))
	}
	b[8] = byte(i)
	b[9] = byte(i >> 8)
	b[10] = byte(i >> 16)
	b[11] = 0xb7 // domain separation from any key hashing
	return xxhash.Sum64(b[:12])
}

// unit returns the learned unit (in pool blocks) of tier t, at least 1.
func (b *blockSizer) unit(t tiers.Tier) int {
	if int(t) >= tiers.Count {
		return 1
	}
	if u := int(b.units[t].Load()); u > 1 {
		return u
	}
	return 1
}

// learnUnit records that tier t held units of k pool blocks.
func (b *blockSizer) learnUnit(t tiers.Tier, k int) {
	if int(t) >= tiers.Count || k <= 1 {
		return
	}
	for {
		cur := b.units[t].Load()
		if int64(k) <= cur || b.units[t].CompareAndSwap(cur, int64(k)) {
			return
		}
	}
}

// roundUnits cuts every tier's reach down to a whole unit of that tier,
// never below the reach of the faster tiers (their blocks are usable as
// they are), and no slower tier past a cut. Matches left with nothing are
// dropped.
func (b *blockSizer) roundUnits(ms []Match) []Match {
	var units [tiers.Count]int
	any := false
	for t := range units {
		units[t] = b.unit(tiers.Tier(t))
		any = any || units[t] > 1
	}
	if !any {
		return ms
	}
	out := ms[:0]
	for _, m := range ms {
		floor, limit := 0, -1
		for t := range m.Blocks {
			n := m.Blocks[t]
			if u := units[t]; u > 1 {
				n = max(n/u*u, floor)
				if n < m.Blocks[t] {
					// Blocks past the cut are held here but not loadable from
					// here; whether a slower tier also holds them is not
					// known, so no slower tier reaches past the cut either.
					limit = n
				}
			}
			if limit >= 0 {
				n = min(n, limit)
			}
			m.Blocks[t], floor = n, n
		}
		if m.Blocks[tiers.Count-1] > 0 {
			out = append(out, m)
		}
	}
	return out
}

// unitOf is the number of pool blocks in one engine block of ev, when ev's
// blocks are larger than the pool's (0 otherwise).
func unitOf(ev *events.Event, size int) int {
	if size <= 0 || ev.BlockSize <= size || ev.BlockSize%size != 0 {
		return 0
	}
	return ev.BlockSize / size
}
