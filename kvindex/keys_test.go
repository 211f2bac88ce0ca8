package kvindex

import (
	"encoding/binary"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter/kvrouter/internal/cputime"
)

// refKey is the block-key definition written out the slow way.
func refKey(parent Key, block []uint32) Key {
	b := binary.LittleEndian.AppendUint64(nil, uint64(parent))
	for _, t := range block {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return Key(xxhash.Sum64(b))
}

func seqTokens(n int, start uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = start + uint32(i)*2654435761
	}
	return out
}

func TestAppendKeys(t *testing.T) {
	root := Root("m", "", "")
	cases := []struct {
		name      string
		tokens    int
		blockSize int
		want      int
	}{
		{"empty", 0, 16, 0},
		{"partial only", 15, 16, 0},
		{"one block", 16, 16, 1},
		{"trailing partial", 40, 16, 2},
		{"many 16-token blocks (the written-out path)", 16*37 + 5, 16, 37},
		{"block size 1", 5, 1, 5},
		{"large block streams", 2 * 300, 300, 2},
		{"zero block size", 32, 0, 0},
		{"negative block size", 32, -4, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			toks := seqTokens(c.tokens, 7)
			got := AppendKeys([]Key{42}, root, toks, c.blockSize)
			if len(got) != 1+c.want || got[0] != 42 {
				t.Fatalf("got %d keys (first %v), want 1+%d with the prefix kept", len(got), got[0], c.want)
			}
			parent := root
			for i := 0; i < c.want; i++ {
				want := refKey(parent, toks[i*c.blockSize:(i+1)*c.blockSize])
				if got[1+i] != want {
					t.Fatalf("key %d = %x, want %x", i, got[1+i], want)
				}
				if b := BlockKey(parent, toks[i*c.blockSize:(i+1)*c.blockSize]); b != want {
					t.Fatalf("BlockKey %d = %x, want %x", i, b, want)
				}
				parent = want
			}
		})
	}
}

func TestKeysChainAcrossCalls(t *testing.T) {
	// Keying a chain in two pieces (as events arrive) equals keying it at once
	// (as the request side does).
	toks := seqTokens(16*10, 1)
	root := Root("m", "", "")
	all := Keys(root, toks, 16)
	head := Keys(root, toks[:16*4], 16)
	tail := Keys(head[3], toks[16*4:], 16)
	for i, k := range append(head, tail...) {
		if k != all[i] {
			t.Fatalf("key %d differs", i)
		}
	}
}

func TestRoot(t *testing.T) {
	base := Root("llama", "", "")
	cases := []struct {
		name  string
		other Key
		same  bool
	}{
		{"same inputs", Root("llama", "", ""), true},
		{"adapter replaces model", Root("other-model", "sql", ""), false},
		{"adapter ignores model", Root("other-model", "sql", "") ^ Root("llama", "sql", ""), false},
		{"other model", Root("mistral", "", ""), false},
		{"salt", Root("llama", "", "tenant-a"), false},
		{"adapter named like model", Root("x", "llama", ""), false},
		{"separator ambiguity", Root("llama\x00salt\x00", "", ""), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if (c.other == base) != c.same {
				t.Fatalf("Root equal = %v, want %v", c.other == base, c.same)
			}
		})
	}
	if Root("a", "sql", "s") != Root("b", "sql", "s") {
		t.Fatal("with an adapter the model must not matter")
	}
}

func TestAppendKeysNoAlloc(t *testing.T) {
	toks := seqTokens(8000, 3)
	dst := make([]Key, 0, 600)
	root := Root("m", "", "")
	if n := testing.AllocsPerRun(20, func() { dst = AppendKeys(dst[:0], root, toks, 16) }); n != 0 {
		t.Fatalf("AppendKeys allocates %.0f times with room in dst", n)
	}
}

func BenchmarkKeys8000(b *testing.B) { benchKeys(b, 8000, 16) }
func BenchmarkKeys2000(b *testing.B) { benchKeys(b, 2000, 16) }
func BenchmarkKeys512(b *testing.B)  { benchKeys(b, 512, 16) }

func benchKeys(b *testing.B, n, bs int) {
	toks := seqTokens(n, 3)
	dst := make([]Key, 0, n/bs)
	root := Root("m", "", "")
	b.ReportAllocs()
	b.SetBytes(int64(4 * n))
	ops := 0
	report := cputime.Report(b)
	for b.Loop() {
		dst = AppendKeys(dst[:0], root, toks, bs)
		ops++
	}
	report(ops)
}

func TestBlockKeyEveryLength(t *testing.T) {
	// The word-wise hash must equal xxhash over the serialised bytes for
	// every length around the 32-byte stripe boundaries and odd counts.
	for n := 0; n <= 70; n++ {
		toks := seqTokens(n, uint32(n)*977)
		for _, parent := range []Key{0, 1, 0xdeadbeefcafef00d} {
			if got, want := BlockKey(parent, toks), refKey(parent, toks); got != want {
				t.Fatalf("len %d parent %x: %x, want %x", n, parent, got, want)
			}
		}
	}
}

func FuzzBlockKey(f *testing.F) {
	f.Add(uint64(0), []byte{})
	f.Add(uint64(7), []byte("0123456789abcdef0123456789abcdef0123"))
	f.Fuzz(func(t *testing.T, parent uint64, raw []byte) {
		toks := make([]uint32, len(raw)/4)
		for i := range toks {
			toks[i] = binary.LittleEndian.Uint32(raw[4*i:])
		}
		if got, want := BlockKey(Key(parent), toks), refKey(Key(parent), toks); got != want {
			t.Fatalf("%x, want %x", got, want)
		}
	})
}
