package simserver

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/sim"
)

// TestTruncatePromptTokens: kvsim prefills a prompt as vLLM does with
// truncate_prompt_tokens k: its last k tokens (token ids: prompt_ids[-k:];
// -1: the last max_model_len), so the usage counts k prompt tokens and a
// second prompt keeping the same tail behind another head hits the first's
// blocks (all but the last: vLLM's num_tokens − 1 cap). 0 is refused, as
// the router refuses to key it (router.PromptTruncation).
func TestTruncatePromptTokens(t *testing.T) {
	in := startInstance(t, Config{Engine: sim.Config{Model: "fake-model", GPUBlocks: 64, MaxModelLen: 200}, TimeScale: 20})
	ids := seqIDs
	complete := func(prompt []int, trunc any) (int, usageResp, string) {
		t.Helper()
		body := map[string]any{}
		if trunc != nil {
			body["truncate_prompt_tokens"] = trunc
		}
		return completeUsage(t, in, prompt, body)
	}
	tail := ids(5000, 64)
	code, r, raw := complete(append(ids(1000, 100), tail...), 64)
	if code != 200 || r.Usage.PromptTokens != 64 || r.Usage.Details.Cached != 0 {
		t.Fatalf("truncate 64 of 164: %d, usage %+v (%s); want 64 prompt tokens, none cached", code, r.Usage, raw)
	}
	code, r, raw = complete(append(ids(2000, 100), tail...), 64)
	if code != 200 || r.Usage.PromptTokens != 64 || r.Usage.Details.Cached != 48 {
		t.Fatalf("same kept tail, another head: %d, usage %+v (%s); want 64 prompt tokens, 48 cached", code, r.Usage, raw)
	}
	// -1 keeps the last max_model_len (200) tokens: a shorter prompt whole,
	// a longer one cut to 200, which with its output is then too long (as
	// vLLM answers).
	if code, r, raw = complete(ids(3000, 150), -1); code != 200 || r.Usage.PromptTokens != 150 {
		t.Fatalf("truncate -1 of 150: %d, usage %+v (%s); want 150 prompt tokens", code, r.Usage, raw)
	}
	if code, _, raw = complete(ids(3000, 250), -1); code != 400 || !strings.Contains(raw, "you requested 201 tokens (200 in the messages") {
		t.Fatalf("truncate -1 of 250: %d %s; want 400 for 200 prompt tokens and 1 out", code, raw)
	}
	chat := map[string]any{"model": "fake-model", "messages": []map[string]string{{"role": "user", "content": strings.Repeat("a long question ", 20)}}, "max_tokens": 1, "truncate_prompt_tokens": 8}
	if code, raw := post(t, in.URL()+"/v1/chat/completions", chat); code != 200 || !strings.Contains(string(raw), `"prompt_tokens":8,`) {
		t.Errorf("chat truncated to 8: %d %s; want 8 prompt tokens", code, raw)
	}
	for _, bad := range []any{0, -2} {
		if code, _, raw := complete(ids(4000, 20), bad); code != 400 || !strings.Contains(raw, "truncate_prompt_tokens") {
			t.Errorf("truncate_prompt_tokens %v: %d %s; want 400 naming it", bad, code, raw)
		}
	}
}

// TestTruncationSideRight: vLLM main's truncation_side "right" keeps a
// prompt's first truncate_prompt_tokens tokens ("left", the default, the
// last; TokenizeParams._token_truncation, vllm/renderers/params.py), so two
// prompts sharing a head hit each other's blocks whatever their tails; a
// side vLLM does not take is a 400.
func TestTruncationSideRight(t *testing.T) {
	in := startInstance(t, Config{Engine: sim.Config{Model: "fake-model", GPUBlocks: 64, MaxModelLen: 400}, TimeScale: 20})
	ids := seqIDs
	complete := func(prompt []int, side string) (int, usageResp, string) {
		t.Helper()
		return completeUsage(t, in, prompt, map[string]any{"truncate_prompt_tokens": 64, "truncation_side": side})
	}
	head := ids(5000, 64)
	if code, r, raw := complete(append(slices.Clone(head), ids(1000, 100)...), "right"); code != 200 || r.Usage.PromptTokens != 64 || r.Usage.Details.Cached != 0 {
		t.Fatalf("right, 64 of 164: %d, usage %+v (%s); want 64 prompt tokens, none cached", code, r.Usage, raw)
	}
	if code, r, raw := complete(append(slices.Clone(head), ids(2000, 100)...), "right"); code != 200 || r.Usage.PromptTokens != 64 || r.Usage.Details.Cached != 48 {
		t.Fatalf("right, same head, another tail: %d, usage %+v (%s); want 64 prompt tokens, 48 cached", code, r.Usage, raw)
	}
	if code, _, raw := complete(ids(3000, 100), "middle"); code != 400 || !strings.Contains(raw, "truncation_side") {
		t.Errorf(`truncation_side "middle": %d %s; want 400 naming it`, code, raw)
	}
}

// seqIDs are the n token ids from, from+1, ….
func seqIDs(from, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = from + i
	}
	return out
}

// completeUsage posts a one-token completion of prompt with the extra
// fields, and reads its usage when it succeeds.
func completeUsage(t *testing.T, in *Instance, prompt []int, extra map[string]any) (int, usageResp, string) {
	t.Helper()
	body := map[string]any{"model": "fake-model", "prompt": prompt, "max_tokens": 1}
	for k, v := range extra {
		body[k] = v
	}
	code, raw := post(t, in.URL()+"/v1/completions", body)
	var r usageResp
	if code == 200 {
		if err := json.Unmarshal(raw, &r); err != nil {
			t.Fatal(err)
		}
	}
	return code, r, string(raw)
}
