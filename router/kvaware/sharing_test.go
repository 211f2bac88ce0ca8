package kvaware

import (
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// TestPrefillSharesStepWithPending: under chunked prefill a request routed
// to an instance joins the next step together with every request routed
// there whose first token has not come, so its prefill delays each of
// them by its own prefill time. A prompt a quarter of which is held on
// vllm-0, where a cache-served request waits for its first token, costs
// that request 48 blocks of prefill there; an idle, cold vllm-1 costs
// nobody anything, and the 16 blocks the holder saves (twice: the
// request's own prefill and the fleet's) are less than the 48 it makes
// the waiting request wait. With nothing waiting on vllm-0 the holder
// keeps the prompt.
func TestPrefillSharesStepWithPending(t *testing.T) {
	w := newKVWorld(t, 2)
	s := w.strategy(config.RoutingConfig{})
	prompt := promptTokens(41, 64*kvTestBS)
	w.store("vllm-0", prompt, 0, 16)

	if d := kvPick(t, s, kvRequest("b", prompt), w.insts); d.Instance.ID() != "vllm-0" {
		t.Fatalf("nothing waiting on the holder: picked %s, want vllm-0", d.Instance.ID())
	}
	// A request served from cache on vllm-0, still waiting for its first token.
	o := w.st.newObserver("vllm-0", kvTestBS, 63*kvTestBS)
	defer o.Done(200, -1)
	// Another prompt sharing the held quarter (the first pick left a
	// speculative entry for all of prompt on vllm-0).
	other := append(prompt[:16*kvTestBS:16*kvTestBS], promptTokens(42, 48*kvTestBS)...)
	if d := kvPick(t, s, kvRequest("b", other), w.insts); d.Instance.ID() != "vllm-1" {
		t.Fatalf("a request waiting on the holder: picked %s, want vllm-1 (its 48 blocks would delay the waiting request)", d.Instance.ID())
	}
}
