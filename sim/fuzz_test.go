package sim

import (
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

// FuzzEngine drives an engine with an arbitrary sequence of submissions,
// aborts, resets, adapter changes and clock moves, and checks that it never
// panics or hangs, that every event is consistent with the cache, and that
// it drains to idle with the events describing exactly the cache.
func FuzzEngine(f *testing.F) {
	f.Add([]byte{0, 10, 3, 0, 20, 5, 1, 0, 2, 0, 3, 9})
	f.Add([]byte{0, 200, 200, 0, 200, 200, 0, 1, 1, 4, 0, 5, 0, 3, 255})
	f.Add([]byte{5, 1, 0, 30, 2, 6, 0, 0, 30, 2, 1, 1, 3, 3})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 600 {
			ops = ops[:600]
		}
		watchdog := time.AfterFunc(5*time.Second, func() { panic("engine hangs") })
		defer watchdog.Stop()
		cfg := Config{GPUBlocks: 24, CPUBlocks: 8, BlockSize: 4, MaxNumBatchedTokens: 32, MaxNumSeqs: 6, MaxModelLen: 90}
		if len(ops) > 0 && ops[0]&0x80 != 0 {
			cfg.CPUWriteThrough = true
		}
		model := newReplayModel()
		var bad error
		e, err := New(cfg, func(b events.Batch) {
			if err := model.apply(b, 4); err != nil && bad == nil {
				bad = err
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Duration(0)
		var ups []Update
		id := uint64(0)
		next := func() byte {
			if len(ops) == 0 {
				return 0
			}
			b := ops[0]
			ops = ops[1:]
			return b
		}
		for len(ops) > 0 {
			switch next() % 7 {
			case 0, 1: // submit
				id++
				n, out, base := int(next()%80), int(next()%20), int(next()%4)
				r := Request{ID: id, Prompt: concat(prompt(base, n/2), prompt(int(id)+10, n-n/2)), MaxTokens: out}
				if next()%3 == 0 {
					r.LoRA = "x"
				}
				if err := e.Submit(r, now); err != nil && !errors.Is(err, ErrEmptyPrompt) &&
					!errors.Is(err, ErrBadMaxTokens) && !errors.Is(err, ErrTooLong) && !errors.Is(err, ErrUnknownAdapter) {
					t.Fatalf("submit: %v", err)
				}
			case 2:
				e.Abort(uint64(next())%(id+1), now)
			case 3:
				_ = e.ResetPrefixCache(now)
			case 4:
				_, _ = e.LoadLoRA("x", "")
			case 5:
				_ = e.UnloadLoRA("x")
			case 6:
				now += time.Duration(next()) * time.Millisecond
				ups = e.Advance(now, ups[:0])
			}
			if bad != nil {
				t.Fatal(bad)
			}
		}
		for steps := 0; ; steps++ {
			next, ok := e.NextEventTime()
			if !ok {
				break
			}
			if steps > 20_000 {
				t.Fatal("engine does not drain")
			}
			ups = e.Advance(next, ups[:0])
		}
		if bad != nil {
			t.Fatal(bad)
		}
		g, c := e.CachedBlocks()
		mg, mc := model.sorted()
		if len(g) != len(mg) || len(c) != len(mc) {
			t.Fatalf("cache GPU %d CPU %d, events GPU %d CPU %d", len(g), len(c), len(mg), len(mc))
		}
		for i := range g {
			if g[i] != mg[i] {
				t.Fatal("GPU sets differ")
			}
		}
		for i := range c {
			if c[i] != mc[i] {
				t.Fatal("CPU sets differ")
			}
		}
		if s := e.Stats(); s.KVUsage != 0 || s.Running+s.Waiting+s.Loading != 0 {
			t.Fatalf("not idle: %+v", s)
		}
	})
}
