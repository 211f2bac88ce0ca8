package events

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/internal/cputime"
)

// BenchmarkDecodeRemovals decodes, with a reused Decoder, the step a vLLM
// engine with a full cache publishes (one BlockStored of 50 blocks and 50
// one-block BlockRemoved events, vllm/v1/core/block_pool.py
// _maybe_evict_cached_block: one event per evicted block), in the newest
// vLLM's map form. cpu-ns/op is per batch. join=64: with
// Decoder.JoinRemovals, as the router's consumer decodes.
func BenchmarkDecodeRemovals(b *testing.B) {
	for _, join := range []int{0, 64} {
		b.Run(fmt.Sprintf("join=%d", join), func(b *testing.B) { benchDecodeRemovals(b, join) })
	}
}

func benchDecodeRemovals(b *testing.B, join int) {
	st := Event{Kind: BlockStored, BlockSize: 16, Medium: "GPU", ParentHash: 1 << 40, HasParent: true}
	for j := 0; j < 50; j++ {
		st.BlockHashes = append(st.BlockHashes, 1<<40|uint64(j+1))
	}
	for i := 0; i < 50*16; i++ {
		st.TokenIDs = append(st.TokenIDs, uint32(1000+i*31%127000))
	}
	evs := []Event{st}
	for j := 0; j < 50; j++ {
		evs = append(evs, Event{Kind: BlockRemoved, Medium: "GPU", BlockHashes: []uint64{2<<40 | uint64(j)}})
	}
	p, err := Encode(nil, Batch{TS: 1.7e9, HasDPRank: true, Events: evs,
		Layout: BatchLayout{N: 3, Map: true, Order: 0 | 1<<2 | 2<<4}}, EncodingMap)
	if err != nil {
		b.Fatal(err)
	}
	dec := Decoder{JoinRemovals: join}
	b.ReportAllocs()
	reportCPU := cputime.Report(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := dec.Decode(p); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	reportCPU(b.N)
}
