package sim

import (
	"fmt"
	"slices"
	"testing"
)

// freeOrder is the GPU free list, head (the next victim) first.
func freeOrder(e *Engine) []string {
	var out []string
	for b := e.pool.gpuFree.head; b != nil; b = b.link[gpu].next {
		out = append(out, fmt.Sprintf("%x", b.hash))
	}
	return out
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
	before := freeOrder(h.e)
	if len(before) < 4 {
		t.Fatalf("free list %v: want the two prompts' 4 cached blocks", before)
	}
	step := func() {
		next, ok := h.e.NextEventTime()
		if !ok {
			t.Fatal("engine idle")
		}
		h.ups = h.e.Advance(next, h.ups)
	}
	h.submit(Request{ID: 3, Prompt: seqPrompt(3000, 96), MaxTokens: 40}, h.e.Now())
	step()
	w := append(slices.Clone(x[:32]), seqPrompt(4000, 100)...)
	h.submit(Request{ID: 4, Prompt: w, MaxTokens: 1}, h.e.Now())
	step()
	if len(h.e.waiting) != 1 || h.e.waiting[0].ID != 4 {
		t.Fatalf("want W waiting (admission failed); waiting %d", len(h.e.waiting))
	}
	after := freeOrder(h.e)
	if len(after) == 0 || after[0] != before[0] {
		t.Fatalf("free list reordered by a failed admission: next victim %.4s.. instead of %.4s.. (before %v, after %v)", first(after), before[0], before, after)
	}
	if len(h.e.waiting[0].held) != 0 {
		t.Fatalf("W holds %d blocks after failing admission", len(h.e.waiting[0].held))
	}
}

func first(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return s[0]
}
