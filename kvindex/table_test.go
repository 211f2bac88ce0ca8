package kvindex

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// checkTable runs ops against a memInstance's engine-hash map and a Go map:
// every op is a store (even byte) or removal (odd) of a small engine hash,
// so probe runs collide, grow and shift back a lot.
func checkTable(t *testing.T, ops []byte) {
	in := newMemInstance("x")
	ref := map[uint64]Key{}
	for i, op := range ops {
		h := uint64(op >> 1 % 64)
		if op&1 == 0 {
			k := Key(h%7 + 1) // few keys: aliasing engine hashes share one
			in.store(h, k, tiers.GPU)
			ref[h] = k
		} else {
			in.removeTier(h, tiers.GPU)
			delete(ref, h)
		}
		if in.n != len(ref) || in.byHash.n != len(ref) || in.byKey.n != len(ref) {
			t.Fatalf("op %d: n=%d byHash=%d byKey=%d, want %d", i, in.n, in.byHash.n, in.byKey.n, len(ref))
		}
	}
	for h := uint64(0); h < 64; h++ {
		k, ok := in.keyOf(h)
		if want, has := ref[h]; ok != has || ok && k != want {
			t.Fatalf("keyOf(%d) = %v,%v; want %v,%v", h, k, ok, want, has)
		}
	}
	held := map[Key]bool{}
	for _, k := range ref {
		held[k] = true
	}
	for k := Key(1); k <= 7; k++ {
		bits, _ := in.probe(k)
		if (bits != 0) != held[k] {
			t.Fatalf("probe(%d) = %b, held %v", k, bits, held[k])
		}
	}
	// The LRU list links every live entry exactly once.
	seen := 0
	for j := in.head; j >= 0; j = in.slab.at(j).next {
		if seen++; seen > in.n {
			t.Fatal("LRU list has a cycle")
		}
	}
	if seen != in.n {
		t.Fatalf("LRU list has %d entries, want %d", seen, in.n)
	}
}

func TestTableAgainstMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 200; round++ {
		ops := make([]byte, 50+rng.IntN(500))
		for i := range ops {
			ops[i] = byte(rng.UintN(256))
		}
		checkTable(t, ops)
	}
}

func FuzzTable(f *testing.F) {
	f.Add([]byte{0, 2, 4, 1, 3, 6, 8, 5})
	f.Fuzz(func(t *testing.T, ops []byte) { checkTable(t, ops) })
}

// FuzzApply feeds the memory backend events with arbitrary (often
// malformed) fields: it must neither panic nor lose count.
func FuzzApply(f *testing.F) {
	f.Add([]byte("\x01\x03\x04\x10abcdefghijklmnop\x02\x01\x00"))
	f.Add([]byte{3, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := NewMemory(MemoryConfig{Model: "m", Capacity: 64})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		media := []string{"GPU", "CPU", "disk", "SHARED", "", "???"}
		var evs []events.Event
		next := func() byte {
			if len(data) == 0 {
				return 0
			}
			b := data[0]
			data = data[1:]
			return b
		}
		for len(data) > 0 && len(evs) < 64 {
			ev := events.Event{Kind: events.Kind(next() % 5), Medium: media[int(next())%len(media)]}
			n := int(next() % 8)
			for i := 0; i < n; i++ {
				ev.BlockHashes = append(ev.BlockHashes, uint64(next()%16))
			}
			if b := next(); b&1 != 0 {
				ev.ParentHash, ev.HasParent = uint64(b>>1%16), true
			}
			ev.BlockSize = int(int8(next())) % 5
			nt := int(next() % 40)
			for i := 0; i < nt; i++ {
				ev.TokenIDs = append(ev.TokenIDs, uint32(next()))
			}
			switch next() % 6 {
			case 0:
				ev.GroupIdx = 1
			case 1:
				ev.SpecKind = "sliding_window"
			case 2:
				ev.LoraName = "a"
			case 3:
				ev.CacheSalt = string(binary.LittleEndian.AppendUint16(nil, uint16(next())))
			}
			evs = append(evs, ev)
		}
		for i, inst := range []string{"a", "b"} {
			if _, err := m.Apply(ctx, inst, evs[i*len(evs)/2:]); err != nil {
				t.Fatal(err)
			}
		}
		n, _ := m.Len(ctx)
		if n < 0 || n > 64 {
			t.Fatalf("Len = %d outside [0, capacity 64]", n)
		}
		if _, err := m.Lookup(ctx, Keys(Root("m", "", ""), []uint32{1, 2, 3, 4, 5, 6, 7, 8}, 2)); err != nil {
			t.Fatal(err)
		}
		stats, _ := m.Instances(ctx)
		for _, s := range stats {
			for _, c := range s.Blocks {
				if c < 0 || c > n {
					t.Fatalf("instance %s tier count %d with Len %d", s.Instance, c, n)
				}
			}
		}
		for _, inst := range []string{"a", "b"} {
			mustApply(t, m, inst, events.Event{Kind: events.AllBlocksCleared})
		}
		if n, _ := m.Len(ctx); n != 0 {
			t.Fatalf("Len = %d after clearing every instance", n)
		}
	})
}
