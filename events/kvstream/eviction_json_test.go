package kvstream

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

// TestEvictionRecordAppendJSON: AppendJSON writes json.Marshal's bytes,
// for plain records and for every kind of string and time that takes the
// fallback.
func TestEvictionRecordAppendJSON(t *testing.T) {
	// AppendJSON writes each field by hand: a field added to the record
	// must be added there (and to the records below) too.
	if n := reflect.TypeOf(EvictionRecord{}).NumField(); n != 7 {
		t.Fatalf("EvictionRecord has %d fields, AppendJSON writes 7: update it and this test", n)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	strs := []string{"", "llama", "vllm-0", "gpu", ReasonEvicted, `a"b`, `a\\b`, "a<b>&c", "ü", "\x00", "\x7f", "\xff"}
	times := []time.Time{{}, time.Unix(1764900000, 0).UTC(), time.Unix(1764900000, 123456789).UTC(), time.Unix(1764900000, 120000000).In(time.FixedZone("X", 5*3600+30*60)),
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 1, 1, 0, 0, 0, 0, time.FixedZone("S", 61)), time.Date(2026, 1, 1, 0, 0, 0, 0, time.FixedZone("D", 25*3600))}
	hashes := [][]uint64{nil, {}, {0}, {1, 1 << 63, ^uint64(0)}}
	for i := 0; i < 2000; i++ {
		r := EvictionRecord{Pool: strs[rng.IntN(len(strs))], Instance: strs[rng.IntN(len(strs))], Tier: strs[rng.IntN(len(strs))],
			Blocks: rng.IntN(200) - 1, Hashes: hashes[rng.IntN(len(hashes))], Time: times[rng.IntN(len(times))], Reason: strs[rng.IntN(len(strs))]}
		want, werr := json.Marshal(r)
		got, gerr := r.AppendJSON([]byte("x"))
		if (werr == nil) != (gerr == nil) || (werr == nil && !bytes.Equal(got, append([]byte("x"), want...))) {
			t.Fatalf("%+v:\n got %s (%v)\nwant x%s (%v)", r, got, gerr, want, werr)
		}
	}
}

// FuzzEvictionRecordAppendJSON: AppendJSON writes json.Marshal's bytes
// for any strings, counts, hashes and times (a zone offset in seconds).
func FuzzEvictionRecordAppendJSON(f *testing.F) {
	f.Add("p", "i", "gpu", ReasonEvicted, 3, uint64(7), int64(1764900000), int64(123456789), 0)
	f.Add(`a"b`, "\xff", "", "", -1, uint64(0), int64(-62135596800), int64(0), 61)
	f.Add("p", "i", "cpu", "x", 0, ^uint64(0), int64(253402300800), int64(1), -25*3600)
	f.Fuzz(func(t *testing.T, pool, inst, tier, reason string, blocks int, h uint64, sec, nsec int64, off int) {
		r := EvictionRecord{Pool: pool, Instance: inst, Tier: tier, Blocks: blocks, Reason: reason,
			Time: time.Unix(sec, nsec).In(time.FixedZone("Z", off%(48*3600)))}
		if h != 0 {
			r.Hashes = []uint64{h, h / 3}
		}
		want, werr := json.Marshal(r)
		got, gerr := r.AppendJSON(nil)
		if (werr == nil) != (gerr == nil) || (werr == nil && !bytes.Equal(got, want)) {
			t.Fatalf("%+v:\n got %s (%v)\nwant %s (%v)", r, got, gerr, want, werr)
		}
	})
}
