package kvaware

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestPlacementCountsKeptTail: with truncate_prompt_tokens k the engine
// computes and then holds only the prompt's last k tokens (vLLM:
// prompt_ids[-k:]), so the placement term's new context — what the request
// leaves on the instance that nobody held — is counted in the kept tail,
// never in the dropped head. The request's ids are kept as Resolve keeps them
// (router.PromptTruncation, router.KeepLast).
func TestPlacementCountsKeptTail(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{})
	// ū: picks that each compute 4 blocks.
	for i := range 2 * drainMinSamples {
		kvPick(t, s, kvRequest("warm", promptTokens(uint32(100+i), 4*kvTestBS)), w.insts[:1])
	}
	if m := s.st.computed.mean(); m != 4*kvTestBS {
		t.Fatalf("ū = %v, want %d", m, 4*kvTestBS)
	}
	later := func(head, tail []uint32) (tokens, best int, n float64) {
		t.Helper()
		// As Resolve keys a token-id prompt with truncate_prompt_tokens
		// (router's TestRVTruncatePromptTokens).
		keep, err := router.PromptTruncation(json.RawMessage(fmt.Sprint(len(tail))))
		if err != nil {
			t.Fatal(err)
		}
		req := kvRequest("t", router.KeepLast(append(slices.Clone(head), tail...), keep))
		ev := s.st.getEval()
		defer s.st.putEval(ev)
		s.evaluate(context.Background(), req, w.insts, ev, false)
		return ev.tokens, ev.best, ev.later
	}
	head := promptTokens(1, 64*kvTestBS)
	// A kept tail held whole on vllm-1 (a whole-block prompt: its last
	// block is recomputed, not new): nothing new is placed.
	tail := promptTokens(2, 8*kvTestBS)
	w.store(w.insts[1].ID(), tail, 0, 8)
	if tok, best, n := later(head, tail); tok != len(tail) || best != 8 || n != 0 {
		t.Errorf("kept tail held whole: %d tokens, best %d blocks, %v later requests; want %d, 8, 0", tok, best, n, len(tail))
	}
	// A 64-block kept tail of which vllm-0 holds the first block: 63
	// blocks of new context over ū = 4 blocks, less the request itself.
	tail = promptTokens(3, 64*kvTestBS)
	w.store(w.insts[0].ID(), tail, 0, 1)
	if tok, best, n := later(head, tail); tok != len(tail) || best != 1 || math.Abs(n-(63.0/4-1)) > 1e-9 {
		t.Errorf("kept tail of 64 blocks, one held: %d tokens, best %d blocks, %v later requests; want %d, 1, %v", tok, best, n, len(tail), 63.0/4-1)
	}
}

// TestPlacementUnmovedByReuseCap: the engine recomputes a whole-block
// prompt's last block (reusable), but that block is already held, so the
// context a request places is T − (the best match) whether or not the
// match is capped: the two differ by at most one block, only where nothing
// is new, and n floors ū at one block, so n is the same either way.
func TestPlacementUnmovedByReuseCap(t *testing.T) {
	const bs = 16
	for T := 1; T <= 8*bs+1; T++ {
		for best := 0; best <= T/bs; best++ {
			for _, mean := range []float64{1, bs, 3 * bs, 40 * bs} {
				plain := laterRequests(T-min(best*bs, T), mean, bs)
				capped := laterRequests(T-min(best*bs, reusable(T, bs)), mean, bs)
				if plain != capped {
					t.Fatalf("T=%d best=%d ū=%v: n %v uncapped, %v capped", T, best, mean, plain, capped)
				}
			}
		}
	}
}
