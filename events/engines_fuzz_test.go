package events

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzDecodeTRTLLM: DecodeTRTLLM never panics; what it accepts converts
// without panicking, and what it accepts without extra token ids reads back
// the same after AppendTRTLLMJSON.
func FuzzDecodeTRTLLM(f *testing.F) {
	for _, name := range []string{"trtllm-kv_cache_events.json", "trtllm-attention-dp.json"} {
		data, err := os.ReadFile(filepath.Join("testdata", "engines", name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte(`{"event_id":1,"data":{"type":"updated","block_hash":5,"cache_level":{"new_value":0,"old_value":1}},"window_size":32}`))
	f.Add([]byte(`[{"event_id":-1,"data":{"type":"x"}}]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		evs, err := DecodeTRTLLM(data)
		if err != nil {
			return
		}
		c := TRTLLMConverter{FullWindow: 4096}
		out, _ := c.Convert(evs)
		for _, list := range out {
			for i := range list {
				if _, err := Encode(nil, Batch{Events: list[i : i+1]}, EncodingMap); err != nil {
					t.Fatalf("converted event %+v does not encode: %v", list[i], err)
				}
			}
		}
		for i := range evs {
			for _, b := range evs[i].Blocks {
				if b.ExtraIDs {
					return
				}
			}
			switch evs[i].Type {
			case "created", "stored", "removed":
			case "updated":
				if !evs[i].HasLevel {
					return
				}
			default:
				return
			}
		}
		again, err := DecodeTRTLLM(AppendTRTLLMJSON(nil, evs))
		if err != nil {
			t.Fatalf("re-encoded events do not decode: %v", err)
		}
		for i := range evs {
			evs[i].Blocks = append([]TRTLLMBlock{}, evs[i].Blocks...)
			for j := range evs[i].Blocks {
				evs[i].Blocks[j].Priority = again[i].Blocks[j].Priority
			}
		}
		if !reflect.DeepEqual(normTRT(evs), normTRT(again)) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", again, evs)
		}
	})
}

func normTRT(evs []TRTLLMEvent) []TRTLLMEvent {
	out := make([]TRTLLMEvent, len(evs))
	for i, e := range evs {
		if len(e.Blocks) == 0 {
			e.Blocks = nil
		}
		for j := range e.Blocks {
			if len(e.Blocks[j].Tokens) == 0 {
				e.Blocks[j].Tokens = nil
			}
		}
		if len(e.Hashes) == 0 {
			e.Hashes = nil
		}
		if len(e.BlocksPerLevel) == 0 {
			e.BlocksPerLevel = nil
		}
		out[i] = e
	}
	return out
}

// FuzzDecodeSGLang: SGLang payloads go through Decode like vLLM's; a batch
// that decodes and is SGLang-shaped (pages of block_size tokens) encodes
// with EncodeSGLang and decodes back to the same pages.
func FuzzDecodeSGLang(f *testing.F) {
	for _, name := range []string{"sglang-v05-dp1.hex", "sglang-medium.hex", "sglang-legacy.hex", "sglang-map.hex", "trtllm-zmq.hex"} {
		f.Add(readHexFixture(f, name))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := Decode(data)
		if err != nil {
			return
		}
		for _, e := range b.Events {
			if e.Kind == BlockStored && len(e.TokenIDs) > 0 && (e.BlockSize <= 0 || len(e.TokenIDs) != e.BlockSize*len(e.BlockHashes)) {
				if _, err := EncodeSGLang(nil, b, SGLangOptions{}); err == nil {
					t.Fatal("EncodeSGLang accepted a store without whole pages")
				}
				return
			}
		}
		raw, err := EncodeSGLang(nil, b, SGLangOptions{Medium: true})
		if err != nil {
			t.Fatal(err)
		}
		again, err := Decode(raw)
		if err != nil {
			t.Fatalf("EncodeSGLang output does not decode: %v", err)
		}
		var pages, got [][]uint32
		for _, e := range b.Events {
			if e.Kind == BlockStored && len(e.TokenIDs) > 0 {
				for j := range e.BlockHashes {
					pages = append(pages, e.TokenIDs[j*e.BlockSize:(j+1)*e.BlockSize])
				}
			}
		}
		for _, e := range again.Events {
			if e.Kind == BlockStored && len(e.TokenIDs) > 0 {
				got = append(got, e.TokenIDs)
			}
		}
		if len(pages) != len(got) {
			t.Fatalf("%d pages, want %d", len(got), len(pages))
		}
		for i := range pages {
			if !bytes.Equal(u32bytes(pages[i]), u32bytes(got[i])) {
				t.Fatalf("page %d = %v, want %v", i, got[i], pages[i])
			}
		}
	})
}

func u32bytes(v []uint32) []byte {
	out := make([]byte, 0, 4*len(v))
	for _, x := range v {
		out = append(out, byte(x), byte(x>>8), byte(x>>16), byte(x>>24))
	}
	return out
}
