package sim

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

// benchWorkload runs n requests of SageMaker's long-context shape (8,000
// shared tokens out of `groups` prefixes + 50-token question, 100 output
// tokens) arriving as a Poisson process at rate req/s on one engine, and
// returns the virtual time it took.
func benchWorkload(b *testing.B, cfg Config, n, groups int, rate float64, sink func(events.Batch)) time.Duration {
	e, err := New(cfg, sink)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 1))
	prefixes := make([][]uint32, groups)
	for g := range prefixes {
		prefixes[g] = prompt(g+1, 8000)
	}
	var ups []Update
	now := time.Duration(0)
	for i := range n {
		now += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		for {
			next, ok := e.NextEventTime()
			if !ok || next > now {
				break
			}
			ups = e.Advance(next, ups[:0])
		}
		p := concat(prefixes[rng.IntN(groups)], prompt(1000+i, 50))
		if err := e.Submit(Request{ID: uint64(i + 1), Prompt: p, MaxTokens: 100}, now); err != nil {
			b.Fatal(err)
		}
	}
	for {
		next, ok := e.NextEventTime()
		if !ok {
			break
		}
		ups = e.Advance(next, ups[:0])
	}
	return e.Now()
}

// BenchmarkEngineLongContext measures discrete-event speed: requests
// simulated per wall second and virtual seconds per wall second.
func BenchmarkEngineLongContext(b *testing.B) {
	for _, tc := range []struct {
		withEvents bool
		algo       HashAlgo
	}{{false, HashSHA256}, {true, HashSHA256}, {true, HashXXH64}} {
		withEvents := tc.withEvents
		b.Run(fmt.Sprintf("events=%v/hash=%d", withEvents, tc.algo), func(b *testing.B) {
			b.ReportAllocs()
			var sink func(events.Batch)
			batches := 0
			if withEvents {
				sink = func(events.Batch) { batches++ }
			}
			const n = 200
			var virtual time.Duration
			for b.Loop() {
				virtual += benchWorkload(b, Config{HashAlgo: tc.algo}, n, 8, 2, sink)
			}
			b.ReportMetric(float64(b.N*n)/b.Elapsed().Seconds(), "req/s")
			b.ReportMetric(virtual.Seconds()/b.Elapsed().Seconds(), "virtual-s/s")
		})
	}
}

// BenchmarkPromptHashes is the engine-side hashing cost of an 8k prompt
// (500 blocks), paid once per admission.
func BenchmarkPromptHashes(b *testing.B) {
	for _, algo := range []struct {
		name string
		a    HashAlgo
	}{{"sha256", HashSHA256}, {"xxhash", HashXXH64}} {
		b.Run(algo.name, func(b *testing.B) {
			e, _ := New(Config{HashAlgo: algo.a}, nil)
			p := prompt(1, 8000)
			b.ReportAllocs()
			b.SetBytes(int64(len(p) * 4))
			for b.Loop() {
				_ = e.PromptHashes(p, "", "")
			}
		})
	}
}

// BenchmarkDecodeStep is one decode step of a batch of 64 running requests.
func BenchmarkDecodeStep(b *testing.B) {
	e, _ := New(Config{}, nil)
	for i := range 64 {
		_ = e.Submit(Request{ID: uint64(i + 1), Prompt: prompt(i+1, 1000), MaxTokens: 1 << 16}, 0)
	}
	var ups []Update
	for range 20 { // past the prefills
		next, _ := e.NextEventTime()
		ups = e.Advance(next, ups[:0])
	}
	b.ReportAllocs()
	for b.Loop() {
		next, ok := e.NextEventTime()
		if !ok {
			b.Fatal("idle")
		}
		ups = e.Advance(next, ups[:0])
	}
}
