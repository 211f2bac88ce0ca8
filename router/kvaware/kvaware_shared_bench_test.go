package kvaware

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkKVAwareDecisionShared is one kv_aware decision from token ids
// under heavy sharing (issue 15): an 8,000-token prompt; 256 instances,
// every one holding the prompt's first 64 blocks (a fleet-wide system
// prompt) and one holding all of it; the index filled with other 500-block
// chains to 1,000,000 blocks. It reports per-decision CPU time of the
// deciding thread (p50, p99).
func BenchmarkKVAwareDecisionShared(b *testing.B) {
	const instances, shared = 256, 64
	ids := promptTokens(7, benchPrompt)
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS, Capacity: 2 * benchBlocks})
	if err != nil {
		b.Fatal(err)
	}
	insts := make([]*router.Instance, instances)
	for i := range insts {
		insts[i], _ = router.NewInstance(fmt.Sprintf("vllm-%03d", i), "http://127.0.0.1:9")
	}
	ctx := context.Background()
	store := func(inst string, toks []uint32) {
		keys := kvindex.Keys(kvindex.Root(kvTestModel, "", ""), toks, kvTestBS)
		ev := events.Event{Kind: events.BlockStored, BlockSize: kvTestBS, Medium: "GPU", TokenIDs: toks}
		for _, k := range keys {
			ev.BlockHashes = append(ev.BlockHashes, engineHash(inst, k))
		}
		if _, err := idx.Apply(ctx, inst, []events.Event{ev}); err != nil {
			b.Fatal(err)
		}
	}
	holder := insts[77]
	total := 0
	for _, in := range insts {
		n := shared
		if in == holder {
			n = len(ids) / kvTestBS
		}
		store(in.ID(), ids[:n*kvTestBS])
		total += n
	}
	for seed := uint32(1); total < benchBlocks; seed++ {
		n := min(500, benchBlocks-total)
		store(insts[int(seed)%instances].ID(), promptTokens(seed+1000, n*kvTestBS))
		total += n
	}
	st, err := NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: idx, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	s, err := NewKVAware(config.RoutingConfig{}, st)
	if err != nil {
		b.Fatal(err)
	}
	text := string(make([]byte, config.DefaultPrefixLength))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	times := cputime.NewOpTimes(1 << 16)
	b.ReportAllocs()
	for b.Loop() {
		req := &router.Request{Endpoint: router.EndpointCompletions, Model: kvTestModel, RoutingText: text, PromptTokens: ids}
		c0 := times.Start()
		d, err := s.Pick(ctx, req, insts)
		times.Stop(c0)
		if err != nil || d.Instance != holder {
			b.Fatalf("picked %v (%s), %v; want %s", d.Instance, d.Reason, err, holder.ID())
		}
		if d.Observer != nil {
			d.Observer.Done(200, -1) // the request ends: the next decision sees the same load
		}
	}
	times.Report(b, "cpu-ns")
}
