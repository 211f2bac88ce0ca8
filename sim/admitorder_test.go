package sim

import (
	"fmt"
	"slices"
	"testing"
)

// lruOrder is an LRU list's blocks, head (the next victim) first.
func lruOrder(l *lru) []string {
	var out []string
	for b := l.head; b != nil; b = b.link[l.t].next {
		out = append(out, fmt.Sprintf("%x", b.hash))
	}
	return out
}

// step advances the engine to its next event.
func (h *harness) step() {
	h.t.Helper()
	next, ok := h.e.NextEventTime()
	if !ok {
		h.t.Fatal("engine idle")
	}
	h.ups = h.e.Advance(next, h.ups)
}

func seqPrompt(start, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(start + i)
	}
	return p
}

// TestFailedAdmissionKeepsEvictionOrder: a waiting request that cannot be
// admitted (not enough room for its new blocks) leaves the cache as it was,
// as vLLM's allocate_slots returns before touching the computed blocks: its
// cached prefix is not moved to the most recently used end of the free
// list at every step it retries.
func TestFailedAdmissionKeepsEvictionOrder(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 12, BlockSize: 16})
	x := seqPrompt(1000, 33)
	h.submit(Request{ID: 1, Prompt: x, MaxTokens: 1}, 0)
	h.drain()
	h.submit(Request{ID: 2, Prompt: seqPrompt(2000, 33), MaxTokens: 1}, h.e.Now())
	h.drain()
	before := lruOrder(&h.e.pool.gpuFree)
	if len(before) < 4 {
		t.Fatalf("free list %v: want the two prompts' 4 cached blocks", before)
	}
	h.submit(Request{ID: 3, Prompt: seqPrompt(3000, 96), MaxTokens: 40}, h.e.Now())
	h.step()
	w := append(slices.Clone(x[:32]), seqPrompt(4000, 100)...)
	h.submit(Request{ID: 4, Prompt: w, MaxTokens: 1}, h.e.Now())
	h.step()
	if len(h.e.waiting) != 1 || h.e.waiting[0].ID != 4 {
		t.Fatalf("want W waiting (admission failed); waiting %d", len(h.e.waiting))
	}
	after := lruOrder(&h.e.pool.gpuFree)
	if len(after) == 0 || after[0] != before[0] {
		t.Fatalf("free list reordered by a failed admission: next victim %.4s.. instead of %.4s.. (before %v, after %v)", first(after), before[0], before, after)
	}
	if len(h.e.waiting[0].held) != 0 {
		t.Fatalf("W holds %d blocks after failing admission", len(h.e.waiting[0].held))
	}
}

// TestFailedCPULoadAdmissionKeepsCPUOrder: a waiting request whose prefix
// is on the CPU tier, with no GPU room to load it into, leaves the CPU LRU
// in its order (the next CPU victim stays the next).
func TestFailedCPULoadAdmissionKeepsCPUOrder(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 12, BlockSize: 16, CPUBlocks: 16})
	x := seqPrompt(1000, 33)
	h.submit(Request{ID: 1, Prompt: x, MaxTokens: 1}, 0)
	h.drain()
	h.submit(Request{ID: 2, Prompt: seqPrompt(2000, 33), MaxTokens: 1}, h.e.Now())
	h.drain()
	// A prompt of nearly the whole cache pushes X's blocks to the CPU tier.
	h.submit(Request{ID: 3, Prompt: seqPrompt(3000, 12*16-20), MaxTokens: 1}, h.e.Now())
	h.drain()
	// R holds 11 of the 12 GPU blocks while it runs.
	h.submit(Request{ID: 4, Prompt: seqPrompt(4000, 176), MaxTokens: 10}, h.e.Now())
	h.step()
	before := lruOrder(&h.e.pool.cpuLRU)
	w := append(slices.Clone(x[:32]), seqPrompt(5000, 100)...)
	h.submit(Request{ID: 5, Prompt: w, MaxTokens: 1}, h.e.Now())
	h.step()
	if len(h.e.waiting) != 1 || h.e.waiting[0].ID != 5 || len(h.e.loading) != 0 {
		t.Fatalf("want W waiting (no GPU room to load its prefix); waiting %d, loading %d", len(h.e.waiting), len(h.e.loading))
	}
	if after := lruOrder(&h.e.pool.cpuLRU); !slices.Equal(after, before) {
		t.Fatalf("CPU LRU reordered by a failed admission: next victim %s instead of %s (before %v, after %v)", first(after), first(before), before, after)
	}
}

func first(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return s[0]
}
