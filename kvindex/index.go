// Package kvindex is the router's global map of which instance holds which KV
// block, in which tier: block keys, the Index interface, and its memory and
// Redis backends.
package kvindex

import (
	"context"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// Key is a router block key: a chained xxhash64 over a block's tokens (see keys.go).
type Key uint64

// Match is what one instance holds of a looked-up key chain: for each tier,
// the number of leading blocks of the chain present in that tier or a faster
// one, contiguous from block 0. Blocks[tiers.GPU] <= Blocks[tiers.CPU] <= ...
// so that "GPU blocks, then CPU blocks beyond them" reads as
// Blocks[GPU], Blocks[CPU]-Blocks[GPU], and so on.
type Match struct {
	Instance string
	Blocks   [tiers.Count]int
}

// ApplyResult counts what Apply did with a batch of events.
type ApplyResult struct {
	Stored   int // block placements added (per tier)
	Removed  int // block placements dropped (per tier)
	Cleared  int // AllBlocksCleared applied
	Orphans  int // stored blocks whose parent was never seen: dropped
	Unmapped int // removals or tokenless stores of engine hashes never mapped: dropped
	Skipped  int // blocks of other KV-cache groups' events (not full attention): dropped
	// Invalid counts events dropped as malformed: token count not a whole
	// number of blocks or not matching the block hashes, block size unknown
	// or contradicting the pool's. InvalidErr says why the first one was
	// dropped (wrapping ErrTokenCount or ErrBlockSize), for the caller's log.
	Invalid    int
	InvalidErr error
	// UnknownMedium counts stored or removed blocks whose medium is not in
	// the tier table; they were applied to tiers.UnknownMediumTier.
	UnknownMedium int
}

// Add adds o's counts to r; r keeps its own InvalidErr when it has one.
func (r *ApplyResult) Add(o ApplyResult) {
	r.Stored += o.Stored
	r.Removed += o.Removed
	r.Cleared += o.Cleared
	r.Orphans += o.Orphans
	r.Unmapped += o.Unmapped
	r.Skipped += o.Skipped
	r.Invalid += o.Invalid
	r.UnknownMedium += o.UnknownMedium
	if r.InvalidErr == nil {
		r.InvalidErr = o.InvalidErr
	}
}

// InstanceStats is the index's view of one instance.
type InstanceStats struct {
	Instance  string
	Blocks    [tiers.Count]int
	LastEvent time.Time
}

// Index is the global block map of one pool. All methods are safe for
// concurrent use; Apply calls for one instance must be made in event order
// (callers shard by instance), calls for different instances may overlap.
type Index interface {
	// Apply applies one instance's events, in order.
	Apply(ctx context.Context, instance string, evs []events.Event) (ApplyResult, error)
	// Lookup returns, for every instance holding at least keys[0], how many
	// leading keys it holds per tier. Instances holding nothing are omitted.
	Lookup(ctx context.Context, keys []Key) ([]Match, error)
	// Purge drops everything known about an instance.
	Purge(ctx context.Context, instance string) error
	// Instances reports per-instance block counts and last event time.
	Instances(ctx context.Context) ([]InstanceStats, error)
	// Len is the number of (block, instance) entries held.
	Len(ctx context.Context) (int, error)
	// BlockSize is the pool's block size in tokens: the configured one, else
	// the one learned from the first event that carried it, else 0.
	BlockSize() int
}
