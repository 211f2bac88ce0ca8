package kvaware

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// TestTokenSourceTruncatePromptTokens: with truncate_prompt_tokens k, vLLM
// tokenizes a text prompt, or a chat's rendered template, truncated on the
// left to k tokens (OpenAIServing._normalize_prompt_text_to_input:
// truncation=True, max_length=k; the tokenizer's truncation_side is "left"
// for generative models), the special tokens it adds counted in the k
// (Llama 3: <|begin_of_text|> and the text's last k − 1 tokens). The token
// source gives those ids, on the parsed path and the raw invoke one; -1
// (max_model_len, unknown here) is an error, so the request routes
// heuristically.
func TestTokenSourceTruncatePromptTokens(t *testing.T) {
	src, err := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceFiles, Path: filepath.Join("..", "..", "tokenizer", "testdata", "llama-3.1")}, config.PoolConfig{Model: "llama"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
	msgs := []map[string]string{{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}}
	// Both paths; a token-id prompt reaches the token source only on the
	// raw one (the router takes a parsed request's ids as they are).
	tokens := func(ep router.Endpoint, fields map[string]any) ([][]uint32, error) {
		t.Helper()
		body, _ := json.Marshal(fields)
		parsed, err := router.ParseOpenAI(ep, body)
		if err != nil {
			t.Fatal(err)
		}
		reqs := []*router.Request{{Endpoint: ep, Body: body, Parsed: parsed}, {Endpoint: router.EndpointInvoke, Body: body}}
		if parsed.Prompt != nil && len(parsed.Prompt.Tokens) > 0 {
			reqs = reqs[1:]
		}
		var out [][]uint32
		for _, req := range reqs {
			ids, err := src.Tokens(ctx, req)
			if err != nil {
				return nil, err
			}
			out = append(out, ids)
		}
		return out, nil
	}
	whole := func(ep router.Endpoint, fields map[string]any) []uint32 {
		t.Helper()
		got, err := tokens(ep, fields)
		if err != nil {
			t.Fatal(err)
		}
		return got[0]
	}
	const k = 8
	text1 := map[string]any{"model": "llama", "prompt": text}
	full := whole(router.EndpointCompletions, text1)
	plain := whole(router.EndpointCompletions, map[string]any{"model": "llama", "prompt": text, "add_special_tokens": false})
	chat := whole(router.EndpointChatCompletions, map[string]any{"model": "llama", "messages": msgs})
	if full[0] != 128000 || len(full) != len(plain)+1 || len(plain) <= k || len(chat) <= k {
		t.Fatalf("fixture: %d ids (first %d) with special tokens, %d without, chat %d", len(full), full[0], len(plain), len(chat))
	}
	tests := []struct {
		name   string
		ep     router.Endpoint
		fields map[string]any
		want   []uint32
	}{
		{"text", router.EndpointCompletions, map[string]any{"model": "llama", "prompt": text, "truncate_prompt_tokens": k},
			append([]uint32{128000}, plain[len(plain)-(k-1):]...)},
		{"text without special tokens", router.EndpointCompletions, map[string]any{"model": "llama", "prompt": text, "add_special_tokens": false, "truncate_prompt_tokens": k},
			plain[len(plain)-k:]},
		{"text shorter than k", router.EndpointCompletions, map[string]any{"model": "llama", "prompt": text, "truncate_prompt_tokens": 1000}, full},
		{"chat", router.EndpointChatCompletions, map[string]any{"model": "llama", "messages": msgs, "truncate_prompt_tokens": k}, chat[len(chat)-k:]},
		{"token ids", router.EndpointCompletions, map[string]any{"model": "llama", "prompt": []int{1, 2, 3, 4, 5}, "truncate_prompt_tokens": 2}, []uint32{4, 5}},
	}
	for _, tc := range tests {
		got, err := tokens(tc.ep, tc.fields)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		for i, ids := range got {
			if !slices.Equal(ids, tc.want) {
				t.Errorf("%s (path %d): ids %v, want vLLM's %v", tc.name, i, ids, tc.want)
			}
		}
	}
	for _, v := range []any{-1, 0, "8"} {
		for _, ep := range []router.Endpoint{router.EndpointCompletions, router.EndpointChatCompletions} {
			f := map[string]any{"model": "llama", "prompt": text, "truncate_prompt_tokens": v}
			if ep == router.EndpointChatCompletions {
				f = map[string]any{"model": "llama", "messages": msgs, "truncate_prompt_tokens": v}
			}
			if got, err := tokens(ep, f); !errors.Is(err, router.ErrTokenSource) {
				t.Errorf("truncate_prompt_tokens %v (endpoint %d): %d ids, err %v; want a token source error", v, ep, len(got), err)
			}
		}
	}
}

// TestTokenSourceTruncationSideRight: vLLM main's truncation_side "right"
// keeps the first truncate_prompt_tokens tokens (TokenizeParams.
// _token_truncation, vllm/renderers/params.py), not the last: the token
// source claims none (a token source error, heuristic routing) rather than
// the tail the engine does not prefill, on the parsed path and the raw one.
func TestTokenSourceTruncationSideRight(t *testing.T) {
	src, err := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceSimple}, config.PoolConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{
		`{"model":"m","prompt":"one two three four five six","truncate_prompt_tokens":2,"truncation_side":"right"}`,
		`{"model":"m","messages":[{"role":"user","content":"one two three four five six"}],"truncate_prompt_tokens":2,"truncation_side":"right"}`,
		`{"model":"m","prompt":[1,2,3,4,5],"truncate_prompt_tokens":2,"truncation_side":"right"}`,
	} {
		ep := router.EndpointCompletions
		if body[14] == 'm' {
			ep = router.EndpointChatCompletions
		}
		parsed, err := router.ParseOpenAI(ep, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		for i, req := range []*router.Request{{Endpoint: ep, Body: []byte(body), Parsed: parsed}, {Endpoint: router.EndpointInvoke, Body: []byte(body)}} {
			if ids, err := src.Tokens(context.Background(), req); !errors.Is(err, router.ErrTokenSource) {
				t.Errorf("%s (path %d): ids %v, err %v; want a token source error", body, i, ids, err)
			}
		}
	}
}
