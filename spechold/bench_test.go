package spechold

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkSetPrompt is one kv_aware decision's work on the overlay for a
// long prompt (3,300 blocks, a 53k-token document question): its blocks
// added as held by the chosen instance, read back (Extend) and half of them
// confirmed (Drop), with the ring at its bound (the default 2^18 entries:
// a 128-instance fleet's traffic) or mostly empty (an 8-instance fleet's,
// ~20k entries in flight).
func BenchmarkSetPrompt(b *testing.B) {
	benchPrompt(b, func() func(keys []uint64, inst string, exp, now int64) {
		s := New[uint64](1 << 18)
		return func(keys []uint64, inst string, exp, now int64) {
			s.Add(keys, inst, exp, 0, now)
			s.Extend(keys, 0, inst, 0, now)
			s.Drop(keys[:len(keys)/2], inst)
		}
	})
}

// BenchmarkChainsPrompt is BenchmarkSetPrompt's work on a Chains (the
// router's overlay since session 18): one run per prompt.
func BenchmarkChainsPrompt(b *testing.B) {
	benchPrompt(b, func() func(keys []uint64, inst string, exp, now int64) {
		s := NewChains[uint64](1 << 18)
		var sc Scan[uint64]
		return func(keys []uint64, inst string, exp, now int64) {
			sc.Reset()
			s.Add(keys, inst, exp, 0, now)
			s.Extend(&sc, keys, 0, inst, 0, now)
			s.Drop(&sc, keys, len(keys)/2, inst)
		}
	})
}

// benchPrompt runs one decision's overlay work (made by mk) per op.
func benchPrompt(b *testing.B, mk func() func(keys []uint64, inst string, exp, now int64)) {
	const blocks = 3300
	for _, held := range []int{20_000, 1 << 18} {
		b.Run(fmt.Sprintf("held=%d", held), func(b *testing.B) {
			op := mk()
			insts := make([]string, 128)
			for i := range insts {
				insts[i] = fmt.Sprintf("engine-%d", i)
			}
			keys := make([]uint64, blocks)
			next := uint64(1)
			var now int64
			// Prompts live for the time that keeps about `held` entries.
			ttl := int64(held / blocks)
			prompt := func(i int) {
				for j := range keys {
					keys[j] = next * 0x9e3779b97f4a7c15
					next++
				}
				now++
				op(keys, insts[i%len(insts)], now+ttl, now)
			}
			for i := range 2 * (1 << 18) / blocks {
				prompt(i)
			}
			b.ResetTimer()
			done := cputime.Report(b)
			for i := 0; i < b.N; i++ {
				prompt(i)
			}
			done(b.N)
		})
	}
}
