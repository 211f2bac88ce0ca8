package sim

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/events"
)

// Tier indexes of a block's residency; the pool models a GPU tier and an
// optional CPU offload tier.
const (
	gpu = 0
	cpu = 1
)

// Medium strings written into events, as vLLM and its OffloadingConnector do.
const (
	MediumGPU = "GPU"
	MediumCPU = "CPU"
)

// block is one hashed (full) KV block, resident on GPU, CPU or both. A block
// on neither tier is deleted from the pool's map.
type block struct {
	hash uint64
	// refs counts running requests holding the block on GPU; a block with
	// refs > 0 is pinned (never evicted).
	refs int32
	on   [2]bool // resident on GPU / CPU
	in   [2]bool // member of the GPU free list / CPU LRU list
	link [2]struct{ prev, next *block }
}

// lru is an intrusive doubly-linked list over one of block's two links;
// front is the next victim.
type lru struct {
	t          int
	head, tail *block
	n          int
}

func (l *lru) pushBack(b *block) {
	b.link[l.t].prev, b.link[l.t].next = l.tail, nil
	if l.tail != nil {
		l.tail.link[l.t].next = b
	} else {
		l.head = b
	}
	l.tail = b
	b.in[l.t] = true
	l.n++
}

func (l *lru) remove(b *block) {
	ln := &b.link[l.t]
	if ln.prev != nil {
		ln.prev.link[l.t].next = ln.next
	} else {
		l.head = ln.next
	}
	if ln.next != nil {
		ln.next.link[l.t].prev = ln.prev
	} else {
		l.tail = ln.prev
	}
	ln.prev, ln.next = nil, nil
	b.in[l.t] = false
	l.n--
}

// pool is the paged KV cache of one engine: hashed blocks shared by prefix,
// unhashed slots owned by requests (partial blocks), LRU eviction of
// unreferenced GPU blocks into the CPU tier when it exists.
//
// Capacity accounting: every GPU-resident hashed block and every slot takes
// one of gpuCap physical blocks. Hashed blocks with refs == 0 sit on gpuFree
// (vLLM's free block queue: reusable, but still hit by prefix lookups until
// evicted).
type pool struct {
	blockSize int
	gpuCap    int
	cpuCap    int
	// writeThrough stores blocks in the CPU tier when they are computed
	// instead of when they leave the GPU.
	writeThrough bool

	blocks    map[uint64]*block
	gpuCached int // hashed blocks on GPU
	slots     int // unhashed physical blocks held by requests
	cpuCount  int
	gpuFree   lru
	cpuLRU    lru

	// pending collects the current step's events; nil when no one listens.
	pending *[]events.Event
	counts  poolCounts
}

type poolCounts struct {
	gpuEvicted, cpuStored, cpuEvicted, promoted uint64
}

func newPool(blockSize, gpuCap, cpuCap int, writeThrough bool) *pool {
	return &pool{
		blockSize: blockSize, gpuCap: gpuCap, cpuCap: cpuCap, writeThrough: writeThrough,
		blocks:  make(map[uint64]*block),
		gpuFree: lru{t: gpu}, cpuLRU: lru{t: cpu},
	}
}

// free is the number of GPU blocks holding nothing.
func (p *pool) free() int { return p.gpuCap - p.gpuCached - p.slots }

// available is how many slots allocate could hand out now (empty blocks
// plus evictable cached ones).
func (p *pool) available() int { return p.free() + p.gpuFree.n }

// used is the number of GPU blocks held by requests (vLLM's KV usage
// counts cached-but-free blocks as free).
// freeListed counts the GPU blocks among hashes that sit on the free list:
// pinning them would take them out of available().
func (p *pool) freeListed(hashes []uint64) int {
	n := 0
	for _, h := range hashes {
		if b := p.blocks[h]; b != nil && b.in[gpu] {
			n++
		}
	}
	return n
}

func (p *pool) used() int { return p.gpuCap - p.available() }

func (p *pool) emit(ev events.Event) {
	if p.pending != nil {
		*p.pending = append(*p.pending, ev)
	}
}

// allocate reserves n unhashed slots, evicting unreferenced GPU blocks
// (least recently freed first) as needed. It reserves nothing and returns
// false when n slots cannot be found.
func (p *pool) allocate(n int) bool {
	if n <= 0 {
		return true
	}
	if p.available() < n {
		return false
	}
	for p.free() < n {
		p.evictGPU(p.gpuFree.head)
	}
	p.slots += n
	return true
}

// release returns n unhashed slots.
func (p *pool) release(n int) { p.slots -= n }

// evictGPU drops an unreferenced block from the GPU, demoting it to the CPU
// tier when there is one. The CPU store is announced before the GPU removal
// so that a listener never believes the block gone while it is offloaded.
func (p *pool) evictGPU(b *block) {
	p.gpuFree.remove(b)
	b.on[gpu] = false
	p.gpuCached--
	p.counts.gpuEvicted++
	if p.cpuCap > 0 && !p.writeThrough {
		if b.on[cpu] {
			p.cpuLRU.remove(b)
			p.cpuLRU.pushBack(b)
		} else {
			p.storeCPU([]*block{b})
		}
	}
	// vLLM emits one BlockRemoved per evicted block.
	p.emit(events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{b.hash}, Medium: MediumGPU})
	if !b.on[cpu] {
		delete(p.blocks, b.hash)
	}
}

// storeCPU copies blocks not yet there into the CPU tier, evicting its
// least recently used blocks as needed, and announces them (vLLM's
// OffloadingConnector: medium "CPU", hashes only), in as few events as
// keep every removal after the store it undoes.
func (p *pool) storeCPU(bs []*block) {
	var hashes []uint64
	flush := func() {
		if len(hashes) > 0 {
			p.emit(events.Event{Kind: events.BlockStored, BlockHashes: hashes, Medium: MediumCPU})
			hashes = nil
		}
	}
	for _, b := range bs {
		if b.on[cpu] {
			continue
		}
		if p.cpuCount >= p.cpuCap {
			flush()
			p.evictCPU(p.cpuLRU.head)
		}
		b.on[cpu] = true
		p.cpuCount++
		p.cpuLRU.pushBack(b)
		p.counts.cpuStored++
		hashes = append(hashes, b.hash)
	}
	flush()
}

func (p *pool) evictCPU(b *block) {
	p.cpuLRU.remove(b)
	b.on[cpu] = false
	p.cpuCount--
	p.counts.cpuEvicted++
	p.emit(events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{b.hash}, Medium: MediumCPU})
	if !b.on[gpu] {
		delete(p.blocks, b.hash)
	}
}

// ref pins a GPU-resident block for a request.
func (p *pool) ref(b *block) {
	if b.refs == 0 && b.in[gpu] {
		p.gpuFree.remove(b)
	}
	b.refs++
	if b.on[cpu] {
		// A GPU hit keeps the offloaded copy warm too.
		p.cpuLRU.remove(b)
		p.cpuLRU.pushBack(b)
	}
}

// unref releases a request's pin; an unreferenced GPU block joins the tail
// of the free list.
func (p *pool) unref(b *block) {
	b.refs--
	if b.refs == 0 && b.on[gpu] {
		p.gpuFree.pushBack(b)
	}
}

// commit turns one of a request's slots into the hashed block h. If the
// block is already on the GPU (another request computed it concurrently)
// the slot is returned and the existing block is shared; if it is only on
// the CPU it is promoted. created reports whether the GPU gained a block,
// which the caller announces with BlockStored.
func (p *pool) commit(h uint64) (b *block, created bool) {
	p.slots--
	b = p.blocks[h]
	if b != nil && b.on[gpu] {
		p.ref(b)
		return b, false
	}
	if b == nil {
		b = &block{hash: h}
		p.blocks[h] = b
	} else {
		p.counts.promoted++
	}
	b.on[gpu] = true
	p.gpuCached++
	p.ref(b)
	return b, true
}

// lookup returns how many leading hashes are resident (on GPU or CPU), at
// most max, and how many of those are on the CPU only.
func (p *pool) lookup(hashes []uint64, max int) (hit, cpuOnly int) {
	for _, h := range hashes[:min(max, len(hashes))] {
		b := p.blocks[h]
		if b == nil {
			break
		}
		if !b.on[gpu] {
			cpuOnly++
		}
		hit++
	}
	return hit, cpuOnly
}

// clear drops every unreferenced block. It reports false (and drops
// nothing) when a request still holds blocks, as vLLM's reset_prefix_cache
// refuses then.
func (p *pool) clear() bool {
	if p.slots > 0 || p.gpuCached != p.gpuFree.n {
		return false
	}
	p.blocks = make(map[uint64]*block)
	p.gpuCached, p.cpuCount = 0, 0
	p.gpuFree = lru{t: gpu}
	p.cpuLRU = lru{t: cpu}
	return true
}

// hasher computes the engine's block hashes over the parent hash, the
// block's token ids and its extra keys (LoRA name on every block, cache
// salt on the first), keeping 64 bits of the digest. With HashSHA256 (the
// default) that is sha256's low 64 bits, as vLLM by default; HashXXH64 is
// xxhash64 over the same bytes, like vLLM's --prefix-caching-hash-algo
// xxhash, and is several times cheaper for large simulations. The root
// parent is derived from a seed, like vLLM's NONE_HASH from
// PYTHONHASHSEED, so these values never coincide with the router's keys:
// the router must map them from the events' token ids.
type hasher struct {
	algo HashAlgo
	root uint64
	buf  []byte
}

func newHasher(algo HashAlgo, seed uint64) *hasher {
	h := &hasher{algo: algo}
	var b [24]byte
	copy(b[:], "kvsim-none-hash:")
	binary.BigEndian.PutUint64(b[16:], seed)
	h.root = h.sum(b[:])
	return h
}

func (h *hasher) sum(b []byte) uint64 {
	if h.algo == HashXXH64 {
		return nonZero(xxhash.Sum64(b))
	}
	sum := sha256.Sum256(b)
	return nonZero(binary.BigEndian.Uint64(sum[24:]))
}

// hash returns the block hash of tokens following parent (root for block 0).
func (h *hasher) hash(parent uint64, tokens []uint32, lora, salt string) uint64 {
	b := h.buf[:0]
	b = binary.BigEndian.AppendUint64(b, parent)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	// Length-prefixed extra keys, so ("ab","") and ("a","b") differ.
	b = binary.BigEndian.AppendUint16(b, uint16(len(lora)))
	b = append(b, lora...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(salt)))
	b = append(b, salt...)
	h.buf = b
	return h.sum(b)
}

// nonZero keeps 0 free: some engines send parent 0 to mean "no parent".
func nonZero(v uint64) uint64 {
	if v == 0 {
		return 1
	}
	return v
}
