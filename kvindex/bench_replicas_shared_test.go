package kvindex

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/events"
)

// applyForBench applies one stream message as a router sharing the index
// does: ApplyAt at the position from says (the instance's last message
// this router handled; the first router to meet an instance seeds it).
func applyForBench(b *testing.B, ctx context.Context, r *Redis, from map[string]uint64, inst string, seq uint64, evs []events.Event) {
	last, ok := from[inst]
	if !ok {
		if _, err := r.LoadAt(ctx, inst, 0, nil); err != nil {
			b.Fatal(err)
		}
	}
	res, err := r.ApplyAt(ctx, inst, Position{Seq: last, Seeded: true}, seq, evs)
	if err != nil || res.Status == SeqBehind {
		b.Fatalf("ApplyAt = %v, %v", res.Status, err)
	}
	from[inst] = seq
}
