package replicasync

import (
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvindex"
)

var seqT0 = time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)

func newSeqs(t *testing.T, start time.Time, names ...string) []*Sequencer {
	t.Helper()
	var out []*Sequencer
	for _, n := range names {
		out = append(out, NewSequencer(SequencerConfig{Replica: n, Epoch: 2 * time.Millisecond, Grace: time.Millisecond, Start: start}))
	}
	return out
}

// publish holds an own request at replica i and delivers its intent to
// every other replica at at.
func publish(t *testing.T, seqs []*Sequencer, i int, arrive, at time.Time, tokens int) Intent {
	t.Helper()
	in, held := seqs[i].Hold(arrive, true, Intent{Tokens: tokens})
	if !held {
		t.Fatalf("replica %d: request at %v not held", i, arrive)
	}
	for j, s := range seqs {
		if j != i && !s.Receive(at, in) {
			t.Fatalf("replica %d: intent %+v not sequenced", j, in)
		}
	}
	return in
}

// Every replica decides a same-instant burst in one order: arrival, then
// replica name, then the replica's seq.
func TestSequencerOneOrderEverywhere(t *testing.T) {
	seqs := newSeqs(t, seqT0, "b", "a", "c")
	burst := seqT0.Add(10*time.Millisecond + 300*time.Microsecond)
	hop := burst.Add(200 * time.Microsecond)
	publish(t, seqs, 0, burst, hop, 1)                        // b 1
	publish(t, seqs, 1, burst, hop, 2)                        // a 1
	publish(t, seqs, 2, burst.Add(-time.Microsecond), hop, 3) // c 1, earlier
	publish(t, seqs, 1, burst, hop, 4)                        // a 2
	publish(t, seqs, 0, burst, hop, 5)                        // b 2

	due, ok := seqs[0].Next()
	if want := seqT0.Add(12*time.Millisecond + time.Millisecond); !ok || !due.Equal(want) {
		t.Fatalf("Next = %v, %v; want %v (the epoch's end plus the grace)", due, ok, want)
	}
	if got := seqs[0].Due(due.Add(-time.Nanosecond), nil); len(got) != 0 {
		t.Fatalf("due before its time: %v", got)
	}
	want := []int{3, 2, 4, 1, 5}
	for i, s := range seqs {
		var got []int
		for _, in := range s.Due(due, nil) {
			got = append(got, in.Tokens)
		}
		if !slices.Equal(got, want) {
			t.Errorf("replica %s decides %v, want %v", s.Name(), got, want)
		}
		if _, ok := s.Next(); ok {
			t.Errorf("replica %d: an epoch still open after Due", i)
		}
	}
}

// With no live peer nothing is held (a lone replica decides at once, as
// without sequencing); a silent peer delays nothing: an epoch is decided
// at its end plus the grace with whatever intents arrived.
func TestSequencerSilentPeer(t *testing.T) {
	seqs := newSeqs(t, seqT0, "a", "b")
	now := seqT0.Add(5 * time.Millisecond)
	if _, held := seqs[0].Hold(now, false, Intent{}); held {
		t.Fatal("held with no live peer")
	}
	in, held := seqs[0].Hold(now, true, Intent{Tokens: 7})
	if !held {
		t.Fatal("not held with a live peer")
	}
	due, _ := seqs[0].Next()
	if want := seqT0.Add(7 * time.Millisecond); !due.Equal(want) {
		t.Fatalf("due %v, want %v", due, want)
	}
	// b is silent: nothing of it arrives, and the epoch goes at its time.
	if got := seqs[0].Due(due, nil); len(got) != 1 || got[0].Seq != in.Seq {
		t.Fatalf("Due = %+v, want the own intent alone", got)
	}
	if st := seqs[0].Stats(); st.Held != 1 || st.Alone != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// An intent received once its epoch is due (or decided) is late: left to
// its owner, never sequenced into a later epoch.
func TestSequencerLateIntent(t *testing.T) {
	seqs := newSeqs(t, seqT0, "a", "b")
	arrive := seqT0.Add(4*time.Millisecond + 100*time.Microsecond)
	in, _ := seqs[1].Hold(arrive, true, Intent{Tokens: 1})
	due := seqT0.Add(7 * time.Millisecond)
	if seqs[0].Receive(due, in) {
		t.Fatal("an intent received at its epoch's due time was sequenced")
	}
	// Another epoch decided here first: an older epoch's intent is late too.
	own, _ := seqs[0].Hold(seqT0.Add(6*time.Millisecond), true, Intent{Tokens: 2})
	seqs[0].Due(seqT0.Add(9*time.Millisecond), nil)
	old := Intent{Replica: "b", Seq: 9, Arrival: seqT0.Add(5 * time.Millisecond).UnixNano()}
	if seqs[0].Receive(seqT0.Add(5500*time.Microsecond), old) {
		t.Fatal("an intent of an epoch older than one decided was sequenced")
	}
	if st := seqs[0].Stats(); st.Late != 2 || st.Received != 0 {
		t.Fatalf("stats %+v, want 2 late", st)
	}
	_ = own
}

// The bound: an epoch holds at most MaxPerEpoch intents; an own request
// beyond it is decided at once, a peer's left to its owner. Keys beyond
// MaxIntentKeys are cut.
func TestSequencerBounds(t *testing.T) {
	s := NewSequencer(SequencerConfig{Replica: "a", Epoch: time.Millisecond, MaxPerEpoch: 2, Start: seqT0})
	now := seqT0.Add(3 * time.Millisecond)
	in, held := s.Hold(now, true, Intent{Keys: make([]uint64, MaxIntentKeys+5)})
	if !held || len(in.Keys) != MaxIntentKeys {
		t.Fatalf("held %v with %d keys, want held with %d", held, len(in.Keys), MaxIntentKeys)
	}
	if !s.Receive(now, Intent{Replica: "b", Seq: 1, Arrival: now.UnixNano()}) {
		t.Fatal("second intent refused")
	}
	if _, held := s.Hold(now, true, Intent{}); held {
		t.Fatal("own request held beyond the bound")
	}
	if s.Receive(now, Intent{Replica: "b", Seq: 2, Arrival: now.UnixNano()}) {
		t.Fatal("peer's intent sequenced beyond the bound")
	}
	if st := s.Stats(); st.Held != 1 || st.Received != 1 || st.Alone != 1 || st.Dropped != 1 {
		t.Fatalf("stats %+v", st)
	}
	// Own intents echoed back are not sequenced twice.
	if s.Receive(now, in) {
		t.Fatal("own intent received as a peer's")
	}
}

// A replica that joins mid-epoch neither holds nor sequences in that
// partial epoch (the peers' intents sent before it listened are missing);
// from the next epoch on it does.
func TestSequencerJoining(t *testing.T) {
	start := seqT0.Add(10*time.Millisecond + 500*time.Microsecond)
	s := NewSequencer(SequencerConfig{Replica: "new", Epoch: 2 * time.Millisecond, Grace: time.Millisecond, Start: start})
	if _, held := s.Hold(start.Add(time.Microsecond), true, Intent{}); held {
		t.Fatal("held in the epoch it joined in")
	}
	peer := Intent{Replica: "old", Seq: 1, Arrival: seqT0.Add(10 * time.Millisecond).UnixNano()}
	if s.Receive(start.Add(time.Microsecond), peer) {
		t.Fatal("sequenced a peer's intent of the partial epoch")
	}
	next := seqT0.Add(12*time.Millisecond + 100*time.Microsecond)
	if _, held := s.Hold(next, true, Intent{}); !held {
		t.Fatal("not held in the first whole epoch")
	}
	peer.Seq, peer.Arrival = 2, next.UnixNano()
	if !s.Receive(next, peer) {
		t.Fatal("peer's intent of the first whole epoch not sequenced")
	}
	if got := s.Due(seqT0.Add(15*time.Millisecond), nil); len(got) != 2 {
		t.Fatalf("Due = %+v, want 2", got)
	}
}

// The overlay counts a peer's dry-decided request as a live peer's state
// (in flight, pending prefill listed for the shared queue, blocks about to
// be computed) until ClearOverlay, and nothing after.
func TestTableOverlay(t *testing.T) {
	tab := NewTable(time.Second, 1024, func() time.Time { return seqT0 })
	keys := []kvindex.Key{11, 12, 13}
	tab.Overlay(Effect{Instance: "i1", Pending: Pending{At: 5, Tokens: 300}, Rate: 1000, Keys: keys[1:]})
	tab.Overlay(Effect{Instance: "i1", Pending: Pending{At: 5, Tokens: 200}})
	tab.Overlay(Effect{Instance: "i2"})
	if f, tok, reqs := tab.PeerLoad("i1"); f != 2 || tok != 500 || reqs != 2 {
		t.Fatalf("PeerLoad(i1) = %d, %d, %d; want 2, 500, 2", f, tok, reqs)
	}
	if f, _, _ := tab.PeerLoad("i2"); f != 1 {
		t.Fatalf("PeerLoad(i2) in flight %d, want 1", f)
	}
	var q PeerQueue
	tab.PeerQueue("i1", &q)
	if len(q.Pending) != 2 || q.Unlisted != 0 || !slices.Equal(q.Rates, []int64{1000}) {
		t.Fatalf("PeerQueue = %+v", q)
	}
	if got := tab.PeerExtend(keys, 1, "i1", 0); got != 3 {
		t.Fatalf("PeerExtend from 1 = %d, want 3", got)
	}
	if got := tab.PeerExtend(keys, 1, "i2", 0); got != 1 {
		t.Fatalf("PeerExtend on i2 = %d, want 1", got)
	}
	if got := tab.PeerHolders(nil, 12); !slices.Equal(got, []string{"i1"}) {
		t.Fatalf("PeerHolders = %v", got)
	}
	// A real peer's blocks and the overlay's chain together.
	tab.ApplySpec(&Message{Kind: KindSpec, Replica: "p", Incarnation: 1, Specs: []Spec{{Instance: "i1", TTL: time.Second, Keys: []uint64{11}}}}, nil)
	if got := tab.PeerExtend(keys, 0, "i1", 0); got != 3 {
		t.Fatalf("PeerExtend through a peer's and the overlay's blocks = %d, want 3", got)
	}
	tab.ClearOverlay()
	if f, tok, reqs := tab.PeerLoad("i1"); f != 0 || tok != 0 || reqs != 0 {
		t.Fatalf("after ClearOverlay PeerLoad = %d, %d, %d", f, tok, reqs)
	}
	if got := tab.PeerExtend(keys, 0, "i1", 0); got != 1 {
		t.Fatalf("after ClearOverlay PeerExtend = %d, want 1 (the peer's block alone)", got)
	}
	if tab.OverlayLen() != 0 {
		t.Fatal("overlay not empty")
	}
}

// A peer's intent stamped further ahead than an epoch and twice the grace
// (a peer's clock far ahead, or a hostile arrival near 2^62 ns) is
// refused and counted: it opens no epoch that the epoch loop would sleep
// on while this replica's own requests wait, and holds no memory.
func TestSequencerRefusesFutureIntent(t *testing.T) {
	s := NewSequencer(SequencerConfig{Replica: "a", Epoch: 2 * time.Millisecond, Grace: 500 * time.Microsecond, Start: seqT0})
	now := seqT0.Add(10 * time.Millisecond)
	for i, ahead := range []time.Duration{3 * time.Second, 1 << 62} {
		in := Intent{Replica: "b", Seq: uint64(i + 1), Arrival: now.Add(ahead).UnixNano()}
		if ahead == 1<<62 {
			in.Arrival = 1 << 62
		}
		if s.Receive(now, in) {
			t.Fatalf("an intent %v ahead was sequenced", ahead)
		}
	}
	if _, ok := s.Next(); ok {
		t.Fatal("a future intent opened an epoch")
	}
	if st := s.Stats(); st.Future != 2 || st.Received != 0 {
		t.Fatalf("stats %+v, want 2 future", st)
	}
	// One from a clock a grace ahead, in the next epoch, is sequenced.
	now = seqT0.Add(11*time.Millisecond + 800*time.Microsecond)
	in := Intent{Replica: "b", Seq: 3, Arrival: now.Add(500 * time.Microsecond).UnixNano()}
	if !s.Receive(now, in) {
		t.Fatal("an intent a grace ahead, in the next epoch, refused")
	}
}

// A peer's intent delivered twice (same replica, seq) is sequenced once.
func TestSequencerDuplicateIntentOnce(t *testing.T) {
	s := NewSequencer(SequencerConfig{Replica: "a", Epoch: 2 * time.Millisecond, Grace: 500 * time.Microsecond, Start: seqT0})
	at := seqT0.Add(10 * time.Millisecond)
	in := Intent{Replica: "b", Seq: 7, Arrival: at.UnixNano(), Tokens: 10}
	s.Receive(at, in)
	s.Receive(at.Add(100*time.Microsecond), in)
	if due := s.Due(at.Add(time.Second), nil); len(due) != 1 {
		t.Fatalf("one intent delivered twice is decided %d times", len(due))
	}
}

// A peer that restarts (a new incarnation, its seqs from 1 again) has its
// new intents sequenced, not dropped as duplicates of the old process's
// intents of the same seq still open; the same intent of one incarnation
// delivered twice is still held once, and the pool's order is the same
// on every replica whichever incarnation's arrives first.
func TestSequencerRestartedPeerNewIncarnation(t *testing.T) {
	s := NewSequencer(SequencerConfig{Replica: "a", Epoch: 2 * time.Millisecond, Grace: 500 * time.Microsecond, Start: seqT0})
	at := seqT0.Add(10 * time.Millisecond)
	old := Intent{Replica: "b", Incarnation: 1, Seq: 1, Arrival: at.UnixNano(), Tokens: 10}
	if !s.Receive(at, old) {
		t.Fatal("the old process's intent refused")
	}
	restarted := Intent{Replica: "b", Incarnation: 2, Seq: 1, Arrival: at.Add(200 * time.Microsecond).UnixNano(), Tokens: 20}
	if !s.Receive(at.Add(300*time.Microsecond), restarted) {
		t.Fatalf("the restarted process's intent seq 1 dropped as a duplicate of the old process's (stats %+v)", s.Stats())
	}
	if s.Receive(at.Add(400*time.Microsecond), restarted) {
		t.Fatal("the restarted process's intent delivered twice sequenced twice")
	}
	due := s.Due(at.Add(time.Second), nil)
	if len(due) != 2 || due[0].Incarnation != 1 || due[1].Incarnation != 2 {
		t.Fatalf("decided %+v, want the old intent then the new one", due)
	}
	// Same arrival, replica and seq: the incarnation orders them.
	x, y := old, old
	y.Incarnation = 2
	if Order(x, y) >= 0 || Order(y, x) <= 0 {
		t.Fatalf("two incarnations' intents of one arrival and seq unordered: %d, %d", Order(x, y), Order(y, x))
	}
}

// A sequencer that replaces another of the same incarnation continues its
// intent seqs (SequencerConfig.After).
func TestSequencerContinuesAfter(t *testing.T) {
	s := NewSequencer(SequencerConfig{Replica: "a", Epoch: 2 * time.Millisecond, Start: seqT0, After: 41})
	in, held := s.Hold(seqT0.Add(10*time.Millisecond), true, Intent{Tokens: 1})
	if !held || in.Seq != 42 {
		t.Fatalf("first intent after 41: seq %d (held %v), want 42", in.Seq, held)
	}
}

// TestSequencersShareNextSeq: two sequencers over one counter (a reload's
// new pool state and the old one, both over the pool's Syncer) never give
// two intents one seq, whichever holds next.
func TestSequencersShareNextSeq(t *testing.T) {
	var n atomic.Uint64
	next := func() uint64 { return n.Add(1) }
	old := NewSequencer(SequencerConfig{Replica: "a", Epoch: 2 * time.Millisecond, Start: seqT0, NextSeq: next})
	cur := NewSequencer(SequencerConfig{Replica: "a", Epoch: 2 * time.Millisecond, Start: seqT0, NextSeq: next})
	seen := map[uint64]bool{}
	for i, s := range []*Sequencer{old, cur, old, cur} {
		in, held := s.Hold(seqT0.Add(10*time.Millisecond), true, Intent{Tokens: 1})
		if !held || seen[in.Seq] {
			t.Fatalf("hold %d: seq %d (held %v), seen already %v", i, in.Seq, held, seen)
		}
		seen[in.Seq] = true
	}
}
