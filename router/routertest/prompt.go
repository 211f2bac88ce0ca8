package routertest

// Prompt returns n token ids drawn from a xorshift sequence seeded by seed:
// deterministic, distinct prompts for tests that store and look up blocks.
func Prompt(seed uint32, n int) []uint32 {
	out := make([]uint32, n)
	x := seed*2654435761 + 7
	for i := range out {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		out[i] = x % 100000
	}
	return out
}
