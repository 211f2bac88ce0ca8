// Package tiers names the storage tiers a KV block can live in, parses the
// engine's "medium" strings into them, and holds the per-tier cost model that
// scoring uses.
package tiers

import "strings"

// Tier is a storage tier for KV blocks, ordered from fastest to slowest.
type Tier uint8

const (
	// GPU is device memory (HBM): a hit costs nothing beyond the lookup.
	GPU Tier = iota
	// CPU is host memory (offloaded blocks): a hit costs a host-to-device copy.
	CPU
	// Disk is local NVMe or filesystem storage.
	Disk
	// Shared is a remote or shared tier (another node, a cache service, a network filesystem).
	Shared
)

// Count is the number of tiers.
const Count = 4

// All lists every tier, fastest first.
var All = [Count]Tier{GPU, CPU, Disk, Shared}

var names = [Count]string{"gpu", "cpu", "disk", "shared"}

// String returns the tier's lower-case name, used in metrics labels, JSON and headers.
func (t Tier) String() string {
	if int(t) < Count {
		return names[t]
	}
	return "unknown"
}

// Bit returns the tier's bit in a tier set.
func (t Tier) Bit() Set { return 1 << t }

// Parse is the inverse of String.
func Parse(s string) (Tier, bool) {
	for i, n := range names {
		if strings.EqualFold(s, n) {
			return Tier(i), true
		}
	}
	return 0, false
}

// Set is a bit set of tiers (bit i = Tier(i)).
type Set uint8

// Has reports whether t is in the set.
func (s Set) Has(t Tier) bool { return s&t.Bit() != 0 }

// UnknownMediumTier is the tier an unrecognised medium maps to. CPU is the
// middle ground: a block the engine reports in a tier we do not know is
// neither free to use (GPU) nor as costly as a remote fetch; FromMedium
// reports it as unknown so callers count it.
const UnknownMediumTier = CPU

// FromMedium maps a vLLM event "medium" string to a tier. The names are the
// ones seen from vLLM and its offloading connectors (vLLM's BlockStored
// "medium" field; OffloadingConnector and LMCache name their own):
// GPU/DEVICE; CPU/CPU_PINNED/CPU_TIER1; DISK/NVME/STORAGE/CPU_TIER2;
// EXTERNAL/REMOTE/SHARED/NETWORK. An empty or nil medium means GPU, as vLLM
// omits it for device blocks in older versions. ok is false for a medium not
// in the table; the tier is then UnknownMediumTier.
func FromMedium(medium string) (t Tier, ok bool) {
	switch strings.ToUpper(medium) {
	case "", "GPU", "DEVICE", "CUDA", "HBM":
		return GPU, true
	case "CPU", "CPU_PINNED", "CPU_TIER1", "HOST":
		return CPU, true
	case "DISK", "NVME", "STORAGE", "CPU_TIER2", "SSD", "FILE":
		return Disk, true
	case "EXTERNAL", "REMOTE", "SHARED", "NETWORK":
		return Shared, true
	}
	return UnknownMediumTier, false
}
