package kvindex

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// On a shared index a router never purges the instances another router's
// Sweep removes, and instances come and go under new names (pods
// replaced): the writer's map cache must not keep a record per name for
// the process's life. Each record kept costs the eviction a scan, and
// before the fix one stayed for every name ever written (300 here, past
// a cache of 100 entries: records of dropped maps, and empty maps that
// counted nothing and were never evicted). After it, every kept map
// counts at least one entry, and a record that keeps no map goes.
func TestRedisMapCacheForgetsGoneInstances(t *testing.T) {
	ctx := context.Background()
	client := redisClient(t)
	prefix := testenv.UniqueName(t)
	const limit, names = 100, 300
	a, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, MapCache: limit})
	if err != nil {
		t.Fatal(err)
	}
	sweeper, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel})
	if err != nil {
		t.Fatal(err)
	}
	for k := range names {
		name := fmt.Sprintf("pod-%d", k)
		c := newChain(Root(testModel, "", ""), 4, 4, uint32(k), uint64(k)<<8)
		mustApply(t, a, name, c.stored(0, 4))
		if k%2 == 1 {
			mustApply(t, a, name, cleared()) // its map kept, empty
		}
		if err := sweeper.Purge(ctx, name); err != nil { // another router's Sweep
			t.Fatal(err)
		}
	}
	a.maps.mu.Lock()
	kept, total := len(a.maps.byInst), a.maps.total
	sum := 0
	for _, m := range a.maps.byInst {
		sum += m.size
	}
	a.maps.mu.Unlock()
	if kept > limit {
		t.Fatalf("the map cache holds %d instance records after %d names came and went; want at most %d (its bound)", kept, names, limit)
	}
	if sum != total || total > limit {
		t.Fatalf("the cache counts %d entries, its records %d; want equal, at most %d", total, sum, limit)
	}
	// Still a working writer: a name written again is written.
	c := newChain(Root(testModel, "", ""), 4, 4, 7, 1<<40)
	mustApply(t, a, "pod-new", c.stored(0, 4))
	checkLookup(t, a, query{c.keys, map[string][4]int{"pod-new": all(4)}}, "after the churn")
}

// A Purge (Sweep's, on its own goroutine) forgets an instance whose
// record another caller already holds: an Apply that called get and
// waits for the record's lock. Before the fix forget removed the record
// anyway, and the Apply then loaded its map into a record the cache no
// longer listed: its size stayed in the total for good (release cannot
// prune it, eviction never sees it) and a later get made a second record
// for the same instance. The held record must stay the instance's, its
// size counted once and given back when it goes.
func TestMapCacheForgetWhileHeld(t *testing.T) {
	c := &mapCache{limit: 100, byInst: map[string]*instMap{}}
	apply := c.get("pod") // an Apply, waiting on m.mu
	purge := c.get("pod")
	purge.mu.Lock()
	c.forget(purge)
	c.release(purge)
	purge.mu.Unlock()

	apply.mu.Lock()
	apply.vals = map[uint64]mapVal{}
	c.resize(apply, 10) // the Apply loaded and merged 10 entries
	again := c.get("pod")
	if again != apply {
		t.Errorf("a get after the purge returned a second record for the instance")
	}
	c.release(again)
	c.release(apply)
	apply.mu.Unlock()

	c.mu.Lock()
	total, records := c.total, len(c.byInst)
	c.mu.Unlock()
	if total != 11 || records != 1 {
		t.Fatalf("after the Apply: total %d over %d records; want 11 over 1 (the map and its 10 entries)", total, records)
	}
	apply.mu.Lock()
	c.drop(apply)
	apply.mu.Unlock()
	c.mu.Lock()
	total, records = c.total, len(c.byInst)
	c.mu.Unlock()
	if total != 0 {
		t.Fatalf("after its map is dropped: total %d over %d records; want 0", total, records)
	}
}
