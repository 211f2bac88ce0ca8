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
