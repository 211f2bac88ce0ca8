package tokenizer

import (
	"encoding/json"
	"errors"
	"testing"
)

// vLLM gives every developer message a tools key: the message's tools, or
// None when it has none (vllm/entrypoints/chat_utils.py @ 001eadcf,
// _parse_chat_message_content: result_msg["tools"] = message.get("tools",
// None) for role "developer"), each tool as its TypedDict validates it
// (ChatCompletionFunctionToolParam: function{name, description, parameters,
// strict}, then type; present keys only, others dropped). Other roles get
// no tools key.
func TestDeveloperToolsAsVLLM(t *testing.T) {
	j, err := NewJinjaTemplate(`{% for m in messages %}{{ m.role }}:{{ m.tools is defined }}:{{ m.tools | tojson }};{% endfor %}`, TemplateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct{ name, msgs, want string }{
		{"developer without tools", `[{"role":"developer","content":"be brief"}]`, `developer:True:null;`},
		{"developer with null tools", `[{"role":"developer","content":"be brief","tools":null}]`, `developer:True:null;`},
		{"developer with tools", `[{"role":"developer","content":"x","tools":[{"type":"function","x":1,"function":{"parameters":{"b":1,"a":2},"name":"f","extra":true}}]}]`,
			`developer:True:[{"function": {"name": "f", "parameters": {"b": 1, "a": 2}}, "type": "function"}];`},
		{"developer with empty tools", `[{"role":"developer","content":"x","tools":[]}]`, `developer:True:[];`},
		// A tool the function-tool TypedDict refuses: the message validates
		// as OpenAI's developer message instead, which has no tools.
		{"developer with a bad tool", `[{"role":"developer","content":"x","tools":[{"type":"custom","custom":{}}]}]`, `developer:True:null;`},
		{"developer, tools not a list", `[{"role":"developer","content":"x","tools":{"a":1}}]`, `developer:True:null;`},
		{"user with tools", `[{"role":"user","content":"hi","tools":[{"type":"function","function":{"name":"f"}}]}]`, `user:False:null;`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var msgs []Message
			if err := json.Unmarshal([]byte(tc.msgs), &msgs); err != nil {
				t.Fatal(err)
			}
			got, err := j.Render(msgs, RenderOptions{})
			if err != nil || got != tc.want {
				t.Fatalf("rendered %q %v, want %q", got, err, tc.want)
			}
		})
	}
}

// A developer message with no content and tools the TypedDict refuses
// validates as no message type: vLLM answers 400.
func TestDeveloperBadToolsNoContentRefused(t *testing.T) {
	j, err := NewJinjaTemplate(`{% for m in messages %}{{ m.role }}{% endfor %}`, TemplateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []Message
	if err := json.Unmarshal([]byte(`[{"role":"developer","tools":[{"type":"function","function":{"name":1}}]}]`), &msgs); err != nil {
		t.Fatal(err)
	}
	if _, err := j.Render(msgs, RenderOptions{}); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("rendered, err %v; want ErrBadMessage", err)
	}
}
