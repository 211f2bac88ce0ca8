package kvaware

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// llamaToolsTemplate is the tools logic of Meta's Llama 3.1 tool template
// (meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json, restated
// here, not copied): tools default to none when undefined, and any tools
// that are not none, even [], switch the system turn to tool calling.
const llamaToolsTemplate = `{{- bos_token }}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}` +
	`{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}` +
	`{{- "Cutting Knowledge Date: December 2023\n" }}{%- if documents is not none %}{%- for d in documents %}{{- d.title + ": " + d.text + "\n" }}{%- endfor %}{%- endif %}<|eot_id|>` +
	`{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}` +
	`{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}`

// llamaTemplateSource is a files token source on the Llama 3.1 test
// tokenizer rendering with template (vLLM's --chat-template).
func llamaTemplateSource(t *testing.T, template string) (*ChatTokenSource, *tokenizer.HF) {
	t.Helper()
	hf, err := tokenizer.LoadHF("../../tokenizer/testdata/llama-3.1", tokenizer.HFConfig{ChatTemplate: template})
	if err != nil {
		t.Fatal(err)
	}
	return &ChatTokenSource{Tokenizer: tokenizer.Local(hf)}, hf
}

// renderedBy is the text src encodes for a chat body (its ids decoded: the
// Llama 3.1 tokenizer round-trips), through the parsed request as the
// router has it.
func renderedBy(t *testing.T, src *ChatTokenSource, hf *tokenizer.HF, body string) string {
	t.Helper()
	parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	ids, err := src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(body), Parsed: parsed})
	if err != nil {
		t.Fatalf("tokens: %v", err)
	}
	text, err := hf.Decode(ids)
	if err != nil {
		t.Fatal(err)
	}
	return text
}

// TestChatEmptyToolsAsVLLM: "tools": [] reaches the template as [] in vLLM
// (tool_dicts), which is not none, so a Llama-3.1-style template writes
// its tool-calling system line; with no tools, tools is none and it does
// not.
func TestChatEmptyToolsAsVLLM(t *testing.T) {
	src, hf := llamaTemplateSource(t, llamaToolsTemplate)
	const msgs = `{"model":"m","messages":[{"role":"user","content":"Hi"}]`
	if got := renderedBy(t, src, hf, msgs+`,"tools":[]}`); !strings.Contains(got, "Environment: ipython") {
		t.Errorf(`"tools": [] rendered without the tool line:\n%s`, got)
	}
	if got := renderedBy(t, src, hf, msgs+`}`); strings.Contains(got, "Environment: ipython") {
		t.Errorf("no tools rendered with the tool line:\n%s", got)
	}
}

// TestChatDocumentsAsVLLM: vLLM passes the request's documents to the
// template (documents=request.documents), none when absent.
func TestChatDocumentsAsVLLM(t *testing.T) {
	src, hf := llamaTemplateSource(t, llamaToolsTemplate)
	const msgs = `{"model":"m","messages":[{"role":"user","content":"Hi"}]`
	if got := renderedBy(t, src, hf, msgs+`,"documents":[{"title":"Paris","text":"Capital of France."}]}`); !strings.Contains(got, "Paris: Capital of France.\n") {
		t.Errorf("documents not rendered:\n%s", got)
	}
	if got := renderedBy(t, src, hf, msgs+`,"documents":null}`); strings.Contains(got, "Paris") {
		t.Errorf("null documents rendered:\n%s", got)
	}
}

// TestChatRefusedAsVLLM: a chat vLLM answers 400 for (a tool call that is
// not a function call) gets no tokens from the router either: an error, as
// for any body the source cannot tokenize, so kv_aware routes it
// heuristically.
func TestChatRefusedAsVLLM(t *testing.T) {
	body := `{"model":"m","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"custom","custom":{"name":"f","input":"x"},"function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}]}`
	parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	ids, err := filesSource(t, "qwen3").Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(body), Parsed: parsed})
	if err == nil || !errors.Is(err, tokenizer.ErrBadMessage) {
		t.Fatalf("got %d ids, err %v; want ErrBadMessage", len(ids), err)
	}
}

// qwenDecode is the text of Qwen3 test-tokenizer ids (it round-trips).
func qwenDecode(t *testing.T, ids []uint32) string {
	t.Helper()
	hf, err := tokenizer.LoadHF("../../tokenizer/testdata/qwen3", tokenizer.HFConfig{})
	if err != nil {
		t.Fatal(err)
	}
	text, err := hf.Decode(ids)
	if err != nil {
		t.Fatal(err)
	}
	return text
}

// TestChatEmptyReasoningAsVLLM: vLLM gives Qwen3's template
// reasoning_content = "" for an assistant turn with "reasoning": "" (it
// `is not None`), so the template keeps the content whole rather than
// splitting a <think> block out of it.
func TestChatEmptyReasoningAsVLLM(t *testing.T) {
	body := `{"model":"m","add_generation_prompt":false,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","reasoning":"","content":"<think>x</think>y"}]}`
	ids := chatTokens(t, "qwen3", router.EndpointChatCompletions, body)
	got := qwenDecode(t, ids)
	if want := "<think>\n\n</think>\n\n<think>x</think>y"; !strings.Contains(got, want) {
		t.Errorf("rendered %q, want it to contain %q", got, want)
	}
}

// TestChatContinueFinalMessageAsVLLM: with continue_final_message vLLM's
// prompt ends where the final message's text does (transformers'
// apply_chat_template cuts the render after the last occurrence of the
// stripped final text), so Qwen3's <|im_end|> after it is not prefilled;
// add_generation_prompt sent true as well is a 400 (vLLM's
// ChatCompletionRequest validator), which the router refuses too.
func TestChatContinueFinalMessageAsVLLM(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello, wor"}]`
	ids := chatTokens(t, "qwen3", router.EndpointChatCompletions, `{"model":"m","continue_final_message":true,"add_generation_prompt":false,`+msgs+`}`)
	got := qwenDecode(t, ids)
	if want := "<|im_start|>assistant\n<think>\n\n</think>\n\nHello, wor"; !strings.HasSuffix(got, want) {
		t.Errorf("rendered %q, want it to end with %q", got, want)
	}
	same := chatTokens(t, "qwen3", router.EndpointChatCompletions, `{"model":"m","continue_final_message":true,`+msgs+`}`)
	if !slices.Equal(ids, same) {
		t.Errorf("add_generation_prompt absent: %d ids, want the %d of false", len(same), len(ids))
	}
	body := `{"model":"m","continue_final_message":true,"add_generation_prompt":true,` + msgs + `}`
	parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := filesSource(t, "qwen3").Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(body), Parsed: parsed}); !errors.Is(err, router.ErrTokenSource) {
		t.Errorf("both true: %d ids, %v; want ErrTokenSource", len(ids), err)
	}
}

// TestChatEmptyNameAsVLLM: an empty name reaches the template (vLLM keeps
// any string name) through the parsed path and the general one alike.
func TestChatEmptyNameAsVLLM(t *testing.T) {
	src, hf := llamaTemplateSource(t, `{% for m in messages %}{{ m.role }}{% if m.name is defined %}[{{ m.name }}]{% endif %}: {{ m.content }}{% endfor %}`)
	for _, body := range []string{
		`{"model":"m","messages":[{"role":"user","content":"Hi","name":""}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}],"name":""}]}`,
	} {
		if got := renderedBy(t, src, hf, body); got != "user[]: Hi" {
			t.Errorf("%s rendered %q, want %q", body, got, "user[]: Hi")
		}
	}
}

// TestChatDeveloperToolsAsVLLM: a developer message's own tools reach the
// template (vLLM: result_msg["tools"], None when absent), through the
// parsed path and the general one alike.
func TestChatDeveloperToolsAsVLLM(t *testing.T) {
	src, hf := llamaTemplateSource(t, `{% for m in messages %}{{ m.role }}{% if m.tools is defined %}[{% if m.tools is none %}none{% else %}{% for x in m.tools %}{{ x.function.name }}{% endfor %}{% endif %}]{% endif %}: {{ m.content }}{% endfor %}`)
	for body, want := range map[string]string{
		`{"model":"m","messages":[{"role":"developer","content":"Hi"}]}`:                                                                                "developer[none]: Hi",
		`{"model":"m","messages":[{"role":"developer","content":"Hi","tools":[{"type":"function","function":{"name":"f"}}]}]}`:                          "developer[f]: Hi",
		`{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"Hi"}],"tools":[{"type":"function","function":{"name":"g"}}]}]}`: "developer[g]: Hi",
		`{"model":"m","messages":[{"role":"user","content":"Hi","tools":[{"type":"function","function":{"name":"f"}}]}]}`:                               "user: Hi",
	} {
		if got := renderedBy(t, src, hf, body); got != want {
			t.Errorf("%s rendered %q, want %q", body, got, want)
		}
	}
}
