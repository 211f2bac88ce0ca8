package consumer

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// startProductionRouter is startRouter with the Redis client options and
// writer lease kvrouter itself uses (go-redis's defaults: 5 s read
// timeout, 3 retries; the default lease; context deadlines honoured on
// reads and writes, as router/kvstate builds its client), not the tests'
// short ones.
func (w *sharedWorld) startProductionRouter() *router {
	w.t.Helper()
	return w.startRouterWith(redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{w.redis.Addr}, ContextTimeoutEnabled: true}), 0)
}

// Redis hangs (SIGSTOP: connections held, nothing answered, as a Redis
// stuck in a fork, on a slow disk or in a paused VM) while the engines
// keep changing their caches, then runs again and executes what its
// clients sent meanwhile. Found on the real binaries: a router kept the
// index reported consistent and healthy through a 13 s hang, and after
// one hang an instance's blocks stayed 627 below the engine's while live.
// The routers must notice the hang within about a second (the epoch
// check's due time; 4 s allowed), not once go-redis gives up (15 s), and
// the index must equal the engines afterwards.
func TestSharedRedisHung(t *testing.T) {
	w := newSharedWorld(t, 23, "e0", "e1", "e2")
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	// The routers start just before the engines' first messages (the
	// start-order miss of docs/BENCHMARKS.md §3, Session 17, showed
	// here; shared_start_test.go holds it deterministically).
	r1, r2 := w.startProductionRouter(), w.startProductionRouter()
	w.publish(1)
	w.converge("first messages", r1, r2)
	w.publish(30)
	w.converge("before the hang", r1, r2)

	for round := range 2 {
		w.redis.Pause()
		hung := time.Now()
		w.publish(40) // into the stream only: the routers' applies hang
		for _, r := range []*router{r1, r2} {
			testenv.WaitFor(t, 4*time.Second, "the hang noticed", func() bool { return !r.c.Healthy() })
		}
		for _, r := range []*router{r1, r2} {
			// As a scrape reads it, whatever else asked meanwhile.
			if g := r.consistentGauge(t); g != 0 {
				t.Fatalf("kvrouter_events_index_consistent = %v during the hang", g)
			}
		}
		t.Logf("round %d: hang noticed by both routers after %v", round, time.Since(hung).Round(time.Millisecond))
		time.Sleep(8 * time.Second) // past go-redis's read timeout (5 s): timed-out writes sent again
		w.redis.Resume()
		w.publish(10)
		w.converge("after the hang", r1, r2)
	}
	close(stop)
	hb.Wait()
}
