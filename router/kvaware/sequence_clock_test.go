package kvaware

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/replicasync"
)

// A peer's intent stamped seconds ahead of this replica's clock neither
// opens an epoch the loop sleeps on nor stalls this replica's own held
// requests: it is refused (future), and a held request is decided when its
// own epoch is due.
func TestFutureIntentDoesNotStallHeldRequests(t *testing.T) {
	const seq = 5 * time.Millisecond
	url, a, _ := sequencingPair(t, seq)
	time.Sleep(8 * seq)

	nc := testenv.Connect(t, url)
	m := replicasync.Message{Kind: replicasync.KindIntent, Replica: "z", Incarnation: 1,
		Intents: []replicasync.Intent{{Seq: 1, Arrival: time.Now().Add(10 * time.Second).UnixNano(), Tokens: 10}}}
	buf, err := m.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(a.sync.IntentSubject(), buf); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "a takes z's intent", func() bool {
		st := a.st.SequenceStats()
		return st.Received+st.Late+st.Future == 1
	})

	s := a.strategy(config.RoutingConfig{})
	// A stalled loop would sleep until z's epoch, 10 s on: the context's
	// 5 s ends it first. 2 s leaves a loaded race run room.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	t0 := time.Now()
	_, err = s.Pick(ctx, kvRequest("q", promptTokens(1, 4*kvTestBS)), a.insts)
	if el := time.Since(t0); err != nil || el > 2*time.Second {
		t.Fatalf("a's held request returned after %v (err %v); its own epoch was due within %v", el, err, seq+a.sync.Grace())
	}
}

// A held request whose epoch opens while the loop sleeps until a later
// epoch (a peer's intent from a clock ahead, within the skew allowed) is
// decided when its own epoch is due: the loop is woken, not left sleeping
// until the later epoch.
func TestSequenceLoopWokenByEarlierEpoch(t *testing.T) {
	// Grace 4δ: an intent is sequenced while its epoch is due within
	// δ + 2×grace, so up to ~4δ ahead. b's intent is 3.5δ ahead: its epoch
	// is due ~3.5δ past the one a's own request opens, less the time taken
	// to notice the intent (the largest δ keeps that margin on a
	// loaded machine).
	const seq = 100 * time.Millisecond
	_, a, b := sequencingPair(t, seq)

	ahead := time.Now().Add(7 * seq / 2)
	in := replicasync.Intent{Seq: 1, Arrival: ahead.UnixNano(), Tokens: 10}
	if !b.sync.PublishIntent(in) {
		t.Fatal("intent refused")
	}
	waitUntil(t, "a sequences b's intent", func() bool { return a.st.SequenceStats().Received == 1 })
	later := time.Unix(0, ahead.UnixNano()).Truncate(seq).Add(seq + a.sync.Grace()) // when b's epoch is due

	s := a.strategy(config.RoutingConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.Pick(ctx, kvRequest("q", promptTokens(1, 4*kvTestBS)), a.insts); err != nil {
		t.Fatal(err)
	}
	if now := time.Now(); !now.Before(later) {
		t.Fatalf("a's held request returned at %v, after b's later epoch was due (%v): the loop slept through its own epoch",
			now.Format("15:04:05.000"), later.Format("15:04:05.000"))
	}
}

// A wall-clock step back while a request is held does not make it wait
// the step's length: its wait is bounded on the monotonic clock.
func TestClockStepBackDoesNotStallHeldRequest(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	const seq = 20 * time.Millisecond
	var offset atomic.Int64
	a := newPeerWorldNow(t, url, pool, "a", 4, true, seq, func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }, nil)
	b := newPeerWorldRun(t, url, pool, "b", 4, true, seq)
	waitUntil(t, "peers live", func() bool { return a.sync.Live() == 1 && b.sync.Live() == 1 })
	time.Sleep(3 * seq) // past the partial epoch

	s := a.strategy(config.RoutingConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan error, 1)
	t0 := time.Now()
	go func() {
		_, err := s.Pick(ctx, kvRequest("q", promptTokens(1, 4*kvTestBS)), a.insts)
		done <- err
	}()
	waitUntil(t, "the request is held", func() bool { return a.st.SequenceStats().Held == 1 })
	offset.Store(int64(-2 * time.Second))
	err := <-done
	if el := time.Since(t0); err != nil || el > time.Second {
		t.Fatalf("a's held request returned after %v (err %v); its epoch was due within %v", el, err, seq+a.sync.Grace())
	}
}

// recordingPeers records, per evaluation of n candidates, the peers'
// requests in flight summed over the candidates.
type recordingPeers struct {
	peerFreshness
	n      int
	mu     sync.Mutex
	calls  int
	sum    int64
	totals []int64
}

func (r *recordingPeers) PeerQueue(inst string, q *replicasync.PeerQueue) {
	r.peerFreshness.PeerQueue(inst, q)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sum += q.InFlight
	if r.calls++; r.calls%r.n == 0 {
		r.totals = append(r.totals, r.sum)
		r.sum = 0
	}
}

// A replica that begins deciding an epoch after a peer's real decision of
// it has reached it (its clock a few ms behind the peer's) does not count
// that request twice, once from the peer's load message and once from its
// dry decision of the peer's intent: the peer's load messages say which
// intents they cover (committed), and those are not decided dry.
func TestLateEpochCountsPeerOnce(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	const seq = 20 * time.Millisecond
	a := newPeerWorldRun(t, url, pool, "a", 4, true, seq)
	var rec *recordingPeers
	b := newPeerWorldNow(t, url, pool, "b", 4, true, seq, func() time.Time { return time.Now().Add(-5 * time.Millisecond) },
		func(pf peerFreshness) kvindex.Freshness { rec = &recordingPeers{peerFreshness: pf, n: 4}; return rec })
	waitUntil(t, "peers live", func() bool { return a.sync.Live() == 1 && b.sync.Live() == 1 })
	time.Sleep(3 * seq)
	sa, sb := a.strategy(config.RoutingConfig{}), b.strategy(config.RoutingConfig{})
	now := time.Now()
	time.Sleep(now.Truncate(seq).Add(seq + 2*time.Millisecond).Sub(now)) // 2 ms into an epoch
	var wg sync.WaitGroup
	pick := func(s *KVAware, w *peerWorld, i int) {
		d, err := s.Pick(context.Background(), kvRequest(fmt.Sprint(i), promptTokens(uint32(300+i), 8*kvTestBS)), w.insts)
		if err != nil {
			t.Error(err)
			return
		}
		d.Instance.Acquire() // as the proxy does
	}
	wg.Go(func() { pick(sa, a, 0) })
	time.Sleep(8 * time.Millisecond)
	wg.Go(func() { pick(sb, b, 1) })
	wg.Wait()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, n := range rec.totals {
		if n > 1 {
			t.Fatalf("b evaluated with %d peer requests in flight (its evaluations: %v); the pool has one, a's", n, rec.totals)
		}
	}
}
