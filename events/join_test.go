package events

import (
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
)

// perHash is b's events as an index applies them: every BlockRemoved split
// into one event per hash (an index removes a removal's hashes one at a
// time, in order), layouts dropped (a joined event keeps only its first
// event's).
func perHash(b Batch) []Event {
	var out []Event
	for _, e := range b.Events {
		e.Layout = EventLayout{}
		if e.Kind != BlockRemoved || len(e.BlockHashes) <= 1 {
			out = append(out, e)
			continue
		}
		for _, h := range e.BlockHashes {
			one := e
			one.BlockHashes = []uint64{h}
			out = append(out, one)
		}
	}
	return out
}

// checkJoined decodes p with a Decoder that joins removals (up to join
// hashes) and with one that does not, both reused over reps decodes, and
// checks they give the same batch as an index applies it, the same counts
// and errors, and that no joined event exceeds join hashes. It returns the
// joined batch's event count.
func checkJoined(t testing.TB, p []byte, join, reps int) int {
	t.Helper()
	jd, ed := Decoder{JoinRemovals: join}, Decoder{}
	n := 0
	for range reps {
		got, gerr := jd.Decode(p)
		want, werr := ed.Decode(p)
		if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
			t.Fatalf("%x: error %v, not joined %v", p, gerr, werr)
		}
		if gerr != nil {
			return 0
		}
		if !reflect.DeepEqual(perHash(got), perHash(want)) {
			t.Fatalf("%x:\n joined %#v\n each   %#v", p, got.Events, want.Events)
		}
		got.Events, want.Events = nil, nil
		if fmt.Sprint(got.InvalidErr) != fmt.Sprint(want.InvalidErr) {
			t.Fatalf("%x: invalid %v, not joined %v", p, got.InvalidErr, want.InvalidErr)
		}
		got.InvalidErr, want.InvalidErr = nil, nil
		if math.Float64bits(got.TS) != math.Float64bits(want.TS) {
			t.Fatalf("%x: ts %v, not joined %v", p, got.TS, want.TS)
		}
		got.TS, want.TS = 0, 0 // a NaN is not DeepEqual to itself
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%x: batch %+v, not joined %+v", p, got, want)
		}
		// An event of more than join hashes is one the engine wrote so.
		n = 0
		for _, e := range jd.d.evBuf[:jd.d.evUsed] {
			if len(e.BlockHashes) > join && !slices.ContainsFunc(ed.d.evBuf[:ed.d.evUsed], func(w Event) bool {
				return reflect.DeepEqual(w.BlockHashes, e.BlockHashes)
			}) {
				t.Fatalf("%x: a joined event of %d hashes, at most %d", p, len(e.BlockHashes), join)
			}
			n++
		}
	}
	return n
}

// removalEv is a one-block BlockRemoved as vLLM writes it per evicted
// block: 3 keys, or 4 with group_idx g (g < 0: 3 keys).
func removalEv(h uint64, g int) mp {
	if g < 0 {
		return removalTail(3).str("block_hashes").arr(1).u64(h).str("medium").str("GPU")
	}
	return removalTail(4).str("block_hashes").arr(1).u64(h).str("medium").str("GPU").str("group_idx").fix(g)
}

// TestJoinRemovals: a full cache's step (a store, then one-block removals)
// decodes, with JoinRemovals, to the store and one removal of all the
// hashes, in order; runs longer than JoinRemovals are cut into events of at
// most that many; the same batch as an index applies it as without.
func TestJoinRemovals(t *testing.T) {
	st := mp{}.mapH(4).str("type").str("BlockStored").str("block_hashes").arr(1).u64(9).
		str("token_ids").arr(2).fix(1).fix(2).str("block_size").fix(2)
	evs := []mp{st}
	for i := range 50 {
		evs = append(evs, removalEv(uint64(i)<<40|7, 0))
	}
	p := batch3(0, evs...)
	dec := Decoder{JoinRemovals: 64}
	for range 3 {
		b, err := dec.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Events) != 2 || b.Events[1].Kind != BlockRemoved || len(b.Events[1].BlockHashes) != 50 ||
			b.Events[1].Medium != "GPU" || b.Events[1].BlockHashes[49] != 49<<40|7 {
			t.Fatalf("got %d events: %+v", len(b.Events), b.Events)
		}
	}
	if n := checkJoined(t, p, 64, 3); n != 2 {
		t.Fatalf("%d events, want 2", n)
	}
	if n := checkJoined(t, p, 16, 3); n != 1+4 { // 16, 16, 16, 2
		t.Fatalf("%d events, want 5", n)
	}
	// Alike only: another group, the 3-key form beside the 4-key form of
	// group 0 (the same event), another medium, two hashes, a store, an
	// unknown event, an unreadable one: each ends or passes a run as
	// the index would see it.
	cpu := removalTail(3).str("block_hashes").arr(1).u64(5).str("medium").str("CPU")
	two := removalTail(3).str("block_hashes").arr(2).u64(5).u64(6).str("medium").str("GPU")
	unknown := mp{}.mapH(1).str("type").str("Nope")
	bad := removalTail(3).str("block_hashes").str("x").str("medium").str("GPU")
	mixed := []mp{removalEv(1, 0), removalEv(2, -1), removalEv(3, 1), removalEv(4, 1), cpu, removalEv(5, 1),
		two, removalEv(6, 0), st, removalEv(7, 0), unknown, removalEv(8, 0), bad, removalEv(9, 0), removalEv(10, 0)}
	checkJoined(t, batch3(0, mixed...), 64, 3)
	checkJoined(t, batch3(0, mixed...), 2, 3)
}

// TestJoinRemovalsRandom: random batches of vLLM's one-block removals among
// other events, decoded over one reused Decoder (its hash buffer grows
// within runs), are the same batch as an index applies them with and
// without joining.
func TestJoinRemovalsRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	st := mp{}.mapH(4).str("type").str("BlockStored").str("block_hashes").arr(2).u64(9).u64(10).
		str("token_ids").arr(2).fix(1).fix(2).str("block_size").fix(1)
	arr := mp{}.arr(3).str("BlockRemoved").arr(1).u64(3).str("GPU")
	for range 300 {
		var evs []mp
		for range rng.IntN(300) {
			switch r := rng.IntN(20); {
			case r < 15:
				evs = append(evs, removalEv(rng.Uint64(), rng.IntN(3)-1))
			case r < 17:
				evs = append(evs, st)
			case r < 18:
				evs = append(evs, arr)
			case r < 19:
				evs = append(evs, removalTail(3).str("block_hashes").arr(1).u64(1).str("medium").str("CPU"))
			default:
				evs = append(evs, removalTail(3).str("block_hashes").str("x").str("medium").str("GPU"))
			}
		}
		checkJoined(t, batch3(0, evs...), 1+rng.IntN(80), 2)
	}
}

// FuzzJoinRemovals: any payload decodes, with JoinRemovals, to the batch
// an index applies alike, errors included.
func FuzzJoinRemovals(f *testing.F) {
	f.Add(uint8(64), batch3(0, removalEv(1, 0), removalEv(2, 0), removalEv(3, -1)))
	f.Add(uint8(2), batch3(1, removalEv(1, 0), removalEv(2, 1), removalEv(3, 1), removalEv(4, 1)))
	f.Fuzz(func(t *testing.T, join uint8, p []byte) {
		checkJoined(t, p, int(join), 2)
	})
}
