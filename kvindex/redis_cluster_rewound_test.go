package kvindex

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A Cluster master restarted from its own persistence to an earlier point
// inside cluster-node-timeout keeps its node id: the topology is the same,
// and what it lost is missing while instance positions on other masters
// say it was applied. Its check counter (one per master) goes back, which
// bumps the rewind generation: the epoch changes and every position
// stamped before stops counting, so the consumers reload every instance,
// as after a failover. The replicas are kept from failing over, so the
// master comes back with its node id whatever the machine's load.
func TestRedisClusterRewound(t *testing.T) {
	ctx := context.Background()
	c := testenv.StartRedisCluster(t)
	admin := func(n *testenv.RedisServer) *redis.Client {
		cl := redis.NewClient(&redis.Options{Addr: n.Addr})
		t.Cleanup(func() { _ = cl.Close() })
		return cl
	}
	for _, n := range c.Nodes {
		if c.Role(n) == "slave" {
			if err := admin(n).ConfigSet(ctx, "cluster-replica-no-failover", "yes").Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: 8})
	t.Cleanup(func() { _ = client.Close() })
	prefix := testenv.UniqueName(t)
	r, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	// A second router's handle on the same index: it finds the same
	// rewind, and the generation moves once.
	r2, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	checkOn := func(r *Redis, what string, want bool) {
		t.Helper()
		got, err := r.Rewound(ctx)
		if err != nil || got != want {
			t.Fatalf("%s: Rewound = %v, %v; want %v", what, got, err, want)
		}
	}
	check := func(what string, want bool) {
		t.Helper()
		checkOn(r, what, want)
		checkOn(r2, what+" (second router)", want)
	}
	epochOf := func(r *Redis) string {
		t.Helper()
		e, _, err := r.Epoch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	epoch := func() string {
		t.Helper()
		e := epochOf(r)
		if e2 := epochOf(r2); e2 != e {
			t.Fatalf("the routers read different epochs: %s and %s", e, e2)
		}
		return e
	}
	ch := newChain(Root(testModel, "", ""), 8, 4, 1, 1)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	e0 := epoch()
	// No generation set yet: the stamp is the earlier releases' (the slot
	// ranges' masters hashed alone), so their positions keep counting
	// through a rolling upgrade.
	slots, err := client.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	var ranges []string
	for _, s := range slots {
		ranges = append(ranges, fmt.Sprintf("%d-%d:%s", s.Start, s.End, s.Nodes[0].ID))
	}
	slices.Sort(ranges)
	if want := fmt.Sprintf("/%016x", xxhash.Sum64String(strings.Join(ranges, ","))); r.topology() != want {
		t.Fatalf("stamp %s without a rewind generation, want the earlier releases' %s", r.topology(), want)
	}
	// The counters' keys hash where this package computes (keySlot).
	for _, tag := range []string{"0", "zz", slotTags()[43], slotTags()[16383]} {
		if got, err := client.ClusterKeySlot(ctx, "x{"+tag+"}").Result(); err != nil || int(got) != keySlot(tag) {
			t.Fatalf("CLUSTER KEYSLOT of tag %q = %d, %v; keySlot %d", tag, got, err, keySlot(tag))
		}
	}
	if res, err := r.LoadAt(ctx, "i", 1, []events.Event{ch.stored(0, 8)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("LoadAt: %+v, %v", res, err)
	}
	check("first check", false)
	check("second check", false)

	m := c.Masters()[1]
	if err := admin(m).Save(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	check("after the save", false)
	check("two after the save", false)
	m.Kill()
	m.Start() // loads its RDB: its counter two checks back
	c.WaitHealthy(30 * time.Second)
	if got := c.Role(m); got != "master" {
		t.Fatalf("the restarted node is %q, not master: it failed over", got)
	}
	// Each router checks, then reads the epoch, as the consumer does; the
	// second finds the generation already moved and leaves it.
	checkOn(r, "a master restored to an earlier point", true)
	e1 := epochOf(r)
	checkOn(r2, "a master restored to an earlier point (second router)", true)
	if e2 := epochOf(r2); e2 != e1 {
		t.Fatalf("the second router moved the rewind generation again: epoch %s, the first router's %s", e2, e1)
	}
	if e1 == e0 {
		t.Fatal("the epoch did not change after a master went back in time")
	}
	if p, err := r.Position(ctx, "i"); err != nil || p.Seeded {
		t.Fatalf("position stamped before the rewind still counts: %v, %v", p, err)
	}
	check("the check after", false)
	if e := epoch(); e != e1 {
		t.Fatalf("epoch moved again without a rewind: %s, was %s", e, e1)
	}
	// Stamped under the new generation, a position counts again.
	if res, err := r.LoadAt(ctx, "i", 2, []events.Event{ch.stored(0, 8)}); err != nil || res.Position != at(2) {
		t.Fatalf("LoadAt after the rewind: %+v, %v", res, err)
	}
	if p, err := r.Position(ctx, "i"); err != nil || p != at(2) {
		t.Fatalf("position after the reload: %v, %v", p, err)
	}
}
