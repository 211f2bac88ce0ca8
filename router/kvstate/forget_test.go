package kvstate

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/tiers/tiermetrics"
)

// TestSharedAccountingForgets: with the shared Redis index, the router's
// per-instance tier accounting (three series per tier) goes when the
// consumer purges an instance (Forget) or the index sweeps one silent
// past its TTL (Sweep, which the consumer finds behind this applier).
// Before, the consumer never purged it in shared mode and found no
// Sweeper behind the applier: the series of every instance name ever seen
// stayed, and Redis kept a dead instance's block keys (a review).
func TestSharedAccountingForgets(t *testing.T) {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: testenv.Redis(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	clock := time.Unix(1_800_000_000, 0)
	rs, err := kvindex.NewRedis(rdb, kvindex.RedisConfig{Model: "m", Prefix: testenv.UniqueName(t), TTL: time.Hour,
		Now: func() time.Time { return clock }})
	if err != nil {
		t.Fatal(err)
	}
	acct, err := tiermetrics.NewAccounting(nil)
	if err != nil {
		t.Fatal(err)
	}
	a := &sharedAccountingApplier{accountingApplier{Index: rs, acct: acct}, rs}
	store := func(instance string, from int) {
		t.Helper()
		if _, err := a.Apply(ctx, instance, []events.Event{{Kind: events.BlockStored, BlockHashes: kvevHashes(from, 4),
			TokenIDs: kvevTokens(64), BlockSize: 16, Medium: "GPU"}}); err != nil {
			t.Fatal(err)
		}
	}
	store("quiet", 1)
	clock = clock.Add(50 * time.Minute)
	store("busy", 100)
	store("purged", 200)
	if acct.Held("quiet")[0] != 4 || acct.Held("busy")[0] != 4 || acct.Held("purged")[0] != 4 {
		t.Fatalf("held quiet %v, busy %v, purged %v; want 4 GPU blocks each", acct.Held("quiet"), acct.Held("busy"), acct.Held("purged"))
	}
	a.Forget("purged")
	if acct.Held("purged")[0] != 0 {
		t.Errorf("purged: accounting held %v after Forget", acct.Held("purged"))
	}
	clock = clock.Add(20 * time.Minute) // quiet: 70 min silent, past the TTL
	var sw any = a
	s, ok := sw.(interface {
		Sweep(context.Context) ([]string, error)
	})
	if !ok {
		t.Fatal("the shared applier has no Sweep: the consumer would never sweep")
	}
	gone, err := s.Sweep(ctx)
	if err != nil || !slices.Equal(gone, []string{"quiet"}) {
		t.Fatalf("Sweep = %v, %v; want [quiet]", gone, err)
	}
	if acct.Held("quiet")[0] != 0 || acct.Held("busy")[0] != 4 {
		t.Errorf("after the sweep: held quiet %v, busy %v; want quiet forgotten, busy kept", acct.Held("quiet"), acct.Held("busy"))
	}
}
