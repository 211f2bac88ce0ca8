package events

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// mp builds msgpack by hand for tests, independently of the codec's writer.
type mp []byte

func (m mp) arr(n int) mp  { return m.header(n, 0x90, 0xdc, 0xdd) }
func (m mp) mapH(n int) mp { return m.header(n, 0x80, 0xde, 0xdf) }

// header appends an array or map header: the fix form (fix|n) below 16,
// else the 16- or 32-bit count after b16 or b32.
func (m mp) header(n int, fix, b16, b32 byte) mp {
	if n < 16 {
		return append(m, fix|byte(n))
	}
	if n <= 0xffff {
		return binary.BigEndian.AppendUint16(append(m, b16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(m, b32), uint32(n))
}
func (m mp) str(s string) mp {
	if len(s) < 32 {
		return append(append(m, 0xa0|byte(len(s))), s...)
	}
	return append(binary.BigEndian.AppendUint32(append(m, 0xdb), uint32(len(s))), s...)
}
func (m mp) u64(v uint64) mp { return binary.BigEndian.AppendUint64(append(m, 0xcf), v) }
func (m mp) u32(v uint32) mp { return binary.BigEndian.AppendUint32(append(m, 0xce), v) }
func (m mp) fix(v int) mp    { return append(m, byte(int8(v))) } // -32..127
func (m mp) i64(v int64) mp  { return binary.BigEndian.AppendUint64(append(m, 0xd3), uint64(v)) }
func (m mp) nil() mp         { return append(m, 0xc0) }
func (m mp) f64(v float64) mp {
	return binary.BigEndian.AppendUint64(append(m, 0xcb), math.Float64bits(v))
}
func (m mp) bin(b []byte) mp  { return append(append(m, 0xc4, byte(len(b))), b...) }
func (m mp) raw(b ...byte) mp { return append(m, b...) }

// batch3 wraps encoded events in [ts, [events...], rank].
func batch3(rank int, evs ...mp) []byte {
	m := mp{}.arr(3).f64(1.5).arr(len(evs))
	for _, e := range evs {
		m = append(m, e...)
	}
	return m.fix(rank)
}

func TestDecodeForms(t *testing.T) {
	digest := make([]byte, 32)
	for i := range digest {
		digest[i] = byte(i + 1)
	}
	storedShort := mp{}.arr(6).str("BlockStored").arr(2).u64(11).u64(12).nil().
		arr(2).u32(5).u32(6).fix(1).nil() // before `medium` existed
	tests := []struct {
		name    string
		payload []byte
		check   func(t *testing.T, b Batch)
	}{
		{"array 6 fields (pre-medium engine)", batch3(0, storedShort), func(t *testing.T, b Batch) {
			e := b.Events[0]
			if e.Kind != BlockStored || len(e.BlockHashes) != 2 || e.BlockHashes[1] != 12 || e.HasParent ||
				len(e.TokenIDs) != 2 || e.BlockSize != 1 || e.HasLoraID || e.Medium != "" || !e.FullAttention() {
				t.Fatalf("%+v", e)
			}
			if b.Encoding != EncodingArray || !b.HasDPRank || b.DPRank != 0 {
				t.Fatalf("batch %+v", b)
			}
		}},
		{"array 12 fields sliding window group", batch3(1, mp{}.arr(12).str("BlockStored").arr(1).u64(7).u64(6).
			arr(1).fix(9).fix(1).fix(3).str("CPU").str("ad").nil().fix(1).str("sliding_window").fix(64)),
			func(t *testing.T, b Batch) {
				e := b.Events[0]
				if !e.HasParent || e.ParentHash != 6 || e.LoraID != 3 || e.Medium != "CPU" || e.LoraName != "ad" ||
					e.GroupIdx != 1 || e.SpecKind != "sliding_window" || e.SlidingWindow != 64 || e.FullAttention() {
					t.Fatalf("%+v", e)
				}
				if b.DPRank != 1 {
					t.Fatalf("rank %d", b.DPRank)
				}
			}},
		{"array 14 fields: unknown trailing fields skipped", batch3(0, mp{}.arr(14).str("BlockStored").arr(0).nil().arr(0).
			fix(16).nil().str("GPU").nil().nil().fix(0).str("full_attention").nil().mapH(1).str("x").arr(1).fix(1).str("future")),
			func(t *testing.T, b Batch) {
				if e := b.Events[0]; e.BlockSize != 16 || e.SpecKind != "full_attention" || !e.FullAttention() {
					t.Fatalf("%+v", e)
				}
			}},
		{"removed 2 and 4 fields", batch3(0, mp{}.arr(2).str("BlockRemoved").arr(1).u64(5),
			mp{}.arr(4).str("BlockRemoved").arr(1).u64(6).str("CPU_TIER2").fix(2)),
			func(t *testing.T, b Batch) {
				if e := b.Events[0]; e.Kind != BlockRemoved || e.BlockHashes[0] != 5 || e.Medium != "" {
					t.Fatalf("%+v", e)
				}
				if e := b.Events[1]; e.Medium != "CPU_TIER2" || e.GroupIdx != 2 || e.FullAttention() {
					t.Fatalf("%+v", e)
				}
			}},
		{"map: type not first, defaults missing, unknown keys", batch3(0,
			mp{}.mapH(5).str("block_hashes").arr(1).u64(9).str("new_field").arr(2).nil().mapH(0).
				str("type").str("BlockStored").fix(7).str("int key").str("token_ids").arr(1).fix(3)),
			func(t *testing.T, b Batch) {
				e := b.Events[0]
				if e.Kind != BlockStored || e.BlockHashes[0] != 9 || e.TokenIDs[0] != 3 || e.HasParent || e.Medium != "" {
					t.Fatalf("%+v", e)
				}
				if b.Encoding != EncodingMap {
					t.Fatalf("encoding %v", b.Encoding)
				}
			}},
		{"map: keys of another event type ignored", batch3(0,
			mp{}.mapH(3).str("type").str("BlockRemoved").str("token_ids").arr(1).fix(1).str("block_hashes").arr(1).fix(2)),
			func(t *testing.T, b Batch) {
				if e := b.Events[0]; e.Kind != BlockRemoved || e.TokenIDs != nil || e.BlockHashes[0] != 2 {
					t.Fatalf("%+v", e)
				}
			}},
		{"two-element batch", mp{}.arr(2).f64(2).arr(1).arr(1).str("AllBlocksCleared"), func(t *testing.T, b Batch) {
			if b.HasDPRank || b.TS != 2 || b.Events[0].Kind != AllBlocksCleared {
				t.Fatalf("%+v", b)
			}
		}},
		{"nil rank, int ts", mp{}.arr(3).fix(5).arr(0).nil(), func(t *testing.T, b Batch) {
			if b.HasDPRank || b.TS != 5 || len(b.Events) != 0 {
				t.Fatalf("%+v", b)
			}
		}},
		{"map batch with unknown key", mp{}.mapH(4).str("events").arr(1).mapH(1).str("type").str("AllBlocksCleared").
			str("extra").nil().str("ts").f64(3).str("data_parallel_rank").fix(2),
			func(t *testing.T, b Batch) {
				if b.TS != 3 || b.DPRank != 2 || len(b.Events) != 1 || !b.Layout.Map {
					t.Fatalf("%+v", b)
				}
			}},
		{"hashes as bytes", batch3(0, mp{}.arr(3).str("BlockRemoved").arr(3).bin(digest).bin([]byte{1, 2, 3}).bin([]byte{0xff}).str("GPU")),
			func(t *testing.T, b Batch) {
				h := b.Events[0].BlockHashes
				if h[0] != 0x191a1b1c1d1e1f20 || h[1] != 0x010203 || h[2] != 0xff {
					t.Fatalf("%x", h)
				}
			}},
		{"negative hash from Python hash()", batch3(0, mp{}.arr(2).str("BlockRemoved").arr(2).i64(-2).fix(-1)),
			func(t *testing.T, b Batch) {
				if h := b.Events[0].BlockHashes; h[0] != math.MaxUint64-1 || h[1] != math.MaxUint64 {
					t.Fatalf("%x", h)
				}
			}},
		{"parent 0 and nil both mean no parent", batch3(0,
			mp{}.arr(3).str("BlockStored").arr(1).fix(1).u64(0),
			mp{}.arr(3).str("BlockStored").arr(1).fix(1).nil()),
			func(t *testing.T, b Batch) {
				if b.Events[0].HasParent || b.Events[1].HasParent {
					t.Fatalf("%+v", b.Events)
				}
			}},
		{"unknown event types skipped and counted", batch3(0,
			mp{}.arr(3).str("BlockPinned").arr(1).fix(1).mapH(1).str("a").fix(1),
			mp{}.arr(1).str("AllBlocksCleared"),
			mp{}.mapH(2).str("x").arr(0).str("type").str("Future"),
			// The tag first (read once, no second pass): the rest skipped whole.
			mp{}.mapH(3).str("type").str("Future").str("block_hashes").arr(2).fix(1).fix(2).str("y").mapH(1).str("a").fix(1),
			mp{}.mapH(2).str("type").str("BlockRemoved").str("block_hashes").arr(1).fix(5)),
			func(t *testing.T, b Batch) {
				if b.Unknown != 3 || len(b.Events) != 2 || b.Events[0].Kind != AllBlocksCleared ||
					b.Events[1].Kind != BlockRemoved || len(b.Events[1].BlockHashes) != 1 || b.Events[1].BlockHashes[0] != 5 {
					t.Fatalf("%+v", b)
				}
			}},
		{"cache salt from extra_keys", batch3(0,
			mp{}.arr(9).str("BlockStored").arr(2).fix(1).fix(2).nil().arr(0).fix(1).nil().str("GPU").nil().
				arr(2).arr(1).str("tenant-a").nil(),
			mp{}.arr(9).str("BlockStored").arr(2).fix(1).fix(2).nil().arr(0).fix(1).fix(1).str("GPU").str("lora-a").
				arr(2).arr(4).str("lora-a").arr(2).str("mm-hash").fix(0).str("tenant-b").bin([]byte{1}).arr(1).str("lora-a"),
			mp{}.arr(9).str("BlockStored").arr(1).fix(3).fix(2).arr(0).fix(1).nil().str("GPU").nil().
				arr(1).arr(1).str("not-block-0")),
			func(t *testing.T, b Batch) {
				if s := b.Events[0].CacheSalt; s != "tenant-a" {
					t.Errorf("salt %q", s)
				}
				if s := b.Events[1].CacheSalt; s != "tenant-b" {
					t.Errorf("salt with lora and mm keys %q", s)
				}
				if s := b.Events[2].CacheSalt; s != "" {
					t.Errorf("salt on a non-first block %q", s)
				}
				if len(b.Events[0].ExtraKeys) == 0 {
					t.Error("ExtraKeys not kept")
				}
			}},
		{"extra_keys of any shape tolerated", batch3(0,
			mp{}.arr(9).str("BlockStored").arr(0).nil().arr(0).fix(1).nil().nil().nil().mapH(1).fix(1).raw(0xd6, 1, 0, 0, 0, 0)),
			func(t *testing.T, b Batch) {
				if b.Events[0].CacheSalt != "" {
					t.Fatal("salt from a map")
				}
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Decode(tc.payload)
			if err != nil {
				t.Fatalf("decode %x: %v", tc.payload, err)
			}
			tc.check(t, b)
			// Whatever decodes must survive both encodings.
			for _, enc := range []Encoding{b.Encoding, EncodingArray, EncodingMap} {
				p, err := Encode(nil, b, enc)
				if err != nil {
					t.Fatalf("encode %v: %v", enc, err)
				}
				back, err := Decode(p)
				if err != nil {
					t.Fatalf("decode re-encoded %v %x: %v", enc, p, err)
				}
				if d := diffBatch(b, back); d != "" {
					t.Fatalf("%v round trip: %s", enc, d)
				}
			}
			// Re-encoding in the received encoding reproduces the input
			// whenever the input holds nothing the codec drops.
			if !strings.Contains(tc.name, "unknown") && !strings.Contains(tc.name, "ignored") &&
				!strings.Contains(tc.name, "int ts") && !strings.Contains(tc.name, "negative") &&
				!strings.Contains(tc.name, "bytes") && !strings.Contains(tc.name, "parent 0") {
				p, _ := Encode(nil, b, b.Encoding)
				if !bytes.Equal(p, tc.payload) {
					t.Errorf("re-encoding differs:\nwant %x\n got %x", tc.payload, p)
				}
			}
		})
	}
}

func TestDecodeRejects(t *testing.T) {
	stored := func(field int, bad mp) []byte {
		vals := []mp{mp{}.arr(1).u64(1), mp{}.nil(), mp{}.arr(1).u32(1), mp{}.fix(16), mp{}.nil(), mp{}.str("GPU"),
			mp{}.nil(), mp{}.nil(), mp{}.fix(0), mp{}.str("full_attention"), mp{}.nil()}
		vals[field-1] = bad
		m := mp{}.arr(12).str("BlockStored")
		for _, v := range vals {
			m = append(m, v...)
		}
		return batch3(0, m)
	}
	tests := []struct {
		name    string
		payload []byte
		want    string
	}{
		{"empty", nil, "truncated"},
		{"not a batch", mp{}.str("hello"), "batch is a str"},
		{"batch too short", mp{}.arr(1).f64(1), "batch has 1"},
		{"ts a string", mp{}.arr(2).str("x").arr(0), "ts"},
		{"events a map", mp{}.arr(2).f64(1).mapH(0), "events"},
		{"rank a string", mp{}.arr(3).f64(1).arr(0).str("0"), "data_parallel_rank"},
		{"rank negative", mp{}.arr(3).f64(1).arr(0).fix(-1), "data_parallel_rank"},
		{"trailing bytes", append(mp{}.arr(2).f64(1).arr(0), 0), "trailing"},
		{"reserved marker", mp{}.arr(2).f64(1).arr(1).raw(0xc1), "event is a invalid"},
		{"billions of events", mp{}.arr(2).f64(1).arr(math.MaxUint32), "truncated"},
		{"billions of hashes", batch3(0, mp{}.arr(2).str("BlockRemoved").arr(math.MaxUint32-1)), "truncated"},
		{"billions of tokens", stored(3, mp{}.arr(1<<30)), "truncated"},
		{"map claims billions", batch3(0, mp{}.mapH(math.MaxUint32)), "truncated"},
		{"string claims 4 GiB", batch3(0, mp{}.arr(1).raw(0xdb, 0xff, 0xff, 0xff, 0xff)), "truncated"},
		{"extra_keys truncated", stored(8, mp{}.arr(100)), "truncated"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(tc.payload)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want ErrMalformed", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %q, want it to mention %q", err, tc.want)
			}
		})
	}
	// Events that are whole msgpack but cannot be read cost only
	// themselves: skipped, counted, the first reason kept.
	for _, tc := range []struct {
		name    string
		payload []byte
		want    string
	}{
		{"empty event array", batch3(0, mp{}.arr(0)), "empty event"},
		{"tag not a string", batch3(0, mp{}.arr(1).fix(1)), "event tag"},
		{"map without type", batch3(0, mp{}.mapH(1).str("block_hashes").arr(0)), "no \"type\""},
		{"event is an int", batch3(0, mp{}.fix(3)), "event is a int"},
		{"empty hash bytes", batch3(0, mp{}.arr(2).str("BlockRemoved").arr(1).bin(nil)), "empty hash"},
		{"hash a string", stored(1, mp{}.arr(1).str("abc")), "block_hashes"},
		{"hashes a map", stored(1, mp{}.mapH(0)), "block_hashes"},
		{"parent a string", stored(2, mp{}.str("p")), "parent_block_hash"},
		{"parent an array", stored(2, mp{}.arr(0)), "parent_block_hash"},
		{"tokens a string", stored(3, mp{}.str("t")), "token_ids"},
		{"token negative", stored(3, mp{}.arr(1).fix(-3)), "token_ids"},
		{"token over uint32", stored(3, mp{}.arr(1).u64(1<<32)), "token_ids"},
		{"token a float", stored(3, mp{}.arr(1).f64(1)), "token_ids"},
		{"block_size a string", stored(4, mp{}.str("16")), "block_size"},
		{"block_size negative", stored(4, mp{}.fix(-16)), "block_size"},
		{"lora_id a string", stored(5, mp{}.str("1")), "lora_id"},
		{"lora_id over int64", stored(5, mp{}.u64(math.MaxUint64)), "lora_id"},
		{"medium an int", stored(6, mp{}.fix(1)), "medium"},
		{"lora_name an array", stored(7, mp{}.arr(0)), "lora_name"},
		{"group_idx a string", stored(9, mp{}.str("0")), "group_idx"},
		{"spec kind an int", stored(10, mp{}.fix(0)), "kv_cache_spec_kind"},
		{"sliding window a bool", stored(11, mp{}.raw(0xc3)), "kv_cache_spec_sliding_window"},
		{"map field wrong type", batch3(0, mp{}.mapH(2).str("type").str("BlockRemoved").str("medium").fix(1)), "medium"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Decode(tc.payload)
			if err != nil {
				t.Fatalf("err = %v, want the event skipped", err)
			}
			if b.Invalid != 1 || len(b.Events) != 0 || !errors.Is(b.InvalidErr, ErrMalformed) {
				t.Fatalf("invalid %d (%v), events %d", b.Invalid, b.InvalidErr, len(b.Events))
			}
			if !strings.Contains(b.InvalidErr.Error(), tc.want) {
				t.Fatalf("reason %q, want it to mention %q", b.InvalidErr, tc.want)
			}
		})
	}
}

// TestDecodeEveryTruncation cuts each capture at every length: each prefix
// must fail cleanly.
func TestDecodeEveryTruncation(t *testing.T) {
	for _, c := range loadCaptures(t)[:6] {
		p := c.payload(t)
		for i := 0; i < len(p); i++ {
			if _, err := Decode(p[:i]); !errors.Is(err, ErrMalformed) {
				t.Fatalf("%s:%d cut at %d/%d: err = %v", c.File, c.Line, i, len(p), err)
			}
		}
	}
}

// TestDecodeDeepNesting: a million nested arrays inside a tolerated field
// are skipped without recursion; as the event itself they are skipped and
// counted as an invalid event.
func TestDecodeDeepNesting(t *testing.T) {
	const depth = 1 << 20
	nest := bytes.Repeat([]byte{0x91}, depth)
	nest = append(nest, 0xc0)
	ok := batch3(0, mp{}.arr(9).str("BlockStored").arr(0).nil().arr(0).fix(1).nil().nil().nil().raw(nest...))
	if b, err := Decode(ok); err != nil || len(b.Events) != 1 {
		t.Fatalf("nested extra_keys: %v", err)
	}
	if b, err := Decode(batch3(0, mp{}.raw(nest...))); err != nil || b.Invalid != 1 {
		t.Fatalf("nested event: %v, invalid %d (want skipped and counted)", err, b.Invalid)
	}
	if _, err := Decode(batch3(0, mp{}.arr(2).str("Unknown").raw(nest[:depth-1]...))); !errors.Is(err, ErrMalformed) {
		t.Fatalf("truncated nesting in an unknown event: %v", err)
	}
}

// TestDecodeAllocationBounded: hostile lengths cost no more memory than the
// payload's size justifies.
func TestDecodeAllocationBounded(t *testing.T) {
	hostile := [][]byte{
		mp{}.arr(2).f64(1).arr(math.MaxUint32),
		batch3(0, mp{}.arr(4).str("BlockStored").arr(math.MaxUint32)),
		batch3(0, mp{}.arr(4).str("BlockStored").arr(0).nil().arr(1<<28)),
		append(mp{}.arr(2).f64(1).arr(1<<20), bytes.Repeat(mp{}.arr(1).str("X"), 1000)...),
	}
	for i, p := range hostile {
		var err error
		alloc := testenv.Allocated(func() { _, err = Decode(p) })
		if err == nil {
			t.Fatalf("%d: decoded", i)
		}
		if alloc > 64<<10 {
			t.Errorf("%d: %d-byte payload allocated %d bytes", i, len(p), alloc)
		}
	}
}

func TestEncodeHandBuilt(t *testing.T) {
	stored := Event{Kind: BlockStored, BlockHashes: []uint64{1 << 40, 2}, TokenIDs: []uint32{1, 300, 70000, 1 << 31},
		BlockSize: 2, Medium: "GPU", SpecKind: "full_attention", ExtraKeys: mp{}.arr(2).nil().nil()}
	removed := Event{Kind: BlockRemoved, BlockHashes: []uint64{5}, Medium: "GPU"}
	b := Batch{TS: 1.5, Events: []Event{stored, removed, {Kind: AllBlocksCleared}}, DPRank: 1, HasDPRank: true}

	// The map form's keys, in the order vLLM 0.26 sends them (as printed in
	// volcano-sh/kthena#1535 from a live engine).
	p, err := Encode(nil, b, EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	wantKeys := "type block_hashes parent_block_hash token_ids block_size lora_id medium lora_name extra_keys group_idx kv_cache_spec_kind"
	if got := mapKeys(t, p, 0); got != wantKeys {
		t.Errorf("map keys\n got %s\nwant %s", got, wantKeys)
	}
	if got := mapKeys(t, p, 1); got != "type block_hashes medium group_idx" {
		t.Errorf("removed keys %s", got)
	}
	// The array form: 8 fields, then up to the last one set.
	pa, err := Encode(nil, b, EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	want := mp{}.arr(3).f64(1.5).arr(3).
		arr(11).str("BlockStored").arr(2).u64(1<<40).fix(2).nil().arr(4).fix(1).raw(0xcd, 1, 44).raw(0xce, 0, 1, 0x11, 0x70).u32(1 << 31).
		fix(2).nil().str("GPU").nil().arr(2).nil().nil().fix(0).str("full_attention").
		arr(3).str("BlockRemoved").arr(1).fix(5).str("GPU").
		arr(1).str("AllBlocksCleared").fix(1)
	if !bytes.Equal(pa, want) {
		t.Errorf("array form\n got %x\nwant %x", pa, []byte(want))
	}
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		p, _ := Encode(nil, b, enc)
		back, err := Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		if d := diffBatch(b, back); d != "" {
			t.Errorf("%v: %s", enc, d)
		}
	}

	// A hand-set cache salt is written the way vLLM carries it.
	salted := Batch{Events: []Event{{Kind: BlockStored, BlockHashes: []uint64{1, 2}, LoraName: "ad", CacheSalt: "t1"}}}
	p, _ = Encode(nil, salted, EncodingArray)
	back, err := Decode(p)
	if err != nil || back.Events[0].CacheSalt != "t1" || back.Events[0].LoraName != "ad" {
		t.Fatalf("salt round trip: %v %+v", err, back.Events)
	}
	if got, want := hex.EncodeToString(back.Events[0].ExtraKeys), hex.EncodeToString(mp{}.arr(2).arr(2).str("ad").str("t1").arr(1).str("ad")); got != want {
		t.Errorf("extra_keys %s, want %s", got, want)
	}
}

// TestEncodeLayoutNeverDropsData: a decoded event changed after decoding is
// written in the modern form when its recorded layout has no slot for the change.
func TestEncodeLayoutNeverDropsData(t *testing.T) {
	c := loadCaptures(t)[0]
	b, err := Decode(c.payload(t))
	if err != nil {
		t.Fatal(err)
	}
	b.Events[0].GroupIdx = 3
	b.Events[0].CacheSalt = "s"
	b.HasDPRank, b.DPRank, b.Layout.N = true, 4, 2
	p, err := Encode(nil, b, b.Encoding)
	if err != nil {
		t.Fatal(err)
	}
	back, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	if e := back.Events[0]; e.GroupIdx != 3 || e.CacheSalt != "s" || back.DPRank != 4 {
		t.Fatalf("changes lost: %+v rank %d", e, back.DPRank)
	}
}

func TestEncodeRejects(t *testing.T) {
	tests := []struct {
		name string
		b    Batch
		enc  Encoding
		want error
	}{
		{"no encoding", Batch{}, 0, ErrEncoding},
		{"bad encoding", Batch{}, 9, ErrEncoding},
		{"zero kind", Batch{Events: []Event{{}}}, EncodingMap, ErrInvalidEvent},
		{"negative block size", Batch{Events: []Event{{Kind: BlockStored, BlockSize: -1}}}, EncodingArray, ErrInvalidEvent},
		{"bad extra keys", Batch{Events: []Event{{Kind: BlockStored, ExtraKeys: []byte{0x92, 1}}}}, EncodingArray, ErrInvalidEvent},
		{"extra keys with trailing bytes", Batch{Events: []Event{{Kind: BlockStored, ExtraKeys: []byte{0xc0, 0xc0}}}}, EncodingArray, ErrInvalidEvent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Encode(nil, tc.b, tc.enc); !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestEncodingNames(t *testing.T) {
	for _, e := range []Encoding{EncodingArray, EncodingMap} {
		got, err := ParseEncoding(strings.ToUpper(e.String()))
		if err != nil || got != e {
			t.Errorf("%v: %v %v", e, got, err)
		}
	}
	if _, err := ParseEncoding("json"); !errors.Is(err, ErrEncoding) {
		t.Errorf("json: %v", err)
	}
}

func TestFullAttention(t *testing.T) {
	tests := []struct {
		e    Event
		want bool
	}{
		{Event{}, true},
		{Event{SpecKind: "full_attention"}, true},
		{Event{SpecKind: "mla_attention"}, true},
		{Event{GroupIdx: 1, SpecKind: "full_attention"}, true},
		{Event{GroupIdx: 3, SpecKind: "mla_attention"}, true},
		{Event{GroupIdx: 1}, false},
		{Event{SpecKind: "sliding_window"}, false},
		{Event{SpecKind: "sliding_window_mla"}, false},
		{Event{SpecKind: "chunked_local_attention"}, false},
		{Event{SpecKind: "mamba"}, false},
		{Event{SlidingWindow: 4096}, false},
	}
	for _, tc := range tests {
		if got := tc.e.FullAttention(); got != tc.want {
			t.Errorf("%+v: %v", tc.e, got)
		}
	}
}

// mapKeys lists the keys of event i of an encoded batch in map form.
func mapKeys(t *testing.T, p []byte, i int) string {
	t.Helper()
	r := reader{b: p}
	if _, err := r.arrayHeader(1); err != nil {
		t.Fatal(err)
	}
	if err := r.skip(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.arrayHeader(1); err != nil {
		t.Fatal(err)
	}
	for j := 0; j < i; j++ {
		if err := r.skip(); err != nil {
			t.Fatal(err)
		}
	}
	n, err := r.mapHeader()
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for j := 0; j < n; j++ {
		k, err := r.readStr()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, string(k))
		if err := r.skip(); err != nil {
			t.Fatal(err)
		}
	}
	return strings.Join(keys, " ")
}

// u writes v in msgpack's smallest unsigned form, as msgspec does.
func (m mp) u(v uint64) mp {
	switch {
	case v < 0x80:
		return append(m, byte(v))
	case v <= 0xff:
		return append(m, 0xcc, byte(v))
	case v <= 0xffff:
		return binary.BigEndian.AppendUint16(append(m, 0xcd), uint16(v))
	case v <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(m, 0xce), uint32(v))
	}
	return m.u64(v)
}

// TestModernFormMatchesVLLM: a hand-built event encodes to the very bytes
// msgspec writes for the live vLLM 0.26 payload printed in
// volcano-sh/kthena#1535 (map-era event, compact integers, array batch).
func TestModernFormMatchesVLLM(t *testing.T) {
	tokens := []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667}
	want := mp{}.arr(3).f64(1789095808.8378847).arr(1).mapH(11).
		str("type").str("BlockStored").
		str("block_hashes").arr(1).u(15760518052499183552).
		str("parent_block_hash").nil().
		str("token_ids").arr(len(tokens))
	for _, tok := range tokens {
		want = want.u(uint64(tok))
	}
	want = want.str("block_size").u(16).
		str("lora_id").nil().
		str("medium").str("GPU").
		str("lora_name").nil().
		str("extra_keys").arr(1).nil().
		str("group_idx").u(0).
		str("kv_cache_spec_kind").str("full_attention").
		u(0)
	b := Batch{TS: 1789095808.8378847, HasDPRank: true, Events: []Event{{
		Kind: BlockStored, BlockHashes: []uint64{15760518052499183552}, TokenIDs: tokens,
		BlockSize: 16, Medium: "GPU", ExtraKeys: mp{}.arr(1).nil(), SpecKind: "full_attention",
	}}}
	got, err := Encode(nil, b, EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("modern map form differs from vLLM's:\n got %x\nwant %x", got, []byte(want))
	}
	dec, err := Decode(want)
	if err != nil {
		t.Fatal(err)
	}
	if d := diffBatch(b, dec); d != "" {
		t.Fatal(d)
	}
	if again, _ := Encode(nil, dec, dec.Encoding); !bytes.Equal(again, want) {
		t.Fatal("decoded vLLM payload does not re-encode byte for byte")
	}
}

// TestNewestVLLMSource pins the newest vllm/distributed/kv_events.py the
// search store holds (vllm-project/vllm @ 0181ea3173e53eea8cf04a86891488e3dc89bb34):
// EventBatch and KVCacheEvent are msgspec structs with omit_defaults and no
// array_like, so the batch too is a map {"ts", "events",
// "data_parallel_rank"} (the publisher always sets the rank, so it is never
// omitted); events carry the tag under "type" first, then their fields in
// declaration order, the seven without defaults always (nil when None),
// extra_keys, group_idx, kv_cache_spec_kind and kv_cache_spec_sliding_window
// only when not None. Block hashes are ExternalBlockHash (bytes | int):
// integers by default, the 32-byte digest with
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; both must give the same hashes.
func TestNewestVLLMSource(t *testing.T) {
	digest := func(last uint64) []byte {
		d := bytes.Repeat([]byte{0xab}, 24)
		return binary.BigEndian.AppendUint64(d, last)
	}
	h1, h2, h3 := uint64(15760518052499183552), uint64(0x0102030405060708), uint64(77)
	payload := func(bin bool) []byte {
		hash := func(m mp, h uint64) mp {
			if bin {
				return m.bin(digest(h))
			}
			return m.u(h)
		}
		m := mp{}.mapH(3).str("ts").f64(1789095808.5).str("events").arr(4)
		m = m.mapH(11).str("type").str("BlockStored")
		m = hash(m.str("block_hashes").arr(1), h1)
		m = m.str("parent_block_hash").nil().str("token_ids").arr(2).u(151644).u(872).
			str("block_size").u(2).str("lora_id").nil().str("medium").str("GPU").str("lora_name").nil().
			str("extra_keys").arr(1).arr(1).str("salt-a").str("group_idx").u(0).
			str("kv_cache_spec_kind").str("full_attention")
		m = m.mapH(11).str("type").str("BlockStored")
		m = hash(m.str("block_hashes").arr(1), h2)
		m = hash(m.str("parent_block_hash"), h1)
		m = m.str("token_ids").arr(2).u(198).u(9064).str("block_size").u(2).str("lora_id").nil().
			str("medium").str("GPU").str("lora_name").nil().str("group_idx").u(1).
			str("kv_cache_spec_kind").str("sliding_window").str("kv_cache_spec_sliding_window").u(4096)
		m = m.mapH(4).str("type").str("BlockRemoved")
		m = hash(m.str("block_hashes").arr(1), h3)
		m = m.str("medium").str("GPU").str("group_idx").u(0)
		m = m.mapH(1).str("type").str("AllBlocksCleared")
		return m.str("data_parallel_rank").u(0)
	}
	for _, bin := range []bool{false, true} {
		p := payload(bin)
		b, err := Decode(p)
		if err != nil {
			t.Fatalf("bin=%v: %v", bin, err)
		}
		if !b.Layout.Map || !b.HasDPRank || b.DPRank != 0 || b.TS != 1789095808.5 || b.Encoding != EncodingMap || len(b.Events) != 4 {
			t.Fatalf("bin=%v: envelope %+v", bin, b)
		}
		s, c, r := b.Events[0], b.Events[1], b.Events[2]
		if s.Kind != BlockStored || s.BlockHashes[0] != h1 || s.HasParent || s.BlockSize != 2 || s.Medium != "GPU" ||
			s.CacheSalt != "salt-a" || !s.FullAttention() || len(s.TokenIDs) != 2 {
			t.Errorf("bin=%v: store %+v", bin, s)
		}
		if c.BlockHashes[0] != h2 || !c.HasParent || c.ParentHash != h1 || c.GroupIdx != 1 || c.SlidingWindow != 4096 || c.FullAttention() {
			t.Errorf("bin=%v: sliding-window store %+v", bin, c)
		}
		if r.Kind != BlockRemoved || r.BlockHashes[0] != h3 || r.Medium != "GPU" || b.Events[3].Kind != AllBlocksCleared {
			t.Errorf("bin=%v: removal/clear %+v %+v", bin, r, b.Events[3])
		}
		if !bin {
			if q, _ := Encode(nil, b, b.Encoding); !bytes.Equal(q, p) {
				t.Errorf("does not re-encode byte for byte:\n got %x\nwant %x", q, p)
			}
		}
	}
}

// TestDecodeIsolatesBadEvent: an event that is well-formed msgpack but whose
// fields do not have the types the codec knows (a future engine changing a
// field, SGLang's metadata before it was known: ai-dynamo/dynamo#14530 lost
// whole batches that way) is skipped and counted in Batch.Invalid; the
// events beside it are kept. Truncation still fails the batch.
func TestDecodeIsolatesBadEvent(t *testing.T) {
	good := mp{}.arr(7).str("BlockStored").arr(1).fix(1).nil().arr(1).fix(5).fix(1).nil().str("GPU")
	bads := map[string]mp{
		"medium an int":       mp{}.arr(7).str("BlockStored").arr(1).fix(2).nil().arr(1).fix(6).fix(1).nil().fix(3),
		"hash a float":        mp{}.arr(2).str("BlockRemoved").arr(1).f64(1),
		"map field a map":     mp{}.mapH(2).str("type").str("BlockStored").str("block_size").mapH(0),
		"map without type":    mp{}.mapH(1).str("block_hashes").arr(0),
		"event an int":        mp{}.fix(3),
		"tag not a string":    mp{}.arr(2).fix(1).fix(2),
		"empty event array":   mp{}.arr(0),
		"token over uint32":   mp{}.arr(4).str("BlockStored").arr(1).fix(1).nil().arr(1).u64(1 << 32),
		"empty hash bytes":    mp{}.arr(2).str("BlockRemoved").arr(1).bin(nil),
		"parent an array":     mp{}.arr(3).str("BlockStored").arr(0).arr(0),
		"group_idx a string":  mp{}.mapH(2).str("type").str("BlockRemoved").str("group_idx").str("0"),
		"sliding window bool": mp{}.arr(12).str("BlockStored").arr(0).nil().arr(0).fix(0).nil().nil().nil().nil().nil().nil().raw(0xc3),
	}
	for name, bad := range bads {
		t.Run(name, func(t *testing.T) {
			removed := mp{}.arr(2).str("BlockRemoved").arr(1).fix(9)
			p := batch3(0, good, bad, removed)
			for _, dec := range []func([]byte) (Batch, error){Decode, new(Decoder).Decode} {
				b, err := dec(p)
				if err != nil {
					t.Fatalf("one bad event failed the batch: %v", err)
				}
				if b.Invalid != 1 || len(b.Events) != 2 || b.Events[0].BlockHashes[0] != 1 || b.Events[1].BlockHashes[0] != 9 {
					t.Fatalf("invalid %d, events %+v", b.Invalid, b.Events)
				}
				// A removal whose tag was read counts as an unreadable
				// removal (the bridge clears the instance after it).
				wantRm := 0
				if strings.Contains(string(bad), "BlockRemoved") {
					wantRm = 1
				}
				if b.InvalidRemovals != wantRm {
					t.Fatalf("invalid removals %d, want %d", b.InvalidRemovals, wantRm)
				}
			}
		})
	}
	// A bad event whose extent cannot be found (truncated) fails the batch.
	if _, err := Decode(batch3(0, good, mp{}.arr(3).str("BlockStored").arr(5).fix(1))); !errors.Is(err, ErrMalformed) {
		t.Fatalf("truncated event: %v", err)
	}
}

// TestVLLMProposedFieldsSkipped: fields proposed or added to the map-era
// events after vllm @ 0181ea3 — BlockStored "ownership"
// (vllm-project/vllm#52067) and "origin" (#51699, "NEW" / "REUSED"),
// BlockRemoved "remaining_copy_counts" (#48933, aligned with block_hashes)
// — are skipped by name and leave the event as it was.
func TestVLLMProposedFieldsSkipped(t *testing.T) {
	p := batch3(0,
		mp{}.mapH(10).str("type").str("BlockStored").str("block_hashes").arr(1).u(5).str("parent_block_hash").nil().
			str("token_ids").arr(1).u(7).str("block_size").u(1).str("lora_id").nil().str("medium").str("CPU").
			str("lora_name").nil().str("ownership").str("offloading").str("origin").str("REUSED"),
		mp{}.mapH(5).str("type").str("BlockRemoved").str("block_hashes").arr(2).u(5).u(6).str("medium").str("GPU").
			str("group_idx").u(0).str("remaining_copy_counts").arr(2).u(1).u(0))
	b, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	want := []Event{
		{Kind: BlockStored, BlockHashes: []uint64{5}, TokenIDs: []uint32{7}, BlockSize: 1, Medium: "CPU"},
		{Kind: BlockRemoved, BlockHashes: []uint64{5, 6}, Medium: "GPU"},
	}
	if d := diffBatch(Batch{TS: b.TS, HasDPRank: true, Events: want}, b); d != "" || b.Invalid != 0 || b.Unknown != 0 {
		t.Fatalf("%s (invalid %d, unknown %d)", d, b.Invalid, b.Unknown)
	}
}
