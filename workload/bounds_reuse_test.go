package workload

import "testing"

// TestBoundLastTokenRecomputed: the pooled bound counts a request's hit
// as an engine does (sim.Engine.admit, maxHitBlocks; vLLM's
// KVCacheManager.get_computed_blocks caps the hit at num_tokens − 1 in
// whole blocks): a prompt of exactly k cached blocks reuses k − 1 of them,
// so the bound never asks of the fleet more than an engine can give.
func TestBoundLastTokenRecomputed(t *testing.T) {
	req := func(n int) Request { return Request{Prompt: []Segment{{Seed: 7, Len: n}}} }
	tests := []struct {
		name string
		reqs []Request
		want int64 // the last request's hit tokens
	}{
		{"whole blocks again", []Request{req(32), req(32)}, 16},
		{"one more token", []Request{req(32), req(33)}, 32},
		{"one block again", []Request{req(16), req(16)}, 0},
	}
	for _, tc := range tests {
		_, hits, err := RequestsBoundPerRequest(tc.reqs, 16, 0, false)
		if err != nil {
			t.Fatal(err)
		}
		if got := hits[len(hits)-1]; got != tc.want {
			t.Errorf("%s: the bound counts %d hit tokens, an engine reuses at most %d", tc.name, got, tc.want)
		}
	}
	// A trace's records: 512-token hash blocks, an engine's 16-token
	// blocks. Repeating a 1,024-token record reuses 1,008 tokens; a
	// 600-token one 592 (its 88-token tail holds 5 whole engine blocks).
	for _, tc := range []struct {
		input int
		ids   []int64
		want  int64
	}{
		{1024, []int64{1, 2}, 1008},
		{600, []int64{3, 4}, 592},
	} {
		rec := TraceRecord{InputLength: tc.input, HashIDs: tc.ids}
		_, hits, err := PooledBoundPerRequest([]TraceRecord{rec, rec}, 16, 0)
		if err != nil {
			t.Fatal(err)
		}
		if hits[1] != tc.want {
			t.Errorf("%d-token record again: the bound counts %d hit tokens, an engine of 16-token blocks reuses at most %d", tc.input, hits[1], tc.want)
		}
	}
}
