package bridge

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/tick"
	"github.com/kvrouter/kvrouter/tiers"
)

// Aging: stores-only sources.
//
// Some sources report what they store and never what they drop: LMCache's
// KV events (a BlockStored per chunk put in its CPU or remote backend) and
// shared stores behind vLLM have no BlockRemoved. Left alone, the index
// would hold such placements for as long as the instance lives, and score
// an instance for chunks its store evicted long ago. Config.AgeOut bounds
// that: a block held in an aged tier and not stored there again within the
// tier's duration is removed by a synthetic BlockRemoved, published to the
// stream like an engine message (header synthetic=aged), so every router
// and every snapshot drop it alike. Re-storing a block refreshes it. Tiers
// without a duration never age: their sources report removals.

// SyntheticAged marks a message the bridge published to remove blocks of a
// stores-only tier that were not stored again within Config.AgeOut.
const SyntheticAged = "aged"

// ReasonAged is the eviction-record reason of aged blocks.
const ReasonAged = SyntheticAged

// clock is the table's clock in unix nanoseconds.
func (t *Table) clock() int64 {
	if t.now != nil {
		return t.now()
	}
	return time.Now().UnixNano()
}

// Expired returns up to max hashes of blocks held in tier whose last store
// there is older than cutoff (unix nanoseconds), oldest first (max <= 0:
// all of them).
func (t *Table) Expired(tier tiers.Tier, cutoff int64, max int) []uint64 {
	type aged struct {
		h  uint64
		at int64
	}
	var out []aged
	for s := t.live.head; s != 0; s = t.at(s).next {
		if b := t.at(s); b.tiers.Has(tier) && b.stored[tier] < cutoff {
			out = append(out, aged{b.hash, b.stored[tier]})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].at < out[j].at })
	if max > 0 && len(out) > max {
		out = out[:max]
	}
	hs := make([]uint64, len(out))
	for i, a := range out {
		hs[i] = a.h
	}
	return hs
}

// ParseAgeOut parses "tier=duration[,tier=duration...]" (tiers as
// tiers.Parse names them: cpu, disk, shared; gpu is refused, engines
// report GPU removals) into a Config.AgeOut map.
func ParseAgeOut(s string) (map[tiers.Tier]time.Duration, error) {
	out := map[tiers.Tier]time.Duration{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	for _, part := range strings.Split(s, ",") {
		name, dur, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return nil, fmt.Errorf("age-out %q: want tier=duration", part)
		}
		t, ok := tiers.Parse(name)
		if !ok || t == tiers.GPU {
			return nil, fmt.Errorf("age-out %q: tier must be cpu, disk or shared", part)
		}
		d, err := time.ParseDuration(dur)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("age-out %q: want a positive duration", part)
		}
		out[t] = d
	}
	return out, nil
}

// ageInterval is how often aged tiers are swept: a quarter of the shortest
// duration, so a block outlives its duration by at most a quarter of it,
// within [1s, 1m] (a sweep walks the whole table).
func ageInterval(ageOut map[tiers.Tier]time.Duration) time.Duration {
	shortest := time.Duration(0)
	for _, d := range ageOut {
		if shortest == 0 || d < shortest {
			shortest = d
		}
	}
	return min(max(shortest/4, time.Second), time.Minute)
}

// ageTicker asks the process goroutine to sweep, every ageInterval.
func (in *instance) ageTicker(ctx context.Context) {
	_ = tick.Every(ctx, ageInterval(in.b.cfg.AgeOut), func() {
		select {
		case in.ageNow <- struct{}{}:
		default:
		}
	})
}

// ageOut publishes removals of the blocks of aged tiers that were not
// stored again in time and applies them to the table. It runs on the
// process goroutine, which orders everything the instance publishes.
func (in *instance) ageOut(ctx context.Context) error {
	now := time.Now()
	for _, tier := range tiers.All {
		d, ok := in.b.cfg.AgeOut[tier]
		if !ok {
			continue
		}
		for {
			in.mu.Lock()
			hs := in.table.Expired(tier, now.Add(-d).UnixNano(), in.b.cfg.MaxBlocksPerMessage)
			in.mu.Unlock()
			if len(hs) == 0 {
				break
			}
			evs := []events.Event{{Kind: events.BlockRemoved, BlockHashes: hs, Medium: tierMedium[tier]}}
			payload, err := events.Encode(nil, events.Batch{TS: float64(now.UnixNano()) / 1e9, Events: evs,
				DPRank: in.src.Rank, HasDPRank: true}, in.encoding())
			if err != nil {
				// Cannot happen for a removal of integer hashes; never stop
				// the pipeline for it.
				in.log.Error("aging: encode removals", "err", err)
				return nil
			}
			seq, err := in.publish(ctx, payload, kvstream.EventHeaders{Rank: in.src.Rank, Encoding: in.encoding().String(),
				Pool: in.b.cfg.Pool, Instance: in.src.Instance, Model: in.b.cfg.Model, Synthetic: SyntheticAged})
			if err != nil {
				return err
			}
			in.mu.Lock()
			in.table.Apply(evs)
			in.streamSeq = seq
			n := in.table.Len()
			in.mu.Unlock()
			in.b.m.tableBlocks.WithLabelValues(in.src.Instance).Set(float64(n))
			in.aged.Add(uint64(len(hs)))
			in.log.Info("aged out blocks of a stores-only tier", "tier", tier.String(), "blocks", len(hs), "after", d)
			in.evict(kvstream.EvictionRecord{Tier: tier.String(), Blocks: len(hs), Hashes: hs, Time: now.UTC(), Reason: ReasonAged})
		}
	}
	return nil
}
