package events

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// capture is one line of the captured JSONL files (testdata/captured/DATA.md).
type capture struct {
	File       string
	Line       int
	Topic      string          `json:"topic"`
	Seq        json.Number     `json:"seq"`
	PayloadB64 string          `json:"payload_b64"`
	Decoded    json.RawMessage `json:"decoded"`
}

// loadCaptures reads every message with a payload from the capture files.
func loadCaptures(t testing.TB) []capture {
	t.Helper()
	files, err := filepath.Glob("testdata/captured/*.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	var out []capture
	for _, f := range files {
		if filepath.Base(f) == "requests.jsonl" || filepath.Base(f) == "requests.map.jsonl" || filepath.Base(f) == "dp.requests.jsonl" {
			continue
		}
		fh, err := os.Open(f)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(fh)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		line := 0
		for sc.Scan() {
			line++
			var c capture
			dec := json.NewDecoder(bytes.NewReader(sc.Bytes()))
			dec.UseNumber()
			if err := dec.Decode(&c); err != nil {
				t.Fatalf("%s:%d: %v", f, line, err)
			}
			if c.PayloadB64 == "" || len(c.Decoded) == 0 {
				continue // replay request line and end sentinel
			}
			c.File, c.Line = filepath.Base(f), line
			out = append(out, c)
		}
		fh.Close()
		if err := sc.Err(); err != nil {
			t.Fatal(err)
		}
	}
	if len(out) < 90 {
		t.Fatalf("found only %d captured messages; testdata/captured is incomplete", len(out))
	}
	return out
}

func (c capture) payload(t testing.TB) []byte {
	p, err := base64.StdEncoding.DecodeString(c.PayloadB64)
	if err != nil {
		t.Fatalf("%s:%d: %v", c.File, c.Line, err)
	}
	return p
}

// Test-side names of the array-era positions, written from the vLLM struct
// declarations independently of the codec's tables.
var testPositions = map[string][]string{
	"BlockStored": {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
		"lora_id", "medium", "lora_name", "extra_keys", "group_idx",
		"kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	"BlockRemoved":     {"type", "block_hashes", "medium", "group_idx"},
	"AllBlocksCleared": {"type"},
}

// expectedFromJSON interprets a capture's `decoded` field (the output of
// Python's msgpack.unpackb) as the batch the codec must produce.
func expectedFromJSON(t testing.TB, raw json.RawMessage) Batch {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var top []any
	if err := dec.Decode(&top); err != nil {
		t.Fatal(err)
	}
	var b Batch
	ts, err := top[0].(json.Number).Float64()
	if err != nil {
		t.Fatal(err)
	}
	b.TS = ts
	if len(top) > 2 && top[2] != nil {
		b.DPRank, b.HasDPRank = int(num(t, top[2])), true
	}
	for _, ev := range top[1].([]any) {
		fields := map[string]any{}
		switch v := ev.(type) {
		case []any:
			tag := v[0].(string)
			for i, x := range v {
				fields[testPositions[tag][i]] = x
			}
		case map[string]any:
			fields = v
		default:
			t.Fatalf("event %T", ev)
		}
		var e Event
		switch fields["type"] {
		case "BlockStored":
			e.Kind = BlockStored
		case "BlockRemoved":
			e.Kind = BlockRemoved
		case "AllBlocksCleared":
			e.Kind = AllBlocksCleared
		default:
			t.Fatalf("type %v", fields["type"])
		}
		if hs, ok := fields["block_hashes"].([]any); ok {
			e.BlockHashes = make([]uint64, 0, len(hs))
			for _, h := range hs {
				e.BlockHashes = append(e.BlockHashes, unum(t, h))
			}
		}
		if p, ok := fields["parent_block_hash"]; ok && p != nil {
			e.ParentHash = unum(t, p)
			e.HasParent = e.ParentHash != 0
		}
		if ts, ok := fields["token_ids"].([]any); ok {
			e.TokenIDs = make([]uint32, 0, len(ts))
			for _, x := range ts {
				e.TokenIDs = append(e.TokenIDs, uint32(unum(t, x)))
			}
		}
		if v, ok := fields["block_size"]; ok && v != nil {
			e.BlockSize = int(num(t, v))
		}
		if v, ok := fields["lora_id"]; ok && v != nil {
			e.LoraID, e.HasLoraID = num(t, v), true
		}
		if v, ok := fields["medium"].(string); ok {
			e.Medium = v
		}
		if v, ok := fields["lora_name"].(string); ok {
			e.LoraName = v
		}
		if v, ok := fields["group_idx"]; ok && v != nil {
			e.GroupIdx = int(num(t, v))
		}
		if v, ok := fields["kv_cache_spec_kind"].(string); ok {
			e.SpecKind = v
		}
		if v, ok := fields["extra_keys"]; ok && v != nil {
			t.Fatalf("captures carry no extra_keys; update the test to check %v", v)
		}
		b.Events = append(b.Events, e)
	}
	return b
}

func num(t testing.TB, v any) int64 {
	n, err := v.(json.Number).Int64()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func unum(t testing.TB, v any) uint64 {
	n, ok := new(big.Int).SetString(string(v.(json.Number)), 10)
	if !ok || n.Sign() < 0 || n.BitLen() > 64 {
		t.Fatalf("not a uint64: %v", v)
	}
	return n.Uint64()
}

// semantic strips the wire layout, and the counts of skipped events (Encode
// writes only the events kept), so batches compare by content.
func semantic(b Batch) Batch {
	b.Layout, b.Encoding, b.Unknown, b.Invalid, b.InvalidErr, b.InvalidRemovals = BatchLayout{}, 0, 0, 0, nil, 0
	evs := make([]Event, len(b.Events))
	for i, e := range b.Events {
		e.Layout = EventLayout{}
		if len(e.BlockHashes) == 0 {
			e.BlockHashes = nil
		}
		if len(e.TokenIDs) == 0 {
			e.TokenIDs = nil
		}
		evs[i] = e
	}
	if len(evs) == 0 {
		evs = nil
	}
	b.Events = evs
	return b
}

func diffBatch(want, got Batch) string {
	w, g := semantic(want), semantic(got)
	if fmt.Sprintf("%#v", w) == fmt.Sprintf("%#v", g) {
		return ""
	}
	if len(w.Events) != len(g.Events) {
		return fmt.Sprintf("events: want %d, got %d", len(w.Events), len(g.Events))
	}
	if w.TS != g.TS || w.DPRank != g.DPRank || w.HasDPRank != g.HasDPRank {
		return fmt.Sprintf("envelope: want ts=%v rank=%v/%v, got ts=%v rank=%v/%v",
			w.TS, w.DPRank, w.HasDPRank, g.TS, g.DPRank, g.HasDPRank)
	}
	for i := range w.Events {
		if a, b := fmt.Sprintf("%#v", w.Events[i]), fmt.Sprintf("%#v", g.Events[i]); a != b {
			return fmt.Sprintf("event %d:\nwant %s\n got %s", i, a, b)
		}
	}
	return "differs"
}

func TestCapturesDecodeAndReencode(t *testing.T) {
	caps := loadCaptures(t)
	kinds := map[Kind]int{}
	encs := map[Encoding]int{}
	for _, c := range caps {
		t.Run(fmt.Sprintf("%s:%d/seq%s", c.File, c.Line, c.Seq), func(t *testing.T) {
			p := c.payload(t)
			got, err := Decode(p)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			want := expectedFromJSON(t, c.Decoded)
			if d := diffBatch(want, got); d != "" {
				t.Fatalf("decoded batch differs from the capture's decoded field: %s", d)
			}
			if got.Unknown != 0 {
				t.Errorf("Unknown = %d, want 0", got.Unknown)
			}
			for _, e := range got.Events {
				kinds[e.Kind]++
				if !e.FullAttention() {
					t.Errorf("captured event %v not full attention", e.Kind)
				}
			}
			encs[got.Encoding]++
			re, err := Encode(nil, got, got.Encoding)
			if err != nil {
				t.Fatalf("encode: %v", err)
			}
			if !bytes.Equal(re, p) {
				t.Fatalf("re-encoding differs from the captured payload:\nwant %x\n got %x", p, re)
			}
			// The other encoding must carry the same events.
			other := EncodingMap
			if got.Encoding == EncodingMap {
				other = EncodingArray
			}
			alt, err := Encode(nil, got, other)
			if err != nil {
				t.Fatalf("encode %v: %v", other, err)
			}
			back, err := Decode(alt)
			if err != nil {
				t.Fatalf("decode %v form: %v", other, err)
			}
			if back.Encoding != other {
				t.Errorf("re-encoded as %v, decoded as %v", other, back.Encoding)
			}
			if d := diffBatch(got, back); d != "" {
				t.Fatalf("%v round trip: %s", other, d)
			}
		})
	}
	// The captures must exercise every kind and both encodings.
	for _, k := range []Kind{BlockStored, BlockRemoved, AllBlocksCleared} {
		if kinds[k] == 0 {
			t.Errorf("no %v event in the captures", k)
		}
	}
	if encs[EncodingArray] == 0 || encs[EncodingMap] == 0 {
		t.Errorf("encodings seen: %v", encs)
	}
}

// TestCaptureFacts pins what DATA.md states about the captures, so a change
// in the decoder that reads them differently is noticed.
func TestCaptureFacts(t *testing.T) {
	for _, c := range loadCaptures(t) {
		b, err := Decode(c.payload(t))
		if err != nil {
			t.Fatal(err)
		}
		if !b.HasDPRank {
			t.Errorf("%s:%d: no rank", c.File, c.Line)
		}
		for _, e := range b.Events {
			if e.Kind == BlockStored {
				if e.BlockSize != 16 || e.Medium != "GPU" || len(e.TokenIDs) != 16*len(e.BlockHashes) {
					t.Errorf("%s:%d: stored event %+v", c.File, c.Line, e)
				}
				if e.HasLoraID != (e.LoraName == "lora-a") || (e.HasLoraID && e.LoraID != 1) {
					t.Errorf("%s:%d: lora %v %d %q", c.File, c.Line, e.HasLoraID, e.LoraID, e.LoraName)
				}
				if e.Layout.Flags&FlagHashFixed64 == 0 || e.Layout.Flags&FlagTokenFixed32 == 0 {
					t.Errorf("%s:%d: flags %b", c.File, c.Line, e.Layout.Flags)
				}
			}
		}
		if seq, _ := strconv.Atoi(string(c.Seq)); c.File == "array.jsonl" && seq == 1 {
			if len(b.Events) != 4 || len(b.Events[0].BlockHashes) != 12 || b.Events[0].HasParent ||
				!b.Events[1].HasParent || b.Events[1].ParentHash != b.Events[0].BlockHashes[11] {
				t.Errorf("seq 1 does not match DATA.md: %+v", b.Events)
			}
		}
	}
}
