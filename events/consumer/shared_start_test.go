package consumer

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// The start of a router on a shared index: it lists the bucket's
// snapshots (syncing each instance listed), then creates its stream
// consumer. Found by Session 17's bug hunt as an instance left empty in
// the index while live, in 3 of about 20 runs of TestSharedRedisHung with
// the routers started just before the first messages. These tests stop
// each router between its listing and its consumer's creation
// (Consumer.afterListing) to store messages in that window.

// startHeld starts n routers, each held between its start's listing and
// its consumer's creation (Consumer.afterListing); once all n are, it
// runs window, which stores what it tests in that window, and lets them
// go on.
func (w *sharedWorld) startHeld(n int, window func(rs []*router)) []*router {
	w.t.Helper()
	listed, release := make(chan struct{}, n), make(chan struct{})
	w.afterListing = func() {
		listed <- struct{}{}
		<-release
	}
	defer func() { w.afterListing = nil }()
	var rs []*router
	for range n {
		rs = append(rs, w.startRouter())
	}
	for range n {
		select {
		case <-listed:
		case <-time.After(30 * time.Second):
			w.t.Fatal("router not at its start's listing after 30s")
		}
	}
	window(rs)
	close(release)
	return rs
}

// convergeBeating is converge with every engine's bridge heartbeating.
func (w *sharedWorld) convergeBeating(what string, rs ...*router) {
	w.t.Helper()
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	defer func() { close(stop); hb.Wait() }()
	w.converge(what, rs...)
}

// joinExisting stores the pool's index epoch in Redis, as routers that
// ran before left it: the routers under test join an existing shared
// index (a rolling restart), so none of them lists the bucket again at
// its first epoch check, as the first router on a new Redis does.
func (w *sharedWorld) joinExisting() {
	w.t.Helper()
	client := redis.NewClient(&redis.Options{Addr: w.redis.Addr})
	defer func() { _ = client.Close() }()
	idx, err := kvindex.NewRedis(client, kvindex.RedisConfig{Prefix: w.prefix, Model: sharedModel, BlockSize: sharedBS})
	if err != nil {
		w.t.Fatal(err)
	}
	if _, _, err := idx.Epoch(w.ctx); err != nil {
		w.t.Fatal(err)
	}
}

// An instance's first messages stored after the routers listed the
// bucket and before they created their consumers (its snapshot written
// after each, as a bridge does), then only heartbeats: no router listed
// it, and a consumer created at the stream's end then never delivers
// them. The index must hold its blocks once every router calls it live.
func TestSharedRedisStartWindow(t *testing.T) {
	w := newSharedWorld(t, 31, "e0", "first")
	w.joinExisting()
	w.publish(3, "e0")
	rs := w.startHeld(2, func([]*router) {
		for w.held("first") == 0 {
			w.publish(1, "first") // it must hold blocks for a miss to show
		}
	})
	w.publish(5, "e0") // "first" sends nothing more
	w.convergeBeating("an instance's messages stored between listing and consuming", rs...)
}

// An instance whose messages were stored before the routers started, with
// no snapshot in the bucket when they listed it (a bridge's first
// messages, its first snapshot not yet written), then silent but for its
// heartbeats: no router gets its messages from the stream, and it is in
// no snapshot they listed. Its heartbeat makes it known: it must not be
// called live until its state in the index was checked and repaired.
func TestSharedRedisStartMissesNoInstance(t *testing.T) {
	w := newSharedWorld(t, 17, "e0", "first")
	w.joinExisting()
	for w.held("first") == 0 {
		w.publish(1, "first")
	}
	w.publish(5, "e0")
	kv, err := kvstream.EnsureBucket(w.ctx, w.js, w.cfg.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := kvstream.SnapshotKey(w.pool, "first")
	snap, err := kv.Get(w.ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(w.ctx, key); err != nil { // not written yet when the routers list the bucket
		t.Fatal(err)
	}
	rs := w.startHeld(2, func([]*router) {
		if _, err := kv.Put(w.ctx, key, snap.Value()); err != nil { // the bridge writes it after
			t.Fatal(err)
		}
	})
	w.publish(5, "e0") // "first" sends nothing more
	w.convergeBeating("an instance's messages stored before the routers started", rs...)
}

// A router joins an index another router kept (that one has stopped and
// its writer lease run out); the instance is listed and synced, its
// position read, and then a message of it is stored before the new
// router's consumer is made. A consumer started at the stream's end as it
// is then never delivers that message: the instance stays without it,
// live and the index consistent, while the engine is idle, and the next
// message is applied at the position the sync found (seen: "from=3 seq=5
// applied"), so the index misses it for good.
func TestSharedRedisStartWindowAfterSync(t *testing.T) {
	w := newSharedWorld(t, 5, "e0")
	r1 := w.startRouter()
	w.publish(3)
	w.convergeBeating("the first router", r1)
	r1.stop()
	time.Sleep(5 * sharedLease) // its writer lease runs out

	rs := w.startHeld(1, func(rs []*router) {
		c := rs[0].c
		testenv.WaitFor(t, 30*time.Second, "e0 synced by the new router", func() bool {
			c.mu.RLock()
			defer c.mu.RUnlock()
			in := c.insts["e0"]
			return in != nil && in.expect.Seeded && !in.syncQueued
		})
		for w.diff(rs[0].idx) == "" {
			w.publish(1) // after the sync read the stream: until the engine differs from the index
		}
	})
	// The engine is idle from here.
	w.convergeBeating("a message stored between the sync and the consumer", rs...)
}
