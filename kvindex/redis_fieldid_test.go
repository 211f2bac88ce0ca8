package kvindex

import (
	"context"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/tiers"
)

// orphanField copies the instance's field of block key from into block key
// to, as it is: a field the instance's map does not list, which is what a
// Redis Cluster failover leaves when the master of a block key dies before
// replicating a removal (HDEL) while the map's log, on another master,
// keeps it. The instance is the block key's only holder.
func orphanField(t *testing.T, r *Redis, from, to Key) {
	t.Helper()
	ctx := context.Background()
	f, err := r.rdb.HGetAll(ctx, r.blockKey(from)).Result()
	if err != nil || len(f) != 1 {
		t.Fatalf("fields of %x: %v, %v; want one", from, f, err)
	}
	for name, val := range f {
		if err := r.rdb.HSet(ctx, r.blockKey(to), name, val).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// A field its instance's map does not list counts in lookups (nothing in
// the data tells it apart) until the instance is reloaded; from then on it
// never counts again, however many loads and clears follow. (With an
// incarnation of 3 bits it came back at the eighth.)
func TestRedisOrphanFieldRetiredForGood(t *testing.T) {
	ctx := context.Background()
	r, _ := newCountedRedis(t, RedisConfig{Model: testModel})
	c := newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	mustApply(t, r, "a", c.stored(0, 3))
	orphanField(t, r, c.keys[2], c.keys[3])
	checkLookup(t, r, query{c.keys, map[string][tiers.Count]int{"a": all(4)}}, "orphan before the reload (stale)")
	for i := range 20 {
		if _, err := r.LoadAt(ctx, "a", uint64(i+1), []events.Event{c.stored(0, 3)}); err != nil {
			t.Fatal(err)
		}
		checkLookup(t, r, query{c.keys, map[string][tiers.Count]int{"a": all(3)}}, "after a load")
		mustApply(t, r, "a", events.Event{Kind: events.AllBlocksCleared}, c.stored(0, 3))
		checkLookup(t, r, query{c.keys, map[string][tiers.Count]int{"a": all(3)}}, "after a clear")
	}
}

// holdingChain returns an index where instance "i" holds chain a (4
// blocks), and a second chain b.
func holdingChain(t *testing.T) (r *Redis, a, b chain) {
	r, _ = newCountedRedis(t, RedisConfig{Model: testModel})
	a = newChain(Root(testModel, "", ""), 4, 4, 1, 10)
	b = newChain(Root(testModel, "", ""), 4, 4, 2, 10)
	mustApply(t, r, "i", a.stored(0, 4))
	return r, a, b
}

// A failover that loses the last writes of an instance's own slot (its
// metadata and map: a clear and the blocks stored after it) while the
// block keys, on other masters, keep the fields written after the clear:
// the reload that the topology change brings must not count those fields,
// which the snapshot does not hold. (With incarnations taken from a
// counter in the metadata, the reload took the lost clear's number again
// and brought them all back.)
func TestRedisReloadAfterLostMetadata(t *testing.T) {
	ctx := context.Background()
	r, a, b := holdingChain(t)
	// DUMP and RESTORE on a client of the test's own (the index's checks
	// its commands), to the same server.
	raw := redis.NewClient(r.rdb.(*redis.Client).Options())
	t.Cleanup(func() { _ = raw.Close() })
	id := instID("i")
	saved := map[string]string{}
	for _, k := range []string{r.metaKey(id), r.logKey(id)} {
		d, err := raw.Dump(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		saved[k] = d
	}
	mustApply(t, r, "i", events.Event{Kind: events.AllBlocksCleared}, b.stored(0, 4))
	checkLookup(t, r, query{b.keys, map[string][tiers.Count]int{"i": all(4)}}, "after the clear")
	for k, d := range saved { // the failover: the instance's slot as it was
		if err := raw.RestoreReplace(ctx, k, 0, d).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Another router reloads the instance from its snapshot, which holds
	// chain a (the bridge's table before the clear, say).
	r2, err := NewRedis(raw, RedisConfig{Prefix: r.prefix[:len(r.prefix)-1], Model: testModel})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r2.LoadAt(ctx, "i", 1, []events.Event{a.stored(0, 4)}); err != nil {
		t.Fatal(err)
	}
	checkLookup(t, r2, query{a.keys, map[string][tiers.Count]int{"i": all(4)}}, "the snapshot's blocks")
	checkLookup(t, r2, query{b.keys, map[string][tiers.Count]int{}}, "the lost clear's blocks")
}

// Block keys are the prefix and 10 characters of keyAlphabet, one key per
// Key (the digits read back to it), with no brace, colon or glob
// character: no Cluster hash tag, no collision with the pool's other keys,
// SCAN patterns match them literally.
func TestRedisBlockKeyEncoding(t *testing.T) {
	if math.Pow(float64(len(keyAlphabet)), blockKeyDigits) < math.Pow(2, 64) {
		t.Fatalf("%d digits in base %d cannot hold 64 bits", blockKeyDigits, len(keyAlphabet))
	}
	seen := map[rune]bool{}
	for _, c := range keyAlphabet {
		if seen[c] || strings.ContainsRune("{}:*?[]\\", c) || c <= ' ' || c > '~' {
			t.Fatalf("alphabet character %q repeated or not allowed", c)
		}
		seen[c] = true
	}
	r, _ := newCountedRedis(t, RedisConfig{Prefix: "p"})
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 10000 {
		k := Key(rng.Uint64())
		switch i {
		case 0:
			k = 0
		case 1:
			k = Key(math.MaxUint64)
		}
		s, ok := strings.CutPrefix(r.blockKey(k), "p:")
		if !ok || len(s) != blockKeyDigits {
			t.Fatalf("block key of %x = %q", k, r.blockKey(k))
		}
		var back uint64
		for _, c := range []byte(s) {
			back = back*uint64(len(keyAlphabet)) + uint64(strings.IndexByte(keyAlphabet, c))
		}
		if Key(back) != k {
			t.Fatalf("block key %q reads back as %x, want %x", s, back, k)
		}
	}
}

// A map whose metadata lost its field id (deleted by hand) cannot tell its
// fields apart: the next write starts the instance over with what it
// stores, instead of failing every write from then on.
func TestRedisMapWithoutFieldID(t *testing.T) {
	ctx := context.Background()
	r, a, b := holdingChain(t)
	if err := r.rdb.HDel(ctx, r.metaKey(instID("i")), fieldField).Err(); err != nil {
		t.Fatal(err)
	}
	r2, err := NewRedis(r.rdb, RedisConfig{Prefix: strings.TrimSuffix(r.prefix, ":"), Model: testModel}) // no cached map
	if err != nil {
		t.Fatal(err)
	}
	mustApply(t, r2, "i", b.stored(0, 2))
	checkLookup(t, r2, query{b.keys, map[string][tiers.Count]int{"i": all(2)}}, "what the write stored")
	checkLookup(t, r2, query{a.keys, map[string][tiers.Count]int{}}, "the map before it")
	if st, err := r2.Instances(ctx); err != nil || len(st) != 1 || st[0].Blocks != blocks(2, 0, 0, 0) {
		t.Fatalf("counters %+v, %v; want 2 blocks", st, err)
	}
}
