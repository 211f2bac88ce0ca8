package tokenizer

import (
	"encoding/json"
	"errors"
	"testing"
)

// TestRequestFieldsWinOverKwargsAsVLLM: vLLM main builds the template
// kwargs as merge_kwargs(request.chat_template_kwargs, {add_generation_prompt,
// continue_final_message, documents, reasoning_effort}) — the request's own
// fields win, a None one (documents absent) leaving the kwarg
// (ChatCompletionRequest.build_chat_params,
// vllm/entrypoints/openai/chat_completion/protocol.py @ 002032ee;
// merge_kwargs in vllm/renderers/params.py) — and only then adds tools and
// the server's defaults under them (with_defaults), while transformers lets
// the kwargs win over bos_token/eos_token.
func TestRequestFieldsWinOverKwargsAsVLLM(t *testing.T) {
	j, err := NewJinjaTemplate(`{{ add_generation_prompt }}|{{ bos_token }}|{{ tools | tojson }}|{{ documents | tojson }}`, TemplateConfig{BOSToken: "<s>"})
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]any{"add_generation_prompt": false, "bos_token": "B", "tools": []any{"t"}, "documents": []any{"kd"}}
	for _, tt := range []struct {
		name string
		opts RenderOptions
		want string
	}{
		{"request add_generation_prompt true, documents absent", RenderOptions{AddGenerationPrompt: true, Vars: vars}, `True|B|["t"]|["kd"]`},
		{"request documents sent", RenderOptions{AddGenerationPrompt: true, Documents: json.RawMessage(`["rd"]`), Vars: vars}, `True|B|["t"]|["rd"]`},
		{"request documents null", RenderOptions{Documents: json.RawMessage(`null`), Vars: map[string]any{"add_generation_prompt": true, "documents": []any{"kd"}}}, `False|<s>|null|["kd"]`},
	} {
		got, err := j.Render(nil, tt.opts)
		if err != nil || got != tt.want {
			t.Errorf("%s: got %q, %v; want %q", tt.name, got, err, tt.want)
		}
	}
	for _, k := range []string{"messages", "chat_template", "tokenize"} {
		if out, err := j.Render(nil, RenderOptions{Vars: map[string]any{k: "x"}}); !errors.Is(err, ErrBadMessage) {
			t.Errorf("chat_template_kwargs %q: rendered %q, %v; want ErrBadMessage", k, out, err)
		}
	}
}

// TestToolReferenceInStringContent: in the "string" content format vLLM
// joins a tool_reference part's name with the texts, as a text of its own
// (_parse_chat_message_content_part returns the name when not wrapping
// dicts, and _parse_chat_message_content_parts joins the truthy results
// with "\n"; vllm/renderers/chat_utils/parse_chat_message_content.py @
// be90fe16); the parts format keeps it {"type": "tool_reference", "name"}.
func TestToolReferenceInStringContent(t *testing.T) {
	const msgs = `[{"role":"tool","tool_call_id":"c","content":[{"type":"text","text":"found"},{"type":"tool_reference","name":"get_weather"},{"type":"tool_reference"}]}]`
	if got, want := renderJSON(t, `{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}`, msgs, RenderOptions{}), "tool=found\nget_weather;"; got != want {
		t.Errorf("string format: got %q, want %q", got, want)
	}
	if got, want := renderJSON(t, partsTmpl, msgs, RenderOptions{}), `tool={"type": "text", "text": "found"}{"type": "tool_reference", "name": "get_weather"}{"type": "tool_reference", "name": null};`; got != want {
		t.Errorf("parts format: got %s, want %s", got, want)
	}
}

// TestContinueFinalMessageSeesTemplateContent: transformers cuts the render
// after chat[-1]["content"] as vLLM hands it to the template — for a tool
// message in the parts format the texts joined with "\n", empty ones
// included (or, with a non-text part, the list, whose last part with a
// "text" key counts) — stripped as Python's str.strip does, which also
// strips \x1c-\x1f (tokenization_utils_base apply_chat_template,
// continue_final_message).
func TestContinueFinalMessageSeesTemplateContent(t *testing.T) {
	const str = `{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}`
	const parts = `{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}</{{ m.role }}>{% endfor %}`
	for _, tt := range []struct{ src, msgs, want string }{
		{parts, `[{"role":"tool","content":[{"type":"text","text":"a"},{"type":"text","text":""},{"type":"text","text":"b"}]}]`, "<tool>a\n\nb"},
		{parts, `[{"role":"tool","content":[{"type":"text","text":"a"},{"type":"text","text":"b"},{"type":"tool_reference","name":"f"}]}]`, "<tool>[a][b"},
		{str, "[{\"role\":\"assistant\",\"content\":\"Hello\\u001f\"}]", "<assistant>Hello"},
	} {
		if got, err := tryRender(t, tt.src, tt.msgs, RenderOptions{ContinueFinalMessage: true}); err != nil || got != tt.want {
			t.Errorf("%s: rendered %q, %v; want %q", tt.msgs, got, err, tt.want)
		}
	}
}
