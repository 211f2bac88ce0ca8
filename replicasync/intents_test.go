package replicasync

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A sequencing replica's intents reach its peer on the pool's intent
// subject (never its own sync subject, where a version 5 replica listens),
// each named by its sender; junk and other kinds on the intent subject
// are counted and dropped; while an epoch is decided the peer's load
// messages wait until its overlay is cleared.
func TestIntentsOnTheirSubject(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	ca, cb := fast(pool, "a"), fast(pool, "b")
	ca.Sequence, cb.Sequence = 5*time.Millisecond, 5*time.Millisecond
	m, _ := NewMetrics(nil)
	cb.Metrics = m
	a, b := startReplica(t, url, ca), startReplica(t, url, cb)
	got := make(chan Intent, 4)
	b.AttachIntents(func(in Intent) { got <- in })
	testenv.WaitFor(t, 10*time.Second, "peers live", func() bool { return a.Live() == 1 && b.Live() == 1 })

	// The sync subject carries no intent.
	watch := testenv.Connect(t, url)
	sync, err := watch.SubscribeSync(SubjectRoot + "." + pool)
	if err != nil {
		t.Fatal(err)
	}
	in := Intent{Seq: 7, Arrival: time.Now().UnixNano(), Tokens: 100, Hash: 42, Keys: []uint64{1, 2, 3}}
	if !a.PublishIntent(in) {
		t.Fatal("intent refused")
	}
	select {
	case r := <-got:
		if r.Replica != "a" || r.Seq != 7 || r.Hash != 42 || len(r.Keys) != 3 {
			t.Fatalf("received %+v", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no intent received")
	}
	for {
		msg, err := sync.NextMsg(50 * time.Millisecond)
		if err != nil {
			break
		}
		if dm, _ := Decode(msg.Data); dm.Kind == KindIntent {
			t.Fatal("an intent on the sync subject")
		}
	}

	// Junk, and a message of another kind, on the intent subject.
	_ = watch.Publish(a.IntentSubject(), []byte("junk"))
	hello, _ := (&Message{Kind: KindHello, Replica: "z"}).AppendBinary(nil)
	_ = watch.Publish(a.IntentSubject(), hello)
	testenv.WaitFor(t, 10*time.Second, "junk counted", func() bool {
		return value(m.dropped.WithLabelValues(pool, "malformed")) >= 2
	})

	// Held back while an epoch is decided.
	b.BeginEpoch()
	a.set(Load{Instance: "i0", InFlight: 4})
	time.Sleep(100 * time.Millisecond) // several of a's sends
	if f, _, _ := b.PeerLoad("i0"); f != 0 {
		t.Fatalf("during an epoch b counts %d of a's in flight", f)
	}
	b.ClearOverlay()
	if f, _, _ := b.PeerLoad("i0"); f != 4 {
		t.Fatalf("after the epoch b counts %d of a's in flight, want 4", f)
	}
}

// An intent with more keys than a small max_message_bytes holds is sent
// with its leading keys, not refused whole (and never counted as the
// byte budget's refusal).
func TestLongIntentTrimmedToMessage(t *testing.T) {
	url := testenv.NATSURL(t)
	pool := testenv.UniqueName(t)
	ca, cb := fast(pool, "a"), fast(pool, "b")
	ca.MaxMessageBytes, ca.Sequence, cb.Sequence = 8<<10, 5*time.Millisecond, 5*time.Millisecond
	a, b := startReplica(t, url, ca), startReplica(t, url, cb)
	got := make(chan Intent, 1)
	b.AttachIntents(func(in Intent) { got <- in })
	testenv.WaitFor(t, 10*time.Second, "peers live", func() bool { return a.Live() == 1 && b.Live() == 1 })
	keys := make([]uint64, MaxIntentKeys)
	for i := range keys {
		keys[i] = uint64(i + 1)
	}
	if !a.PublishIntent(Intent{Seq: 1, Arrival: time.Now().UnixNano(), Tokens: 16 * len(keys), Keys: keys}) {
		t.Fatalf("an intent of %d keys refused with max_message_bytes %d", len(keys), ca.MaxMessageBytes)
	}
	select {
	case r := <-got:
		if n := len(r.Keys); n == 0 || n >= len(keys) || r.Keys[0] != 1 || r.Keys[n-1] != uint64(n) {
			t.Fatalf("received %d keys (first %v): want the leading ones, fewer than %d", n, r.Keys[:min(n, 1)], len(keys))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the trimmed intent never arrived")
	}
}

// A replica's commit (the highest own intent seq decided for real)
// reaches its peer after its load messages, is held back with them while
// the peer decides an epoch, and names its incarnation.
func TestCommitReachesPeer(t *testing.T) {
	a, b := fastPair(t)
	testenv.WaitFor(t, 10*time.Second, "peers live", func() bool { return a.Live() == 1 && b.Live() == 1 })
	a.Commit(3)
	testenv.WaitFor(t, 10*time.Second, "b hears a's commit", func() bool { return b.Committed("a", a.incarnation) == 3 })
	if got := b.Committed("a", a.incarnation+1); got != 0 {
		t.Fatalf("another incarnation of a committed %d", got)
	}
	b.BeginEpoch()
	a.Commit(5)
	a.Commit(4)                        // never back
	time.Sleep(100 * time.Millisecond) // several of a's sends
	if got := b.Committed("a", a.incarnation); got != 3 {
		t.Fatalf("during an epoch b reads a's commit %d, want 3 (held back)", got)
	}
	b.ClearOverlay()
	if got := b.Committed("a", a.incarnation); got != 5 {
		t.Fatalf("after the epoch b reads a's commit %d, want 5", got)
	}
}
