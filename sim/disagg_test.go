package sim

import (
	"testing"
	"time"
)

// A remote-prefilled request (disaggregated decode) receives the full
// blocks it does not hold over the network instead of computing them: its
// first token comes after the transfer and one short step, far sooner than
// a prefill of the same prompt; the received blocks enter the prefix cache
// and are announced like computed ones; the local hit is what the engine
// already held.
func TestRemotePrefill(t *testing.T) {
	cfg := Config{GPUBlocks: 4096, Timing: Timing{KVTransferTokensPerSec: 1e6}}
	p := prompt(1, 8000)

	h := newHarness(t, cfg)
	h.submit(Request{ID: 1, Prompt: p, MaxTokens: 2}, 0)
	h.drain()
	prefilled := h.find(1, FirstToken).At

	r := newHarness(t, cfg)
	r.submit(Request{ID: 1, Prompt: p, MaxTokens: 2, RemotePrefill: true}, 0)
	r.drain()
	first := r.find(1, FirstToken)
	blocks := (len(p) - 1) / 16
	transfer := time.Duration(float64(blocks*16) / 1e6 * float64(time.Second))
	if first.At < transfer || first.At > transfer+50*time.Millisecond {
		t.Fatalf("remote-prefilled first token at %v, want the %v transfer and one step", first.At, transfer)
	}
	if first.At*4 > prefilled {
		t.Fatalf("remote-prefilled first token at %v, a local prefill's at %v: the transfer should be far cheaper", first.At, prefilled)
	}
	if first.CachedTokens != 0 {
		t.Fatalf("cached %d tokens on an empty engine", first.CachedTokens)
	}
	st := r.e.Stats()
	if st.RemoteTokens != uint64(blocks*16) {
		t.Fatalf("RemoteTokens = %d, want %d", st.RemoteTokens, blocks*16)
	}
	if st.GPUBlocks != len(p)/16 {
		t.Fatalf("%d GPU blocks cached, want the prompt's %d full blocks", st.GPUBlocks, len(p)/16)
	}
	r.checkModel()

	// The same prompt again, remote-prefilled: everything is local now, so
	// nothing is transferred and the local hit is reported.
	r.submit(Request{ID: 2, Prompt: p, MaxTokens: 2, RemotePrefill: true}, r.e.Now())
	r.drain()
	if got := r.find(2, Finished).CachedTokens; got != blocks*16 {
		t.Fatalf("second request cached %d tokens, want %d", got, blocks*16)
	}
	if st2 := r.e.Stats(); st2.RemoteTokens != st.RemoteTokens {
		t.Fatalf("RemoteTokens grew to %d for a prompt held locally", st2.RemoteTokens)
	}
	r.checkModel()
}
