package test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/replicasync"
	"github.com/kvrouter/kvrouter/router/kvaware"
)

// replicaConfig is the fleet's router config with replica sync on, under
// name, with a short heartbeat and timeout so the test sees expiry soon.
func (f *clusterFleet) replicaConfig(name string) config.Config {
	cfg := f.routerConfig()
	cfg.Events.ReplicaSync = &config.ReplicaSyncConfig{Enabled: true, Replica: name,
		Heartbeat: 200 * time.Millisecond, PeerTimeout: time.Second}
	return cfg
}

// loadView is one router's picture of an instance's load: its own
// counters plus its peers'.
type loadView struct{ inflight, tokens, reqs int64 }

func (r *clusterRouter) view(t testing.TB, pool string) map[string]loadView {
	p, ok := r.srv.Pool(pool)
	if !ok || kvaware.Of(p) == nil {
		t.Fatalf("router has no kv state for %s", pool)
	}
	out := map[string]loadView{}
	for _, in := range p.Instances() {
		tok, reqs := kvaware.Of(p).PendingPrefill(in.ID())
		pf, pt, pr := kvaware.Of(p).PeerLoad(in.ID())
		out[in.ID()] = loadView{int64(in.InFlight()) + pf, tok + pt, reqs + pr}
	}
	return out
}

func (r *clusterRouter) peers(t testing.TB, pool string) []replicasync.PeerStatus {
	ps, ok := r.kve.ReplicaPeers(pool)
	if !ok {
		t.Fatalf("no replica sync for %s", pool)
	}
	return ps
}

func (r *clusterRouter) peerView(t testing.TB, pool string) loadView {
	p, _ := r.srv.Pool(pool)
	var v loadView
	for _, in := range p.Instances() {
		f, tk, rq := kvaware.Of(p).PeerLoad(in.ID())
		v.inflight, v.tokens, v.reqs = v.inflight+f, v.tokens+tk, v.reqs+rq
	}
	return v
}

// hold sends n long completions through r (each in flight for ~7 s on a
// real-time engine: long enough for a replica to start and join on a
// loaded machine) and returns a func that waits for them.
func hold(t testing.TB, r *clusterRouter, n int, seed int) func() {
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		p := make([]uint32, 40+i)
		for k := range p {
			p[k] = uint32(7000 + seed*1000 + i*37 + k)
		}
		body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": p, "max_tokens": 1000})
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(r.http.URL+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				return // the replica was killed under it
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}()
	}
	return wg.Wait
}

// Two router replicas, active-active on the NATS cluster with replica
// sync: requests held in flight through each half of the traffic are seen
// by both replicas, per instance, exactly, once one sync interval has
// passed; a third replica that joins catches up through its hello; a
// replica that dies (its NATS connection cut, nothing said) stops counting
// at the others after the peer timeout, not before.
func TestE2EReplicaSyncActiveActive(t *testing.T) {
	f := newClusterFleet(t, 3, 256, 1)
	r0 := f.startRouter(f.replicaConfig("r0"))
	r1 := f.startRouter(f.replicaConfig("r1"))

	wait0 := hold(t, r0, 5, 0)
	wait1 := hold(t, r1, 4, 1)
	start := time.Now()
	var agreedAfter time.Duration
	testenv.WaitFor(t, 20*time.Second, "both replicas see all 9 requests per instance alike", func() bool {
		v0, v1 := r0.view(t, f.pool), r1.view(t, f.pool)
		total := int64(0)
		for id, a := range v0 {
			if a != v1[id] {
				return false
			}
			total += a.inflight
		}
		agreedAfter = time.Since(start)
		return total == 9
	})
	t.Logf("replicas agree on every instance's in-flight and pending load %v after 5+4 requests were sent through the two halves", agreedAfter)
	if pv := r0.peerView(t, f.pool); pv.inflight != 4 {
		t.Fatalf("r0 counts %d of r1's requests, want 4", pv.inflight)
	}

	// A joining replica catches up at once (its hello), well before a
	// heartbeat would have told it.
	joined := time.Now()
	r2 := f.startRouter(f.replicaConfig("r2"))
	var caughtUp time.Duration
	testenv.WaitFor(t, 20*time.Second, "the joining replica sees the others' requests", func() bool {
		caughtUp = time.Since(joined)
		return r2.peerView(t, f.pool).inflight == 9
	})
	t.Logf("joining replica caught up %v after it started (router start included)", caughtUp)

	// r1 dies without a word: its connection is cut while its requests
	// are in flight.
	r1.kve.Conn().Close()
	cut := time.Now()
	if pv := r0.peerView(t, f.pool); pv.inflight < 4 {
		t.Fatalf("r1's requests dropped at r0 at once (%d left): expiry must wait for the timeout", pv.inflight)
	}
	var expired, silent time.Duration
	testenv.WaitFor(t, 20*time.Second, "r1's contribution expires at r0", func() bool {
		expired = time.Since(cut)
		// r0's peers are r1 and r2, which routes nothing.
		if r0.peerView(t, f.pool).inflight != 0 {
			return false
		}
		for _, p := range r0.peers(t, f.pool) {
			if p.Replica == "r1" {
				silent = time.Since(p.LastSeen)
				return true
			}
		}
		return false
	})
	t.Logf("dead replica's contribution gone %v after its connection was cut, %v after r0 last heard from it (peer_timeout 1s)", expired, silent)
	if silent < time.Second {
		t.Fatalf("r1 stopped counting %v after it was last heard from, before the 1s peer timeout", silent)
	}
	r1.stop()
	wait0()
	wait1()
	// Nothing in flight anywhere: the views settle at zero.
	testenv.WaitFor(t, 60*time.Second, "views back to zero", func() bool {
		for _, r := range []*clusterRouter{r0, r2} {
			for _, v := range r.view(t, f.pool) {
				if v != (loadView{}) {
					return false
				}
			}
		}
		return true
	})
}

// A router that exits with requests still counted (its drain timed out:
// the process ends under them) says so on its way out: its peer stops
// counting them at once, not a peer timeout after its last message. The
// timeout is an hour here, so only the exiting replica's last message can
// zero them (before the fix r0 counted r1's 4 requests until the timeout:
// on the binaries, 8 requests cut at a 3 s drain were counted ~2 s more).
func TestE2EReplicaExitZeroesItsLoad(t *testing.T) {
	f := newClusterFleet(t, 3, 256, 1)
	cfg := func(name string) config.Config {
		c := f.replicaConfig(name)
		c.Events.ReplicaSync.PeerTimeout = time.Hour
		return c
	}
	r0 := f.startRouter(cfg("r0"))
	r1 := f.startRouter(cfg("r1"))
	wait1 := hold(t, r1, 4, 1)
	testenv.WaitFor(t, 20*time.Second, "r0 sees r1's 4 requests", func() bool {
		return r0.peerView(t, f.pool).inflight == 4
	})
	r1.stop() // the requests are cut under it, as at a drain's deadline
	wait1()
	testenv.WaitFor(t, 20*time.Second, "r1's requests no longer counted at r0 after it exited", func() bool {
		return r0.peerView(t, f.pool) == loadView{}
	})
}

// The sync's own traffic at a steady request rate through two replicas:
// messages and bytes per second each replica sends (KV_REPLICA_SECONDS
// sets the measuring time, default 5s). Figures for docs/BENCHMARKS.md.
func TestE2EReplicaSyncTraffic(t *testing.T) {
	f := newClusterFleet(t, 3, 256, 50)
	r0 := f.startRouter(f.replicaConfig("r0"))
	r1 := f.startRouter(f.replicaConfig("r1"))
	secs := testenv.Value(t, "KV_REPLICA_SECONDS", 5.0)
	before := [2]syncCounters{r0.syncCounters(t), r1.syncCounters(t)}
	l := f.startLoad([]*clusterRouter{r0, r1}, 8, 3)
	time.Sleep(time.Duration(secs * float64(time.Second)))
	l.finish()
	if l.failed.Load() > 0 {
		t.Fatalf("%s", l.summary())
	}
	rate := float64(l.sent.Load()) / secs
	for i, r := range []*clusterRouter{r0, r1} {
		c := r.syncCounters(t).minus(before[i])
		t.Logf("replica r%d at %.0f requests/s through 2 replicas (%.0f/s each): sent %.1f messages/s (%s), %.0f bytes/s; dropped %v",
			i, rate, rate/2, c.msgs/secs, c.kinds(secs), c.bytes/secs, c.dropped)
		if c.msgs == 0 {
			t.Fatalf("replica r%d sent nothing", i)
		}
		if c.dropped > 0 {
			t.Fatalf("replica r%d dropped %v sync data at %.0f requests/s", i, c.dropped, rate)
		}
	}
}

type syncCounters struct {
	msgs, bytes, dropped float64
	byKind               map[string]float64
}

func (c syncCounters) minus(o syncCounters) syncCounters {
	out := syncCounters{msgs: c.msgs - o.msgs, bytes: c.bytes - o.bytes, dropped: c.dropped - o.dropped, byKind: map[string]float64{}}
	for k, v := range c.byKind {
		out.byKind[k] = v - o.byKind[k]
	}
	return out
}

func (c syncCounters) kinds(secs float64) string {
	var parts []string
	for _, k := range []string{"load", "spec", "hello"} {
		parts = append(parts, fmt.Sprintf("%s %.1f/s", k, c.byKind[k]/secs))
	}
	return strings.Join(parts, ", ")
}

// syncCounters reads the router's replica sync metrics (sent side).
func (r *clusterRouter) syncCounters(t testing.TB) syncCounters {
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	c := syncCounters{byKind: map[string]float64{}}
	label := func(m *dto.Metric, name string) string {
		for _, l := range m.GetLabel() {
			if l.GetName() == name {
				return l.GetValue()
			}
		}
		return ""
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			v := m.GetCounter().GetValue()
			switch mf.GetName() {
			case "kvrouter_replica_sync_messages_total":
				if label(m, "direction") == "sent" {
					c.msgs += v
					c.byKind[label(m, "kind")] += v
				}
			case "kvrouter_replica_sync_bytes_total":
				if label(m, "direction") == "sent" {
					c.bytes += v
				}
			case "kvrouter_replica_sync_dropped_total":
				c.dropped += v
			}
		}
	}
	return c
}
