// Package fmix is MurmurHash3's 64-bit finaliser (fmix64), shared by the
// index's hash table (engine hashes are not always uniform: tests and some
// engines use small integers) and the router's rendezvous and tenant
// hashing — standard library free.
package fmix

// Mix64 is fmix64: a bijection on 64-bit words with full avalanche, cheap
// enough for a hot loop (the compiler inlines it).
func Mix64(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}
