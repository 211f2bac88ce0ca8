package kvaware

import (
	"math"
	"testing"

	"github.com/kvrouter/kvrouter/replicasync"
)

const sec = int64(1e9)

// Two replicas that have applied each other's latest state compute the
// same queue for an instance: each drains its own and its peer's pending
// requests by one FIFO model, from the same facts.
func TestSharedQueueSameOnEveryReplica(t *testing.T) {
	a := []replicasync.Pending{{At: 0, Tokens: 20000}, {At: 3 * sec / 10, Tokens: 5000}}
	b := []replicasync.Pending{{At: sec / 10, Tokens: 10000}}
	const rateA, rateB = 20000, 25000
	now := sec / 2
	var s1, s2 sharedScratch
	// Replica A: its own a; B's b as published.
	qa := replicasync.PeerQueue{Pending: b, Rates: []int64{rateB}, Started: 0}
	got1 := sharedQueue(now, a, 0, true, rateA, &qa, &s1)
	qb := replicasync.PeerQueue{Pending: a, Rates: []int64{rateA}}
	got2 := sharedQueue(now, b, 0, true, rateB, &qb, &s2)
	if got1 != got2 {
		t.Fatalf("replica A sees %v tokens, replica B %v", got1, got2)
	}
	// One FIFO queue at the mean rate 22,500/s: the work (35,000 tokens)
	// started at 0 without a gap, so 0.5 s of it is done.
	want := 35000 - 0.5*22500
	if math.Abs(got1-want) > 1 {
		t.Fatalf("queue %v tokens, want %v", got1, want)
	}
}

// A first byte seen later than the FIFO prediction moves the queue's
// start: the work behind it had not started.
func TestSharedQueueStartsAfterFirstByte(t *testing.T) {
	own := []replicasync.Pending{{At: sec / 10, Tokens: 10000}}
	q := replicasync.PeerQueue{Started: 9 * sec / 10}
	var s sharedScratch
	got := sharedQueue(9*sec/10, own, 0, true, 10000, &q, &s)
	if math.Abs(got-10000) > 1 {
		t.Fatalf("queue %v tokens, want all 10000 (the request ahead just finished)", got)
	}
	// This replica's own Started counts only while it has load there (the
	// entry its peers see).
	q = replicasync.PeerQueue{Pending: own, Rates: []int64{10000}}
	if got := sharedQueue(9*sec/10, nil, 9*sec/10, false, 10000, &q, &s); math.Abs(got-2000) > 1 {
		t.Fatalf("queue %v tokens, want 2000 (own first byte not published)", got)
	}
}

// Unlisted pending prefill (a version 1 peer) counts in full beside the
// drained listed requests.
func TestSharedQueueUnlistedInFull(t *testing.T) {
	q := replicasync.PeerQueue{Unlisted: 7000}
	var s sharedScratch
	own := []replicasync.Pending{{At: 0, Tokens: 10000}}
	if got := sharedQueue(sec/2, own, 0, true, 10000, &q, &s); math.Abs(got-(7000+5000)) > 1 {
		t.Fatalf("queue %v tokens, want 12000", got)
	}
}

// Listed pending requests whose tokens sum beyond int64 (a hostile peer's,
// or very many peers') count as a full queue, not as none: the sums
// saturate.
func TestSharedQueueSumsSaturate(t *testing.T) {
	pend := []replicasync.Pending{{At: 0, Tokens: 1 << 62}, {At: 0, Tokens: 1 << 62}}
	q := replicasync.PeerQueue{Pending: pend, Rates: []int64{1 << 62, 1 << 62}}
	var s sharedScratch
	if got := sharedQueue(sec, nil, 0, false, 0, &q, &s); got <= 0 {
		t.Fatalf("queue %v tokens", got)
	}
	q.Rates = nil // no rate: counted in full
	if got := sharedQueue(sec, nil, 0, false, 0, &q, &s); got <= 0 {
		t.Fatalf("queue %v tokens without a rate", got)
	}
}
