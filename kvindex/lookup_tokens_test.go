package kvindex

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkLookupTokensShared is the heavy-sharing lookup at 256 instances
// (BenchmarkMemoryLookupShared's shape) from the query's tokens: keyed
// first and looked up after (AppendKeys, LookupAppend), and keyed as the
// walk goes (LookupTokens), as kv_aware decides.
func BenchmarkLookupTokensShared(b *testing.B) {
	const n = 256
	m, err := NewMemory(MemoryConfig{Model: testModel, Capacity: 2 * n * sharedChain})
	if err != nil {
		b.Fatal(err)
	}
	query := fillShared(b, m, n)
	toks := append(seqTokens(sharedBlocks*shapeBS, 1), seqTokens((sharedChain-sharedBlocks)*shapeBS, 2)...)
	root := Root(testModel, "", "")
	if !slices.Equal(Keys(root, toks, shapeBS), query) {
		b.Fatal("the query's tokens do not key to its keys")
	}
	ctx := context.Background()
	// A prompt that shares only the 64 blocks every instance holds: the
	// walk stops there, and the other 448 keys are made after it.
	other := append(seqTokens(sharedBlocks*shapeBS, 1), seqTokens((sharedChain-sharedBlocks)*shapeBS, 77777)...)
	for _, c := range []struct {
		name  string
		toks  []uint32
		fused bool
	}{{"keys+lookup", toks, false}, {"fused", toks, true}, {"diverging/keys+lookup", other, false}, {"diverging/fused", other, true}} {
		toks, fused := c.toks, c.fused
		b.Run(c.name, func(b *testing.B) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			times := cputime.NewOpTimes(1 << 16)
			var ms []Match
			var keys []Key
			b.ReportAllocs()
			for b.Loop() {
				t0 := times.Start()
				if fused {
					ms, keys, err = m.LookupTokens(ctx, ms, keys[:0], root, toks, shapeBS)
				} else {
					keys = AppendKeys(keys[:0], root, toks, shapeBS)
					ms, err = m.LookupAppend(ctx, ms, keys)
				}
				times.Stop(t0)
				if err != nil || len(ms) != n || len(keys) != sharedChain {
					b.Fatalf("lookup: %d matches, %d keys, %v", len(ms), len(keys), err)
				}
			}
			times.Report(b, "cpu-ns")
		})
	}
}

// TestLookupTokens checks that LookupTokens answers as AppendKeys then
// LookupAppend do: the same keys (appended after the caller's), the same
// matches, at 16-token blocks (the written-out keying) and others, over
// holders inline, in lists and in sets, in several tiers, for queries
// that stop early, run past every chain, end in a partial block or hold
// nothing at all.
func TestLookupTokens(t *testing.T) {
	for _, c := range []struct {
		bs  int
		cpu bool
	}{{16, false}, {16, true}, {4, false}, {4, true}} {
		bs := c.bs
		t.Run(fmt.Sprint("bs=", bs, ",cpu=", c.cpu), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(bs), 7))
			m, err := NewMemory(MemoryConfig{Model: testModel, BlockSize: bs})
			if err != nil {
				t.Fatal(err)
			}
			root := Root(testModel, "", "")
			// 40 instances: all hold a 24-block prefix; groups of 1, 5
			// and 20 (inline, list, set) hold longer stretches of one
			// continuation; each instance then its own tail; all in the
			// GPU tier (the lookup's uniform path) or some in the CPU
			// tier.
			prefix := seqTokens(24*bs, 1)
			cont := seqTokens(40*bs, 99)
			var chains [][]uint32
			for i := range 40 {
				own := 24
				switch {
				case i == 0:
					own = 64
				case i < 5:
					own = 50
				case i < 20:
					own = 36
				}
				toks := slices.Concat(prefix, cont)[:own*bs]
				toks = append(toks, seqTokens(8*bs, uint32(1000+i))...)
				medium := "GPU"
				if c.cpu && i%7 == 3 {
					medium = "CPU"
				}
				keys := Keys(root, toks, bs)
				hs := make([]uint64, len(keys))
				for b := range hs {
					hs[b] = uint64(i)<<32 | uint64(b)
				}
				mustApply(t, m, fmt.Sprintf("pod-%d", i), events.Event{Kind: events.BlockStored, BlockSize: bs, Medium: medium, TokenIDs: toks, BlockHashes: hs})
				chains = append(chains, toks)
			}
			ctx := context.Background()
			var ms, want []Match
			var keys []Key
			for q := range 300 {
				toks := chains[rng.IntN(len(chains))]
				toks = toks[:rng.IntN(len(toks)+1)]
				if q%5 == 0 {
					toks = append(slices.Clone(toks), seqTokens(rng.IntN(6*bs), uint32(q))...) // diverge
				}
				if q%31 == 0 {
					toks = seqTokens(rng.IntN(10*bs), uint32(5000+q)) // held by nobody
				}
				pre := []Key{Key(q), 7}[:q%3%2*2]
				wantKeys := AppendKeys(slices.Clone(pre), root, toks, bs)
				want, err = m.LookupAppend(ctx, want, wantKeys[len(pre):])
				if err != nil {
					t.Fatal(err)
				}
				ms, keys, err = m.LookupTokens(ctx, ms, append(keys[:0], pre...), root, toks, bs)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(keys, wantKeys) {
					t.Fatalf("query %d (%d tokens): keys %v, want %v", q, len(toks), keys, wantKeys)
				}
				sortMatches(ms)
				sortMatches(want)
				if !slices.Equal(ms, want) {
					t.Fatalf("query %d (%d tokens): matches %v, want %v", q, len(toks), ms, want)
				}
			}
			// A done context: no matches, its error, every key still made.
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			ms, keys, err = m.LookupTokens(cctx, ms, nil, root, chains[0], bs)
			if err == nil || ms != nil || !slices.Equal(keys, Keys(root, chains[0], bs)) {
				t.Fatalf("done context: %d matches, %d keys, %v", len(ms), len(keys), err)
			}
		})
	}
}
