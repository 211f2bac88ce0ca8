package test

import (
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tiers"
)

// One NATS node killed mid-load, twice: first the node leading the events
// stream (JetStream elects a new leader from the two replicas left), then,
// after it is back, the node the router is connected to (the router's
// connection fails over to another seed). Through both, clients see no
// error, bridges drop nothing (they buffer and resend, JetStream drops the
// duplicates), the consumers miss no event (no gap, nothing lost to
// replay), events flow again within a bound, and afterwards the index
// holds every engine's cache block for block.
func TestE2ENATSNodeKillUnderLoad(t *testing.T) {
	f := newClusterFleet(t, 3, 128, 50)
	cfg := f.routerConfig()
	r := f.startRouter(cfg)
	if got := r.kve.Conn().Servers(); len(got) < 3 {
		t.Fatalf("router's NATS connection knows %d servers (%v), want every seed", len(got), got)
	}
	for _, u := range strings.Split(f.nc.URLs(), ",") {
		if !slices.Contains(r.kve.Conn().Servers(), u) {
			t.Fatalf("seed %s missing from the router's server list %v", u, r.kve.Conn().Servers())
		}
		for _, e := range f.engines {
			if !slices.Contains(e.bridge.Servers(), u) {
				t.Fatalf("seed %s missing from %s's bridge server list %v", u, e.id, e.bridge.Servers())
			}
		}
	}
	c, a := f.startConsumer()
	l := f.startLoad([]*clusterRouter{r}, 4, 1)
	defer l.finish()
	testenv.WaitFor(t, 30*time.Second, "traffic", func() bool { return l.sent.Load() > 50 })

	// Both consumers must recover: the test's own and the router's (its
	// index is what routing reads; a stall there alone once went unseen
	// here, as its Healthy stays true while it delivers nothing).
	rc, ok := r.kve.Consumer(f.pool)
	if !ok {
		t.Fatalf("the router has no consumer for pool %s", f.pool)
	}
	consumers := []struct {
		name string
		c    *consumer.Consumer
	}{{"test consumer", c}, {"router's consumer", rc}}
	kill := func(what string, node int) {
		t.Helper()
		sentBefore := l.sent.Load()
		t.Logf("%s: JetStream health before killing node %d (meta leader: node %d): %s", what, node, f.nc.MetaLeader(), f.nc.Health())
		killed := time.Now()
		f.nc.Kill(node)
		// Where each bridge was when the node went: what it publishes
		// after must reach the consumer.
		var before []uint64
		for _, e := range f.engines {
			before = append(before, e.br.Stats()[0].StreamSeq)
		}
		// Every engine gets fresh prompts of its own (besides the routed
		// load, which may favour some), so each has events to carry.
		stopPoke := f.poke()
		defer stopPoke()
		// Recovered: each bridge has published past where it was at the
		// kill, and both consumers have applied it.
		// stuck says which engines have not recovered yet: the bridge has
		// published nothing since the kill, or a consumer has not applied
		// what it published ("" once all have).
		stuck := func() string {
			var bad []string
			for i, e := range f.engines {
				seq := e.br.Stats()[0].StreamSeq
				if seq <= before[i] {
					bad = append(bad, fmt.Sprintf("%s: bridge at %d, not past %d (connected to %q)", e.id, seq, before[i], e.bridge.ConnectedUrl()))
					continue
				}
				for _, cons := range consumers {
					at := uint64(0)
					for _, s := range cons.c.Instances() {
						if s.Instance == e.id {
							at = s.StreamSeq
						}
					}
					if at < seq {
						bad = append(bad, fmt.Sprintf("%s: bridge at %d, %s at %d", e.id, seq, cons.name, at))
					}
				}
			}
			return strings.Join(bad, "; ")
		}
		deadline := time.Now().Add(60 * time.Second)
		for d := stuck(); d != ""; d = stuck() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: events not flowing again 60s after the kill: %s; consumer healthy=%v; stream leader node %d; JetStream health: %s; %s",
					what, d, c.Healthy(), f.nc.StreamLeader(f.stream.Name), f.nc.Health(), dumpGoroutines(t))
			}
			time.Sleep(10 * time.Millisecond)
		}
		recovery := time.Since(killed)
		testenv.WaitFor(t, 60*time.Second, what+": the router's stream healthy (exact routing)", func() bool { return r.kve.StreamHealthy(f.pool) })
		exact := time.Since(killed)
		testenv.WaitFor(t, 30*time.Second, what+": routing after the kill", func() bool { return l.sent.Load() > sentBefore+50 })
		t.Logf("%s (node %d): events flowing end to end again %.3fs after the kill, the router routing exactly again after %.3fs; %s",
			what, node, recovery.Seconds(), exact.Seconds(), l.summary())
		f.nc.Restart(node)
		f.nc.WaitJetStream(30 * time.Second)
		// The next kill only once the restarted node has caught up:
		// killing a second node before it is current would take away
		// two of the stream's three replicas, not one.
		f.nc.WaitHealthy(60 * time.Second)
	}
	leader := f.nc.StreamLeader(f.stream.Name)
	if leader < 0 {
		t.Fatal("the events stream has no leader")
	}
	kill("stream leader killed", leader)
	kill("router's node killed", f.nodeOf(r.kve.Conn()))

	l.finish()
	if n := l.failed.Load(); n > 0 {
		t.Fatalf("clients saw %d errors (last: %v); %s", n, l.lastErr.Load(), l.summary())
	}
	f.waitExact(a, "after the kills", c)
	dropped, gaps := f.lost(c)
	t.Logf("lost events: %d dropped or unreplayable at the bridges, %d gaps at the consumer; %s", dropped, gaps, l.summary())
	if dropped+gaps > 0 {
		t.Fatalf("lost events: %d dropped at the bridges, %d gaps at the consumer", dropped, gaps)
	}
	// The router's own index agrees on every engine's block count.
	testenv.WaitFor(t, 30*time.Second, "router index block counts", func() bool {
		idx, _ := r.kve.KV(cfg.Pools[0])
		st, err := idx.Instances(f.ctx)
		if err != nil {
			return false
		}
		for _, e := range f.engines {
			want := len(f.truth(e))
			ok := false
			for _, s := range st {
				if s.Instance == e.id && s.Blocks[tiers.GPU] == want {
					ok = true
				}
			}
			if !ok {
				return false
			}
		}
		return true
	})
	// Routing is exact again: a warm prompt matches.
	if n := reasonCount(l, string(router.ReasonKVMatch)); n == 0 {
		t.Fatalf("no kv_match decision under load: %s", l.summary())
	}
}

func reasonCount(l *load, reason string) int64 {
	v, ok := l.reasons.Load(reason)
	if !ok {
		return 0
	}
	return v.(interface{ Load() int64 }).Load()
}

// dumpGoroutines writes every goroutine's stack to a file (the evidence of
// what a stalled pipeline waits on) and returns a note naming it.
func dumpGoroutines(t *testing.T) string {
	f, err := os.CreateTemp("", "kvrouter-goroutines-*.txt")
	if err != nil {
		return "goroutine dump failed: " + err.Error()
	}
	defer f.Close()
	if err := pprof.Lookup("goroutine").WriteTo(f, 2); err != nil {
		return "goroutine dump failed: " + err.Error()
	}
	return "goroutines dumped to " + f.Name()
}

// Two of the three NATS nodes killed while the engines keep changing
// their caches: the events stream has lost its quorum, stores nothing and
// answers nothing, so the bridges buffer and the index falls behind the
// engines. The consumer, whose connection fails over to the one node left,
// must not call the stream healthy (kv_aware would route exactly on the
// frozen index) for as long as the quorum is lost, however long that is;
// once two nodes are back, the index is exact again and healthy.
func TestE2ENATSQuorumLostNotHealthy(t *testing.T) {
	f := newClusterFleet(t, 2, 128, 50)
	c, a := f.startConsumer()
	stopPoke := f.poke()
	defer stopPoke()
	f.waitExact(a, "before the outage", c)

	// The node holding the consumer is the one kept: its pull goes on
	// answering idle heartbeats, so nats.go reports no consume error and
	// the consumer itself looks fine; only the stream is gone.
	keep := f.consumerNode()
	// And the stream's leader: it goes on answering reads for a while
	// after losing its replicas, which a check of reads alone takes for a
	// working stream.
	f.moveStreamLeader(keep)
	t.Logf("keeping node %d (the consumer's and the stream leader's)", keep)
	killed := time.Now()
	for i := 0; i < f.nc.Size(); i++ {
		if i != keep {
			f.nc.Kill(i)
		}
	}
	// Detection gets a few heartbeats (a stream request times out after
	// two); from then on, every sample until well past the 10 s for which
	// one consume error keeps the stream unhealthy must say unhealthy.
	const from, until = 6 * time.Second, 20 * time.Second
	time.Sleep(time.Until(killed.Add(from)))
	healthy := 0
	var first time.Duration
	for time.Since(killed) < until {
		if c.Healthy() {
			if healthy == 0 {
				first = time.Since(killed)
			}
			healthy++
		}
		time.Sleep(100 * time.Millisecond)
	}
	stale := ""
	for _, e := range f.engines {
		s, m := diff(keys(a.dump(e.id)), f.truth(e))
		stale += fmt.Sprintf(" %s: %d stale, %d missing;", e.id, s, m)
	}
	t.Logf("quorum lost for %v: the index against the engines:%s", until.Round(time.Second), stale)
	if healthy > 0 {
		t.Errorf("the consumer called the stream healthy %.1fs after two of three nodes died (%d samples of 100 ms), the stream storing nothing:%s",
			first.Seconds(), healthy, stale)
	}
	for i := 0; i < f.nc.Size(); i++ {
		if i != keep {
			f.nc.Restart(i)
		}
	}
	f.nc.WaitJetStream(60 * time.Second)
	testenv.WaitFor(t, 60*time.Second, "healthy after the quorum is back", c.Healthy)
	f.waitExact(a, "after the quorum is back", c)
}

// consumerNode returns the cluster node that leads the pool's consumer of
// the events stream (the test's consumer: the fleet's only one).
func (f *clusterFleet) consumerNode() int {
	f.t.Helper()
	js, err := jetstream.New(f.conn("lister"))
	if err != nil {
		f.t.Fatal(err)
	}
	var node int
	testenv.WaitFor(f.t, 10*time.Second, "the consumer's node", func() bool {
		node = -1
		s, err := js.Stream(f.ctx, f.stream.Name)
		if err != nil {
			return false
		}
		l := s.ListConsumers(f.ctx)
		for info := range l.Info() {
			if info.Cluster == nil {
				continue
			}
			for i := 0; i < f.nc.Size(); i++ {
				if srv := f.nc.Server(i); srv != nil && srv.Name() == info.Cluster.Leader {
					node = i
				}
			}
		}
		return node >= 0 && l.Err() == nil
	})
	return node
}

// moveStreamLeader makes node lead the events stream (a leader stepdown
// naming it as the preferred new leader, repeated until it does).
func (f *clusterFleet) moveStreamLeader(node int) {
	f.t.Helper()
	nc := f.conn("stepdown")
	body := fmt.Sprintf(`{"placement":{"preferred":%q}}`, f.nc.Server(node).Name())
	testenv.WaitFor(f.t, 30*time.Second, fmt.Sprintf("node %d leading the stream", node), func() bool {
		if f.nc.StreamLeader(f.stream.Name) == node {
			return true
		}
		_, _ = nc.Request("$JS.API.STREAM.LEADER.STEPDOWN."+f.stream.Name, []byte(body), 2*time.Second)
		time.Sleep(500 * time.Millisecond)
		return f.nc.StreamLeader(f.stream.Name) == node
	})
}
