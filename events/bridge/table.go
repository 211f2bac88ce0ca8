package bridge

import (
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// block is one engine block the instance holds, with what a consumer needs
// to place it again from scratch: its parent, its tokens and the root
// inputs (LoRA adapter, cache salt) of its key chain.
type block struct {
	parent    uint64
	hasParent bool
	tokens    []uint32
	blockSize int
	loraName  string
	loraID    int64
	hasLoraID bool
	salt      string
	tiers     tiers.Set
	// stored is, per tier, when the block was last stored there (the
	// table's clock, unix nanoseconds): what aging reads (aging.go).
	stored [tiers.Count]int64
	// hash is the block's engine hash; prev and next link it in
	// Table.live (tiers != 0) or Table.ghosts (tiers 0).
	hash       uint64
	prev, next *block
	// children counts blocks in the table whose parent this is. A block
	// that leaves every tier while it has children stays as a ghost
	// (tiers 0): a snapshot must still be able to key its descendants,
	// which an index keyed while it was present keeps.
	children int
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
	max       int
	blocks    map[uint64]*block // held blocks and ghosts
	live      blockList         // held blocks, oldest (first stored) first
	ghosts    blockList         // ghosts, oldest first
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
	return &Table{max: max, blocks: make(map[uint64]*block)}
}

// Len is the number of blocks held (ghosts excluded).
func (t *Table) Len() int { return t.live.Len() }

// Ghosts is the number of ghosts: blocks no longer held that are kept
// because held blocks descend from them.
func (t *Table) Ghosts() int { return t.ghosts.Len() }

// BlockSize is the last block size seen in a store (0 before any).
func (t *Table) BlockSize() int { return t.blockSize }

// Clear drops every block and returns how many were held.
func (t *Table) Clear() int {
	n := t.Len()
	clear(t.blocks)
	t.live.Init()
	t.ghosts.Init()
	return n
}

// listOf is the list b sits in.
func (t *Table) listOf(b *block) *blockList {
	if b.tiers == 0 {
		return &t.ghosts
	}
	return &t.live
}

// blockList is a list of blocks linked through their prev and next: what
// container/list would be without the element and the boxed hash it
// allocated per block stored (two of a new block's four allocations).
type blockList struct {
	head, tail *block
	n          int
}

func (l *blockList) Len() int      { return l.n }
func (l *blockList) Front() *block { return l.head }

// Init empties the list (its blocks are being dropped).
func (l *blockList) Init() { *l = blockList{} }

func (l *blockList) PushBack(b *block) {
	b.prev, b.next = l.tail, nil
	if l.tail != nil {
		l.tail.next = b
	} else {
		l.head = b
	}
	l.tail = b
	l.n++
}

// Remove takes b, which is in l, out of it. A block already out of every
// list (no links, not a head) is left alone, as container/list's Remove
// leaves an element of no list; callers know which list a block is in
// (listOf), so a block in the other list is not asked for.
func (l *blockList) Remove(b *block) {
	if b.prev == nil && b.next == nil && l.head != b {
		return
	}
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		l.head = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		l.tail = b.prev
	}
	b.prev, b.next = nil, nil
	l.n--
}

// drop deletes a block and releases its parent: a ghost whose last child
// goes, goes too, and so on up the chain.
func (t *Table) drop(h uint64, b *block) {
	t.listOf(b).Remove(b)
	delete(t.blocks, h)
	t.release(b)
}

func (t *Table) release(b *block) {
	for b.hasParent {
		p := t.blocks[b.parent]
		if p == nil {
			return
		}
		p.children--
		if p.tiers != 0 || p.children > 0 {
			return
		}
		t.ghosts.Remove(p)
		delete(t.blocks, b.parent)
		b = p
	}
}

// unhold is called when b (held until now) has just left its last tier:
// it becomes a ghost if held blocks descend from it, else it goes. It
// returns the number of held blocks dropped by the ghost bound.
func (t *Table) unhold(h uint64, b *block) int {
	t.live.Remove(b)
	if b.children == 0 {
		delete(t.blocks, h)
		t.release(b)
		return 0
	}
	t.ghosts.PushBack(b)
	dropped := 0
	for t.max > 0 && t.ghosts.Len() > t.max {
		dropped += t.dropSubtree(t.ghosts.Front().hash)
	}
	return dropped
}

// dropSubtree drops the ghost root and every block descending from it,
// and returns how many held blocks went. It walks the whole table: it
// runs only past the ghost bound, which vLLM's eviction order keeps far.
//
// Each block has at most one parent, so "under root" follows one chain
// up; the walk is iterative, and each block it passes is marked "not
// under" until the chain's answer is known, so a parent cycle (an engine
// that names a block its own ancestor: a hash collision, or a broken
// engine) meets its own mark and ends instead of recursing forever.
func (t *Table) dropSubtree(root uint64) int {
	in := map[uint64]bool{root: true}
	var path []uint64
	under := func(h uint64) bool {
		path = path[:0]
		v, known := in[h]
		for !known {
			b := t.blocks[h]
			if b == nil || !b.hasParent {
				break // the chain ends without root
			}
			in[h] = false
			path = append(path, h)
			h = b.parent
			v, known = in[h]
		}
		for _, p := range path {
			in[p] = v
		}
		return v
	}
	held := 0
	rb := t.blocks[root]
	for h := range t.blocks {
		if h == root || !under(h) {
			continue
		}
		b := t.blocks[h]
		if b.tiers != 0 {
			held++
		}
		t.listOf(b).Remove(b)
		delete(t.blocks, h)
	}
	t.ghosts.Remove(rb)
	delete(t.blocks, root)
	t.release(rb)
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
				b := t.blocks[h]
				if b == nil || !b.tiers.Has(tier) {
					continue
				}
				b.tiers &^= tier.Bit()
				if b.tiers == 0 {
					r.Evicted += t.unhold(h, b)
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
		// The block's tokens, copied only when kept (a store of a block
		// held already keeps none).
		hasToks := bs > 0 && len(e.TokenIDs) >= (i+1)*bs
		toks := func() []uint32 { return append([]uint32(nil), e.TokenIDs[i*bs:(i+1)*bs]...) }
		b := t.blocks[h]
		switch {
		case b != nil:
			if !b.tiers.Has(tier) {
				r.Stored++
			}
			if b.tiers == 0 {
				// A ghost stored again: held, and the newest.
				t.ghosts.Remove(b)
				t.live.PushBack(b)
			}
			b.tiers |= tier.Bit()
			b.stored[tier] = now
			if b.tokens == nil && hasToks {
				t.fill(b, e, toks(), parent, hasParent, i == 0)
			}
		case !hasToks:
			// A tokenless (offload-tier) store of a block never seen
			// with tokens: nobody can place it in a key chain.
			r.Unplaced++
		default:
			b = &block{hash: h, tiers: tier.Bit()}
			b.stored[tier] = now
			t.fill(b, e, toks(), parent, hasParent, i == 0)
			t.live.PushBack(b)
			t.blocks[h] = b
			if hasParent {
				if p := t.blocks[parent]; p != nil {
					p.children++
				}
			}
			r.Stored++
		}
		parent, hasParent = h, true
	}
}

// bound drops the oldest held blocks while more are held than the engine
// can hold, and returns how many held blocks went.
func (t *Table) bound() int {
	n := 0
	for t.max > 0 && t.live.Len() > t.max {
		b := t.live.Front()
		b.tiers = 0
		n += 1 + t.unhold(b.hash, b)
	}
	return n
}

func (t *Table) fill(b *block, e *events.Event, toks []uint32, parent uint64, hasParent, first bool) {
	b.tokens, b.blockSize = toks, e.BlockSize
	b.parent, b.hasParent = parent, hasParent
	b.loraName, b.loraID, b.hasLoraID = e.LoraName, e.LoraID, e.HasLoraID
	if first && !hasParent {
		// vLLM puts the cache salt in the extra keys of a chain's first block.
		b.salt = e.CacheSalt
	}
}

// tierMedium is the medium string a snapshot writes for each tier.
var tierMedium = [tiers.Count]string{"GPU", "CPU", "DISK", "SHARED"}

// Events renders the table as events that rebuild it on an empty instance:
// BlockStored with tokens for every block, parents before children, runs of
// a chain merged into one event; then tokenless stores for each slower
// tier; then BlockRemoved from GPU for blocks no longer on GPU.
func (t *Table) Events() []events.Event {
	out := make([]events.Event, 0, 16)
	emitted := make(map[uint64]bool, len(t.blocks))
	var lastHash uint64
	var stack []uint64
	emit := func(h uint64, b *block) {
		emitted[h] = true
		if n := len(out); n > 0 {
			prev := &out[n-1]
			if b.hasParent && b.parent == lastHash && b.salt == "" && prev.BlockSize == b.blockSize &&
				prev.LoraName == b.loraName && prev.LoraID == b.loraID && prev.HasLoraID == b.hasLoraID {
				prev.BlockHashes = append(prev.BlockHashes, h)
				prev.TokenIDs = append(prev.TokenIDs, b.tokens...)
				lastHash = h
				return
			}
		}
		out = append(out, events.Event{
			Kind:        events.BlockStored,
			BlockHashes: []uint64{h},
			ParentHash:  b.parent,
			HasParent:   b.hasParent,
			TokenIDs:    append([]uint32(nil), b.tokens...),
			BlockSize:   b.blockSize,
			LoraName:    b.loraName,
			LoraID:      b.loraID,
			HasLoraID:   b.hasLoraID,
			Medium:      tierMedium[tiers.GPU],
			CacheSalt:   b.salt,
		})
		lastHash = h
	}
	for el := t.live.Front(); el != nil; el = el.next {
		h := el.hash
		if emitted[h] {
			continue
		}
		// Walk up to the oldest ancestor not yet emitted, then emit down.
		// A block is marked when the walk takes it, so a parent cycle (a
		// broken engine's) ends the walk where it closes.
		stack = stack[:0]
		for cur := h; ; {
			b := t.blocks[cur]
			if b == nil || emitted[cur] {
				break
			}
			stack = append(stack, cur)
			emitted[cur] = true
			if !b.hasParent {
				break
			}
			cur = b.parent
		}
		for i := len(stack) - 1; i >= 0; i-- {
			emit(stack[i], t.blocks[stack[i]])
		}
	}
	var notGPU []uint64
	for _, tier := range tiers.All[1:] {
		var hs []uint64
		for b := t.live.Front(); b != nil; b = b.next {
			if b.tiers.Has(tier) {
				hs = append(hs, b.hash)
			}
		}
		if len(hs) > 0 {
			out = append(out, events.Event{Kind: events.BlockStored, BlockHashes: hs, Medium: tierMedium[tier]})
		}
	}
	for _, l := range []*blockList{&t.live, &t.ghosts} {
		for b := l.Front(); b != nil; b = b.next {
			if emitted[b.hash] && !b.tiers.Has(tiers.GPU) {
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
	out := make(map[uint64]Placement, len(t.blocks))
	for h, b := range t.blocks {
		if b.tiers == 0 {
			continue // ghost
		}
		out[h] = Placement{Parent: b.parent, HasParent: b.hasParent, Tokens: len(b.tokens), Tiers: b.tiers}
	}
	return out
}
