package tokenizer

import (
	"container/heap"
	"context"
	"fmt"
	"hash/maphash"
	"slices"
	"strings"
	"sync"
	"unicode/utf8"
)

// bpe is a BPE model whose vocabulary is keyed by the raw bytes a token stands for: for
// byte-level models the ByteLevel alphabet (Ġ for space, ...) is undone at load time, so
// a piece of input text is looked up and merged without converting it.
type bpe struct {
	vocab map[string]uint32
	// merges maps a pair of symbol ids (left<<32 | right) to rank<<32 | merged id.
	merges map[uint64]uint64
	// byteIDs is the initial symbol of each byte (byte-level models only).
	byteIDs   [256]uint32
	byteLevel bool
	// ignoreMerges: a piece that is itself a vocabulary entry is emitted as one token
	// (Llama 3's "ignore_merges": true).
	ignoreMerges bool
	// byteFallback: a character missing from the vocabulary becomes its <0xNN> byte tokens.
	byteFallback bool
	byteFallIDs  [256]uint32
	unk          uint32
	hasUnk       bool
	fuseUnk      bool
}

// naiveLimit is the piece length (in symbols) up to which the quadratic merge loop is used;
// longer pieces go through a heap so pathological inputs stay O(n log n).
const naiveLimit = 48

// encodePiece appends the ids of one pre-token piece to dst; it stops early (ids
// incomplete) once stop says so.
func (m *bpe) encodePiece(dst []uint32, piece string, stop *stopper) []uint32 {
	if m.ignoreMerges {
		if id, ok := m.vocab[piece]; ok {
			return append(dst, id)
		}
	}
	var buf [naiveLimit]uint32
	syms := m.initialSymbols(buf[:0], piece)
	if len(syms) <= naiveLimit {
		syms = m.mergeNaive(syms)
	} else {
		syms = m.mergeHeap(syms, stop)
	}
	return append(dst, syms...)
}

// initialSymbols splits piece into its starting symbols: bytes for byte-level models,
// characters (or byte fallback tokens, or unk) otherwise.
func (m *bpe) initialSymbols(syms []uint32, piece string) []uint32 {
	if m.byteLevel {
		for i := 0; i < len(piece); i++ {
			syms = append(syms, m.byteIDs[piece[i]])
		}
		return syms
	}
	prevUnk := false
	for i := 0; i < len(piece); {
		_, w := utf8.DecodeRuneInString(piece[i:])
		ch := piece[i : i+w]
		i += w
		if id, ok := m.vocab[ch]; ok {
			syms = append(syms, id)
			prevUnk = false
			continue
		}
		if m.byteFallback {
			for j := 0; j < len(ch); j++ {
				syms = append(syms, m.byteFallIDs[ch[j]])
			}
			prevUnk = false
			continue
		}
		if m.hasUnk && !(m.fuseUnk && prevUnk) {
			syms = append(syms, m.unk)
		}
		prevUnk = m.hasUnk
	}
	return syms
}

// noMerge is the rank of a pair that has no merge.
const noMerge = ^uint32(0)

// mergeNaive applies merges lowest rank first, leftmost first among equal ranks (equal
// ranks only occur for the same pair, and Hugging Face's heap orders them by position).
// The rank of each adjacent pair is kept in ranks, so a round costs a scan of integers
// and only the two pairs touching a merge are looked up again.
func (m *bpe) mergeNaive(syms []uint32) []uint32 {
	if len(syms) < 2 {
		return syms
	}
	var rbuf, ibuf [naiveLimit]uint32
	ranks, ids := rbuf[:0], ibuf[:0]
	if len(syms)-1 > naiveLimit {
		ranks, ids = make([]uint32, 0, len(syms)), make([]uint32, 0, len(syms))
	}
	ranks, ids = ranks[:len(syms)-1], ids[:len(syms)-1]
	for i := range ranks {
		ranks[i], ids[i] = m.pairRank(syms[i], syms[i+1])
	}
	for len(syms) > 1 {
		best, bestRank := -1, noMerge
		for i, r := range ranks {
			if r < bestRank {
				best, bestRank = i, r
			}
		}
		if best < 0 {
			break
		}
		syms[best] = ids[best]
		syms = append(syms[:best+1], syms[best+2:]...)
		ranks = append(ranks[:best], ranks[best+1:]...)
		ids = append(ids[:best], ids[best+1:]...)
		if best > 0 {
			ranks[best-1], ids[best-1] = m.pairRank(syms[best-1], syms[best])
		}
		if best < len(ranks) {
			ranks[best], ids[best] = m.pairRank(syms[best], syms[best+1])
		}
	}
	return syms
}

// pairRank returns the merge rank of (a, b) and the merged id, or noMerge.
func (m *bpe) pairRank(a, b uint32) (uint32, uint32) {
	v, ok := m.merges[uint64(a)<<32|uint64(b)]
	if !ok {
		return noMerge, 0
	}
	return uint32(v >> 32), uint32(v)
}

// mergeCand is a possible merge of the symbol at pos with its right neighbour.
type mergeCand struct {
	pos, rank int
	left      uint32 // the left id when queued, to detect stale entries
	right     uint32
	id        uint32
}

type mergeHeap []mergeCand

func (h mergeHeap) Len() int { return len(h) }
func (h mergeHeap) Less(i, j int) bool {
	if h[i].rank != h[j].rank {
		return h[i].rank < h[j].rank
	}
	return h[i].pos < h[j].pos
}
func (h mergeHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *mergeHeap) Push(x any)   { *h = append(*h, x.(mergeCand)) }
func (h *mergeHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// mergeHeap gives the same result as mergeNaive in O(n log n): symbols form a linked list
// and candidate merges sit in a heap ordered by (rank, position); entries made stale by an
// earlier merge are recognised by comparing the ids they were queued with.
func (m *bpe) mergeHeap(syms []uint32, stop *stopper) []uint32 {
	n := len(syms)
	next := make([]int, n)
	prev := make([]int, n)
	alive := make([]bool, n)
	for i := range syms {
		next[i], prev[i], alive[i] = i+1, i-1, true
	}
	h := make(mergeHeap, 0, n)
	cand := func(i int) (mergeCand, bool) {
		j := next[i]
		if j >= n {
			return mergeCand{}, false
		}
		v, ok := m.merges[uint64(syms[i])<<32|uint64(syms[j])]
		return mergeCand{pos: i, rank: int(v >> 32), left: syms[i], right: syms[j], id: uint32(v)}, ok
	}
	for i := 0; i+1 < n; i++ {
		if stop.stopped() {
			return syms
		}
		if c, ok := cand(i); ok {
			h = append(h, c)
		}
	}
	heap.Init(&h)
	for h.Len() > 0 && !stop.stopped() {
		c := heap.Pop(&h).(mergeCand)
		i := c.pos
		if !alive[i] || syms[i] != c.left {
			continue
		}
		j := next[i]
		if j >= n || syms[j] != c.right {
			continue
		}
		syms[i] = c.id
		alive[j] = false
		next[i] = next[j]
		if next[j] < n {
			prev[next[j]] = i
		}
		if p := prev[i]; p >= 0 {
			if c, ok := cand(p); ok {
				heap.Push(&h, c)
			}
		}
		if c, ok := cand(i); ok {
			heap.Push(&h, c)
		}
	}
	out := syms[:0]
	for i := 0; i < n; i = next[i] {
		out = append(out, syms[i])
	}
	return out
}

// stopper ends a long encoding when its context ends: one piece can be megabytes (a run
// of newlines is one pre-token), so the context is checked every stopEvery steps (pieces
// and heap merges), cheaply. A nil stopper never stops.
type stopper struct {
	ctx context.Context
	n   int
	err error
}

const stopEvery = 1024

func newStopper(ctx context.Context) *stopper {
	if ctx == nil || ctx.Done() == nil {
		return nil
	}
	return &stopper{ctx: ctx}
}

// stopped counts a step and reports whether the encoding must stop (err then says why).
func (s *stopper) stopped() bool {
	if s == nil {
		return false
	}
	if s.err != nil {
		return true
	}
	if s.n++; s.n%stopEvery == 0 {
		s.err = s.ctx.Err()
	}
	return s.err != nil
}

// failed reports the context's error once the encoding stopped.
func (s *stopper) failed() error {
	if s == nil || s.err == nil {
		return nil
	}
	return fmt.Errorf("tokenizer: encoding stopped: %w", s.err)
}

// pieceCache memoises piece → ids. It is sharded to keep lock contention low on the
// request path; a full shard is simply cleared, which bounds memory without LRU
// bookkeeping (hot pieces come straight back).
type pieceCache struct {
	seed     maphash.Seed
	perShard int
	shards   [cacheShards]cacheShard
}

const cacheShards = 32

type cacheShard struct {
	mu sync.RWMutex // guards m
	m  map[string][]uint32
}

func newPieceCache(entries int) *pieceCache {
	c := &pieceCache{seed: maphash.MakeSeed(), perShard: max(1, entries/cacheShards)}
	for i := range c.shards {
		c.shards[i].m = make(map[string][]uint32)
	}
	return c
}

func (c *pieceCache) shard(key string) *cacheShard {
	return &c.shards[maphash.String(c.seed, key)%cacheShards]
}

func (c *pieceCache) get(key string) ([]uint32, bool) {
	s := c.shard(key)
	s.mu.RLock()
	ids, ok := s.m[key]
	s.mu.RUnlock()
	return ids, ok
}

func (c *pieceCache) put(key string, ids []uint32) {
	s := c.shard(key)
	s.mu.Lock()
	if len(s.m) >= c.perShard {
		clear(s.m)
	}
	// Clone: key is usually a substring of a request body, which must not stay pinned.
	s.m[strings.Clone(key)] = ids
	s.mu.Unlock()
}

// len reports the number of cached pieces.
func (c *pieceCache) len() int {
	n := 0
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.RLock()
		n += len(s.m)
		s.mu.RUnlock()
	}
	return n
}

// segmentCache memoises whole text segments → ids, bounded by bytes (key length plus four
// bytes per id). Like pieceCache it is sharded and clears a shard that would overflow.
type segmentCache struct {
	seed      maphash.Seed
	shardSize int
	shards    [cacheShards]segShard
}

type segShard struct {
	mu    sync.RWMutex // guards m and bytes
	m     map[segKey][]uint32
	bytes int
}

// segKey distinguishes a segment at the start of the input, which Metaspace's
// prepend_scheme "first" may encode differently.
type segKey struct {
	text  string
	first bool
}

func newSegmentCache(bytes int) *segmentCache {
	c := &segmentCache{seed: maphash.MakeSeed(), shardSize: max(1, bytes/cacheShards)}
	for i := range c.shards {
		c.shards[i].m = make(map[segKey][]uint32)
	}
	return c
}

func (c *segmentCache) shard(text string) *segShard {
	return &c.shards[maphash.String(c.seed, text)%cacheShards]
}

func (c *segmentCache) get(text string, first bool) ([]uint32, bool) {
	s := c.shard(text)
	s.mu.RLock()
	ids, ok := s.m[segKey{text, first}]
	s.mu.RUnlock()
	return ids, ok
}

func (c *segmentCache) put(text string, first bool, ids []uint32) {
	cost := len(text) + 4*len(ids)
	if cost > c.shardSize {
		return // larger than a shard: caching it would evict everything else
	}
	s := c.shard(text)
	s.mu.Lock()
	defer s.mu.Unlock()
	k := segKey{text, first}
	if _, ok := s.m[k]; ok {
		return
	}
	if s.bytes+cost > c.shardSize {
		clear(s.m)
		s.bytes = 0
	}
	s.m[segKey{strings.Clone(text), first}] = slices.Clone(ids)
	s.bytes += cost
}
