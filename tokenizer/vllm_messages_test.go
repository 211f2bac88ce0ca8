package tokenizer

import (
	"encoding/json"
	"testing"
)

// renderJSON renders a template over messages given as an OpenAI JSON array.
func renderJSON(t *testing.T, src, msgs string, opts RenderOptions) string {
	t.Helper()
	var m []Message
	if err := json.Unmarshal([]byte(msgs), &m); err != nil {
		t.Fatal(err)
	}
	tmpl, err := NewJinjaTemplate(src, TemplateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	out, err := tmpl.Render(m, opts)
	if err != nil {
		t.Fatal(err)
	}
	return out
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
