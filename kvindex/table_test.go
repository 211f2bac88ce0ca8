package kvindex

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// checkTable runs ops against a memory index and a Go map: every op is a
// store (even byte) or removal (odd) of a small engine hash by one of three
// instances, so probe runs collide, grow and shift back a lot, keys alias
// (several engine hashes of an instance map to one key) and holders move
// between inline, list and set form.
func checkTable(t *testing.T, ops []byte) {
	m, err := NewMemory(MemoryConfig{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	type ik struct {
		inst uint8
		h    uint64
	}
	ref := map[ik]Key{}
	m.mu.Lock()
	var ins [3]*memInstance
	for i := range ins {
		if ins[i], err = m.instance(fmt.Sprintf("i%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	for i, op := range ops {
		inst, h := op%3, uint64(op>>2%32)
		in := ins[inst]
		before := in.n
		if op&2 == 0 {
			k := Key(h%7 + 1) // few keys: aliasing engine hashes share one
			in.store(h, k, tiers.GPU)
			ref[ik{inst, h}] = k
		} else {
			in.removeTier(h, tiers.GPU)
			delete(ref, ik{inst, h})
		}
		m.entries.Add(int64(in.n - before))
		if err := memoryInvariantsLocked(m); err != nil {
			m.mu.Unlock()
			t.Fatalf("op %d: %v", i, err)
		}
		for _, tb := range []*table{&in.byHash, &in.byNode} {
			if err := tableCounts(tb); err != nil {
				m.mu.Unlock()
				t.Fatalf("op %d: %v", i, err)
			}
		}
	}
	for inst, in := range ins {
		for h := uint64(0); h < 32; h++ {
			k, ok := in.keyOf(h)
			if want, has := ref[ik{uint8(inst), h}]; ok != has || ok && k != want {
				t.Fatalf("keyOf(%d) = %v,%v; want %v,%v", h, k, ok, want, has)
			}
		}
	}
	m.mu.Unlock()
}

// tableCounts checks a table's item and tombstone counts against its slots.
func tableCounts(tb *table) error {
	var n, tombs int
	for _, c := range tb.slots {
		switch {
		case c == tomb:
			tombs++
		case c != 0:
			n++
		}
	}
	if n != tb.n || tombs != tb.tombs {
		return fmt.Errorf("table of %d slots holds %d items and %d tombstones, counted %d and %d", len(tb.slots), n, tombs, tb.n, tb.tombs)
	}
	return nil
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
	// A store of block 1; then, in one call, a store with block 1 as its
	// parent and no blocks, and a removal of block 1 (the section's
	// prefetch once sliced the empty store's tokens and panicked).
	f.Add([]byte{1, 0, 1, 1, 0, 4, 4, 1, 2, 3, 4, 5, 1, 0, 0, 3, 4, 0, 5, 2, 0, 1, 1, 0, 0, 0, 5})
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
			// In calls of 1, 2, 3, 1, … events: a call's sections of
			// several events then meet blocks earlier calls stored.
			rest := evs[i*len(evs)/2:]
			for k := 1; len(rest) > 0; k = k%3 + 1 {
				c := min(k, len(rest))
				if _, err := m.Apply(ctx, inst, rest[:c]); err != nil {
					t.Fatal(err)
				}
				rest = rest[c:]
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
