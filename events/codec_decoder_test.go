package events

import (
	"errors"
	"fmt"
	"reflect"
	"testing"
	"unsafe"
)

// decodeBoth decodes p with Decode and with dec, and fails unless both give
// the same batch (deeply: events, layouts, empty-but-not-nil slices) or the
// same error.
func decodeBoth(t *testing.T, dec *Decoder, p []byte) (Batch, error) {
	t.Helper()
	want, werr := Decode(p)
	got, gerr := dec.Decode(p)
	if (werr == nil) != (gerr == nil) || (werr != nil && werr.Error() != gerr.Error()) {
		t.Fatalf("Decoder.Decode error %v, Decode %v (payload %x)", gerr, werr, p)
	}
	if werr != nil && !errors.Is(gerr, ErrMalformed) {
		t.Fatalf("error not ErrMalformed: %v", gerr)
	}
	if !reflect.DeepEqual(want, got) {
		t.Fatalf("Decoder.Decode differs from Decode for %x:\n got %#v\nwant %#v", p, got, want)
	}
	return got, gerr
}

// decoderPayloads is every capture, then a batch of two 512-block
// events (larger than a Decoder's first buffers and than a retaining
// one's chunks) and two bytes that do not decode.
func decoderPayloads(t *testing.T) [][]byte {
	var ps [][]byte
	for _, c := range loadCaptures(t) {
		ps = append(ps, c.payload(t))
	}
	e := longPrompt()
	big, err := Encode(nil, Batch{TS: 1, Events: []Event{e, e}}, EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	return append(ps, big, []byte{0x92, 0x01})
}

// TestDecoderMatchesDecode runs every capture through one Decoder in turn
// (buffers reused from batch to batch, growing and shrinking), then in
// reverse, and checks each batch against Decode's.
func TestDecoderMatchesDecode(t *testing.T) {
	ps := decoderPayloads(t)
	ps = append(ps, ps[0])
	var dec Decoder
	for _, p := range ps {
		decodeBoth(t, &dec, p)
	}
	for i := len(ps) - 1; i >= 0; i-- {
		decodeBoth(t, &dec, ps[i])
	}
}

// TestRetainingDecoderKeepsBatches: a Decoder with Retain decodes every
// capture, a batch larger than its chunks, malformed bytes and an empty
// batch as Decode does, and every batch it returned is still Decode's
// after all the others were decoded (nothing carved twice).
func TestRetainingDecoderKeepsBatches(t *testing.T) {
	ps := append(decoderPayloads(t), []byte(mp{}.arr(2).f64(1).arr(0))) // and an empty batch
	ps = append(ps, ps...)
	dec := Decoder{Retain: true}
	var got []Batch
	for _, p := range ps {
		b, _ := decodeBoth(t, &dec, p)
		got = append(got, b)
	}
	for i, p := range ps {
		want, _ := Decode(p)
		if !reflect.DeepEqual(got[i], want) {
			t.Fatalf("batch %d changed after later ones were decoded:\n got %#v\nwant %#v", i, got[i], want)
		}
	}
}

// TestDecoderBatchValidUntilNext: every event of one batch keeps its own
// hashes and tokens while the batch is read, even when the buffers had to
// grow part-way through it.
func TestDecoderBatchValidUntilNext(t *testing.T) {
	var evs []Event
	for i := range 40 {
		ev := Event{Kind: BlockStored, BlockSize: 16, Medium: "GPU"}
		n := 1 + i*7%33
		for j := range n {
			ev.BlockHashes = append(ev.BlockHashes, uint64(i)<<32|uint64(j))
		}
		for j := range 16 * n {
			ev.TokenIDs = append(ev.TokenIDs, uint32(i*100000+j))
		}
		evs = append(evs, ev)
	}
	p, err := Encode(nil, Batch{TS: 1, Events: evs}, EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	var dec Decoder
	for round := range 3 {
		b, err := dec.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		for i, ev := range b.Events {
			if !reflect.DeepEqual(ev.BlockHashes, evs[i].BlockHashes) || !reflect.DeepEqual(ev.TokenIDs, evs[i].TokenIDs) {
				t.Fatalf("round %d: event %d's blocks or tokens overwritten within its batch", round, i)
			}
		}
	}
}

// TestDecoderDoesNotAllocate: once its buffers have grown, a Decoder
// decodes a stream's usual batch without allocating.
func TestDecoderDoesNotAllocate(t *testing.T) {
	ev := Event{Kind: BlockStored, BlockSize: 16, Medium: "GPU", HasParent: true, ParentHash: 7,
		BlockHashes: make([]uint64, 16), TokenIDs: make([]uint32, 256), SpecKind: "full_attention"}
	for i := range ev.BlockHashes {
		ev.BlockHashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		p, err := Encode(nil, Batch{TS: 1, Events: []Event{ev}, HasDPRank: true}, enc)
		if err != nil {
			t.Fatal(err)
		}
		var dec Decoder
		if n := decodeAllocs(t, &dec, p, 100); n != 0 {
			t.Errorf("%v: %.1f allocations per batch, want 0", enc, n)
		}
	}
}

// FuzzDecoder checks that a Decoder that has already decoded other batches
// (its buffers holding their contents) decodes anything exactly as Decode
// does, twice in a row; a retaining one (Retain) too, leaving the batches
// it returned before unchanged.
func FuzzDecoder(f *testing.F) {
	var seeds [][]byte
	for _, c := range loadCaptures(f) {
		seeds = append(seeds, c.payload(f))
	}
	for _, s := range seeds {
		f.Add(s)
	}
	f.Add([]byte(mp{}.arr(2).f64(1).arr(2).arr(1).str("AllBlocksCleared").arr(2).str("Other").arr(0)))
	f.Fuzz(func(t *testing.T, p []byte) {
		for _, retain := range []bool{false, true} {
			dec := Decoder{Retain: retain}
			var kept []Batch
			for i, s := range seeds {
				if i%3 == len(p)%3 {
					b, err := dec.Decode(s)
					if err != nil {
						t.Fatal(fmt.Errorf("seed %d: %w", i, err))
					}
					kept = append(kept, b)
				}
			}
			decodeBoth(t, &dec, p)
			decodeBoth(t, &dec, p)
			if !retain {
				continue
			}
			// What a retaining Decoder returned before is unchanged.
			for i, j := 0, 0; i < len(seeds); i++ {
				if i%3 == len(p)%3 {
					if want, _ := Decode(seeds[i]); !reflect.DeepEqual(kept[j], want) {
						t.Fatalf("seed %d's batch changed after later decodes", i)
					}
					j++
				}
			}
		}
	})
}

// TestFieldIDNames: every map-era key maps to its own field id, and
// nothing else (prefixes, other case) maps to one.
func TestFieldIDNames(t *testing.T) {
	for id, name := range fieldNames {
		if got := fieldID([]byte(name)); got != id {
			t.Errorf("fieldID(%q) = %d, want %d", name, got, id)
		}
		for _, other := range []string{name[:len(name)-1], name + "x", "X" + name[1:]} {
			if got := fieldID([]byte(other)); got != -1 {
				t.Errorf("fieldID(%q) = %d, want -1", other, got)
			}
		}
	}
}

// One huge batch does not pin memory in a Decoder for good: after a small
// batch, no buffer is much larger than decoderKeep (a steady stream of
// huge batches keeps its buffers, TestDecoderDoesNotAllocate the small
// ones), and the events of an earlier, longer batch left in the event
// buffer's unused tail are cleared (they would pin their hashes, tokens
// and strings).
func TestDecoderReleasesHugeBatch(t *testing.T) {
	encode := func(evs []Event) []byte {
		p, err := Encode(nil, Batch{TS: 1, Events: evs}, EncodingArray)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	const blocks = 1 << 17 // 1 MiB of hashes and of tokens (each of two events)
	huge := Event{Kind: BlockStored, BlockSize: 2, Medium: "GPU", BlockHashes: make([]uint64, blocks), TokenIDs: make([]uint32, 2*blocks)}
	many := make([]Event, 1<<14) // evBuf: 16,384 events (> 1 MiB)
	for i := range many {
		many[i] = Event{Kind: BlockRemoved, BlockHashes: []uint64{uint64(i) + 1}, Medium: "GPU"}
	}
	small := encode([]Event{{Kind: BlockRemoved, BlockHashes: []uint64{9}, Medium: "GPU"}})
	var dec Decoder
	hugeP := encode([]Event{huge, huge})
	for _, p := range [][]byte{hugeP, encode(many)} {
		if _, err := dec.Decode(p); err != nil {
			t.Fatal(err)
		}
		if _, err := dec.Decode(small); err != nil {
			t.Fatal(err)
		}
		d := &dec.d
		if n := cap(d.hashBuf) * 8; n > decoderKeep {
			t.Errorf("hash buffer of %d bytes kept after a small batch", n)
		}
		if n := cap(d.tokBuf) * 4; n > decoderKeep {
			t.Errorf("token buffer of %d bytes kept after a small batch", n)
		}
		if n := cap(d.evBuf) * int(unsafe.Sizeof(Event{})); n > decoderKeep {
			t.Errorf("event buffer of %d bytes kept after a small batch", n)
		}
		for i, e := range d.evBuf[1:cap(d.evBuf)] {
			if !reflect.ValueOf(e).IsZero() {
				t.Fatalf("event %d of an earlier batch left in the buffer (%d hashes)", i+1, len(e.BlockHashes))
			}
		}
	}
	// A stream of huge batches keeps its buffers.
	if n := decodeAllocs(t, &dec, hugeP, 3); n != 0 {
		t.Errorf("%.1f allocations per huge batch in a stream of them, want 0", n)
	}
}

// decodeAllocs decodes p once with dec (its buffers grown) and returns
// the allocations per further decode of p.
func decodeAllocs(t *testing.T, dec *Decoder, p []byte, runs int) float64 {
	t.Helper()
	if _, err := dec.Decode(p); err != nil {
		t.Fatal(err)
	}
	return testing.AllocsPerRun(runs, func() {
		if _, err := dec.Decode(p); err != nil {
			t.Fatal(err)
		}
	})
}

// TestDecoderSkippedEventLeavesNothing: events are decoded in place, so a
// skipped event (unreadable, or of an unknown kind) must leave its slot as
// it found it: a reusing Decoder fed a batch whose unreadable BlockStored
// had its hashes, parent, tokens, medium and LoRA name read before the
// field that fails, then batches of a BlockRemoved, returns what Decode
// does (no field of the skipped event shows through), and the same after
// an unknown event.
func TestDecoderSkippedEventLeavesNothing(t *testing.T) {
	stored := func(blockSize mp) mp {
		return mp{}.arr(8).str("BlockStored").arr(1).u64(7).u64(6).arr(2).u32(1).u32(2).raw(blockSize...).fix(3).str("GPU").str("lora-x")
	}
	// The unreadable event last: its slot is past the batch's events.
	bad := mp{}.arr(3).f64(1).arr(2).raw(stored(mp{}.fix(2))...).raw(stored(mp{}.str("not a size"))...).nil()
	unknown := mp{}.arr(3).f64(1).arr(2).raw(stored(mp{}.fix(2))...).arr(3).str("Other").arr(1).u64(9).str("GPU").nil()
	removed := mp{}.arr(3).f64(2).arr(2).arr(3).str("BlockRemoved").arr(1).u64(7).str("CPU").arr(3).str("BlockRemoved").arr(1).u64(8).str("CPU").nil()
	for _, retain := range []bool{false, true} {
		dec := Decoder{Retain: retain}
		for _, p := range [][]byte{bad, removed, bad, unknown, removed, removed} {
			decodeBoth(t, &dec, p)
		}
		if b, _ := decodeBoth(t, &dec, bad); b.Invalid != 1 || len(b.Events) != 1 {
			t.Fatalf("retain %v: the unreadable event not skipped alone: %+v", retain, b)
		}
	}
}
