package workload

import (
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/internal/slotlist"
)

// Bound is the hit rate a cache reaches on a trace when every request is
// served from one shared cache: counting, per request, the leading blocks
// already cached (a prefix cache stops at the first miss), then inserting
// the request's blocks — no timing, no routing.
type Bound struct {
	// CapacityTokens is the cache size; 0 means infinite.
	CapacityTokens int64 `json:"capacity_tokens"`
	HitBlocks      int64 `json:"hit_blocks"`
	Blocks         int64 `json:"blocks"`
	// HitTokens counts hit blocks × the block size (512 for traces), capped at each request's input length
	// (the per-request bounds: at what an engine reuses of it, engineReuse).
	HitTokens   int64 `json:"hit_tokens"`
	InputTokens int64 `json:"input_tokens"`
}

// BlockRatio is HitBlocks / Blocks.
func (b Bound) BlockRatio() float64 { return ratio(b.HitBlocks, b.Blocks) }

// TokenRatio is HitTokens / InputTokens.
func (b Bound) TokenRatio() float64 { return ratio(b.HitTokens, b.InputTokens) }

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// InfiniteBound is the hit rate of an infinite shared cache.
//
// InfiniteBound and PooledBound are the trace's own statistics (its
// README's table): hits in whole hash blocks, not what an engine reuses.
func InfiniteBound(recs []TraceRecord) Bound {
	b, _ := PooledBound(recs, 0)
	return b
}

// PooledBound is the hit rate of a single LRU cache of capacityTokens
// (whole 512-token blocks; 0 = infinite) — a perfect router over a fleet
// whose caches were pooled into one. A request's blocks, hit or not, become
// the most recently used in prompt order, last block most recent.
func PooledBound(recs []TraceRecord, capacityTokens int64) (Bound, error) {
	return pooledBound(recs, TraceBlockTokens, 0, capacityTokens, nil)
}

// PooledBoundPerRequest is PooledBound with each record's hit tokens, so
// that the bound can be taken over the same requests as a measured hit
// rate (e.g. only those that completed); a record's hit tokens are at most
// what an engine of engineBlockTokens-token blocks reuses of it
// (engineReuse).
func PooledBoundPerRequest(recs []TraceRecord, engineBlockTokens int, capacityTokens int64) (Bound, []int64, error) {
	hits := make([]int64, len(recs))
	b, err := pooledBound(recs, TraceBlockTokens, engineBlockTokens, capacityTokens, hits)
	return b, hits, err
}

// RequestsBoundPerRequest is PooledBoundPerRequest for generated requests
// (which have token ids, not a trace's hash ids): each prompt is cut into
// whole blockTokens-token blocks, as a vLLM prefix cache does, and each
// block is named by a hash of every token up to its end, so that equal
// prefixes give equal names. A partial last block is never cached, so it
// is never a hit, nor the block holding the last token (engineReuse). The token ids are those of Request.Tokens, which is what
// an engine with the Simple tokenizer caches for a completions prompt
// (kvbench live and demo send completions); requests sent as chat messages
// are rendered by a template, and the bound then holds to within the
// template's few tokens per request.
//
// A request's LoRA adapter, and its tenant key when saltByTenant (sent as
// its cache_salt), seed the digest before its first token: an engine folds
// them into its block hashes (the salt into the first block's, which every
// later block chains from), so equal tokens under another adapter or salt
// are other blocks, and so they are here.
func RequestsBoundPerRequest(reqs []Request, blockTokens int, capacityTokens int64, saltByTenant bool) (Bound, []int64, error) {
	if blockTokens <= 0 {
		return Bound{}, nil, fmt.Errorf("%w: bound: block size %d must be > 0", ErrInvalid, blockTokens)
	}
	recs := make([]TraceRecord, len(reqs))
	var toks []uint32
	var buf [4]byte
	for i := range reqs {
		toks = reqs[i].AppendTokens(toks[:0])
		n := len(toks) / blockTokens
		ids := make([]int64, n)
		d := xxhash.New()
		salt := ""
		if saltByTenant {
			salt = reqs[i].Tenant
		}
		if reqs[i].Adapter != "" || salt != "" {
			// Length-prefixed, so ("ab", "") and ("a", "b") differ.
			for _, k := range []string{reqs[i].Adapter, salt} {
				binary.LittleEndian.PutUint32(buf[:], uint32(len(k)))
				_, _ = d.Write(buf[:])
				_, _ = d.WriteString(k)
			}
		}
		for j := 0; j < n; j++ {
			for _, t := range toks[j*blockTokens : (j+1)*blockTokens] {
				binary.LittleEndian.PutUint32(buf[:], t)
				_, _ = d.Write(buf[:])
			}
			ids[j] = int64(d.Sum64())
		}
		recs[i] = TraceRecord{InputLength: len(toks), HashIDs: ids}
	}
	hits := make([]int64, len(recs))
	b, err := pooledBound(recs, blockTokens, blockTokens, capacityTokens, hits)
	return b, hits, err
}

// engineReuse is the most of an n-token prompt an engine of
// engineBlockTokens-token blocks takes from its cache (0: no cap beyond
// n): whole blocks, never the last token, which it recomputes for the
// first output token's logits (sim.Engine.admit's maxHitBlocks; vLLM v1
// KVCacheManager.get_computed_blocks, max_cache_hit_length = num_tokens − 1).
func engineReuse(n, engineBlockTokens int) int {
	if engineBlockTokens <= 0 || n <= 0 {
		return max(n, 0)
	}
	return (n - 1) / engineBlockTokens * engineBlockTokens
}

func pooledBound(recs []TraceRecord, blockTokens, engineBlockTokens int, capacityTokens int64, perReq []int64) (Bound, error) {
	if capacityTokens < 0 {
		return Bound{}, fmt.Errorf("%w: bound: capacity %d must be >= 0", ErrInvalid, capacityTokens)
	}
	capBlocks := capacityTokens / int64(blockTokens)
	if capacityTokens > 0 && capBlocks == 0 {
		return Bound{}, fmt.Errorf("%w: bound: capacity %d is under one %d-token block", ErrInvalid, capacityTokens, blockTokens)
	}
	b := Bound{CapacityTokens: capacityTokens}
	lru := newLRU(capBlocks)
	for i, r := range recs {
		hit := 0
		for _, h := range r.HashIDs {
			if !lru.contains(h) {
				break
			}
			hit++
		}
		for _, h := range r.HashIDs {
			lru.touch(h)
		}
		b.HitBlocks += int64(hit)
		b.Blocks += int64(len(r.HashIDs))
		ht := int64(min(hit*blockTokens, engineReuse(r.InputLength, engineBlockTokens)))
		b.HitTokens += ht
		if perReq != nil {
			perReq[i] = ht
		}
		b.InputTokens += int64(r.InputLength)
	}
	return b, nil
}

// lru is a set of ids with least-recently-used eviction, as a doubly linked
// list over slot indices (no per-entry allocation). capacity 0 = unbounded.
type lru struct {
	capacity int64
	slot     map[int64]int32
	id       []int64 // by slot
	order    slotlist.List
}

func newLRU(capacity int64) *lru {
	return &lru{capacity: capacity, slot: map[int64]int32{}, order: slotlist.New()}
}

func (l *lru) contains(h int64) bool { _, ok := l.slot[h]; return ok }

// touch makes h the most recently used, inserting it (and evicting the
// least recently used when full) if absent.
func (l *lru) touch(h int64) {
	if s, ok := l.slot[h]; ok {
		l.order.MoveToFront(s)
		return
	}
	var s int32
	if l.capacity > 0 && int64(len(l.slot)) >= l.capacity {
		s = l.order.Back()
		l.order.MoveToFront(s)
		delete(l.slot, l.id[s])
		l.id[s] = h
	} else {
		s = l.order.Add()
		l.id = append(l.id, h)
	}
	l.slot[h] = s
}
