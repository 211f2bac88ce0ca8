package fmix

import "testing"

// Known values of MurmurHash3's fmix64 (0 is its fixed point), and
// distinct inputs stay distinct (it is a bijection).
func TestMix64(t *testing.T) {
	if Mix64(0) != 0 {
		t.Fatalf("Mix64(0) = %#x, want 0", Mix64(0))
	}
	// fmix64 as MurmurHash3 defines it (shifts of 33, constants
	// 0xff51afd7ed558ccd and 0xc4ceb9fe1a85ec53), computed apart from this
	// package (Python, arbitrary-precision integers masked to 64 bits).
	for _, c := range []struct{ in, out uint64 }{
		{1, 0xb456bcfc34c2cb2c},
		{2, 0x3abf2a20650683e7},
		{0xdeadbeef, 0xd24bd59f862a1dac},
		{^uint64(0), 0x64b5720b4b825f21},
	} {
		if got := Mix64(c.in); got != c.out {
			t.Fatalf("Mix64(%#x) = %#x, want %#x", c.in, got, c.out)
		}
	}
	seen := map[uint64]uint64{}
	for k := uint64(1); k <= 1<<12; k++ {
		h := Mix64(k)
		if prev, dup := seen[h]; dup {
			t.Fatalf("Mix64(%d) = Mix64(%d) = %#x", k, prev, h)
		}
		seen[h] = k
	}
	// One bit flipped in the input flips about half the output bits.
	flips := 0
	for b := range 64 {
		flips += popcount(Mix64(1) ^ Mix64(1^(1<<b)))
	}
	if avg := float64(flips) / 64; avg < 24 || avg > 40 {
		t.Fatalf("average %.1f output bits flip per input bit, want about 32", avg)
	}
}

func popcount(x uint64) int {
	n := 0
	for ; x != 0; x &= x - 1 {
		n++
	}
	return n
}
