package tokenizer

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"os"
	"slices"
	"testing"
)

// renderJSON renders a template over messages given as an OpenAI JSON array.
func renderJSON(t *testing.T, src, msgs string, opts RenderOptions) string {
	t.Helper()
	out, err := tryRender(t, src, msgs, opts)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryRender is renderJSON returning the render's error.
func tryRender(t *testing.T, src, msgs string, opts RenderOptions) (string, error) {
	t.Helper()
	var m []Message
	if err := json.Unmarshal([]byte(msgs), &m); err != nil {
		t.Fatal(err)
	}
	tmpl, err := NewJinjaTemplate(src, TemplateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return tmpl.Render(m, opts)
}

// TestToolCallsOnlyOnAssistant: vLLM's _parse_chat_message_content copies
// tool_calls to the conversation only for assistant messages.
func TestToolCallsOnlyOnAssistant(t *testing.T) {
	got := renderJSON(t, `{% for m in messages %}{{ m.role }}:{{ m.tool_calls is defined }};{% endfor %}`,
		`[{"role":"user","content":"a","tool_calls":[{"type":"function","function":{"name":"f","arguments":"{}"}}]},`+
			`{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":"{}"}}]}]`, RenderOptions{})
	if want := "user:False;assistant:True;"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestReasoningField: an assistant message's reasoning reaches the template
// as reasoning and reasoning_content (vLLM's _parse_chat_message_content),
// only on assistant messages, and the engine's /tokenize gets it too.
func TestReasoningField(t *testing.T) {
	got := renderJSON(t, `{% for m in messages %}{{ m.role }}:{{ m.reasoning }}/{{ m.reasoning_content }};{% endfor %}`,
		`[{"role":"user","content":"a","reasoning":"no"},{"role":"assistant","content":"b","reasoning":"r"},{"role":"assistant","content":"c","reasoning_content":"rc"}]`, RenderOptions{})
	if want := "user:/;assistant:r/r;assistant:rc/rc;"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	var m Message
	if err := json.Unmarshal([]byte(`{"role":"assistant","content":"b","reasoning":"r"}`), &m); err != nil {
		t.Fatal(err)
	}
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(out, &back); err != nil || back["reasoning"] != "r" {
		t.Errorf("marshalled for /tokenize as %s: reasoning lost", out)
	}
}

// TestTextLikeParts: text-like parts and bare strings are text parts, as
// vLLM's _parse_chat_message_content_part makes them, both for templates
// that take content as a string and for those that loop over its parts.
func TestTextLikeParts(t *testing.T) {
	const msgs = `[{"role":"user","content":[{"type":"input_text","text":"a"},"b",{"type":"text","text":null},{"type":"text","text":""},` +
		`{"type":"refusal","refusal":"c"},{"type":"image_url","image_url":{"url":"u"}},{"type":"thinking","thinking":"d"}]}]`
	if got, want := renderJSON(t, `{{ messages[0].content }}`, msgs, RenderOptions{}), "a\nb\nc\nd"; got != want {
		t.Errorf("string content %q, want %q", got, want)
	}
	got := renderJSON(t, `{% for p in messages[0].content %}{{ p.type }}={{ p.text }};{% endfor %}`, msgs, RenderOptions{})
	if want := "text=a;text=b;text=;text=c;image=;text=d;"; got != want {
		t.Errorf("parts %q, want %q", got, want)
	}
}

// TestNamedToolUseTemplate: with a list of named chat templates, vLLM
// renders through transformers' get_chat_template, which takes "tool_use"
// when the request has tools (tools is not None) and the file has one, and
// "default" otherwise.
func TestNamedToolUseTemplate(t *testing.T) {
	tj, err := os.ReadFile("testdata/sentencepiece/llama2/tokenizer.json")
	if err != nil {
		t.Fatal(err)
	}
	cfg := `{"chat_template":[{"name":"default","template":"DEFAULT {{ messages[0].content }}"},` +
		`{"name":"tool_use","template":"TOOLS {{ tools | tojson }} {{ messages[0].content }}"}]}`
	tok, err := NewHF(tj, []byte(cfg), HFConfig{})
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{Role: "user", Content: "hi"}}
	for _, c := range []struct {
		tools json.RawMessage
		want  string
	}{
		{nil, "DEFAULT hi"},
		{json.RawMessage(`null`), "DEFAULT hi"},
		{json.RawMessage(`[{"type":"function","function":{"name":"f"}}]`), `TOOLS [{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}] hi`},
	} {
		got, err := tok.Render(msgs, RenderOptions{Tools: c.tools})
		if err != nil || got != c.want {
			t.Errorf("tools %s: %q, %v; want %q", c.tools, got, err, c.want)
		}
	}
}

// TestChatAddSpecialTokensRemote: a chat's add_special_tokens goes to the
// engine's /tokenize, and the in-process tokenizers agree with it.
func TestChatAddSpecialTokensRemote(t *testing.T) {
	tok, err := LoadHF("testdata/sentencepiece/llama2", HFConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(&vllmTokenize{tok: tok})
	defer ts.Close()
	remote, _ := NewRemote(RemoteConfig{URL: ts.URL})
	msgs := []Message{{Role: "user", Content: "hello world"}}
	ctx := context.Background()
	plain, err := Local(tok).TokenizeChat(ctx, msgs, RenderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	opts := RenderOptions{AddSpecialTokens: true}
	want := append([]uint32{1}, plain...) // the llama2 post-processor's <s>
	for name, pt := range map[string]PromptTokenizer{"remote": remote, "local": Local(tok)} {
		if got, err := pt.TokenizeChat(ctx, msgs, opts); err != nil || !slices.Equal(got, want) {
			t.Errorf("%s: %v, %v; want %v", name, got, err, want)
		}
	}
	if got, _, err := EncodeChat(tok, msgs, opts); err != nil || !slices.Equal(got, want) {
		t.Errorf("EncodeChat: %v, %v; want %v", got, err, want)
	}
}

// TestBigIntegersKept: Python's json keeps integers of any size, so a
// tool schema's or arguments' 18446744073709551615 reaches tojson as that
// integer, not as the float 1.8446744073709552e+19.
func TestBigIntegersKept(t *testing.T) {
	const big = `{"maximum": 18446744073709551615, "minimum": -9223372036854775809, "small": 7, "float": 1e3}`
	got := renderJSON(t, `{{ tools[0].function.parameters | tojson }}|{{ messages[0].tool_calls[0].function.arguments | tojson }}`,
		`[{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":`+
			`"{\"n\": 123456789012345678901234567890}"}}]}]`,
		RenderOptions{Tools: json.RawMessage(`[{"type":"function","function":{"name":"f","parameters":` + big + `}}]`)})
	want := `{"maximum": 18446744073709551615, "minimum": -9223372036854775809, "small": 7, "float": 1000.0}|{"n": 123456789012345678901234567890}`
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}
