package events

import (
	"bytes"
	"fmt"
	"reflect"
	"testing"
)

// removalTail is a BlockRemoved map event's header for n keys and its
// "type" first, as msgspec writes it; the event's other fields follow.
func removalTail(n int) mp { return mp{}.mapH(n).str("type").str("BlockRemoved") }

// decodeOne decodes a batch of the one event ev with a reused Decoder (the
// consumer's), twice over the same Decoder so that reuse is exercised.
func decodeOne(t testing.TB, ev []byte) (Batch, error) {
	var dec Decoder
	p := batch3(0, ev)
	if _, err := dec.Decode(p); err != nil {
		return Batch{}, err
	}
	return dec.Decode(p)
}

// generalOf is ev (a map event of n keys) with one more key that no event
// has, appended: the decoder skips it, so the event decodes the same, but
// never through removal1 (which takes only the exact forms).
func generalOf(ev []byte, n int) []byte {
	var h mp
	if n+1 < 16 {
		h = mp{}.mapH(n + 1)
		ev = ev[1:]
	} else {
		return nil
	}
	return append(append(h, ev...), mp{}.str("zz_not_a_field").nil()...)
}

// checkRemoval1 checks that ev (a BlockRemoved map event of n keys)
// decodes exactly as the general loop decodes it, errors included, and
// whether removal1 took it.
func checkRemoval1(t *testing.T, ev []byte, n int, wantFast bool) {
	t.Helper()
	var d decoder
	d.r = reader{b: ev}
	if _, err := d.r.mapHeader(); err != nil {
		t.Fatal(err)
	}
	d.r.off += len(removalTail(0)) - 1
	var e Event
	var st fieldState
	start := d.r.off
	if fast := d.removal1(&e, n, &st); fast != wantFast {
		t.Fatalf("removal1 took %x: %v, want %v", ev, fast, wantFast)
	} else if !fast && (d.r.off != start || !reflect.DeepEqual(st, fieldState{}) || !reflect.DeepEqual(e, Event{})) {
		t.Fatalf("removal1 declined %x but consumed or recorded: off %d→%d, %+v, %+v", ev, start, d.r.off, st, e)
	}
	got, gerr := decodeOne(t, ev)
	ref := generalOf(ev, n)
	want, werr := decodeOne(t, ref)
	if (gerr == nil) != (werr == nil) {
		t.Fatalf("%x: error %v, general %v", ev, gerr, werr)
	}
	if gerr != nil {
		return
	}
	if !reflect.DeepEqual(got.Events, want.Events) {
		t.Fatalf("%x:\n got %#v\nwant %#v", ev, got.Events, want.Events)
	}
}

func TestRemoval1SameAsGeneral(t *testing.T) {
	hashForms := map[string]func(mp) mp{
		"cf":     func(m mp) mp { return m.u64(0x0123456789abcdef) },
		"cfHigh": func(m mp) mp { return m.u64(1 << 63) },
		"fixint": func(m mp) mp { return m.fix(7) },
		"ce":     func(m mp) mp { return m.u32(0xdeadbeef) },
		"min":    func(m mp) mp { return m.u(300) },
		"neg":    func(m mp) mp { return m.i64(-5) },
		"bin32":  func(m mp) mp { return m.bin(bytes.Repeat([]byte{0xab}, 32)) },
		"bin3":   func(m mp) mp { return m.bin([]byte{1, 2, 3}) },
		"bin0":   func(m mp) mp { return m.bin(nil) },     // an error: empty digest
		"str":    func(m mp) mp { return m.str("x") },     // an error: not a hash
		"trunc":  func(m mp) mp { return m.raw(0xcf, 1) }, // truncated
	}
	for name, hf := range hashForms {
		fast := name != "bin0" && name != "str" && name != "trunc"
		t.Run(name, func(t *testing.T) {
			// vLLM's forms: with and without group_idx.
			ev := hf(removalTail(3).str("block_hashes").arr(1)).str("medium").str("GPU")
			checkRemoval1(t, ev, 3, fast)
			for _, g := range []int{0, 1, 127} {
				ev := hf(removalTail(4).str("block_hashes").arr(1)).str("medium").str("GPU").str("group_idx").fix(g)
				checkRemoval1(t, ev, 4, fast)
			}
		})
	}
	// Forms it declines, decoded by the general loop all the same.
	declined := []struct {
		name string
		ev   mp
		n    int
	}{
		{"two hashes", removalTail(3).str("block_hashes").arr(2).u64(1).u64(2).str("medium").str("GPU"), 3},
		{"no hashes", removalTail(3).str("block_hashes").arr(0).str("medium").str("GPU"), 3},
		{"nil hashes", removalTail(3).str("block_hashes").nil().str("medium").str("GPU"), 3},
		{"CPU", removalTail(3).str("block_hashes").arr(1).u64(1).str("medium").str("CPU"), 3},
		{"nil medium", removalTail(3).str("block_hashes").arr(1).u64(1).str("medium").nil(), 3},
		{"medium first", removalTail(3).str("medium").str("GPU").str("block_hashes").arr(1).u64(1), 3},
		{"no medium", removalTail(2).str("block_hashes").arr(1).u64(1), 2},
		{"group 128", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx").u(128), 4},
		{"group -1", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx").fix(-1), 4},
		{"group a map", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx").mapH(0), 4},
		{"group nil", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx").nil(), 4},
		{"other 4th", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("lora_id").fix(1), 4},
		{"4 keys, 3 written", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU"), 4},
		{"medium truncated", removalTail(3).str("block_hashes").arr(1).u64(1).raw(0xa6, 'm', 'e'), 3},
		{"group_idx truncated", removalTail(4).str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx"), 4},
	}
	for _, c := range declined {
		t.Run(c.name, func(t *testing.T) { checkRemoval1(t, c.ev, c.n, false) })
	}
}

// TestRemoval1Batch: a full cache's step (one store, then one-block
// removals in both of vLLM's forms) decodes to the same events and layouts
// as the general loop gives them.
func TestRemoval1Batch(t *testing.T) {
	st := mp{}.mapH(4).str("type").str("BlockStored").str("block_hashes").arr(1).u64(9).
		str("token_ids").arr(2).fix(1).fix(2).str("block_size").fix(2)
	evs, gen := []mp{st}, []mp{st}
	for i := range 20 {
		n := 3 + i%2
		ev := removalTail(n).str("block_hashes").arr(1).u64(uint64(i) << 40).str("medium").str("GPU")
		if n == 4 {
			ev = ev.str("group_idx").fix(i % 3)
		}
		evs, gen = append(evs, ev), append(gen, generalOf(ev, n))
	}
	var dec, ref Decoder
	got, err := dec.Decode(batch3(1, evs...))
	if err != nil {
		t.Fatal(err)
	}
	want, err := ref.Decode(batch3(1, gen...))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Events) != 21 || !reflect.DeepEqual(got.Events, want.Events) {
		t.Fatalf("got %d events %#v\nwant %#v", len(got.Events), got.Events, want.Events)
	}
	if e := got.Events[4]; e.Kind != BlockRemoved || e.BlockHashes[0] != 3<<40 || e.Medium != "GPU" || e.GroupIdx != 0 ||
		e.Layout.N != 4 || e.Layout.Flags != FlagHashFixed64 || e.Layout.Encoding != EncodingMap {
		t.Fatalf("event 4: %#v", e)
	}
	// Re-encoding gives the engine's bytes back (the layout is the one read).
	q, err := Encode(nil, got, got.Encoding)
	if err != nil {
		t.Fatal(err)
	}
	if p := batch3(1, evs...); !bytes.Equal(q, p) {
		t.Fatalf("re-encoded\n%x\nwant\n%x", q, p)
	}
}

// FuzzRemoval1: any BlockRemoved map event whose "type" comes first
// decodes exactly as the general loop decodes it (the event with one
// unknown key more), errors included.
func FuzzRemoval1(f *testing.F) {
	f.Add(4, []byte(mp{}.str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx").fix(0)))
	f.Add(3, []byte(mp{}.str("block_hashes").arr(1).u(77).str("medium").str("GPU")))
	f.Add(3, []byte(mp{}.str("block_hashes").arr(1).bin([]byte{1, 2}).str("medium").str("GPU")))
	f.Add(4, []byte(mp{}.str("block_hashes").arr(1).u64(1).str("medium").str("GPU").str("group_idx").u(200)))
	f.Add(4, []byte(mp{}.str("block_hashes").arr(1).u64(1).str("medium").str("GP"))) // truncated in the medium
	f.Add(3, []byte(mp{}.str("block_hashes").arr(1)))                                // truncated before the hash
	f.Fuzz(func(t *testing.T, n int, body []byte) {
		if n < 1 || n > 14 {
			return
		}
		ev := append(removalTail(n), body...)
		// Only the event's own bytes: trailing ones would be read as the
		// general form's extra key.
		r := reader{b: ev}
		if r.skip() != nil {
			// A truncated event (the body ends inside it): the batch
			// holding it must fail to decode, through removal1 or not,
			// and never panic or read past its end.
			if _, err := decodeOne(t, ev); err == nil {
				t.Fatalf("%x: a truncated event decoded", ev)
			}
			return
		}
		ev = ev[:r.off]
		got, gerr := decodeOne(t, ev)
		want, werr := decodeOne(t, generalOf(ev, n))
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("%x: error %v, general %v", ev, gerr, werr)
		}
		if gerr == nil && !reflect.DeepEqual(got.Events, want.Events) {
			t.Fatalf("%x:\n got %s\nwant %s", ev, fmt.Sprintf("%#v", got.Events), fmt.Sprintf("%#v", want.Events))
		}
	})
}
