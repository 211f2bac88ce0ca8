package tokenizer

import (
	"encoding/json"
	"errors"
	"testing"
)

// partsTmpl loops over content (vLLM's "openai" content format) and prints
// each message's content as a string (S:...) or its parts as JSON.
const partsTmpl = `{% for m in messages %}{{ m.role }}={% if m.content is string %}S:{{ m.content }}{% else %}{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endif %};{% endfor %}`

// TestToolsNoneOrEmptyAsVLLM: vLLM passes tools=None when the request has
// none and [tool.model_dump() ...] (so [] for "tools": []) otherwise
// (serving_engine _preprocess_chat: tool_dicts), and transformers'
// render_jinja_template always renders with tools=... and documents=..., so
// both are defined: none, or the list as sent.
func TestToolsNoneOrEmptyAsVLLM(t *testing.T) {
	const src = `{{ tools is defined }}/{{ tools is none }}/{% if tools is not none %}{{ tools | length }}{% endif %}|{{ documents is defined }}/{{ documents is none }}`
	for _, tt := range []struct {
		name string
		opts RenderOptions
		want string
	}{
		{"absent", RenderOptions{}, "True/True/|True/True"},
		{"null", RenderOptions{Tools: json.RawMessage(`null`)}, "True/True/|True/True"},
		{"empty", RenderOptions{Tools: json.RawMessage(`[]`)}, "True/False/0|True/True"},
	} {
		if got := renderJSON(t, src, `[{"role":"user","content":"a"}]`, tt.opts); got != tt.want {
			t.Errorf("%s: got %q, want %q", tt.name, got, tt.want)
		}
	}
}

// TestEmptyReasoningKept: vLLM's _parse_chat_message_content sets reasoning
// and reasoning_content from message.get("reasoning") when it `is not None`,
// so an empty reasoning is given to the template (as ""), and it wins over
// reasoning_content; null is absent.
func TestEmptyReasoningKept(t *testing.T) {
	const src = `{% for m in messages %}{{ m.reasoning is defined }}:{{ m.reasoning_content }};{% endfor %}`
	got := renderJSON(t, src, `[{"role":"assistant","content":"a","reasoning":""},{"role":"assistant","content":"b","reasoning":"","reasoning_content":"rc"},`+
		`{"role":"assistant","content":"c","reasoning":null},{"role":"assistant","content":"d","reasoning":null,"reasoning_content":"rc"}]`, RenderOptions{})
	if want := "True:;True:;False:;True:rc;"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	var m Message
	if err := json.Unmarshal([]byte(`{"role":"assistant","content":"b","reasoning":""}`), &m); err != nil {
		t.Fatal(err)
	}
	out, _ := json.Marshal(m)
	var back map[string]any
	if err := json.Unmarshal(out, &back); err != nil {
		t.Fatal(err)
	}
	if r, ok := back["reasoning"]; !ok || r != "" {
		t.Errorf("marshalled for /tokenize as %s: empty reasoning lost", out)
	}
}

// TestMediaPartsAsPlaceholders: in the "openai" content format vLLM gives
// a template {"type": <modality>} for a media part (plus the part's keys no
// content-part type declares), not the part as sent
// (_parse_chat_message_content_part, wrap_dicts).
func TestMediaPartsAsPlaceholders(t *testing.T) {
	got := renderJSON(t, partsTmpl, `[{"role":"user","content":[{"type":"text","text":"a"},`+
		`{"type":"image_url","image_url":{"url":"u"}},{"type":"input_image","image_url":"u"},{"type":"image_embeds","image_embeds":"e"},`+
		`{"type":"input_audio","input_audio":{"data":"d","format":"wav"}},{"type":"audio_url","audio_url":{"url":"u"}},`+
		`{"type":"video_url","video_url":{"url":"u"},"cache_control":{"type":"ephemeral"}},{"image_url":{"url":"u"}}]}]`, RenderOptions{})
	want := `user={"type": "text", "text": "a"}{"type": "image"}{"type": "image"}{"type": "image"}{"type": "audio"}{"type": "audio"}` +
		`{"type": "video", "cache_control": {"type": "ephemeral"}}{"type": "image"};`
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}

// TestToolMessageFlattened: vLLM turns a tool message's content into one
// string when every part is text ("\n".join of the texts, empty ones
// included; "" for none), also in the "openai" content format
// (_parse_chat_message_content, role "tool"); with a media part it stays a
// list.
func TestToolMessageFlattened(t *testing.T) {
	got := renderJSON(t, partsTmpl, `[{"role":"tool","tool_call_id":"1","content":[{"type":"text","text":"a"},{"type":"text","text":""},"b"]},`+
		`{"role":"tool","content":"x"},{"role":"tool","content":null},{"role":"tool","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}]`, RenderOptions{})
	want := "tool=S:a\n\nb;tool=S:x;tool=S:;tool=" + `{"type": "text", "text": "a"}{"type": "image"};`
	if got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}

// TestNullContentAsVLLM: vLLM reads a null or absent content as no parts
// (_parse_chat_message_content: content = []), so a string template gets
// "" and a parts template an empty list, never None (which Jinja prints as
// "None").
func TestNullContentAsVLLM(t *testing.T) {
	const msgs = `[{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"assistant"}]`
	if got, want := renderJSON(t, `{% for m in messages %}{{ m.content is none }}[{{ m.content }}];{% endfor %}`, msgs, RenderOptions{}), "False[];False[];"; got != want {
		t.Errorf("string format: got %q, want %q", got, want)
	}
	if got, want := renderJSON(t, partsTmpl, msgs, RenderOptions{}), "assistant=;assistant=;"; got != want {
		t.Errorf("openai format: got %q, want %q", got, want)
	}
}

// TestNonFunctionToolCallRefused: vLLM validates an assistant's tool_calls
// as ChatCompletionMessageFunctionToolCallParam (type Literal["function"])
// and fails others (a "custom" call has no "function" for
// _postprocess_messages), so the request is refused rather than rendered.
func TestNonFunctionToolCallRefused(t *testing.T) {
	var m []Message
	if err := json.Unmarshal([]byte(`[{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"custom","custom":{"name":"f","input":"x"},"function":{"name":"f"}}]}]`), &m); err != nil {
		t.Fatal(err)
	}
	tmpl, err := NewJinjaTemplate(`{% for m in messages %}{{ m.tool_calls | length }}{% endfor %}`, TemplateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := tmpl.Render(m, RenderOptions{}); !errors.Is(err, ErrBadMessage) {
		t.Errorf("rendered %q, %v; want ErrBadMessage", out, err)
	}
}

// TestUnknownPartRefused: vLLM answers 400 for a content part type it does
// not parse ("Unsupported chat content part type"), whatever the template's
// content format.
func TestUnknownPartRefused(t *testing.T) {
	var m []Message
	if err := json.Unmarshal([]byte(`[{"role":"user","content":[{"type":"text","text":"a"},{"type":"file","file":{"file_id":"f"}}]}]`), &m); err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{`{{ messages[0].content }}`, partsTmpl} {
		tmpl, err := NewJinjaTemplate(src, TemplateConfig{})
		if err != nil {
			t.Fatal(err)
		}
		if out, err := tmpl.Render(m, RenderOptions{}); !errors.Is(err, ErrBadMessage) {
			t.Errorf("%s: rendered %q, %v; want ErrBadMessage", src, out, err)
		}
	}
}

// TestContinueFinalMessage: the render is cut after the last occurrence of
// the final message's stripped text (its last text part in the parts
// format), as transformers' apply_chat_template does; no such text fails.
func TestContinueFinalMessage(t *testing.T) {
	const str = `{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}`
	const parts = `{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}{% endfor %}</{{ m.role }}>{% endfor %}`
	for _, tt := range []struct{ src, msgs, want string }{
		{str, `[{"role":"user","content":"a"},{"role":"assistant","content":" hi "}]`, "<user>a</user><assistant> hi"},
		{parts, `[{"role":"assistant","content":[{"type":"text","text":"x"},{"type":"text","text":"y"},{"type":"image_url","image_url":{"url":"u"}}]}]`, "<assistant>xy"},
		{parts, `[{"role":"assistant","content":[{"type":"image_url","image_url":{"url":"u"}}]}]`, ""},
	} {
		got, err := tryRender(t, tt.src, tt.msgs, RenderOptions{ContinueFinalMessage: true})
		if tt.want == "" {
			if !errors.Is(err, ErrTemplate) {
				t.Errorf("%s: rendered %q, %v; want ErrTemplate", tt.msgs, got, err)
			}
		} else if err != nil || got != tt.want {
			t.Errorf("%s: rendered %q, %v; want %q", tt.msgs, got, err, tt.want)
		}
	}
}

// TestEmptyNameKept: vLLM copies a message's name whenever it is a string
// (_parse_chat_message_content: isinstance(message["name"], str)), "" too.
func TestEmptyNameKept(t *testing.T) {
	got := renderJSON(t, `{% for m in messages %}{{ m.name is defined }};{% endfor %}`,
		`[{"role":"user","content":"a","name":""},{"role":"user","content":"b"},{"role":"user","content":"c","name":null}]`, RenderOptions{})
	if want := "True;False;False;"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}
