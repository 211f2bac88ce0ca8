package kvindex

import (
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
)

// stallHook runs fn (once) before the next pipeline of its client, when armed.
type stallHook struct {
	armed atomic.Bool
	fn    func()
}

func (h *stallHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *stallHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *stallHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.armed.CompareAndSwap(true, false) {
			h.fn()
		}
		return next(ctx, cmds)
	}
}

// regFID is the instance's field id in the registry, in hex.
func regFID(t *testing.T, r *Redis, inst string) string {
	v, err := r.rdb.HGet(context.Background(), r.regKey(), instID(inst)).Result()
	if err != nil {
		t.Fatal(err)
	}
	f, ok := regFieldID(v)
	if !ok {
		t.Fatalf("registry %q", v)
	}
	return hex.EncodeToString(f[:])
}

// metaFID is the instance's field id in its metadata, in hex.
func metaFID(t *testing.T, r *Redis, inst string) string {
	v, _ := r.rdb.HGet(context.Background(), r.metaKey(instID(inst)), fieldField).Result()
	return hex.EncodeToString([]byte(v))
}

// A late write (a router whose pipeline stalled past its lease while
// another reloaded the instance) must not put the retired field id back
// in the registry: the fields the reload retired would count again, and
// the instance's current blocks would stop counting. The registry write
// is a compare-and-set on the field id (regScript).
func TestRedisLateWriterKeepsFieldIDRetired(t *testing.T) {
	ctx := context.Background()
	prefix := testenv.UniqueName(t)
	lease := time.Second // well over one LoadAt on a loaded machine (a write starts only within half of it)
	addr := testenv.Redis(t)
	c1 := redis.NewClient(&redis.Options{Addr: addr})
	c2 := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = c1.Close(); _ = c2.Close() })
	h := &stallHook{}
	c1.AddHook(h)
	r1, err := NewRedis(c1, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4, WriterLease: lease})
	if err != nil {
		t.Fatal(err)
	}
	r2, err := NewRedis(c2, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4, WriterLease: lease})
	if err != nil {
		t.Fatal(err)
	}
	a := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	b := newChain(Root(testModel, "", ""), 4, 4, 2, 10)
	orph := newChain(Root(testModel, "", ""), 4, 4, 3, 10)
	if res, err := r1.LoadAt(ctx, "i", 1, []events.Event{a.stored(0, 3)}); err != nil || res.Status != SeqApplied {
		t.Fatal(res, err)
	}
	f1 := regFID(t, r1, "i")
	// Fields under F1 no map lists (what a failover or a failed clean-up leaves).
	for _, k := range orph.keys {
		orphanField(t, r1, a.keys[0], k)
	}
	checkLookup(t, r2, query{orph.keys, map[string][tiers.Count]int{"i": all(4)}}, "orphans before the reload (stale, documented)")
	t0 := time.Now()

	// r1's next write takes the fast path (no begin), then its pipeline is
	// delayed past its lease; meanwhile r2 reloads the instance.
	var f2 string
	h.fn = func() {
		t.Logf("stalled pipeline %v after the load", time.Since(t0))
		time.Sleep(lease + 200*time.Millisecond)
		if res, err := r2.LoadAt(ctx, "i", 5, []events.Event{a.stored(0, 3)}); err != nil || res.Status != SeqApplied {
			t.Errorf("r2 load: %v %v", res, err)
		}
		f2 = regFID(t, r2, "i")
		checkLookup(t, r2, query{orph.keys, map[string][tiers.Count]int{}}, "orphans after r2's reload (retired)")
		checkLookup(t, r2, query{a.keys, map[string][tiers.Count]int{"i": all(3)}}, "a after r2's reload")
	}
	h.armed.Store(true)
	var res SeqResult
	res, err = r1.ApplyAt(ctx, "i", Position{Seq: 1, Seeded: true}, 2, []events.Event{b.stored(0, 1)})
	if err == nil {
		t.Fatalf("late ApplyAt succeeded: %+v", res)
	}
	if reg, meta := regFID(t, r2, "i"), metaFID(t, r2, "i"); reg != f2 || meta != f2 || f2 == f1 {
		t.Fatalf("field ids: F1 %s, F2 (r2's load) %s; registry %s, metadata %s", f1, f2, reg, meta)
	}
	checkLookup(t, r2, query{orph.keys, map[string][tiers.Count]int{}}, "orphans after the late write")
	checkLookup(t, r2, query{a.keys, map[string][tiers.Count]int{"i": all(3)}}, "a after the late write")
}

// The whole metadata key lost (deleted by hand, evicted) while the log
// stays: a router without a cached map must be given the log (its
// generation "" matches the missing one's), or its write appends to the
// old log and the next router to read it counts the old entries again.
func TestRedisMetadataLostLogKept(t *testing.T) {
	ctx := context.Background()
	r, _ := newCountedRedis(t, RedisConfig{Model: testModel})
	a := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	b := newChain(Root(testModel, "", ""), 4, 4, 2, 20)
	mustApply(t, r, "i", a.stored(0, 4))
	if err := r.rdb.Del(ctx, r.metaKey(instID("i"))).Err(); err != nil {
		t.Fatal(err)
	}
	fresh := func() *Redis {
		x, err := NewRedis(r.rdb, RedisConfig{Prefix: r.prefix[:len(r.prefix)-1], Model: testModel})
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	r2 := fresh()
	mustApply(t, r2, "i", b.stored(0, 2))
	r3 := fresh()
	mustApply(t, r3, "i", b.stored(2, 3))
	n, _ := r3.Len(ctx)
	checkLookup(t, r3, query{b.keys, map[string][tiers.Count]int{"i": all(3)}}, "b")
	checkLookup(t, r3, query{a.keys, map[string][tiers.Count]int{}}, "a (old incarnation)")
	st, _ := r3.Instances(ctx)
	if n != 3 {
		t.Errorf("Len = %d, Instances %+v after r3's write, want 3 (lookups serve 3 blocks; the map counts the lost incarnation's %d entries again)", n, st, n-3)
	}
}

// A map without a field id starts over (TestRedisMapWithoutFieldID) and
// removes its fields under the id the registry still names, so that a
// purge leaves no field behind.
func TestRedisMapWithoutFieldIDLeavesNoField(t *testing.T) {
	ctx := context.Background()
	r, a, b := holdingChain(t)
	if err := r.rdb.HDel(ctx, r.metaKey(instID("i")), fieldField).Err(); err != nil {
		t.Fatal(err)
	}
	r2, _ := NewRedis(r.rdb, RedisConfig{Prefix: r.prefix[:len(r.prefix)-1], Model: testModel})
	mustApply(t, r2, "i", b.stored(0, 2))
	if err := r2.Purge(ctx, "i"); err != nil {
		t.Fatal(err)
	}
	left := 0
	for _, k := range append(a.keys, b.keys...) {
		left += len(r.rdb.HKeys(ctx, r.blockKey(k)).Val())
	}
	if left != 0 {
		t.Errorf("%d block fields left after Purge (a's %d under the lost field id)", left, len(a.keys))
	}
}

// Names with spaces: the registry's name is parsed alike by regScript and
// parseRegEntry; a second write of the same name is no collision, and a
// colliding name with spaces is reported whole.
func TestRedisNamesWithSpaces(t *testing.T) {
	ctx := context.Background()
	r, _ := newCountedRedis(t, RedisConfig{Model: testModel})
	a := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	for _, name := range []string{"my pod 1", " lead", "trail ", "a  b", ""} {
		mustApply(t, r, name, a.stored(0, 2))
		mustApply(t, r, name, a.stored(2, 3))
		mustApply(t, r, name, events.Event{Kind: events.AllBlocksCleared}, a.stored(0, 4))
	}
	if st, err := r.Instances(ctx); err != nil || len(st) != 5 {
		t.Fatalf("Instances = %+v, %v; want 5", st, err)
	}
	if ms, err := r.Lookup(ctx, a.keys); err != nil || len(ms) != 5 {
		t.Fatalf("Lookup = %+v, %v; want 5 matches", ms, err)
	}
	// A colliding other name with spaces is named whole.
	if err := r.rdb.HSet(ctx, r.regKey(), instID("pod"), "1 0000000000 other pod x").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Apply(ctx, "pod", []events.Event{a.stored(0, 1)}); !errors.Is(err, ErrInstanceID) || !strings.Contains(err.Error(), `"other pod x"`) {
		t.Fatalf("Apply = %v, want ErrInstanceID naming \"other pod x\"", err)
	}
}
