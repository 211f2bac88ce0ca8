package replicasync

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// slowTick is a configuration whose interval (slowInterval) is far longer
// than any wait below: whatever a peer hears within it came by an early
// send.
func slowTick(pool, name string, m *Metrics) Config {
	return Config{Pool: pool, Replica: name, Interval: slowInterval, MinGap: time.Millisecond,
		Heartbeat: time.Minute, PeerTimeout: 3 * time.Minute, Metrics: m}
}

// slowInterval and earlyWait: the longest interval a configuration may
// have, and an early send waited for up to just under it (these waits
// timed out at 5 s on a loaded machine, a full make test beside other
// runs): each wait is timed on its own, and what arrives within the
// interval can only have been sent early.
const (
	slowInterval = 10 * time.Second
	earlyWait    = 9 * time.Second
)

func newTestMetrics(t *testing.T) *Metrics {
	t.Helper()
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Changed sends what changed within min_gap, long before the interval; a
// replica that joins is answered by an early full send (its hello), not at
// the interval either; with early sends off the change waits.
func TestChangedSendsEarly(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	am := newTestMetrics(t)
	a := startReplica(t, url, slowTick(pool, "a", am))
	a.set(Load{Instance: "i0", InFlight: 2})
	a.Speculate("i0", []kvindex.Key{1, 2, 3}, time.Minute)
	a.Changed() // no peer yet: sent to no one
	// a subscribes before its hello; once the hello is sent, a round trip
	// on a's connection has the server hold a's subscription, so b's
	// hello reaches it (else a, started asynchronously, could miss b's
	// hello on a loaded machine and answer only at its 10 s interval).
	testenv.WaitFor(t, earlyWait, "a's hello sent", func() bool {
		return value(am.messages.WithLabelValues(pool, "sent", "hello")) >= 1
	})
	if err := a.cfg.Conn.FlushTimeout(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	b := startReplica(t, url, slowTick(pool, "b", nil))
	start := time.Now()
	// b's hello makes a send its whole table and its announcements early.
	testenv.WaitFor(t, earlyWait, "b catches up by a's early send", func() bool {
		f, _, _ := b.PeerLoad("i0")
		return f == 2 && b.PeerExtend([]kvindex.Key{1, 2, 3}, 0, "i0", 0) == 3
	})
	if el := time.Since(start); el >= slowInterval {
		t.Fatalf("b caught up after %v, the interval's time: not early", el)
	}
	start = time.Now()
	a.set(Load{Instance: "i0", InFlight: 3}, Load{Instance: "i1", PendingTokens: 500, PendingRequests: 1})
	a.Speculate("i1", []kvindex.Key{7, 8}, time.Minute)
	a.Changed()
	testenv.WaitFor(t, earlyWait, "b hears a's change", func() bool {
		f, _, _ := b.PeerLoad("i0")
		_, p, _ := b.PeerLoad("i1")
		return f == 3 && p == 500 && b.PeerExtend([]kvindex.Key{7, 8}, 0, "i1", 0) == 2
	})
	if el := time.Since(start); el >= slowInterval {
		t.Fatalf("b heard the change after %v, the interval's time: not early", el)
	}
	if n := value(am.early.WithLabelValues(pool, "sent")); n < 2 {
		t.Fatalf("%v early sends counted, want >= 2", n)
	}

	// Off: a change waits for the interval.
	offPool := testenv.UniqueName(t) + "_off"
	cfg := slowTick(offPool, "c", nil)
	cfg.NoEarlySend = true
	c := startReplica(t, url, cfg)
	d := startReplica(t, url, slowTick(offPool, "d", nil))
	time.Sleep(200 * time.Millisecond) // hellos answered (d's, by c's interval: not yet)
	c.set(Load{Instance: "i0", InFlight: 4})
	c.Changed()
	time.Sleep(500 * time.Millisecond)
	if f, _, _ := d.PeerLoad("i0"); f != 0 {
		t.Fatalf("with early sends off, d heard c's change within 0.7 s of a 10 s interval (%d in flight)", f)
	}
}

// A flood of changes, each signalled from several goroutines, sends at
// most one early message per min_gap besides the interval's, and never
// beyond the byte budget: counted over the real elapsed time, so a slow
// machine only sends fewer. Run under -race for the concurrent calls.
func TestChangedFloodBounded(t *testing.T) {
	for _, tc := range []struct {
		name          string
		gap, interval time.Duration
		rate          int // bytes/s; 0 = default
	}{
		{"gap bound", 5 * time.Millisecond, 50 * time.Millisecond, 0},
		{"byte bound", time.Millisecond, 50 * time.Millisecond, MinMessageBytes},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url := testenv.NATSURL(t)
			pool := testenv.UniqueName(t)
			m := newTestMetrics(t)
			cfg := Config{Pool: pool, Replica: "a", Interval: tc.interval, MinGap: tc.gap, Heartbeat: time.Minute,
				PeerTimeout: 3 * time.Minute, MaxMessageBytes: MinMessageBytes, MaxBytesPerSecond: tc.rate, Metrics: m}
			a := startReplica(t, url, cfg)
			b := startReplica(t, url, fast(pool, "b"))
			testenv.WaitFor(t, 10*time.Second, "a hears b", func() bool { return len(a.Peers()) == 1 })
			sent := func() (msgs, bytes float64) {
				return value(m.messages.WithLabelValues(pool, "sent", "load")), value(m.bytes.WithLabelValues(pool, "sent"))
			}
			msgs0, bytes0 := sent()
			start := time.Now()
			var wg sync.WaitGroup
			var mu sync.Mutex // orders the counters' updates
			n := 0
			for g := 0; g < 4; g++ {
				wg.Go(func() {
					for time.Since(start) < 500*time.Millisecond {
						mu.Lock()
						n++
						k := n
						a.set(Load{Instance: "i0", InFlight: int64(k)})
						mu.Unlock()
						a.Speculate("i0", []kvindex.Key{kvindex.Key(k)}, time.Second)
						a.Changed()
						time.Sleep(20 * time.Microsecond) // request goroutines, not a spin
					}
				})
			}
			wg.Wait()
			msgs1, bytes1 := sent()
			elapsed := time.Since(start)
			msgs, bytes := msgs1-msgs0, bytes1-bytes0
			// Each send is one load message (one instance; the
			// speculative blocks go in their own messages, split by size
			// and bounded by the bytes); early sends are min_gap apart,
			// the ticks an interval, and one of each may straddle either
			// edge.
			bound := float64(elapsed)/float64(tc.gap) + float64(elapsed)/float64(tc.interval) + 2
			t.Logf("%d changes in %v: %v load messages (bound %.0f), %v bytes; early sent %v, deferred %v", n, elapsed, msgs, bound,
				bytes, value(m.early.WithLabelValues(pool, "sent")), value(m.early.WithLabelValues(pool, "deferred")))
			if msgs > bound {
				t.Fatalf("%v messages in %v for %d changes: over %.0f (one per min_gap %v and interval %v)", msgs, elapsed, n, bound, tc.gap, tc.interval)
			}
			if tc.rate > 0 {
				if limit := float64(tc.rate) * (1 + elapsed.Seconds()); bytes > limit {
					t.Fatalf("%v bytes in %v over the bucket's %v", bytes, elapsed, limit)
				}
				if value(m.early.WithLabelValues(pool, "deferred")) == 0 {
					t.Fatalf("a budget of one message a second deferred no early send in %v of changes", elapsed)
				}
			} else if value(m.early.WithLabelValues(pool, "sent")) == 0 {
				t.Fatalf("no early send for %d changes", n)
			}
			// The last state still arrives (by an early send or a tick).
			mu.Lock()
			last := int64(n)
			mu.Unlock()
			a.Changed()
			testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("b sees a's last count %d", last), func() bool {
				f, _, _ := b.PeerLoad("i0")
				return f == last
			})
		})
	}
}

// A replica with no live peer sends no early messages (it would send one
// per decision to no one); a peer's hello makes it send again, early.
func TestNoEarlySendWithoutPeer(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	am := newTestMetrics(t)
	a := startReplica(t, url, slowTick(pool, "a", am))
	time.Sleep(100 * time.Millisecond) // a's own hello went out
	for i := range 5 {
		a.set(Load{Instance: "i0", InFlight: int64(i + 1)})
		a.Changed()
		time.Sleep(10 * time.Millisecond)
	}
	testenv.WaitFor(t, earlyWait, "a's lone changes counted", func() bool {
		return value(am.early.WithLabelValues(pool, "no_peer")) >= 1
	})
	if n := value(am.messages.WithLabelValues(pool, "sent", "load")); n != 0 {
		t.Fatalf("a lone replica sent %v load messages within its 10 s interval", n)
	}
	b := startReplica(t, url, slowTick(pool, "b", nil))
	testenv.WaitFor(t, earlyWait, "b catches up by a's early send", func() bool {
		f, _, _ := b.PeerLoad("i0")
		return f == 5
	})
	a.set(Load{Instance: "i0", InFlight: 9})
	a.Changed()
	testenv.WaitFor(t, earlyWait, "b hears a's change early", func() bool {
		f, _, _ := b.PeerLoad("i0")
		return f == 9
	})
}

// A replica that hears no live peer still sends its whole rent table on
// the heartbeat, as it does its load table: a peer that hears it (its
// own messages lost on the way back, or a peer whose hello was missed)
// counts it live by its load messages, and would otherwise keep summing
// its last accounts, frozen. Deltas wait for a live peer.
func TestRentTableOnHeartbeatWithoutPeer(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	am := newTestMetrics(t)
	cfg := fast(pool, "a")
	cfg.Metrics = am
	a := startReplica(t, url, cfg)
	var deltas atomic.Int64
	a.AttachRent(func(dst []Rent, full bool) []Rent {
		if !full {
			deltas.Add(1)
			return append(dst, Rent{Key: 8, Rent: 0.5}) // a change every flush
		}
		return append(dst, Rent{Key: 7, Gen: 1, Rent: 0.25})
	})
	testenv.WaitFor(t, 5*time.Second, "a lone replica's heartbeats", func() bool {
		return value(am.messages.WithLabelValues(pool, "sent", "load")) >= 3 && deltas.Load() >= 3
	})
	rents := value(am.messages.WithLabelValues(pool, "sent", "rent"))
	loads := value(am.messages.WithLabelValues(pool, "sent", "load"))
	if rents < 1 {
		t.Fatalf("a lone replica sent %v load messages and no rent message", loads)
	}
	// Heartbeats only (one whole table each, a message each), not a
	// delta every interval: no more rent messages than load heartbeats
	// could allow (a load message goes out only on the heartbeat here).
	if rents > loads+1 {
		t.Fatalf("a lone replica sent %v rent messages for %v load heartbeats: deltas to no one", rents, loads)
	}
}
