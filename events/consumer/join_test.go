package consumer

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
)

// applyLog is a memory index that records each Apply's events and result.
type applyLog struct {
	*kvindex.Memory
	mu  sync.Mutex
	evs [][]events.Event
	res []kvindex.ApplyResult
}

func (a *applyLog) Apply(ctx context.Context, instance string, evs []events.Event) (kvindex.ApplyResult, error) {
	res, err := a.Memory.Apply(ctx, instance, evs)
	a.mu.Lock()
	defer a.mu.Unlock()
	kept := make([]events.Event, len(evs))
	for i, e := range evs {
		e.BlockHashes = append([]uint64(nil), e.BlockHashes...)
		kept[i] = e
	}
	a.evs, a.res = append(a.evs, kept), append(a.res, res)
	return res, err
}

// TestFullCacheStepJoined: a full cache's step, as vLLM sends it (a store
// and one one-block BlockRemoved per evicted block), reaches the index as
// the store and one removal of all the evicted hashes, in order
// (events.Decoder.JoinRemovals), and leaves the index as the step says.
func TestFullCacheStepJoined(t *testing.T) {
	e := newEnv(t)
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m", BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	a := &applyLog{Memory: idx}
	cfg := e.cfg
	cfg.Applier = a
	c := e.start(cfg)
	old := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: make([]uint32, 16*70)}
	for j := range 70 {
		old.BlockHashes = append(old.BlockHashes, uint64(100+j))
	}
	e.send("i0", 1, old)
	step := []events.Event{{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: make([]uint32, 16*2),
		BlockHashes: []uint64{200, 201}, ParentHash: 169, HasParent: true}}
	for j := range 70 {
		step = append(step, events.Event{Kind: events.BlockRemoved, Medium: "GPU", BlockHashes: []uint64{uint64(100 + j)}})
	}
	e.send("i0", 2, step...)
	testenv.WaitFor(t, 10*time.Second, "both messages applied", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return len(a.evs) == 2
	})
	a.mu.Lock()
	got, res := a.evs[1], a.res[1]
	a.mu.Unlock()
	// Joined in events of at most kvindex.SectionBlocks hashes (64 and 6;
	// a run also ends where the decoder's hash buffer is replaced).
	removed := []uint64{}
	for _, ev := range got[1:] {
		if ev.Kind != events.BlockRemoved || len(ev.BlockHashes) > kvindex.SectionBlocks {
			t.Fatalf("the step reached the index as %+v", got)
		}
		removed = append(removed, ev.BlockHashes...)
	}
	if len(got) > 4 {
		t.Fatalf("the step's 70 removals reached the index as %d events", len(got)-1)
	}
	for i, h := range removed {
		if h != uint64(100+i) {
			t.Fatalf("removed hash %d is %d, want %d", i, h, 100+i)
		}
	}
	if res.Stored != 2 || res.Removed != 70 || res.Unmapped != 0 {
		t.Fatalf("applied %+v", res)
	}
	if n, _ := idx.Len(e.ctx); n != 2 {
		t.Fatalf("index holds %d entries, want 2", n)
	}
	// The engine's events are counted as the engine sent them, joined or
	// not (kvrouter_events_applied_total; it read 2 removals here).
	if n := counterValue(c.m.byKind[events.BlockRemoved]); n != 70 {
		t.Fatalf("counted %v BlockRemoved events applied, want 70", n)
	}
	if n := counterValue(c.m.byKind[events.BlockStored]); n != 2 {
		t.Fatalf("counted %v BlockStored events applied, want 2", n)
	}
}
