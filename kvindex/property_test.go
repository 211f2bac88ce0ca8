package kvindex

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// refIndex is the reference model of the index semantics: plain maps, no
// cleverness, written from the rules rather than from applyEvents.
type refIndex struct {
	model string
	bs    int
	inst  map[string]map[uint64]refEntry // instance → engine hash → entry
}

type refEntry struct {
	key  Key
	bits tiers.Set
}

func (r *refIndex) apply(inst string, evs []events.Event) {
	m := r.inst[inst]
	if m == nil {
		m = map[uint64]refEntry{}
		r.inst[inst] = m
	}
	for _, ev := range evs {
		switch ev.Kind {
		case events.AllBlocksCleared:
			clear(m)
		case events.BlockRemoved:
			t, _ := tiers.FromMedium(ev.Medium)
			for _, h := range ev.BlockHashes {
				if e, ok := m[h]; ok {
					e.bits &^= t.Bit()
					if e.bits == 0 {
						delete(m, h)
					} else {
						m[h] = e
					}
				}
			}
		case events.BlockStored:
			t, _ := tiers.FromMedium(ev.Medium)
			if len(ev.TokenIDs) == 0 {
				for _, h := range ev.BlockHashes {
					if e, ok := m[h]; ok {
						e.bits |= t.Bit()
						m[h] = e
					}
				}
				continue
			}
			k := Root(r.model, ev.LoraName, ev.CacheSalt)
			if ev.HasParent {
				p, ok := m[ev.ParentHash]
				if !ok {
					continue
				}
				k = p.key
			}
			for i, h := range ev.BlockHashes {
				k = BlockKey(k, ev.TokenIDs[i*r.bs:(i+1)*r.bs])
				e, ok := m[h]
				if !ok || e.key != k {
					e = refEntry{key: k}
				}
				e.bits |= t.Bit()
				m[h] = e
			}
		}
	}
}

func (r *refIndex) lookup(keys []Key) map[string][tiers.Count]int {
	out := map[string][tiers.Count]int{}
	for inst, m := range r.inst {
		held := map[Key]tiers.Set{}
		for _, e := range m {
			held[e.key] |= e.bits
		}
		var b [tiers.Count]int
		for t := range tiers.Count {
			for _, k := range keys {
				if held[k]&(2<<t-1) == 0 {
					break
				}
				b[t]++
			}
		}
		if b[tiers.Count-1] > 0 {
			out[inst] = b
		}
	}
	return out
}

func (r *refIndex) len() int {
	n := 0
	for _, m := range r.inst {
		n += len(m)
	}
	return n
}

// propWorld is the material random operations are drawn from: a few
// documents sharing prefixes, under two roots (base model and a LoRA).
type propWorld struct {
	bs     int
	docs   [][]uint32 // tokens
	lora   []string   // per doc: "" or an adapter name
	keys   [][]Key
	hashes [][]uint64 // engine hashes per doc block (equal prefixes → equal hashes)
}

func newPropWorld(rng *rand.Rand, model string) *propWorld {
	w := &propWorld{bs: 4}
	const blocksPerDoc = 10
	base := seqTokens(blocksPerDoc*w.bs, 5)
	for d := 0; d < 6; d++ {
		toks := slices.Clone(base)
		shared := rng.IntN(blocksPerDoc)
		for i := shared * w.bs; i < len(toks); i++ {
			toks[i] = rng.Uint32()
		}
		lora := ""
		if d%3 == 2 {
			lora = "adapter-x"
		}
		w.docs = append(w.docs, toks)
		w.lora = append(w.lora, lora)
		ks := Keys(Root(model, lora, ""), toks, w.bs)
		w.keys = append(w.keys, ks)
		hs := make([]uint64, len(ks))
		for i, k := range ks {
			hs[i] = uint64(k)*31 + 7 // the engine's own hashing: any injective function
		}
		w.hashes = append(w.hashes, hs)
	}
	return w
}

var propMedia = []string{"GPU", "GPU", "GPU", "CPU", "CPU", "DISK", "SHARED"}

func (w *propWorld) randomEvent(rng *rand.Rand) events.Event {
	d := rng.IntN(len(w.docs))
	n := len(w.hashes[d])
	from := rng.IntN(n)
	to := from + 1 + rng.IntN(n-from)
	medium := propMedia[rng.IntN(len(propMedia))]
	switch r := rng.IntN(10); {
	case r < 5: // stored with tokens
		ev := events.Event{
			Kind:        events.BlockStored,
			BlockHashes: slices.Clone(w.hashes[d][from:to]),
			TokenIDs:    slices.Clone(w.docs[d][from*w.bs : to*w.bs]),
			BlockSize:   w.bs,
			Medium:      medium,
			LoraName:    w.lora[d],
		}
		if rng.IntN(3) > 0 {
			ev.Medium = "GPU"
		}
		if from > 0 {
			ev.ParentHash, ev.HasParent = w.hashes[d][from-1], true
		}
		return ev
	case r < 7: // tokenless store (offload)
		return events.Event{Kind: events.BlockStored, BlockHashes: slices.Clone(w.hashes[d][from:to]), Medium: medium}
	case r < 9:
		return events.Event{Kind: events.BlockRemoved, BlockHashes: slices.Clone(w.hashes[d][from:to]), Medium: medium}
	default:
		return events.Event{Kind: events.AllBlocksCleared}
	}
}

func testIndexProperty(t *testing.T, newIndex factory, rounds, ops, instances int) {
	for round := 0; round < rounds; round++ {
		seed := uint64(round)*7919 + 17
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 3))
			ctx := context.Background()
			idx := newIndex(t, factoryConfig{Model: testModel, BlockSize: 4})
			ref := &refIndex{model: testModel, bs: 4, inst: map[string]map[uint64]refEntry{}}
			w := newPropWorld(rng, testModel)
			insts := make([]string, instances)
			for i := range insts {
				insts[i] = fmt.Sprintf("i%d", i)
			}
			mem, _ := idx.(*Memory)
			for op := 0; op < ops; op++ {
				inst := insts[rng.IntN(len(insts))]
				switch r := rng.IntN(20); {
				case r == 0:
					if err := idx.Purge(ctx, inst); err != nil {
						t.Fatal(err)
					}
					delete(ref.inst, inst)
				case r < 14:
					evs := make([]events.Event, 1+rng.IntN(4))
					for i := range evs {
						evs[i] = w.randomEvent(rng)
					}
					if _, err := idx.Apply(ctx, inst, evs); err != nil {
						t.Fatal(err)
					}
					ref.apply(inst, evs)
				default:
					d := rng.IntN(len(w.keys))
					keys := w.keys[d][:1+rng.IntN(len(w.keys[d]))]
					checkLookup(t, idx, query{keys: keys, want: ref.lookup(keys)}, fmt.Sprintf("op %d", op))
				}
				if mem != nil {
					checkMemory(t, mem)
				}
			}
			for d := range w.keys {
				checkLookup(t, idx, query{keys: w.keys[d], want: ref.lookup(w.keys[d])}, fmt.Sprintf("final doc %d", d))
			}
			if n, err := idx.Len(ctx); err != nil || n != ref.len() {
				t.Fatalf("Len = %d (%v), reference %d", n, err, ref.len())
			}
		})
	}
}

func TestMemoryProperty(t *testing.T) { testIndexProperty(t, newMemoryForTest, 40, 400, 4) }

// TestMemoryPropertyManyHolders runs the property test with enough
// instances that blocks get many holders: the block map's holder lists
// turn into bitsets over instance slots and back.
func TestMemoryPropertyManyHolders(t *testing.T) {
	testIndexProperty(t, newMemoryForTest, 10, 3000, 150)
}

func TestRedisProperty(t *testing.T) { testIndexProperty(t, newRedisForTest, 8, 250, 4) }
