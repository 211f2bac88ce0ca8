package kvindex

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
)

// productionClient is the client kvrouter builds for a single Redis
// (router/kvstate.NewPoolIndexes), not the tests' MaxRetries -1 one.
func productionClient(t *testing.T, addr string) redis.UniversalClient {
	c := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{addr}})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// warmPool opens n connections at once and leaves them idle in the pool,
// as a router's concurrent shards do.
func warmPool(t *testing.T, c redis.UniversalClient, n int) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.Do(context.Background(), "blpop", "warm-pool-"+testenv.UniqueName(t)+string(rune('a'+i)), 0.2).Err()
		}()
	}
	wg.Wait()
}

// waitDrained waits until Redis has run everything its clients sent: no
// client with unread query bytes, twice in a row.
func waitDrained(t *testing.T, c redis.UniversalClient) {
	quiet := 0
	testenv.WaitFor(t, 30*time.Second, "redis drained its clients' queries", func() bool {
		list, err := c.ClientList(context.Background()).Result()
		if err != nil {
			quiet = 0
			return false
		}
		for _, l := range strings.Split(strings.TrimSpace(list), "\n") {
			if !strings.Contains(l, " qbuf=0 ") && !strings.Contains(l, "cmd=client|list") {
				quiet = 0
				return false
			}
		}
		quiet++
		return quiet >= 2
	})
}

// Redis hangs (SIGSTOP) between a snapshot load's two round trips, with
// the client kvrouter uses in production. The load's write pipeline
// (block keys, then the commit) sits in the hung server's socket; the
// client gives up, takes the written fields back (unsettle) and returns
// an error. When Redis runs again it executes every copy of the pipeline
// and the take-back, interleaved 16 KB at a time per connection. After
// that the instance's position must either say its state is not whole
// (unseeded: the consumer reloads it) or its state must be exactly what
// the position says: every block of the snapshot found by lookups.
func TestRedisHungLoad(t *testing.T) {
	// Sizes: a pipeline larger than the loopback socket takes while the
	// server is stopped (cut short: no commit sent), and one it takes
	// whole (everything runs at the resume).
	for _, tc := range []struct {
		name        string
		nOld, nSnap int
	}{{"cut short", 1500, 2400}, {"whole", 20, 32}} {
		t.Run(tc.name, func(t *testing.T) { testRedisHungLoad(t, tc.nOld, tc.nSnap) })
	}
}

func testRedisHungLoad(t *testing.T, nOld, nSnap int) {
	ctx := context.Background()
	// The old state's removals come first in the load's pipeline, the
	// snapshot's stores after them: with more stores than removals, the
	// take-back's first commands reach stores the load has already
	// written, and it ends before the load's commit does.
	h := startHungLoad(t, nOld, nSnap)
	srv, c, r, old, snap := h.srv, h.c, h.r, h.old, h.snap
	checkLookup(t, r, query{old.keys, map[string][tiers.Count]int{"i": all(nOld)}}, "before the hang")

	h.pauseNow.Store(true)
	hung := time.Now()
	res, err := r.LoadAt(ctx, "i", 20, []events.Event{snap.stored(0, nSnap)})
	t.Logf("load during the hang: status %v, err %v, after %v", res.Status, err, time.Since(hung).Round(time.Millisecond))
	srv.Resume()
	waitDrained(t, c)

	pos, err := r.Position(ctx, "i")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after the hang: position %v", pos)
	switch {
	case pos.Seeded && pos.Seq == 20:
		checkLookup(t, r, query{snap.keys, map[string][tiers.Count]int{"i": all(nSnap)}}, "position 20 (the load ran late): the snapshot")
		checkLookup(t, r, query{old.keys, nil}, "position 20 (the load ran late): the old state")
	case pos.Seeded && pos.Seq == 10:
		checkLookup(t, r, query{old.keys, map[string][tiers.Count]int{"i": all(nOld)}}, "position 10: the old state")
		checkLookup(t, r, query{snap.keys, nil}, "position 10: the snapshot")
	case pos.Seeded:
		t.Fatalf("position %v: neither load's", pos)
	}
	// Not whole, or whole: a reload makes it exact either way.
	if res, err := r.LoadAt(ctx, "i", 30, []events.Event{snap.stored(0, nSnap)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("reload: %+v %v", res, err)
	}
	checkLookup(t, r, query{snap.keys, map[string][tiers.Count]int{"i": all(nSnap)}}, "after the reload: the snapshot")
	checkLookup(t, r, query{old.keys, nil}, "after the reload: the old state")
}

// A load replacing a large map, with Redis hung while it is sent: its
// removals of the old incarnation's fields must not outlive what lists
// them. Sent after the commit, a pipeline cut short in them left the old
// fields in block keys for good (10,422 of 20,000 after a reload and a
// purge: nothing named the old field id any more); before the commit,
// the reload, still under the old id, removes them.
func TestRedisHungLoadLeavesNoOldFields(t *testing.T) {
	ctx := context.Background()
	const nOld, nSnap = 20000, 4
	h := startHungLoad(t, nOld, nSnap)
	srv, c, r, old, snap := h.srv, h.c, h.r, h.old, h.snap
	oldFid, _ := c.HGet(ctx, r.metaKey(instID("i")), fieldField).Result()
	h.pauseNow.Store(true)
	res, err := r.LoadAt(ctx, "i", 20, []events.Event{snap.stored(0, nSnap)})
	t.Logf("load during the hang: %+v %v", res, err)
	srv.Resume()
	waitDrained(t, c)
	pos, _ := r.Position(ctx, "i")
	t.Logf("position after: %v", pos)
	if res, err := r.LoadAt(ctx, "i", 30, []events.Event{snap.stored(0, nSnap)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("reload: %+v %v", res, err)
	}
	if err := r.Purge(ctx, "i"); err != nil {
		t.Fatal(err)
	}
	left := 0
	for _, k := range old.keys {
		if n, _ := c.HExists(ctx, r.blockKey(k), oldFid).Result(); n {
			left++
		}
	}
	t.Logf("after reload and purge: %d of %d old fields left", left, nOld)
	if left > 0 {
		t.Fatalf("%d old-incarnation fields left after a reload and a purge of the instance", left)
	}
}

// hungLoad is a Redis index on its own redis-server, through the
// production client, whose instance "i" holds old at position 10; setting
// pauseNow hangs the server at the next write, between its first round
// trip and its pipeline.
type hungLoad struct {
	srv       *testenv.RedisServer
	c         redis.UniversalClient
	r         *Redis
	pauseNow  *atomic.Bool
	old, snap chain
}

func startHungLoad(t *testing.T, nOld, nSnap int) hungLoad {
	t.Helper()
	h := hungLoad{srv: testenv.StartRedis(t), pauseNow: new(atomic.Bool)}
	h.c = productionClient(t, h.srv.Addr)
	var err error
	h.r, err = NewRedis(h.c, RedisConfig{Prefix: testenv.UniqueName(t), Model: testModel, BlockSize: 4, ExactLookup: true,
		Now: func() time.Time {
			// Called once per write, between its first round trip and
			// its pipeline: the hang starts there.
			if h.pauseNow.Swap(false) {
				h.srv.Pause()
			}
			return time.Now()
		}})
	if err != nil {
		t.Fatal(err)
	}
	root := Root(testModel, "", "")
	h.old = newChain(root, nOld, 4, 1, 1)
	h.snap = newChain(root, nSnap, 4, 7, 1_000_000)
	warmPool(t, h.c, 8)
	if res, err := h.r.LoadAt(context.Background(), "i", 10, []events.Event{h.old.stored(0, nOld)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("first load: %+v %v", res, err)
	}
	return h
}

// Redis hangs while a router asks for the epoch on an empty index, with
// the production client: go-redis sends SET NX GET again after the read
// timeout, and at the resume the first copy creates the epoch, the
// second finds it. The call still reports that it created it (the value
// found is its own), so the consumer's first check knows the index held
// nothing of this pool. Old code: created false.
func TestRedisHungEpochCreated(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	c := productionClient(t, srv.Addr)
	warmPool(t, c, 4) // the re-sent copy goes out on an idle connection
	r, err := NewRedis(c, RedisConfig{Prefix: testenv.UniqueName(t), Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	srv.Pause()
	type answer struct {
		epoch   string
		created bool
		err     error
	}
	done := make(chan answer, 1)
	go func() {
		e, created, err := r.Epoch(ctx)
		done <- answer{e, created, err}
	}()
	// Past the first read timeout (5 s): a second copy is on its way.
	time.Sleep(6500 * time.Millisecond)
	srv.Resume()
	a := <-done
	t.Logf("epoch %q, created %v, err %v", a.epoch, a.created, a.err)
	if a.err != nil {
		return // no answer: the consumer checks again
	}
	if !a.created {
		t.Fatalf("Epoch on an empty index reported the epoch found, not created")
	}
	if e, created, err := r.Epoch(ctx); err != nil || created || e != a.epoch {
		t.Fatalf("second Epoch = %q, %v, %v; want %q, false", e, created, err, a.epoch)
	}
}

// lateCancel is a caller's context cancelled just after its first Err
// call: between a check of the context and its next use.
type lateCancel struct {
	context.Context // Background: no deadline, no values
	once            sync.Once
	done            chan struct{}
}

func (c *lateCancel) Done() <-chan struct{} { return c.done }

func (c *lateCancel) Err() error {
	select {
	case <-c.done:
		return context.Canceled
	default:
	}
	c.once.Do(func() { close(c.done) })
	return nil
}

// Once unsettle has decided to mark an instance (a write of unknown
// outcome), the mark goes out with its own bound, whatever the caller's
// context does: unsettle checked ctx.Err() and only then derived its
// timeout from the caller's context, so a cancellation in between (a
// router shutting down) cut the mark, and another router read the
// instance at its old position as whole.
func TestRedisUnsettleMarksWhenCallerCancels(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	newIndex := func() (*Redis, *redis.Client) {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { _ = c.Close() })
		r, err := NewRedis(c, RedisConfig{Prefix: "unsettle", Model: "m", BlockSize: 4})
		if err != nil {
			t.Fatal(err)
		}
		return r, c
	}
	r, c := newIndex()
	if res, err := r.LoadAt(ctx, "i", 10, nil); err != nil || res.Status != SeqApplied {
		t.Fatalf("load: %+v %v", res, err)
	}
	m := r.maps.peek("i")
	if m == nil {
		t.Fatal("no map of i after its load")
	}
	mkey := r.metaKey(instID("i"))
	r.unsettle(&lateCancel{Context: ctx, done: make(chan struct{})}, m, mkey, nil, nil)
	if n := m.unsettled.Load(); n != 0 {
		t.Errorf("the mark not sent: %d write(s) left unsettled", n)
	}
	if v, err := c.HGet(ctx, mkey, fieldTopology).Result(); err != nil || v != "!" {
		t.Errorf("i's topology field %q (%v) in Redis, want the mark %q", v, err, "!")
	}
	// Another router (no map of its own to settle) must read i unseeded.
	other, _ := newIndex()
	if p, err := other.Position(ctx, "i"); err != nil || p.Seeded {
		t.Fatalf("another router reads i at %v (%v) after a write of unknown outcome, want unseeded", p, err)
	}
}
