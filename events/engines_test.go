package events

import (
	"bytes"
	"encoding/hex"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// readHexFixture reads an annotated hex fixture: bytes as hex digits,
// whitespace ignored, "#" starting a comment to the end of the line.
func readHexFixture(t testing.TB, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "engines", name))
	if err != nil {
		t.Fatal(err)
	}
	var digits strings.Builder
	for _, line := range strings.Split(string(data), "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		digits.WriteString(strings.Join(strings.Fields(line), ""))
	}
	b, err := hex.DecodeString(digits.String())
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

func TestSGLangFixtures(t *testing.T) {
	const h0, h1 = uint64(2355870434279254203), uint64(13598607926081326006) // h1 = int64 -4848136147628225610
	page0 := []uint32{0, 671, 6102, 4593}
	page1 := []uint32{294, 8760, 344, 22979}
	cases := []struct {
		file string
		opt  SGLangOptions
		want Batch
	}{
		{"sglang-v05-dp1.hex", SGLangOptions{}, Batch{TS: 1748998067.7508266, DPRank: 1, HasDPRank: true, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{h0}, TokenIDs: page0, BlockSize: 4},
			{Kind: BlockStored, BlockHashes: []uint64{h1}, ParentHash: h0, HasParent: true, TokenIDs: page1, BlockSize: 4},
			{Kind: BlockRemoved, BlockHashes: []uint64{h1}},
		}}},
		{"sglang-medium.hex", SGLangOptions{Medium: true}, Batch{TS: 1780585934.7584138, DPRank: 0, HasDPRank: true, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{h0}, TokenIDs: page0, BlockSize: 4, Medium: "GPU"},
			{Kind: BlockStored, BlockHashes: []uint64{h0}, TokenIDs: page0, BlockSize: 4, Medium: "CPU_TIER1"},
			{Kind: BlockRemoved, BlockHashes: []uint64{h0}, Medium: "GPU"},
			{Kind: AllBlocksCleared},
		}}},
		{"sglang-legacy.hex", SGLangOptions{NoRank: true}, Batch{TS: 1748998067.7508266, Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{h0}, TokenIDs: page0, BlockSize: 4},
		}}},
	}
	for _, c := range cases {
		t.Run(c.file, func(t *testing.T) {
			raw := readHexFixture(t, c.file)
			got, err := Decode(raw)
			if err != nil {
				t.Fatal(err)
			}
			if got.TS != c.want.TS || got.DPRank != c.want.DPRank || got.HasDPRank != c.want.HasDPRank || len(got.Events) != len(c.want.Events) {
				t.Fatalf("batch = ts %v rank %d/%v, %d events; want ts %v rank %d/%v, %d events",
					got.TS, got.DPRank, got.HasDPRank, len(got.Events), c.want.TS, c.want.DPRank, c.want.HasDPRank, len(c.want.Events))
			}
			for i := range got.Events {
				g, w := got.Events[i], c.want.Events[i]
				g.Layout = EventLayout{}
				if !reflect.DeepEqual(g, w) {
					t.Errorf("event %d = %+v, want %+v", i, g, w)
				}
				if !g.FullAttention() {
					t.Errorf("event %d not full attention", i)
				}
			}
			// The simulator's encoder writes the same bytes from the same events.
			again, err := EncodeSGLang(nil, got, c.opt)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(again, raw) {
				t.Errorf("EncodeSGLang:\n got %x\nwant %x", again, raw)
			}
		})
	}
}

func TestSGLangNamedFieldMaps(t *testing.T) {
	b, err := Decode(readHexFixture(t, "sglang-map.hex"))
	if err != nil {
		t.Fatal(err)
	}
	if !b.HasDPRank || b.DPRank != 2 {
		t.Errorf("attn_dp_rank = %d/%v, want 2", b.DPRank, b.HasDPRank)
	}
	if len(b.Events) != 1 || b.Events[0].Kind != BlockStored || b.Events[0].BlockSize != 4 ||
		b.Events[0].Medium != "GPU" || b.Events[0].HasParent || len(b.Events[0].TokenIDs) != 4 {
		t.Errorf("events = %+v", b.Events)
	}
}

// EncodeSGLang splits multi-block events into pages chained by parent, as
// SGLang emits them: the decoded pages chain exactly as the input did.
func TestEncodeSGLangSplitsPages(t *testing.T) {
	in := Batch{TS: 1, HasDPRank: true, Events: []Event{
		{Kind: BlockStored, BlockHashes: []uint64{1, 1 << 63, 3}, ParentHash: 9, HasParent: true, TokenIDs: []uint32{1, 2, 3, 4, 5, 6}, BlockSize: 2, Medium: "CPU"},
		{Kind: BlockRemoved, BlockHashes: []uint64{1, 3}, Medium: "CPU"},
	}}
	raw, err := EncodeSGLang(nil, in, SGLangOptions{Medium: true})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 5 {
		t.Fatalf("%d events, want 5 (3 pages, 2 removals)", len(b.Events))
	}
	parents := []uint64{9, 1, 1 << 63}
	for i := 0; i < 3; i++ {
		e := b.Events[i]
		if e.ParentHash != parents[i] || !e.HasParent || e.BlockHashes[0] != in.Events[0].BlockHashes[i] || e.Medium != "CPU_TIER1" ||
			!reflect.DeepEqual(e.TokenIDs, in.Events[0].TokenIDs[2*i:2*i+2]) {
			t.Errorf("page %d = %+v", i, e)
		}
	}
	if _, err := EncodeSGLang(nil, Batch{Events: []Event{{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 2}}}, SGLangOptions{}); err == nil {
		t.Error("a store with part of a page of tokens was encoded")
	}
}

func TestTRTLLMZMQFixture(t *testing.T) {
	b, err := Decode(readHexFixture(t, "trtllm-zmq.hex"))
	if err != nil {
		t.Fatal(err)
	}
	if b.Encoding != EncodingMap || b.DPRank != 3 || len(b.Events) != 2 {
		t.Fatalf("batch = %+v", b)
	}
	const h = uint64(15760518052499183552) // int64 -2686226021210368064
	if e := b.Events[0]; e.Kind != BlockStored || e.BlockHashes[0] != h || e.BlockSize != 4 || e.Medium != "GPU" ||
		!reflect.DeepEqual(e.TokenIDs, []uint32{1, 15043, 29892, 920}) {
		t.Errorf("stored = %+v", e)
	}
	if e := b.Events[1]; e.Kind != BlockRemoved || e.BlockHashes[0] != h {
		t.Errorf("removed = %+v", e)
	}
}

func TestTRTLLMJSONFixture(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "engines", "trtllm-kv_cache_events.json"))
	if err != nil {
		t.Fatal(err)
	}
	raw = bytes.TrimRight(raw, "\n")
	evs, err := DecodeTRTLLM(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 5 {
		t.Fatalf("%d events, want 5", len(evs))
	}
	if got := AppendTRTLLMJSON(nil, evs); !bytes.Equal(got, raw) {
		t.Errorf("AppendTRTLLMJSON:\n got %s\nwant %s", got, raw)
	}
	var c TRTLLMConverter
	out, st := c.Convert(evs)
	r0 := out[0]
	const a, b, cc = uint64(12686426958405996318), uint64(6269600025196600361), uint64(739629926121699524)
	want := []Event{
		{Kind: AllBlocksCleared},
		{Kind: BlockStored, BlockHashes: []uint64{a, b}, TokenIDs: []uint32{1, 15043, 29892, 920, 526, 366, 2599, 29973}, BlockSize: 4, Medium: "GPU"},
		{Kind: BlockStored, BlockHashes: []uint64{b}, Medium: "CPU"},
		{Kind: BlockRemoved, BlockHashes: []uint64{b}, Medium: "GPU"},
		{Kind: BlockStored, BlockHashes: []uint64{cc}, ParentHash: a, HasParent: true, TokenIDs: []uint32{306, 626, 2691, 29889}, BlockSize: 4, Medium: "GPU"},
		{Kind: BlockRemoved, BlockHashes: []uint64{cc}, Medium: "GPU"}, // it was on GPU: removed from there only
	}
	if !reflect.DeepEqual(r0, want) {
		t.Errorf("converted:\n got %+v\nwant %+v", r0, want)
	}
	if st.Restarts != 1 || st.Gaps != 0 || len(out) != 1 {
		t.Errorf("stats %+v, ranks %d", st, len(out))
	}
	// Removals name the level the block was last seen in; a block never
	// seen leaves both.
	out, _ = c.Convert([]TRTLLMEvent{{EventID: 5, Type: "removed", Hashes: []uint64{b, 77}}})
	wantRm := []Event{{Kind: BlockRemoved, BlockHashes: []uint64{77}, Medium: "GPU"}, {Kind: BlockRemoved, BlockHashes: []uint64{b, 77}, Medium: "CPU"}}
	if !reflect.DeepEqual(out[0], wantRm) {
		t.Errorf("removals by level:\n got %+v\nwant %+v", out[0], wantRm)
	}
	// The same ids again: the engine restarted (ids went backwards).
	out, st = c.Convert(evs[1:2])
	if st.Restarts != 1 || out[0][0].Kind != AllBlocksCleared {
		t.Errorf("repeated id: stats %+v, events %+v", st, out[0])
	}
	// A skipped id: events were lost, the rank is cleared.
	evs[4].EventID = 9
	out, st = c.Convert(evs[4:5])
	if st.Gaps != 1 || out[0][0].Kind != AllBlocksCleared {
		t.Errorf("gap: stats %+v, events %+v", st, out[0])
	}
}

func TestTRTLLMAttentionDPAndWindows(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "engines", "trtllm-attention-dp.json"))
	if err != nil {
		t.Fatal(err)
	}
	evs, err := DecodeTRTLLM(raw)
	if err != nil {
		t.Fatal(err)
	}
	c := TRTLLMConverter{FullWindow: 4096}
	out, st := c.Convert(evs)
	if len(out[1]) != 2 || len(out[0]) != 0 {
		t.Fatalf("per rank: %+v", out)
	}
	if e := out[1][0]; !e.FullAttention() || e.BlockSize != 4 {
		t.Errorf("rank 1 full window = %+v", e)
	}
	if e := out[1][1]; e.FullAttention() || e.SlidingWindow != 128 {
		t.Errorf("rank 1 128-token window = %+v, want a sliding-window group", e)
	}
	if st.ExtraIDBlocks != 1 {
		t.Errorf("extra-id blocks = %d, want 1 (rank 0's block has token_extra_id 7)", st.ExtraIDBlocks)
	}
}

func TestDecodeTRTLLMRejects(t *testing.T) {
	for _, in := range []string{
		``, `{`, `[{"data":{"type":"removed"}}]`, `[{"event_id":1}]`,
		`[{"event_id":1,"data":{"type":"removed","block_hashes":[1.5]}}]`,
		`[{"event_id":1,"data":{"type":"removed","block_hashes":[18446744073709551616]}}]`,
		`[{"event_id":1,"data":{"type":"stored","blocks":[{"tokens":[]}]}}]`,
		`[{"event_id":1,"data":{"type":"stored","blocks":[{"block_hash":1,"tokens":[{"token_id":4294967296}]}]}}]`,
		`[{"event_id":1,"window_size":-1,"data":{"type":"created"}}]`,
		`[{"event_id":1,"data":{"type":"updated"}}]`,
		`[] []`,
	} {
		if _, err := DecodeTRTLLM([]byte(in)); err == nil {
			t.Errorf("DecodeTRTLLM(%q) accepted", in)
		}
	}
	evs, err := DecodeTRTLLM([]byte(`{"event_id":3,"data":{"type":"removed","block_hashes":[-1]},"window_size":0}`))
	if err != nil || len(evs) != 1 || evs[0].Hashes[0] != 1<<64-1 {
		t.Errorf("single object with an int64 hash: %+v, %v", evs, err)
	}
}

// TestSGLangCacheSaltMetadata: SGLang since sgl-project/sglang#30827 (in
// 0.5.18) writes a salted store as its 7-field positional BlockStored plus
// an 8th element, a metadata map {"cache_salt": ...} (and, since
// sgl-project/sglang#37482, "session_id"), where vLLM has lora_name; unsalted
// stores keep 7 fields. Since #37482 the events are named-field maps with the
// salt in that metadata or, per the maintainers (sgl-project/sglang#38561),
// as a "cache_salt" key of the event. Sources: the descriptions of
// sgl-project/sglang#30827, #37271, #37482, #38562 and ai-dynamo/dynamo#14530
// (the engine source at those commits was not in the searchable store; the
// shapes are built from those descriptions). Before this, the map in the
// lora_name slot failed the whole batch, its unsalted stores included.
func TestSGLangCacheSaltMetadata(t *testing.T) {
	page := func(m mp) mp { // block_hashes, parent, tokens, block_size, lora_id, medium
		return m.arr(1).i64(-7).nil().arr(2).u(11).u(12).u(2).nil().str("GPU")
	}
	unsalted := page(mp{}.arr(7).str("BlockStored"))
	salted := page(mp{}.arr(8).str("BlockStored")).mapH(2).str("cache_salt").str("tenant-a").str("session_id").str("s1")
	child := mp{}.arr(8).str("BlockStored").arr(1).i64(-8).i64(-7).arr(2).u(13).u(14).u(2).nil().str("GPU").
		mapH(1).str("cache_salt").str("tenant-a")
	mapMeta := mp{}.mapH(8).str("type").str("BlockStored").str("block_hashes").arr(1).i64(-9).
		str("parent_block_hash").nil().str("token_ids").arr(2).u(1).u(2).str("block_size").u(2).
		str("lora_id").nil().str("medium").str("GPU").str("metadata").mapH(1).str("cache_salt").str("tenant-b")
	mapKey := mp{}.mapH(9).str("type").str("BlockStored").str("block_hashes").arr(1).i64(-10).
		str("parent_block_hash").nil().str("token_ids").arr(2).u(1).u(2).str("block_size").u(2).
		str("lora_id").nil().str("medium").str("GPU").str("cache_salt").str("tenant-c").str("session_id").str("s2")
	p := mp{}.arr(3).f64(1).arr(5)
	for _, e := range []mp{unsalted, salted, child, mapMeta, mapKey} {
		p = append(p, e...)
	}
	p = p.u(0)
	b, err := Decode(p)
	if err != nil {
		t.Fatalf("salted SGLang stores rejected the batch: %v", err)
	}
	want := []string{"", "tenant-a", "", "tenant-b", "tenant-c"}
	if len(b.Events) != len(want) {
		t.Fatalf("%d events, want %d", len(b.Events), len(want))
	}
	for i, e := range b.Events {
		if e.CacheSalt != want[i] || e.LoraName != "" || len(e.BlockHashes) != 1 {
			t.Errorf("event %d: salt %q lora_name %q hashes %x, want salt %q", i, e.CacheSalt, e.LoraName, e.BlockHashes, want[i])
		}
	}
	if e := b.Events[2]; !e.HasParent || e.ParentHash != uint64(math.MaxUint64-6) {
		t.Errorf("child parent %x", e.ParentHash)
	}
	// Re-encoded in vLLM's form the salt survives (in extra_keys).
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		q, err := Encode(nil, b, enc)
		if err != nil {
			t.Fatal(err)
		}
		back, err := Decode(q)
		if err != nil {
			t.Fatal(err)
		}
		if d := diffBatch(b, back); d != "" {
			t.Fatalf("%v: %s", enc, d)
		}
	}
}

// TestTRTLLMV2Metadata: KVCacheManagerV2's events (NVIDIA/TensorRT-LLM#13589,
// merged 2026-04-29) keep the V1 JSON shapes and add "hash_algo"
// ("v1_block_key" / "v2_sha256") and "layer_group_id" metadata, with 64-bit
// hashes; where the serializer puts those keys is not in the PR description,
// so both the event and its data carry them here. They are skipped; the
// events read as V1's.
func TestTRTLLMV2Metadata(t *testing.T) {
	raw := []byte(`[{"event_id":0,"window_size":4096,"hash_algo":"v2_sha256","layer_group_id":0,` +
		`"data":{"type":"stored","parent_hash":null,"hash_algo":"v2_sha256","layer_group_id":0,` +
		`"blocks":[{"type":"stored_block","block_hash":18446744073709551615,"tokens":[{"type":"unique_token","token_id":1,"token_extra_id":0}],"lora_id":null,"cache_level":0,"priority":35,"mm_keys":[]}]}},` +
		`{"event_id":1,"window_size":4096,"hash_algo":"v2_sha256","layer_group_id":0,"data":{"type":"removed","block_hashes":[18446744073709551615],"layer_group_id":0}}]`)
	evs, err := DecodeTRTLLM(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[0].Type != "stored" || len(evs[0].Blocks) != 1 || evs[0].Blocks[0].Hash != math.MaxUint64 ||
		evs[0].Blocks[0].Tokens[0] != 1 || evs[1].Type != "removed" || evs[1].Hashes[0] != math.MaxUint64 {
		t.Fatalf("%+v", evs)
	}
}
