package kvindex

import (
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

var (
	// ErrTokenCount: a stored event's token ids are not a whole number of
	// blocks, or not one block per block hash.
	ErrTokenCount = errors.New("kvindex: token count does not match block hashes")
	// ErrBlockSize: an event's block size contradicts the pool's, or a
	// stored event with tokens arrived before any block size was known.
	ErrBlockSize = errors.New("kvindex: block size unknown or inconsistent")
	// ErrEventKind: an event of a kind the index does not know.
	ErrEventKind = errors.New("kvindex: unknown event kind")
	// ErrConfig: a backend's configuration is invalid.
	ErrConfig = errors.New("kvindex: invalid config")
)

// instanceOps is what the event semantics need from a backend's state for
// one instance: the engine-hash → (key, tiers) map. Both backends implement
// it (memory directly, Redis as an overlay flushed in one pipeline), so the
// semantics live in one place: applyEvents.
type instanceOps interface {
	// keyOf returns the router key an engine hash is mapped to.
	keyOf(h uint64) (Key, bool)
	// store maps h to k and adds tier t; added is false when h was already
	// mapped to k in t. A mapping to another key is replaced.
	store(h uint64, k Key, t tiers.Tier) (added bool)
	// addTier adds tier t to an already mapped h.
	addTier(h uint64, t tiers.Tier) (mapped, added bool)
	// removeTier drops tier t from h, and the mapping once no tier is left.
	removeTier(h uint64, t tiers.Tier) (mapped, removed bool)
	// clearAll drops every block and mapping of the instance.
	clearAll()
}

// prefetcher is implemented by backend state that gains from knowing an
// event's blocks before the stores or removals, one by one, that apply
// them (the memory backend loads what they will touch together, so that
// the cache misses overlap instead of coming one block at a time).
type prefetcher interface {
	// prefetchHashes is called first for a stored event with tokens, with
	// its engine hashes, before its parent is looked up and its keys are
	// made: loads it starts then overlap with that work.
	prefetchHashes(hs []uint64)
	// prefetch is called before storing blocks with engine hashes hs and
	// router keys keys (one key per hash, or units of several: see units.go).
	prefetch(hs []uint64, keys []Key)
	// prefetchRemove is called before removing blocks with engine hashes hs.
	prefetchRemove(hs []uint64)
}

// blockSizer holds the pool's block size: configured, else learned from the
// first event that carries one.
type blockSizer struct {
	configured int
	learned    atomic.Int64
	// units is, per tier, the largest engine block seen in it, in pool
	// blocks (see units.go); 0 or 1: blocks are the pool's.
	units [tiers.Count]atomic.Int64
	// group is 1 + the full-attention KV-cache group whose stores are
	// applied (the lowest seen); 0 before any.
	group atomic.Int64
}

// primary reports whether stores of full-attention group g are applied:
// g is the lowest full-attention group seen so far.
func (b *blockSizer) primary(g int) bool {
	for {
		cur := b.group.Load()
		if cur != 0 && int(cur-1) <= g {
			return int(cur-1) == g
		}
		if b.group.CompareAndSwap(cur, int64(g)+1) {
			return true
		}
	}
}

func (b *blockSizer) get() int {
	if b.configured > 0 {
		return b.configured
	}
	return int(b.learned.Load())
}

// learn takes the block size from the first of evs that carries a valid
// one, when none is configured or learned yet: a shared index learns it
// from the messages another router applied, too.
func (b *blockSizer) learn(evs []events.Event) {
	if b.get() != 0 {
		return
	}
	for i := range evs {
		if evs[i].BlockSize > 0 && !skipEvent(&evs[i]) {
			b.learned.CompareAndSwap(0, int64(evs[i].BlockSize))
			return
		}
	}
}

// resolve returns the block size to key an event with; evBS is the event's
// own block_size (0 when absent).
func (b *blockSizer) resolve(evBS int) (int, error) {
	cur := b.get()
	switch {
	case evBS < 0:
		return 0, fmt.Errorf("%w: event block size %d", ErrBlockSize, evBS)
	case evBS == 0 && cur == 0:
		return 0, fmt.Errorf("%w: no block size configured and none learned yet", ErrBlockSize)
	case evBS == 0:
		return cur, nil
	case cur == 0:
		if b.learned.CompareAndSwap(0, int64(evBS)) {
			return evBS, nil
		}
		return b.resolve(evBS) // another instance's event taught it first
	case evBS != cur && evBS%cur == 0:
		return cur, nil // engine blocks of several pool blocks (units.go)
	case evBS != cur:
		return 0, fmt.Errorf("%w: event block size %d, pool block size %d", ErrBlockSize, evBS, cur)
	}
	return cur, nil
}

// skipEvent reports whether an event belongs to a KV-cache group the index
// does not track: only full-attention groups map prompts to blocks the way
// block keys do (events.Event.FullAttention); sliding-window groups hold
// only a window's tail, mamba groups one state per chunk.
func skipEvent(ev *events.Event) bool { return !ev.FullAttention() }

// mediumTier is tiers.FromMedium with the medium vLLM sends on every GPU
// event ("GPU", or none) answered first: FromMedium upper-cases the name
// before its switch, a cost paid per event.
func mediumTier(medium string) (tiers.Tier, bool) {
	if medium == "GPU" || medium == "" {
		return tiers.GPU, true
	}
	return tiers.FromMedium(medium)
}

// rootFor is the root of a chain that starts at block 0 in an event: the
// adapter from the event when it has one, else the pool's model.
func rootFor(model string, ev *events.Event) Key {
	adapter := ev.LoraName
	if adapter == "" && ev.HasLoraID && ev.LoraID != 0 {
		// An adapter known only by its engine id cannot be matched by name
		// from the request side, but must not alias the base model either.
		adapter = "lora-id:" + strconv.FormatInt(ev.LoraID, 10)
	}
	return Root(model, adapter, ev.CacheSalt)
}

// applyEvents applies one instance's events, in order, to st. scratch is a
// reusable key buffer; the grown buffer is returned.
func applyEvents(st instanceOps, model string, bs *blockSizer, evs []events.Event, res *ApplyResult, scratch []Key) []Key {
	invalid := func(i int, err error) {
		res.Invalid++
		if res.InvalidErr == nil {
			res.InvalidErr = fmt.Errorf("event %d: %w", i, err)
		}
	}
	pf, _ := st.(prefetcher)
	for i := range evs {
		ev := &evs[i]
		switch ev.Kind {
		case events.AllBlocksCleared:
			st.clearAll()
			res.Cleared++
			continue
		case events.BlockStored, events.BlockRemoved:
		default:
			invalid(i, fmt.Errorf("%w: %d", ErrEventKind, ev.Kind))
			continue
		}
		if skipEvent(ev) {
			res.Skipped += len(ev.BlockHashes)
			continue
		}
		if ev.Kind == events.BlockStored && !bs.primary(ev.GroupIdx) {
			// A prefix is reusable only while every full-attention group
			// holds it. Stores are taken from one of them (the lowest
			// group seen); removals from any (vLLM hashes blocks alike in
			// every group), so a block one group dropped is dropped here
			// too. Under-claiming is the safe side.
			res.Skipped += len(ev.BlockHashes)
			continue
		}
		tier, known := mediumTier(ev.Medium)
		if !known {
			res.UnknownMedium += len(ev.BlockHashes)
		}
		if ev.Kind == events.BlockRemoved {
			removeBlocks(st, pf, bs, ev, tier, res)
			continue
		}
		if len(ev.TokenIDs) == 0 {
			// Tokenless stores (CPU offload, or engines that omit tokens)
			// can only be placed through the engine-hash map
			// (llm-d/llm-d-router#878: they must still be indexed).
			k := max(1, unitOf(ev, bs.get()))
			if k > 1 {
				bs.learnUnit(tier, k)
			}
			for _, h := range ev.BlockHashes {
				mapped, added := st.addTier(h, tier)
				if !mapped {
					res.Unmapped++
					continue
				}
				if added {
					res.Stored++
				}
				for i := 0; i < k-1; i++ {
					st.addTier(unitHash(h, i), tier)
				}
			}
			continue
		}
		size, err := bs.resolve(ev.BlockSize)
		if err != nil {
			invalid(i, err)
			continue
		}
		k := max(1, unitOf(ev, size))
		if len(ev.TokenIDs)%size != 0 || len(ev.TokenIDs)/size != k*len(ev.BlockHashes) {
			sentinel := ErrTokenCount
			if k > 1 {
				// Tokens that do not make whole engine blocks of a size other
				// than the pool's: the size, not the count, is what is off.
				sentinel = ErrBlockSize
			}
			invalid(i, fmt.Errorf("%w: %d tokens, block size %d (pool %d), %d block hashes",
				sentinel, len(ev.TokenIDs), ev.BlockSize, size, len(ev.BlockHashes)))
			continue
		}
		if k > 1 {
			bs.learnUnit(tier, k)
		}
		if pf != nil {
			pf.prefetchHashes(ev.BlockHashes)
		}
		var parent Key
		if ev.HasParent {
			k, ok := st.keyOf(ev.ParentHash)
			if !ok {
				// Without the parent's key the chain cannot be keyed: the
				// whole event is dropped (its blocks would be unreachable).
				res.Orphans += len(ev.BlockHashes)
				continue
			}
			parent = k
		} else {
			parent = rootFor(model, ev) // hashes the model name: only for a chain's first event
		}
		scratch = AppendKeys(scratch[:0], parent, ev.TokenIDs, size)
		if pf != nil {
			pf.prefetch(ev.BlockHashes, scratch)
		}
		// Last block first, so that within an event the chain's head ends
		// up most recent: LRU eviction then trims chains from their ends,
		// as the engine does, instead of cutting off their first blocks
		// (which would make the rest unreachable).
		for j := len(ev.BlockHashes) - 1; j >= 0; j-- {
			h := ev.BlockHashes[j]
			for i := k - 2; i >= 0; i-- {
				st.store(unitHash(h, i), scratch[j*k+i], tier)
			}
			if st.store(h, scratch[j*k+k-1], tier) {
				res.Stored++
			}
		}
	}
	return scratch
}

// removeBlocks drops ev's blocks from tier t, with the interior blocks of
// units larger than the pool's (units.go).
func removeBlocks(st instanceOps, pf prefetcher, bs *blockSizer, ev *events.Event, t tiers.Tier, res *ApplyResult) {
	k := max(bs.unit(t), unitOf(ev, bs.get()))
	if pf != nil {
		pf.prefetchRemove(ev.BlockHashes)
	}
	for _, h := range ev.BlockHashes {
		_, removed := st.removeTier(h, t)
		if removed {
			res.Removed++
		} else {
			// Unmapped also covers a tier the block was not held in
			// (mapped but not removed): the index had nothing to drop.
			res.Unmapped++
		}
		for i := 0; i < k-1; i++ {
			st.removeTier(unitHash(h, i), t)
		}
	}
}
