package bridge

// The block table's storage: blocks by value in pages of slots, a free list
// of the slots removed blocks left, the tokens in shared chunks, and the
// live and ghost lists linked through slot numbers. Before, each new block
// was two allocations (the block and its tokens) and a map entry holding a
// pointer: about a fifth of the bridge's CPU on captured vLLM batches
// (docs/BENCHMARKS.md, "Session 16"), and every block a pointer for the
// garbage collector to follow.
//
// A slot is taken from the free list first, else the next never-used one;
// a slot keeps its token room when its block goes, so a block stored into
// a reused slot (after a removal, a bound's eviction or a clear) copies its
// tokens into that room and allocates nothing. The table's memory is thus
// that of the most blocks and ghosts it has held at once — what an engine
// of that size keeps it at anyway, and at most twice its bound (held
// blocks, ghosts) plus one batch's stores.

// slot numbers a block's place in the table; 0 is no block (the zero link).
type slot int32

// slotPageBits sizes a page of slots: 1,024 blocks (about 140 KiB), so
// that a table grows a page at a time without copying what it holds.
const slotPageBits = 10

// tokenChunk is the size of a chunk tokens are carved from: 64 Ki tokens
// (256 KiB), 4,096 blocks of vLLM's default 16 tokens; a block larger than
// a chunk gets one of its own.
const tokenChunk = 1 << 16

// tokRef is where a block's tokens are: n tokens at off in chunk c, in room
// for room (what the slot keeps when its block goes).
type tokRef struct {
	c, off, n, room uint32
}

// at is the block in slot s (s from a slot the table handed out).
func (t *Table) at(s slot) *block {
	return &t.pages[s>>slotPageBits][s&(1<<slotPageBits-1)]
}

// newSlot returns an empty slot for a block: a freed one, else the next
// never used. The slot's token room is kept for the block's tokens.
func (t *Table) newSlot() slot {
	s := t.free
	if s != 0 {
		t.free = t.at(s).next
	} else {
		if t.used == 0 {
			t.used = 1 // slot 0 is no block
		}
		s = slot(t.used)
		t.used++
		if int(s>>slotPageBits) == len(t.pages) {
			t.pages = append(t.pages, make([]block, 1<<slotPageBits))
		}
	}
	b := t.at(s)
	*b = block{tok: tokRef{c: b.tok.c, off: b.tok.off, room: b.tok.room}}
	return s
}

// freeSlot gives back the slot of a block that left the table (out of its
// list and the index already).
func (t *Table) freeSlot(s slot) {
	b := t.at(s)
	if b.named {
		delete(t.names, s)
	}
	*b = block{tok: tokRef{c: b.tok.c, off: b.tok.off, room: b.tok.room}, next: t.free}
	t.free = s
}

// tokens are b's tokens, in the table's chunks (read them before the
// table changes).
func (t *Table) tokens(b *block) []uint32 {
	if b.tok.n == 0 {
		return nil
	}
	return t.chunks[b.tok.c][b.tok.off : b.tok.off+b.tok.n : b.tok.off+b.tok.n]
}

// setTokens copies toks in as b's tokens: into the room b's slot has, or
// new room carved from the last chunk when that is too small.
func (t *Table) setTokens(b *block, toks []uint32) {
	n := uint32(len(toks))
	if n > b.tok.room {
		last := len(t.chunks) - 1
		if last < 0 || cap(t.chunks[last])-len(t.chunks[last]) < len(toks) {
			t.chunks = append(t.chunks, make([]uint32, 0, max(len(toks), tokenChunk)))
			last++
		}
		ch := t.chunks[last]
		b.tok = tokRef{c: uint32(last), off: uint32(len(ch)), room: n}
		t.chunks[last] = ch[:len(ch)+len(toks)]
	}
	b.tok.n = n
	copy(t.chunks[b.tok.c][b.tok.off:b.tok.off+n], toks)
}

// blockList is a list of blocks linked through their prev and next slots:
// held blocks or ghosts, oldest first.
type blockList struct {
	head, tail slot
	n          int
}

func (l *blockList) Len() int { return l.n }

func (t *Table) pushBack(l *blockList, s slot) {
	b := t.at(s)
	b.prev, b.next = l.tail, 0
	if l.tail != 0 {
		t.at(l.tail).next = s
	} else {
		l.head = s
	}
	l.tail = s
	l.n++
}

// unlink takes s, which is in l, out of it. A block already out of every
// list (no links, not a head) is left alone; callers know which list a
// block is in (listOf), so a block in the other list is not asked for.
func (t *Table) unlink(l *blockList, s slot) {
	b := t.at(s)
	if b.prev == 0 && b.next == 0 && l.head != s {
		return
	}
	if b.prev != 0 {
		t.at(b.prev).next = b.next
	} else {
		l.head = b.next
	}
	if b.next != 0 {
		t.at(b.next).prev = b.prev
	} else {
		l.tail = b.prev
	}
	b.prev, b.next = 0, 0
	l.n--
}
