package bridge

import (
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// block is one engine block the instance holds, with what a consumer needs
// to place it again from scratch: its parent, its tokens and the root
// inputs (LoRA adapter, cache salt) of its key chain.
//
// Blocks live by value in the table's slots (slots.go) and hold no
// pointer: their tokens are a tokRef into the table's token chunks, their
// rare strings (a LoRA name, a cache salt) sit in Table.names, and their
// links are slot numbers. A new block therefore costs no allocation once
// the table has held as many blocks before, and the garbage collector
// never walks the blocks (a table at the default bound holds a million).
type block struct {
	// hash is the block's engine hash.
	hash      uint64
	parent    uint64
	loraID    int64
	blockSize int
	// stored is, per tier, when the block was last stored there (the
	// table's clock, unix nanoseconds): what aging reads (aging.go).
	stored [tiers.Count]int64
	tok    tokRef
	// prev and next link the block in Table.live (tiers != 0) or
	// Table.ghosts (tiers 0); a free slot's next is the next free one.
	prev, next slot
	// children counts blocks in the table whose parent this is. A block
	// that leaves every tier while it has children stays as a ghost
	// (tiers 0): a snapshot must still be able to key its descendants,
	// which an index keyed while it was present keeps.
	children  int32
	tiers     tiers.Set
	hasParent bool
	hasLoraID bool
	// named: the block has a LoRA name or a cache salt in Table.names.
	named bool
}

// blockNames are a block's strings, kept beside the table's slots (most
// blocks have neither, and a block with no pointer is one the garbage
// collector skips).
type blockNames struct {
	lora, salt string
}

// Removal is one tier's blocks removed by an event, for eviction records.
// Hashes may be the event's own BlockHashes (a prefix, its capacity its
// length, so appending to it copies): read it while the event is kept.
type Removal struct {
	Tier   tiers.Tier
	Hashes []uint64
}

// TableResult counts what Apply did.
type TableResult struct {
	Stored   int       // (block, tier) placements added
	Removed  []Removal // per event, blocks actually removed from a tier
	Cleared  int       // blocks dropped by AllBlocksCleared
	Skipped  int       // events of non-full-attention groups
	Unplaced int       // tokenless stores of blocks never stored with tokens
	Evicted  int       // held blocks dropped because the table was full
	Unknown  int       // media not in tiers.FromMedium's table (mapped, counted)
}

// Table is the live block table of one instance: engine hash → block.
//
// It is bounded by a maximum number of held blocks, the engine's cache size
// (GPU plus offload tiers), which the engine itself never exceeds: while
// the bridge sees every event the bound is never reached, and only a
// mis-set bound (or lost removals) makes the oldest held block go. Ghosts
// do not count against that bound, because the engine does not hold them:
// counting them (as an earlier version did) dropped held blocks, and
// ghosts with held children, from a table sized exactly to the engine.
// Ghosts have their own bound of the same size: every ghost is the
// ancestor of a held block, and vLLM frees a request's blocks tail first
// so that parents outlive children, so a ghost is the exception; past the
// bound the oldest ghost goes with its descendants (none of which a
// snapshot could key without it). Not safe for concurrent use; the bridge
// guards it.
type Table struct {
	max    int
	index  map[uint64]slot // held blocks and ghosts, by engine hash
	live   blockList       // held blocks, oldest (first stored) first
	ghosts blockList       // ghosts, oldest first
	// The blocks' storage (slots.go): pages of slots, the first free slot
	// (linked through next), the slots ever used, the token chunks and
	// the strings of the blocks that have any.
	pages     [][]block
	free      slot
	used      int
	chunks    [][]uint32
	names     map[slot]blockNames
	blockSize int
	// now is the clock of the stored stamps (nil: the wall clock).
	now func() int64
	// group is 1 + the full-attention KV-cache group whose stores count
	// (the lowest seen); 0 before any.
	group int
}

// primaryGroup reports whether stores of full-attention group g count: g
// is the lowest full-attention group seen so far.
func (t *Table) primaryGroup(g int) bool {
	if t.group == 0 || g < t.group-1 {
		t.group = g + 1
	}
	return g == t.group-1
}

// NewTable returns an empty table holding at most max blocks (0: no bound).
func NewTable(max int) *Table {
	return &Table{max: max, index: make(map[uint64]slot), names: make(map[slot]blockNames)}
}

// Len is the number of blocks held (ghosts excluded).
func (t *Table) Len() int { return t.live.Len() }

// Ghosts is the number of ghosts: blocks no longer held that are kept
// because held blocks descend from them.
func (t *Table) Ghosts() int { return t.ghosts.Len() }

// BlockSize is the last block size seen in a store (0 before any).
func (t *Table) BlockSize() int { return t.blockSize }

// Clear drops every block and returns how many were held. The slots and
// their token room stay, for the blocks stored next.
func (t *Table) Clear() int {
	n := t.Len()
	clear(t.index)
	clear(t.names)
	t.live, t.ghosts = blockList{}, blockList{}
	t.free, t.used = 0, min(t.used, 1)
	return n
}

// listOf is the list b sits in.
func (t *Table) listOf(b *block) *blockList {
	if b.tiers == 0 {
		return &t.ghosts
	}
	return &t.live
}

// lookup is the slot of the block with engine hash h (0: none).
func (t *Table) lookup(h uint64) slot { return t.index[h] }

// drop deletes the block in s and releases its parent: a ghost whose last
// child goes, goes too, and so on up the chain.
func (t *Table) drop(s slot) {
	b := t.at(s)
	t.unlink(t.listOf(b), s)
	delete(t.index, b.hash)
	t.release(s)
}

// release frees the slot of a block that has left the index and its list,
// and releases its parent as drop does.
func (t *Table) release(s slot) {
	for s != 0 {
		b := t.at(s)
		parent, hasParent := b.parent, b.hasParent
		t.freeSlot(s)
		if !hasParent {
			return
		}
		s = t.unchild(parent)
	}
}

// unchild counts one child fewer for the block with hash parent. A ghost
// left with none leaves the index and the ghost list: its slot is returned
// for release (0: none, or still needed).
func (t *Table) unchild(parent uint64) slot {
	ps := t.lookup(parent)
	if ps == 0 {
		return 0
	}
	p := t.at(ps)
	p.children--
	if p.tiers != 0 || p.children > 0 {
		return 0
	}
	t.unlink(&t.ghosts, ps)
	delete(t.index, parent)
	return ps
}

// unhold is called when the block in s (held until now) has just left its
// last tier: it becomes a ghost if held blocks descend from it, else it
// goes. It returns the number of held blocks dropped by the ghost bound.
func (t *Table) unhold(s slot) int {
	t.unlink(&t.live, s)
	b := t.at(s)
	if b.children == 0 {
		delete(t.index, b.hash)
		t.release(s)
		return 0
	}
	t.pushBack(&t.ghosts, s)
	dropped := 0
	for t.max > 0 && t.ghosts.Len() > t.max {
		dropped += t.dropSubtree(t.ghosts.head)
	}
	return dropped
}

// dropSubtree drops the ghost in root and every block descending from it,
// and returns how many held blocks went. It walks the whole table: it
// runs only past the ghost bound, which vLLM's eviction order keeps far.
//
// Each block has at most one parent, so "under root" follows one chain
// up; the walk is iterative, and each block it passes is marked "not
// under" until the chain's answer is known, so a parent cycle (an engine
// that names a block its own ancestor: a hash collision, or a broken
// engine) meets its own mark and ends instead of recursing forever.
func (t *Table) dropSubtree(root slot) int {
	rootHash := t.at(root).hash
	in := map[uint64]bool{rootHash: true}
	var path []uint64
	under := func(h uint64) bool {
		path = path[:0]
		v, known := in[h]
		for !known {
			s := t.lookup(h)
			if s == 0 || !t.at(s).hasParent {
				break // the chain ends without root
			}
			in[h] = false
			path = append(path, h)
			h = t.at(s).parent
			v, known = in[h]
		}
		for _, p := range path {
			in[p] = v
		}
		return v
	}
	held := 0
	for h, s := range t.index {
		if h == rootHash || !under(h) {
			continue
		}
		b := t.at(s)
		if b.tiers != 0 {
			held++
		}
		t.unlink(t.listOf(b), s)
		delete(t.index, h)
		// Its parent is under root too, and goes: no release.
		t.freeSlot(s)
	}
	t.unlink(&t.ghosts, root)
	delete(t.index, rootHash)
	t.release(root)
	return held
}

// Apply folds one batch's events into the table, in order, then applies
// the bound.
func (t *Table) Apply(evs []events.Event) TableResult {
	var r TableResult
	for i := range evs {
		e := &evs[i]
		if !e.FullAttention() || e.Kind == events.BlockStored && !t.primaryGroup(e.GroupIdx) {
			// Stores come from one full-attention group, removals from
			// all, as the index applies them (kvindex, docs/engines.md).
			r.Skipped++
			continue
		}
		switch e.Kind {
		case events.AllBlocksCleared:
			r.Cleared += t.Clear()
		case events.BlockStored:
			t.store(e, &r)
		case events.BlockRemoved:
			tier, ok := tiers.FromMedium(e.Medium)
			if !ok {
				r.Unknown++
			}
			rm := Removal{Tier: tier}
			// While every hash so far was removed, the removed ones are
			// e.BlockHashes[:lead] and need no copy (the usual case: the
			// engine removes what it had stored).
			lead := 0
			for j, h := range e.BlockHashes {
				s := t.lookup(h)
				if s == 0 {
					continue
				}
				b := t.at(s)
				if !b.tiers.Has(tier) {
					continue
				}
				b.tiers &^= tier.Bit()
				if b.tiers == 0 {
					r.Evicted += t.unhold(s)
				}
				switch {
				case rm.Hashes != nil:
					rm.Hashes = append(rm.Hashes, h)
				case lead == j:
					lead++
				default:
					rm.Hashes = append(make([]uint64, 0, len(e.BlockHashes)-j+lead), e.BlockHashes[:lead]...)
					rm.Hashes = append(rm.Hashes, h)
				}
			}
			if rm.Hashes == nil && lead > 0 {
				rm.Hashes = e.BlockHashes[:lead:lead]
			}
			if len(rm.Hashes) > 0 {
				r.Removed = append(r.Removed, rm)
			}
		}
	}
	// The bound applies to the state after the batch: within one, a
	// snapshot stores ghosts before removing them, and an engine may
	// store before it removes.
	r.Evicted += t.bound()
	return r
}

func (t *Table) store(e *events.Event, r *TableResult) {
	tier, ok := tiers.FromMedium(e.Medium)
	if !ok {
		r.Unknown++
	}
	bs := e.BlockSize
	if bs > 0 {
		t.blockSize = bs
	}
	parent, hasParent := e.ParentHash, e.HasParent
	now := t.clock() // one event's blocks are stored at one instant
	for i, h := range e.BlockHashes {
		// The block's tokens (copied into the table only when kept: a
		// store of a block held already keeps none).
		hasToks := bs > 0 && len(e.TokenIDs) >= (i+1)*bs
		s := t.lookup(h)
		switch {
		case s != 0:
			b := t.at(s)
			if !b.tiers.Has(tier) {
				r.Stored++
			}
			if b.tiers == 0 {
				// A ghost stored again: held, and the newest.
				t.unlink(&t.ghosts, s)
				t.pushBack(&t.live, s)
			}
			b.tiers |= tier.Bit()
			b.stored[tier] = now
			if b.tok.n == 0 && hasToks {
				t.fill(s, e, e.TokenIDs[i*bs:(i+1)*bs], parent, hasParent, i == 0)
			} else if hasToks && (b.hasParent != hasParent || hasParent && b.parent != parent) {
				t.reparent(s, parent, hasParent)
			}
		case !hasToks:
			// A tokenless (offload-tier) store of a block never seen
			// with tokens: nobody can place it in a key chain.
			r.Unplaced++
		default:
			s = t.newSlot()
			b := t.at(s)
			b.hash, b.tiers = h, tier.Bit()
			b.stored[tier] = now
			t.fill(s, e, e.TokenIDs[i*bs:(i+1)*bs], parent, hasParent, i == 0)
			t.pushBack(&t.live, s)
			t.index[h] = s
			if hasParent {
				if ps := t.lookup(parent); ps != 0 {
					t.at(ps).children++
				}
			}
			r.Stored++
		}
		parent, hasParent = h, true
	}
}

// reparent records parent as the block in s's parent: the engine stored it
// again under another one, and the index keys a stored hash by the event's
// parent (kvindex re-keys it), so a snapshot must name the same parent or a
// router rebuilt from it holds chains the others do not. vLLM cannot do
// this (a block's hash covers its parent's); llm-d-inference-sim does
// (eec055a, pkg/kv-cache/block_cache.go startRequest: a store's parent is
// the request's last cached block, which after its map-order eviction can
// follow the stored ones). The old parent is released as drop releases it;
// a block named as its own parent keeps the one it has.
func (t *Table) reparent(s slot, parent uint64, hasParent bool) {
	b := t.at(s)
	if hasParent && parent == b.hash {
		return
	}
	if hasParent {
		if ps := t.lookup(parent); ps != 0 {
			t.at(ps).children++ // first: the old parent's release may reach it
		}
	}
	old, hadParent := b.parent, b.hasParent
	b.parent, b.hasParent = parent, hasParent
	if hadParent {
		t.release(t.unchild(old))
	}
}

// bound drops the oldest held blocks while more are held than the engine
// can hold, and returns how many held blocks went.
func (t *Table) bound() int {
	n := 0
	for t.max > 0 && t.live.Len() > t.max {
		s := t.live.head
		t.at(s).tiers = 0
		n += 1 + t.unhold(s)
	}
	return n
}

func (t *Table) fill(s slot, e *events.Event, toks []uint32, parent uint64, hasParent, first bool) {
	b := t.at(s)
	t.setTokens(b, toks)
	b.blockSize = e.BlockSize
	b.parent, b.hasParent = parent, hasParent
	b.loraID, b.hasLoraID = e.LoraID, e.HasLoraID
	n := blockNames{lora: e.LoraName}
	if first && !hasParent {
		// vLLM puts the cache salt in the extra keys of a chain's first block.
		n.salt = e.CacheSalt
	}
	if b.named = n != (blockNames{}); b.named {
		t.names[s] = n
	} else {
		delete(t.names, s) // a block filled again (a ghost's tokens)
	}
}

// namesOf are the strings of the block in s.
func (t *Table) namesOf(s slot) blockNames {
	if !t.at(s).named {
		return blockNames{}
	}
	return t.names[s]
}

// tierMedium is the medium string a snapshot writes for each tier.
var tierMedium = [tiers.Count]string{"GPU", "CPU", "DISK", "SHARED"}

// Events renders the table as events that rebuild it on an empty instance:
// BlockStored with tokens for every block, parents before children, runs of
// a chain merged into one event; then tokenless stores for each slower
// tier; then BlockRemoved from GPU for blocks no longer on GPU.
func (t *Table) Events() []events.Event {
	out := make([]events.Event, 0, 16)
	emitted := make(map[uint64]bool, len(t.index))
	var lastHash uint64
	var stack []slot
	emit := func(s slot) {
		b := t.at(s)
		h, nm := b.hash, t.namesOf(s)
		if n := len(out); n > 0 {
			prev := &out[n-1]
			if b.hasParent && b.parent == lastHash && nm.salt == "" && prev.BlockSize == b.blockSize &&
				prev.LoraName == nm.lora && prev.LoraID == b.loraID && prev.HasLoraID == b.hasLoraID {
				prev.BlockHashes = append(prev.BlockHashes, h)
				prev.TokenIDs = append(prev.TokenIDs, t.tokens(b)...)
				lastHash = h
				return
			}
		}
		out = append(out, events.Event{
			Kind:        events.BlockStored,
			BlockHashes: []uint64{h},
			ParentHash:  b.parent,
			HasParent:   b.hasParent,
			TokenIDs:    append([]uint32(nil), t.tokens(b)...),
			BlockSize:   b.blockSize,
			LoraName:    nm.lora,
			LoraID:      b.loraID,
			HasLoraID:   b.hasLoraID,
			Medium:      tierMedium[tiers.GPU],
			CacheSalt:   nm.salt,
		})
		lastHash = h
	}
	for el := t.live.head; el != 0; el = t.at(el).next {
		if emitted[t.at(el).hash] {
			continue
		}
		// Walk up to the oldest ancestor not yet emitted, then emit down.
		// A block is marked when the walk takes it, so a parent cycle (a
		// broken engine's) ends the walk where it closes.
		stack = stack[:0]
		for cur := t.at(el).hash; ; {
			s := t.lookup(cur)
			if s == 0 || emitted[cur] {
				break
			}
			stack = append(stack, s)
			emitted[cur] = true
			b := t.at(s)
			if !b.hasParent {
				break
			}
			cur = b.parent
		}
		for i := len(stack) - 1; i >= 0; i-- {
			emit(stack[i])
		}
	}
	var notGPU []uint64
	for _, tier := range tiers.All[1:] {
		var hs []uint64
		for s := t.live.head; s != 0; s = t.at(s).next {
			if b := t.at(s); b.tiers.Has(tier) {
				hs = append(hs, b.hash)
			}
		}
		if len(hs) > 0 {
			out = append(out, events.Event{Kind: events.BlockStored, BlockHashes: hs, Medium: tierMedium[tier]})
		}
	}
	for _, l := range []*blockList{&t.live, &t.ghosts} {
		for s := l.head; s != 0; s = t.at(s).next {
			if b := t.at(s); emitted[b.hash] && !b.tiers.Has(tiers.GPU) {
				notGPU = append(notGPU, b.hash)
			}
		}
	}
	if len(notGPU) > 0 {
		out = append(out, events.Event{Kind: events.BlockRemoved, BlockHashes: notGPU, Medium: tierMedium[tiers.GPU]})
	}
	return out
}

// Placement is one block's state, for tests and debugging.
type Placement struct {
	Parent    uint64
	HasParent bool
	Tokens    int
	Tiers     tiers.Set
}

// Dump returns every block's placement.
func (t *Table) Dump() map[uint64]Placement {
	out := make(map[uint64]Placement, len(t.index))
	for h, s := range t.index {
		b := t.at(s)
		if b.tiers == 0 {
			continue // ghost
		}
		out[h] = Placement{Parent: b.parent, HasParent: b.hasParent, Tokens: int(b.tok.n), Tiers: b.tiers}
	}
	return out
}
