package replicasync

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// replica is one Syncer with a settable local table.
type replica struct {
	*Syncer
	mu    sync.Mutex // guards loads
	loads []Load
	stop  func() // stops Run and waits for it
}

func (r *replica) set(loads ...Load) {
	r.mu.Lock()
	r.loads = loads
	r.mu.Unlock()
}

func startReplica(t *testing.T, url string, cfg Config) *replica {
	t.Helper()
	return startReplicaOn(t, testenv.Connect(t, url), cfg)
}

// startReplicaOn is startReplica on a connection of the test's own.
func startReplicaOn(t *testing.T, nc *nats.Conn, cfg Config) *replica {
	t.Helper()
	cfg.Conn = nc
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := &replica{Syncer: s}
	s.AttachLocal(func(dst []Load) []Load {
		r.mu.Lock()
		defer r.mu.Unlock()
		return append(dst, r.loads...)
	})
	r.stop = testenv.Go(t, context.Background(), s.Run)
	return r
}

// noHeartbeat is fast's interval with no heartbeat or timeout within a
// test: what a peer learns, it learns from deltas and hellos.
func noHeartbeat(pool, name string) Config {
	return Config{Pool: pool, Replica: name, Interval: 10 * time.Millisecond, Heartbeat: time.Minute, PeerTimeout: 3 * time.Minute}
}

func fast(pool, name string) Config {
	return Config{Pool: pool, Replica: name, Interval: 10 * time.Millisecond, Heartbeat: 100 * time.Millisecond, PeerTimeout: 300 * time.Millisecond}
}

// fastPair starts replicas a and b of a pool of their own on a test NATS
// server, both with fast timings.
func fastPair(t *testing.T) (a, b *replica) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	return startReplica(t, url, fast(pool, "a")), startReplica(t, url, fast(pool, "b"))
}

// Two replicas see each other's counters and speculative blocks, never
// their own; a replica that stops publishing stops counting after the
// peer timeout; one restarted under the same name replaces its old
// counters.
func TestTwoReplicasShareAndExpire(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	a := startReplica(t, url, fast(pool, "a"))
	b := startReplica(t, url, fast(pool, "b"))
	a.set(Load{Instance: "i0", InFlight: 3, PendingTokens: 4000, PendingRequests: 2})
	b.set(Load{Instance: "i0", InFlight: 1}, Load{Instance: "i1", InFlight: 5})
	testenv.WaitFor(t, 10*time.Second, "b sees a", func() bool {
		f, p, r := b.PeerLoad("i0")
		return f == 3 && p == 4000 && r == 2
	})
	testenv.WaitFor(t, 10*time.Second, "a sees b", func() bool {
		f0, _, _ := a.PeerLoad("i0")
		f1, _, _ := a.PeerLoad("i1")
		return f0 == 1 && f1 == 5
	})
	// Changes travel as deltas; an instance back to zero is sent as zero.
	a.set(Load{Instance: "i2", PendingTokens: 7})
	testenv.WaitFor(t, 10*time.Second, "b sees a's change", func() bool {
		f, _, _ := b.PeerLoad("i0")
		_, p, _ := b.PeerLoad("i2")
		return f == 0 && p == 7
	})
	keys := []kvindex.Key{11, 12, 13, 14}
	a.Speculate("i0", keys[1:3], 5*time.Second)
	testenv.WaitFor(t, 10*time.Second, "b sees a's speculative blocks", func() bool {
		return b.PeerExtend(keys, 1, "i0", 0) == 3
	})
	if got := a.PeerExtend(keys, 1, "i0", 0); got != 1 {
		t.Fatalf("a counts its own announcement as a peer's: extend %d", got)
	}
	if got := b.PeerExtend(keys, 1, "i0", 1); got != 1 {
		t.Fatalf("a block announced in another cache epoch counts: extend %d", got)
	}
	if h := b.PeerHolders(nil, 12); len(h) != 1 || h[0] != "i0" {
		t.Fatalf("holders %v", h)
	}

	// a killed: its contribution expires.
	a.stop()
	stopped := time.Now()
	testenv.WaitFor(t, 10*time.Second, "a's counters expire at b", func() bool {
		_, p, _ := b.PeerLoad("i2")
		ps := b.Peers()
		return p == 0 && len(ps) == 1 && !ps[0].Live
	})
	if el := time.Since(stopped); el < 200*time.Millisecond {
		t.Fatalf("a dropped after %v, before the peer timeout", el)
	}

	// a restarted under the same name: new counters, not added to old ones.
	a2 := startReplica(t, url, fast(pool, "a"))
	a2.set(Load{Instance: "i2", PendingTokens: 1})
	testenv.WaitFor(t, 10*time.Second, "b sees a's new incarnation", func() bool {
		_, p, _ := b.PeerLoad("i2")
		return p == 1
	})
}

// A replica that stops (Run's context ends: its process is exiting)
// publishes its table with nothing in flight or pending: a router whose
// drain timed out exits with requests still counted, and its peers counted
// them as if fresh for the peer timeout (found on the binaries, session
// 19: 8 requests cut at a 3 s drain, counted by the peer ~2 s more). Its
// recent ends stay listed (peers take them out of engine samples). The
// peer timeout is an hour here: only the stop's message can zero them.
func TestStopPublishesNothingInFlight(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	long := func(name string) Config {
		return Config{Pool: pool, Replica: name, Interval: 10 * time.Millisecond, Heartbeat: 100 * time.Millisecond, PeerTimeout: time.Hour}
	}
	a := startReplica(t, url, long("a"))
	b := startReplica(t, url, long("b"))
	a.set(Load{Instance: "i0", InFlight: 3, PendingTokens: 4000, PendingRequests: 2, Rate: 5000,
		Pending: []Pending{{At: 100, Tokens: 1500}, {At: 200, Tokens: 2500}},
		Ended:   []Ended{{At: 10, End: 50}}},
		Load{Instance: "i1", InFlight: 1})
	testenv.WaitFor(t, 10*time.Second, "b sees a", func() bool {
		f, p, r := b.PeerLoad("i0")
		f1, _, _ := b.PeerLoad("i1")
		return f == 3 && p == 4000 && r == 2 && f1 == 1 && b.PeerEnded("i0", 20, 30) == 1
	})
	a.stop()
	testenv.WaitFor(t, 10*time.Second, "a's requests no longer counted at b", func() bool {
		f, p, r := b.PeerLoad("i0")
		f1, _, _ := b.PeerLoad("i1")
		return f == 0 && p == 0 && r == 0 && f1 == 0
	})
	var q PeerQueue
	b.PeerQueue("i0", &q)
	if len(q.Pending) != 0 || q.Unlisted != 0 {
		t.Fatalf("a's pending prefill still counted after it stopped: %+v", q)
	}
	if n := b.PeerEnded("i0", 20, 30); n != 1 {
		t.Fatalf("a's recent end dropped when it stopped: %d", n)
	}
}

// A replica that joins catches up at once through its hello, without
// waiting for a heartbeat: load counters and unexpired speculative blocks.
func TestJoinCatchesUp(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	slow := func(name string) Config { return noHeartbeat(pool, name) }
	a := startReplica(t, url, slow("a"))
	a.set(Load{Instance: "i0", InFlight: 2})
	a.Speculate("i0", []kvindex.Key{1, 2, 3}, time.Minute)
	time.Sleep(100 * time.Millisecond) // a's first full table and its announcement go out to no one
	start := time.Now()
	c := startReplica(t, url, slow("c"))
	testenv.WaitFor(t, 10*time.Second, "c catches up", func() bool {
		f, _, _ := c.PeerLoad("i0")
		return f == 2 && c.PeerExtend([]kvindex.Key{1, 2, 3}, 0, "i0", 0) == 3
	})
	t.Logf("caught up in %v", time.Since(start))
}

// Messages never exceed MaxMessageBytes (a big table is split), the rate
// bound drops and counts what exceeds it, and undecodable traffic on the
// subject is counted and ignored.
func TestBounds(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	watch := testenv.Connect(t, url)
	var biggest, total atomic.Int64
	sub, err := watch.Subscribe(SubjectRoot+"."+pool, func(m *nats.Msg) {
		total.Add(int64(len(m.Data)))
		for {
			b := biggest.Load()
			if int64(len(m.Data)) <= b || biggest.CompareAndSwap(b, int64(len(m.Data))) {
				break
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	// b counts into its own registry, so that what a sent is a's alone.
	bm, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	cfg := fast(pool, "a")
	const rate = 64 << 10
	cfg.MaxMessageBytes, cfg.MaxBytesPerSecond, cfg.Metrics = MinMessageBytes, rate, m
	start := time.Now()
	a := startReplica(t, url, cfg)
	bcfg := fast(pool, "b")
	bcfg.Metrics = bm
	b := startReplica(t, url, bcfg)
	var loads []Load
	for i := 0; i < 200; i++ { // ~20 bytes each: several messages
		loads = append(loads, Load{Instance: fmt.Sprintf("instance-%03d", i), InFlight: int64(i + 1)})
	}
	a.set(loads...)
	testenv.WaitFor(t, 10*time.Second, "b holds a's whole split table", func() bool {
		for i := range loads {
			if f, _, _ := b.PeerLoad(loads[i].Instance); f != int64(i+1) {
				return false
			}
		}
		return true
	})
	// Far more speculative blocks than 64 KiB/s carries.
	for i := 0; i < 400; i++ {
		ks := make([]kvindex.Key, 100)
		for j := range ks {
			ks[j] = kvindex.Key(i*1000 + j)
		}
		a.Speculate("instance-000", ks, time.Second)
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	if got := biggest.Load(); got > int64(MinMessageBytes) {
		t.Fatalf("a message of %d bytes, bound %d", got, MinMessageBytes)
	}
	dropped := value(m.dropped.WithLabelValues(pool, "rate")) + value(m.dropped.WithLabelValues(pool, "queue"))
	if dropped == 0 {
		t.Fatalf("400×100 keys (320 KB) in ~0.6s under a 64 KiB/s bound: nothing dropped")
	}
	// The bucket holds one second's worth and refills at the rate: in T
	// seconds a sends at most rate·(1+T), however slow this machine made
	// the loop above.
	sent, elapsed := value(m.bytes.WithLabelValues(pool, "sent")), time.Since(start).Seconds()
	if bound := rate * (1 + elapsed); sent > bound {
		t.Fatalf("%v bytes sent in %.2fs at %d B/s: over the bucket's %v", sent, elapsed, rate, bound)
	}
	if err := watch.Publish(SubjectRoot+"."+pool, append([]byte("KRS"), append([]byte{Version + 1}, "junk"...)...)); err != nil {
		t.Fatal(err)
	}
	if err := watch.Publish(SubjectRoot+"."+pool, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "junk counted", func() bool {
		for _, m := range []*Metrics{m, bm} {
			if value(m.dropped.WithLabelValues(pool, "version")) < 1 || value(m.dropped.WithLabelValues(pool, "malformed")) < 1 {
				return false
			}
		}
		return true
	})
}

func TestConfigValidate(t *testing.T) {
	good := Config{Pool: "p", Replica: "r"}.WithDefaults()
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []Config{
		{Pool: "p.x", Replica: "r"},
		{Pool: "p", Replica: "r r"},
		{Pool: "p", Replica: "r", Interval: time.Microsecond},
		{Pool: "p", Replica: "r", MinGap: 50 * time.Microsecond},                                // under a NATS hop
		{Pool: "p", Replica: "r", Interval: 5 * time.Millisecond, MinGap: 6 * time.Millisecond}, // over the interval
		{Pool: "p", Replica: "r", Heartbeat: time.Second, PeerTimeout: time.Second},
		{Pool: "p", Replica: "r", MaxMessageBytes: 10},
		{Pool: "p", Replica: "r", MaxMessageBytes: 1 << 10}, // under the largest load entry
		{Pool: "p", Replica: "r", MaxMessageBytes: 64 << 10, MaxBytesPerSecond: 1 << 10},
	} {
		if err := c.WithDefaults().Validate(); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	for _, c := range []Config{
		{Pool: "p", Replica: "r", Interval: time.Millisecond}, // the default gap, cut to the interval
		{Pool: "p", Replica: "r", MinGap: MinMinGap},
		{Pool: "p", Replica: "r", MinGap: DefaultInterval},
	} {
		if err := c.WithDefaults().Validate(); err != nil {
			t.Errorf("%+v refused: %v", c, err)
		}
	}
	if r := DefaultReplica(); checkName("replica", r) != nil {
		t.Fatalf("default replica name %q invalid", r)
	}
}

// The table: an older load message is stale, a complete one replaces,
// an entry not refreshed within the timeout stops counting.
func TestTableLoads(t *testing.T) {
	now := time.Unix(1000, 0)
	tb := NewTable(time.Second, 16, func() time.Time { return now })
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 2, Complete: true, Loads: []Load{{Instance: "x", InFlight: 2}, {Instance: "y", InFlight: 1}}})
	if r := tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 1, Loads: []Load{{Instance: "x", InFlight: 9}}}); r != Stale {
		t.Fatalf("older message: %v", r)
	}
	if f, _, _ := tb.PeerLoad("x"); f != 2 {
		t.Fatalf("x %d", f)
	}
	now = now.Add(600 * time.Millisecond)
	// The next delta in sequence: x is unchanged, still current.
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 3, Loads: []Load{{Instance: "y", InFlight: 4}}})
	now = now.Add(600 * time.Millisecond)
	if f, _, _ := tb.PeerLoad("x"); f != 2 {
		t.Fatalf("x, confirmed by a gapless delta 0.6s ago, counts %d", f)
	}
	// A delta after a gap (seq 5, 4 lost): x may have changed in the lost
	// one, so it ages from its own last refresh (1.2s ago: expired).
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 5, Loads: []Load{{Instance: "y", InFlight: 4}}})
	now = now.Add(500 * time.Millisecond)
	if f, _, _ := tb.PeerLoad("x"); f != 0 {
		t.Fatalf("x not refreshed within the timeout after a gap still counts %d", f)
	}
	if f, _, _ := tb.PeerLoad("y"); f != 4 {
		t.Fatalf("y %d", f)
	}
	tb.ApplyLoad(&Message{Replica: "a", Incarnation: 1, Seq: 6, Complete: true, Loads: []Load{{Instance: "z", InFlight: 1}}})
	if f, _, _ := tb.PeerLoad("y"); f != 0 {
		t.Fatalf("a complete table without y leaves y at %d", f)
	}
	if r := tb.ApplyLoad(&Message{Replica: "a", Incarnation: 2, Seq: 1}); r != Restarted {
		t.Fatalf("new incarnation: %v", r)
	}
	if f, _, _ := tb.PeerLoad("z"); f != 0 {
		t.Fatalf("restarted peer's old counter %d", f)
	}
	now = now.Add(time.Hour)
	if live := tb.Forget(); live != 0 || len(tb.Peers()) != 0 {
		t.Fatalf("forget: live %d, peers %v", live, tb.Peers())
	}
}

// Speculative entries are bounded: the oldest make way and are counted.
func TestTableSpecCapacity(t *testing.T) {
	now := time.Unix(1000, 0)
	tb := NewTable(time.Second, 4, func() time.Time { return now })
	ev := tb.ApplySpec(&Message{Specs: []Spec{{Instance: "x", TTL: time.Second, Keys: []uint64{1, 2, 3, 4, 5, 6}}}}, nil)
	if ev != 2 || tb.SpecLen() != 4 {
		t.Fatalf("evicted %d, held %d", ev, tb.SpecLen())
	}
	keys := []kvindex.Key{1, 2, 3, 4, 5, 6}
	if got := tb.PeerExtend(keys, 2, "x", 0); got != 6 {
		t.Fatalf("extend %d", got)
	}
	if got := tb.PeerExtend(keys, 0, "x", 0); got != 0 {
		t.Fatalf("evicted key still held: extend %d", got)
	}
	now = now.Add(2 * time.Second)
	if got := tb.PeerExtend(keys, 2, "x", 0); got != 2 {
		t.Fatalf("expired keys still held: extend %d", got)
	}
}

func value(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// The largest load entry there can be (an instance and a replica name of
// MaxNameLen, MaxPending pending and MaxEnded ended requests, every number
// at its longest) fits in one message of MinMessageBytes: a replica never
// has an entry it cannot send (found in review: at 1 KiB, sendLoads spun
// on empty messages once an instance had 64 recent ends).
func TestMinMessageHoldsLargestLoad(t *testing.T) {
	const big = 1 << 62 // the largest time a message carries
	l := Load{Instance: strings.Repeat("i", MaxNameLen), InFlight: MaxCounter, PendingTokens: MaxCounter,
		PendingRequests: MaxCounter, Rate: MaxCounter, Started: big}
	for i := range MaxPending {
		l.Pending = append(l.Pending, Pending{At: big - int64(MaxPending-i), Tokens: MaxCounter})
	}
	for i := range MaxEnded {
		l.Ended = append(l.Ended, Ended{At: 1 + int64(i), End: big - int64(MaxEnded-i)})
	}
	m := Message{Kind: KindLoad, Replica: strings.Repeat("r", MaxNameLen), Incarnation: math.MaxUint64, Seq: big, Loads: []Load{l}}
	b, err := m.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > MinMessageBytes {
		t.Fatalf("largest load message %d bytes, MinMessageBytes %d", len(b), MinMessageBytes)
	}
	if got, err := Decode(b); err != nil || len(got.Loads) != 1 || len(got.Loads[0].Ended) != MaxEnded {
		t.Fatalf("decode: %v, %+v", err, got.Loads)
	}
}

// A replica's placement averages reach its peer every interval, and a
// change replaces them there.
func TestPlacementShared(t *testing.T) {
	a, b := fastPair(t)
	var mu sync.Mutex
	computed, wait := 250.0, 0.5
	a.AttachPlacement(func(dst []Queued) ([]Queued, float64) {
		mu.Lock()
		defer mu.Unlock()
		return append(dst, Queued{Instance: "i0", Wait: wait}), computed
	})
	testenv.WaitFor(t, 10*time.Second, "b hears a's placement", func() bool {
		vals, n := b.PeerComputed(nil)
		q := b.PeerQueued("i0", nil)
		return n == 1 && len(vals) == 1 && vals[0] == 250 && len(q) == 1 && q[0] == 0.5
	})
	mu.Lock()
	computed, wait = 300, 0.75
	mu.Unlock()
	testenv.WaitFor(t, 10*time.Second, "b hears a's change", func() bool {
		vals, _ := b.PeerComputed(nil)
		q := b.PeerQueued("i0", nil)
		return len(vals) == 1 && vals[0] == 300 && len(q) == 1 && q[0] == 0.75
	})
	if _, n := a.PeerComputed(nil); n != 0 {
		t.Fatalf("a counts %d peers publishing placement; b publishes none", n)
	}
}

// TestRentShared: a replica's rent accounts reach its peer over NATS (a
// delta with a change, and the whole table after a hello), and a dropped
// account leaves the peer's table.
func TestRentShared(t *testing.T) {
	a, b := fastPair(t)
	var mu sync.Mutex
	accounts := map[uint64]Rent{7: {Key: 7, Gen: 1, Rent: 0.25}}
	changed := map[uint64]bool{7: true}
	a.AttachRent(func(dst []Rent, full bool) []Rent {
		mu.Lock()
		defer mu.Unlock()
		for k := range changed {
			if !full {
				dst = append(dst, accounts[k]) // zero Rent{Key: k}: removed
			}
		}
		if full {
			for _, r := range accounts {
				dst = append(dst, r)
			}
		}
		clear(changed)
		return dst
	})
	account := func(key uint64) (uint64, float64) { return b.RentAccount(key, 0, 0) }
	testenv.WaitFor(t, 10*time.Second, "b hears a's account", func() bool {
		g, acc := account(7)
		return g == 1 && acc == 0.25
	})
	mu.Lock()
	accounts[7] = Rent{Key: 7, Gen: 2}
	accounts[8] = Rent{Key: 8, Rent: 0.5}
	changed[7], changed[8] = true, true
	mu.Unlock()
	a.Changed()
	testenv.WaitFor(t, 10*time.Second, "b hears a's purchase and new rent", func() bool {
		g7, acc7 := account(7)
		_, acc8 := account(8)
		return g7 == 2 && acc7 == 0 && acc8 == 0.5
	})
	mu.Lock()
	delete(accounts, 8)
	changed[8] = true
	mu.Unlock()
	testenv.WaitFor(t, 10*time.Second, "b drops a's removed account", func() bool {
		_, acc8 := account(8)
		return acc8 == 0
	})
	if g, acc := a.RentAccount(7, 0, 0); g != 0 || acc != 0 {
		t.Fatalf("a holds accounts (%d, %v); b publishes none", g, acc)
	}
}

// A hello's answer carries every unexpired announcement once, oldest
// first: the list kept for hellos is compacted at each flush without
// losing older entries.
func TestHelloResendsEveryAnnouncement(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	slow := func(name string) Config { return noHeartbeat(pool, name) }
	a := startReplica(t, url, slow("a"))
	keys := []kvindex.Key{101, 102, 103}
	for i, inst := range []string{"i0", "i1", "i2"} {
		a.Speculate(inst, keys[i:i+1], time.Minute)
		time.Sleep(60 * time.Millisecond) // several of a's interval flushes (to no one)
	}
	c := startReplica(t, url, slow("c"))
	testenv.WaitFor(t, 10*time.Second, "c hears a's newest announcement", func() bool {
		return c.PeerExtend(keys, 2, "i2", 0) == 3
	})
	time.Sleep(200 * time.Millisecond)
	if got0, got1 := c.PeerExtend(keys, 0, "i0", 0), c.PeerExtend(keys, 1, "i1", 0); got0 != 1 || got1 != 2 {
		t.Fatalf("after its hello c holds a's i0 announcement: %v, i1: %v (want both): a's recent list lost them", got0 == 1, got1 == 2)
	}
}
