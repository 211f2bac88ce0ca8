package kvindex

import (
	"math/bits"

	"github.com/cespare/xxhash/v2"
)

// rootVersion is folded into every root so that a future change of the key
// scheme cannot alias keys computed by an older router sharing a Redis index.
const rootVersion = "kvrouter.v1"

// Root returns the key that block 0 of a chain is chained from. It folds in
// the model (or, when adapter is set, the LoRA adapter instead: an adapter's
// KV differs from its base model's, so their chains must never alias) and
// the cache salt (tenants that salt their requests get disjoint chains, as
// the engine keeps their KV apart too). The model/adapter distinction is
// itself folded in, so an adapter named like a model does not collide.
func Root(model, adapter, cacheSalt string) Key {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(rootVersion)
	if adapter != "" {
		_, _ = d.WriteString("\x00adapter\x00")
		_, _ = d.WriteString(adapter)
	} else {
		_, _ = d.WriteString("\x00model\x00")
		_, _ = d.WriteString(model)
	}
	_, _ = d.WriteString("\x00salt\x00")
	_, _ = d.WriteString(cacheSalt)
	return Key(d.Sum64())
}

// BlockKey is the key of one full block of tokens chained from parent:
// xxhash64 (seed 0) over parent (8 bytes, little-endian) followed by the
// tokens as little-endian uint32.
//
// It is computed word by word straight from the tokens rather than by
// serialising them into a buffer for a general xxhash call: keying is on
// the request path for every prompt, and this halves its cost. The result
// equals xxhash.Sum64 of the serialised block (tested).
func BlockKey(parent Key, block []uint32) Key {
	return Key(xxh64Block(uint64(parent), block))
}

// xxHash64 primes (from the xxHash specification).
const (
	prime1 uint64 = 0x9E3779B185EBCA87
	prime2 uint64 = 0xC2B2AE3D27D4EB4F
	prime3 uint64 = 0x165667B19E3779F9
	prime4 uint64 = 0x85EBCA77C2B2AE63
	prime5 uint64 = 0x27D4EB2F165667C5
)

func xxRound(acc, in uint64) uint64 {
	acc += in * prime2
	acc = bits.RotateLeft64(acc, 31)
	return acc * prime1
}

// xxAvalanche is xxHash64's final mix.
func xxAvalanche(h uint64) uint64 {
	h ^= h >> 33
	h *= prime2
	h ^= h >> 29
	h *= prime3
	h ^= h >> 32
	return h
}

func xxMerge(acc, v uint64) uint64 {
	acc ^= xxRound(0, v)
	return acc*prime1 + prime4
}

// xxh64Block is xxHash64 with seed 0 of the byte string
// LE64(parent) || LE32(block[0]) || LE32(block[1]) || ...
// read as 64-bit little-endian words: w0 = parent, then token pairs.
func xxh64Block(parent uint64, block []uint32) uint64 {
	n := uint64(8 + 4*len(block))
	// word returns the i-th 8-byte word of the stream (i >= 1: tokens).
	word := func(i int) uint64 {
		j := 2 * (i - 1)
		return uint64(block[j]) | uint64(block[j+1])<<32
	}
	words := int(n / 8) // whole words, parent included
	var h uint64
	w := 0 // next word to consume
	if n >= 32 {
		p1, p2 := prime1, prime2 // variables: the sums wrap, as the spec intends
		v1 := p1 + p2
		v2 := p2
		v3 := uint64(0)
		v4 := -p1
		// First stripe holds the parent and three token words.
		v1 = xxRound(v1, parent)
		v2 = xxRound(v2, word(1))
		v3 = xxRound(v3, word(2))
		v4 = xxRound(v4, word(3))
		w = 4
		for ; w+4 <= words; w += 4 {
			j := 2 * (w - 1)
			b := block[j : j+8 : j+8]
			v1 = xxRound(v1, uint64(b[0])|uint64(b[1])<<32)
			v2 = xxRound(v2, uint64(b[2])|uint64(b[3])<<32)
			v3 = xxRound(v3, uint64(b[4])|uint64(b[5])<<32)
			v4 = xxRound(v4, uint64(b[6])|uint64(b[7])<<32)
		}
		h = bits.RotateLeft64(v1, 1) + bits.RotateLeft64(v2, 7) +
			bits.RotateLeft64(v3, 12) + bits.RotateLeft64(v4, 18)
		h = xxMerge(h, v1)
		h = xxMerge(h, v2)
		h = xxMerge(h, v3)
		h = xxMerge(h, v4)
	} else {
		h = prime5
	}
	h += n
	for ; w < words; w++ {
		var k uint64
		if w == 0 {
			k = parent
		} else {
			k = word(w)
		}
		h ^= xxRound(0, k)
		h = bits.RotateLeft64(h, 27)*prime1 + prime4
	}
	if len(block)%2 == 1 {
		h ^= uint64(block[len(block)-1]) * prime1
		h = bits.RotateLeft64(h, 23)*prime2 + prime3
	}
	return xxAvalanche(h)
}

// xxh64Block16 is xxh64Block for a block of 16 tokens (vLLM's default
// block size), written out: everything but the first lane and the merge
// chain is independent of parent, so the CPU computes it ahead while the
// previous block's key, which parent is, is still being finished. Keying
// is latency-bound on that chain; the general loop left more work on it.
func xxh64Block16(parent uint64, b *[16]uint32) uint64 {
	w := func(i int) uint64 { return uint64(b[2*i]) | uint64(b[2*i+1])<<32 }
	p1, p2 := prime1, prime2 // variables: the sums wrap, as the spec intends
	v2 := xxRound(xxRound(p2, w(0)), w(4))
	v3 := xxRound(xxRound(0, w(1)), w(5))
	v4 := xxRound(xxRound(-p1, w(2)), w(6))
	c := bits.RotateLeft64(v2, 7) + bits.RotateLeft64(v3, 12) + bits.RotateLeft64(v4, 18)
	r2, r3, r4 := xxRound(0, v2), xxRound(0, v3), xxRound(0, v4)
	t := xxRound(0, w(7))
	v1 := xxRound(xxRound(p1+p2, parent), w(3))
	h := bits.RotateLeft64(v1, 1) + c
	h = (h^xxRound(0, v1))*prime1 + prime4
	h = (h^r2)*prime1 + prime4
	h = (h^r3)*prime1 + prime4
	h = (h^r4)*prime1 + prime4
	h += 8 + 4*16
	h ^= t
	h = bits.RotateLeft64(h, 27)*prime1 + prime4
	return xxAvalanche(h)
}

// AppendKeys appends to dst the keys of the full blocks of tokens, chained
// from parent (Root for a chain that starts at block 0, else the key of the
// block before tokens[0]). A trailing partial block gets no key, as the
// engine caches only full blocks. blockSize <= 0 appends nothing.
func AppendKeys(dst []Key, parent Key, tokens []uint32, blockSize int) []Key {
	if blockSize <= 0 {
		return dst
	}
	n := len(tokens) / blockSize
	dst = grow(dst, n)
	k := uint64(parent)
	if blockSize == 16 {
		for i := 0; i < n; i++ {
			k = xxh64Block16(k, (*[16]uint32)(tokens[i*16:]))
			dst = append(dst, Key(k))
		}
		return dst
	}
	for i := 0; i < n; i++ {
		k = xxh64Block(k, tokens[i*blockSize:(i+1)*blockSize])
		dst = append(dst, Key(k))
	}
	return dst
}

// Keys is AppendKeys into a new slice.
func Keys(parent Key, tokens []uint32, blockSize int) []Key {
	return AppendKeys(nil, parent, tokens, blockSize)
}

func grow(dst []Key, n int) []Key {
	if cap(dst)-len(dst) >= n {
		return dst
	}
	out := make([]Key, len(dst), len(dst)+n)
	copy(out, dst)
	return out
}
