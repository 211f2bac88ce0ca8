//go:build faults

// Quarantined from `make test` (build tag "faults"; `make test-faults` runs
// it with -race): it found a real but rare failure to converge after a node
// dies (about 1 in 5 full runs, 2026-12-03), under investigation.

package test

import (
	"slices"
	"strings"
	"testing"
	"time"

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
	waitFor(t, 30*time.Second, "traffic", func() bool { return l.sent.Load() > 50 })

	kill := func(what string, node int) {
		t.Helper()
		sentBefore := l.sent.Load()
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
		// kill, and the consumer has applied it.
		waitFor(t, 60*time.Second, what+": events flowing again", func() bool {
			for i, e := range f.engines {
				seq := e.br.Stats()[0].StreamSeq
				if seq <= before[i] {
					return false
				}
				applied := false
				for _, s := range c.Instances() {
					if s.Instance == e.id && s.StreamSeq >= seq {
						applied = true
					}
				}
				if !applied {
					return false
				}
			}
			return true
		})
		recovery := time.Since(killed)
		waitFor(t, 60*time.Second, what+": the router's stream healthy (exact routing)", func() bool { return r.kve.StreamHealthy(f.pool) })
		exact := time.Since(killed)
		waitFor(t, 30*time.Second, what+": routing after the kill", func() bool { return l.sent.Load() > sentBefore+50 })
		t.Logf("%s (node %d): events flowing end to end again %.3fs after the kill, the router routing exactly again after %.3fs; %s",
			what, node, recovery.Seconds(), exact.Seconds(), l.summary())
		f.nc.Restart(node)
		f.nc.WaitJetStream(30 * time.Second)
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
	f.waitExact(a, "after the kills")
	dropped, gaps := f.lost(c)
	t.Logf("lost events: %d dropped or unreplayable at the bridges, %d gaps at the consumer; %s", dropped, gaps, l.summary())
	if dropped+gaps > 0 {
		t.Fatalf("lost events: %d dropped at the bridges, %d gaps at the consumer", dropped, gaps)
	}
	// The router's own index agrees on every engine's block count.
	waitFor(t, 30*time.Second, "router index block counts", func() bool {
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
