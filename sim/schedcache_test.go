package sim

import (
	"testing"
	"time"
)

// busyEngine starts a 1,024-token request on a fresh engine so that the
// requests a test submits next arrive while a step is in flight and are
// scheduled together at its end.
func busyEngine(t *testing.T, cfg Config) *harness {
	t.Helper()
	h := newHarness(t, cfg)
	h.submit(Request{ID: 100, Prompt: prompt(100, 1024), MaxTokens: 1}, 0)
	if !h.e.stepActive {
		t.Fatal("no step in flight")
	}
	return h
}

// wantCached checks the cached-token figure request id finished with.
func (h *harness) wantCached(id uint64, want int) {
	h.t.Helper()
	if got := h.find(id, Finished).CachedTokens; got != want {
		h.t.Fatalf("request %d cached %d tokens, want %d", id, got, want)
	}
}

// Two requests with the same 72-token prompt admitted in one schedule: the
// second hits the 4 full blocks the first is computing in that step (vLLM's
// allocate_slots caches them when the first is scheduled), so the step
// computes those 64 tokens once.
func TestSameStepAdmissionsShareBlocks(t *testing.T) {
	h := busyEngine(t, Config{GPUBlocks: 256})
	a := prompt(1, 72)
	h.submit(Request{ID: 1, Prompt: a, MaxTokens: 2}, time.Millisecond)
	h.submit(Request{ID: 2, Prompt: a, MaxTokens: 2}, time.Millisecond)
	h.runUntil(h.e.stepEnd) // the first step ends; 1 and 2 are scheduled
	q1, q2 := h.e.byID[1], h.e.byID[2]
	if q1 == nil || q2 == nil || q1.state != stRunning || q2.state != stRunning {
		t.Fatal("requests 1 and 2 not both admitted in the second step")
	}
	if q1.scheduled != 72 || q2.scheduled != 72-64 {
		t.Fatalf("scheduled %d and %d tokens, want 72 and 8", q1.scheduled, q2.scheduled)
	}
	h.drain()
	h.wantCached(1, 0)
	h.wantCached(2, 64) // the shared full blocks
	if got := h.find(1, FirstToken).At; got != h.find(2, FirstToken).At {
		t.Fatalf("first tokens at %v and %v, want the same step", got, h.find(2, FirstToken).At)
	}
	h.checkModel()
}

// A request admitted in the step that schedules another's chunk covering its
// prefix hits the whole chunk, not only the blocks computed before the step.
func TestAdmissionHitsChunkInFlight(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 256, MaxNumBatchedTokens: 96})
	a := prompt(1, 160) // 10 blocks: chunks of 96 and 64 tokens
	h.submit(Request{ID: 1, Prompt: a, MaxTokens: 1}, 0)
	b := concat(a[:128], prompt(2, 16)) // 8 shared blocks, then its own
	h.submit(Request{ID: 2, Prompt: b, MaxTokens: 1}, time.Millisecond)
	h.runUntil(h.e.stepEnd) // step 2: 1's last 64 tokens, then 2 with 32 left
	if q := h.e.byID[2]; q == nil || q.state != stRunning {
		t.Fatal("request 2 not admitted in the second step")
	}
	h.drain()
	// (144-1)/16 = 8 blocks can hit; 1's second chunk (blocks 6-9) is in the
	// step that admits 2, so all 8 do (before the step: 6).
	h.wantCached(2, 128)
	h.checkModel()
}

// An abort while a step is in flight keeps the blocks that step scheduled:
// vLLM handles aborts between steps, so the step computes them, and they
// stay cached for later requests.
func TestAbortMidStepKeepsScheduledBlocks(t *testing.T) {
	h := newHarness(t, Config{GPUBlocks: 256})
	a := prompt(1, 72)
	h.submit(Request{ID: 1, Prompt: a, MaxTokens: 5}, 0)
	mid := h.e.stepEnd / 2
	if !h.e.Abort(1, mid) {
		t.Fatal("abort failed")
	}
	h.drain()
	h.find(1, Aborted)
	if s := h.e.Stats(); s.KVUsage != 0 {
		t.Fatalf("blocks still held after abort: %+v", s)
	}
	if g, _ := h.e.CachedBlocks(); len(g) != 4 {
		t.Fatalf("%d blocks cached, want the 4 the aborted step computed", len(g))
	}
	h.checkModel()
	h.submit(Request{ID: 2, Prompt: a, MaxTokens: 1}, time.Second)
	h.drain()
	h.wantCached(2, 64)
	h.checkModel()
}
