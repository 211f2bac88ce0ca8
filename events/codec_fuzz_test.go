package events

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzDecode feeds arbitrary payloads to Decode. Anything that decodes must
// re-encode, in its own encoding and in the other one, to a payload that
// decodes to the same batch; and re-encoding is stable (encoding a decoded
// re-encoding gives the same bytes). Anything that does not decode must fail
// with ErrMalformed.
func FuzzDecode(f *testing.F) {
	for _, c := range loadCaptures(f) {
		f.Add(c.payload(f))
	}
	f.Add(batch3(0, mp{}.arr(12).str("BlockStored").arr(1).bin(bytes.Repeat([]byte{7}, 32)).nil().arr(1).fix(1).
		fix(1).fix(-1).str("CPU").str("x").arr(1).arr(2).str("x").str("salt").fix(1).str("mamba").fix(8)))
	f.Add([]byte(mp{}.mapH(3).str("ts").raw(0xca, 0, 0, 0, 0).str("events").arr(1).mapH(2).str("type").str("BlockRemoved").
		str("block_hashes").arr(1).fix(1).str("data_parallel_rank").nil()))
	f.Add([]byte(mp{}.arr(2).f64(1).arr(2).arr(1).str("AllBlocksCleared").arr(2).str("Other").arr(0)))
	// Unreadable events (fixints where events belong), skipped and counted.
	f.Add([]byte{0x93, 0x30, 0x99, 0x30, 0x30, 0x30, 0xce, 0x30, 0x30, 0x30, 0x30, 0xce, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30})
	// SGLang's salted store: metadata where vLLM has lora_name, and as a map key.
	f.Add(batch3(0, mp{}.arr(8).str("BlockStored").arr(1).i64(-7).nil().arr(1).fix(1).fix(1).nil().str("GPU").
		mapH(2).str("cache_salt").str("t").str("session_id").str("s"),
		mp{}.mapH(3).str("type").str("BlockStored").str("block_hashes").arr(1).fix(2).str("metadata").mapH(1).str("cache_salt").str("u")))
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := Decode(p)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		for _, enc := range []Encoding{b.Encoding, EncodingArray, EncodingMap} {
			q, err := Encode(nil, b, enc)
			if err != nil {
				t.Fatalf("encode %v: %v", enc, err)
			}
			back, err := Decode(q)
			if err != nil {
				t.Fatalf("decode of re-encoded %v %x: %v", enc, q, err)
			}
			if d := diffBatch(b, back); d != "" {
				t.Fatalf("%v round trip of %x: %s", enc, p, d)
			}
			again, err := Encode(nil, back, enc)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(q, again) {
				t.Fatalf("re-encoding not stable in %v:\n%x\n%x", enc, q, again)
			}
		}
	})
}

func benchPayload(b *testing.B, file string, line int) ([]byte, int) {
	for _, c := range loadCaptures(b) {
		if c.File == file && c.Line == line {
			p := c.payload(b)
			bt, err := Decode(p)
			if err != nil {
				b.Fatal(err)
			}
			blocks := 0
			for _, e := range bt.Events {
				blocks += len(e.BlockHashes)
			}
			return p, blocks
		}
	}
	b.Fatalf("no capture %s:%d", file, line)
	return nil, 0
}

// BenchmarkDecode decodes the first captured batch (4 BlockStored events,
// 35 blocks, 560 tokens) in each encoding.
func BenchmarkDecode(b *testing.B) {
	for _, file := range []string{"array.jsonl", "map.jsonl"} {
		b.Run(file, func(b *testing.B) {
			p, blocks := benchPayload(b, file, 1)
			benchDecode(b, p, blocks)
		})
	}
}

// BenchmarkEncode re-encodes the same batch into a reused buffer.
func BenchmarkEncode(b *testing.B) {
	for _, file := range []string{"array.jsonl", "map.jsonl"} {
		b.Run(file, func(b *testing.B) {
			p, blocks := benchPayload(b, file, 1)
			bt, _ := Decode(p)
			buf := make([]byte, 0, 2*len(p))
			b.ReportAllocs()
			b.SetBytes(int64(len(p)))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				var err error
				if buf, err = Encode(buf[:0], bt, bt.Encoding); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkDecodeLongPrompt decodes what vLLM sends for one 8,192-token
// prompt: a BlockStored of 512 blocks in the map form current vLLM writes,
// with compact integers (token ids of a 128k vocabulary, so 1-, 3- and
// 5-byte forms mixed).
func BenchmarkDecodeLongPrompt(b *testing.B) {
	e := longPrompt()
	e.SpecKind = "full_attention"
	p, err := Encode(nil, Batch{TS: 1, Events: []Event{e}, HasDPRank: true}, EncodingMap)
	if err != nil {
		b.Fatal(err)
	}
	benchDecode(b, p, 512)
	b.ReportMetric(8192*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}

// longPrompt is the BlockStored of one 8,192-token prompt on GPU: 512
// blocks of 16, pseudo-random block hashes (xorshift), token ids spread
// over a 128k vocabulary (so 1-, 3- and 5-byte msgpack forms mixed).
func longPrompt() Event {
	e := Event{Kind: BlockStored, BlockSize: 16, Medium: "GPU", BlockHashes: make([]uint64, 512), TokenIDs: make([]uint32, 512*16)}
	x := uint64(0x9e3779b97f4a7c15)
	for i := range e.BlockHashes {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		e.BlockHashes[i] = x
	}
	for i := range e.TokenIDs {
		e.TokenIDs[i] = uint32((uint64(i) * 2654435761) % 128256)
	}
	return e
}

// benchDecode decodes p b.N times, reporting bytes, allocations and
// blocks (of the blocks p holds) per second.
func benchDecode(b *testing.B, p []byte, blocks int) {
	b.ReportAllocs()
	b.SetBytes(int64(len(p)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := Decode(p); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkDecodeRetained decodes the captured vLLM batches in turn with a
// retaining Decoder, as kvbridge does (every batch kept until its ack;
// here dropped in order), per batch.
func BenchmarkDecodeRetained(b *testing.B) {
	var ps [][]byte
	for _, c := range loadCaptures(b) {
		if c.File == "array.jsonl" {
			ps = append(ps, c.payload(b))
		}
	}
	var dec Decoder
	dec.Retain = true
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := dec.Decode(ps[i%len(ps)]); err != nil {
			b.Fatal(err)
		}
	}
}
