package tokenizer

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// FuzzEncode: no input panics or hangs; byte-level models round-trip through Decode
// (Qwen3 up to its NFC normalizer); cache on and off, and the two BPE merge loops, agree.
func FuzzEncode(f *testing.F) {
	f.Add("Hello, world! I'm here.")
	f.Add("<|begin_of_text|>x<|eot_id|><|im_start|>user\nhi<|im_end|><think>")
	f.Add("naïve café 😀👍🏽 中文 ｆｕｌｌ \u00a0\u0085\ufeff\r\n\t 12345")
	f.Add("e\u0301 A\u030a \xff\xfe")
	f.Add("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
	llama, qwen := loadModel(f, "llama-3.1"), loadModel(f, "qwen3")
	sp, err := LoadHF("testdata/sentencepiece/llama2", HFConfig{})
	if err != nil {
		f.Fatal(err)
	}
	uncached := map[*HF]*HF{}
	for _, tok := range []*HF{llama, qwen} {
		c := *tok
		c.cache, c.segs = nil, nil
		uncached[tok] = &c
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, tok := range []*HF{llama, qwen} {
			ids, err := tok.Encode(s)
			if err != nil {
				t.Fatal(err)
			}
			cold, _ := uncached[tok].Encode(s)
			if !slices.Equal(ids, cold) {
				t.Fatalf("cached %v != uncached %v for %q", ids, cold, s)
			}
			if !utf8.ValidString(s) {
				continue
			}
			back, err := tok.Decode(ids)
			if err != nil {
				t.Fatal(err)
			}
			want := s
			if tok == qwen {
				want = norm.NFC.String(s)
			}
			if back != want {
				t.Fatalf("Decode(Encode(%q)) = %q", s, back)
			}
		}
		if _, err := sp.Encode(s); err != nil {
			t.Fatal(err)
		}
	})
}

// FuzzMergeLoops: the heap merge loop used for long pieces gives the naive loop's result.
func FuzzMergeLoops(f *testing.F) {
	f.Add(" internationalization")
	f.Add("                                                                  ")
	f.Add("abababababababababababababababababababababababababababababababab")
	m := loadModel(f, "qwen3").model
	f.Fuzz(func(t *testing.T, s string) {
		if len(s) > 4096 {
			return
		}
		a := m.mergeNaive(m.initialSymbols(nil, s))
		b := m.mergeHeap(m.initialSymbols(nil, s), nil)
		if !slices.Equal(a, b) {
			t.Fatalf("%q: naive %v heap %v", s, a, b)
		}
	})
}

// FuzzNewHF: a corrupt tokenizer.json or tokenizer_config.json is an error, never a panic
// or a runaway allocation, and whatever loads can encode.
func FuzzNewHF(f *testing.F) {
	f.Add([]byte(`{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}}`), []byte(`{"chat_template":"{{ messages[0].content }}"}`))
	f.Add([]byte(`{"normalizer":{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},{"type":"Replace","pattern":{"String":" "},"content":"▁"}]},"pre_tokenizer":{"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":true},"added_tokens":[{"id":3,"content":"<s>","special":true}],"model":{"type":"BPE","vocab":{"a":0,"▁":1,"<unk>":2},"merges":[],"unk_token":"<unk>","fuse_unk":true}}`), []byte(`{}`))
	f.Add([]byte(`{"pre_tokenizer":{"type":"Split","pattern":{"Regex":"\\s+|\\w+"},"behavior":"Removed"},"model":{"type":"BPE","vocab":{"a":4294967295},"merges":[]}}`), []byte(`{"chat_template":[{"name":"default","template":"x"}]}`))
	f.Fuzz(func(t *testing.T, tj, tc []byte) {
		tok, err := NewHF(tj, tc, HFConfig{})
		if err != nil {
			return
		}
		if _, err := tok.Encode("a b <s> ab\n é"); err != nil {
			t.Fatal(err)
		}
		_, _ = tok.Render([]Message{{Role: "user", Content: "a"}}, RenderOptions{})
	})
}

// FuzzMessageJSON: any message JSON either fails with ErrBadMessage or round-trips
// through MarshalJSON to a message with the same content.
func FuzzMessageJSON(f *testing.F) {
	f.Add([]byte(`{"role":"user","content":"hi"}`))
	f.Add([]byte(`{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}`))
	f.Add([]byte(`{"role":"assistant","content":null,"tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]}`))
	f.Add([]byte(`{"role":"assistant","content":"a","reasoning":"","name":""}`))
	f.Add([]byte(`{"role":"tool","content":[{"type":"text","text":"a","x":1},{"type":"text","text":""},"b"]}`))
	f.Add([]byte(`{"role":"user","content":[{"type":"video_url","video_url":{"url":"u"},"z":1,"a":2},{"image_url":"u","uuid":"i"},{"type":"tool_reference","name":"n"},{"type":"file","file":{}}]}`))
	f.Add([]byte(`{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"custom","custom":{"name":"f","input":"x"}}]}`))
	f.Add([]byte(`{"role":"tool","content":[{"type":"text","text":"a"},{"type":"tool_reference","name":"f"},{"type":"text","text":" b\u001f"}]}`))
	f.Add([]byte(`{"role":"assistant","content":" x\u001c "}`))
	str, err := NewJinjaTemplate(`{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}`, TemplateConfig{})
	if err != nil {
		f.Fatal(err)
	}
	parts, err := NewJinjaTemplate(`{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endif %}{{ m.reasoning }}{% endfor %}`, TemplateConfig{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Message
		if err := json.Unmarshal(b, &m); err != nil {
			return
		}
		out, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("marshal %+v: %v", m, err)
		}
		var back Message
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("re-read %s: %v", out, err)
		}
		if back.Role != m.Role || back.Content != m.Content || back.ContentNull != m.ContentNull || len(back.Parts) != len(m.Parts) ||
			back.ReasoningSet != m.ReasoningSet || back.Reasoning != m.Reasoning || back.NameSet != m.NameSet || back.Name != m.Name {
			t.Fatalf("round trip %s -> %s changed the message", b, out)
		}
		// A parts or string template renders it as vLLM would, or refuses it as vLLM
		// does; continued (continue_final_message), the render is the whole one cut
		// after a text, so a prefix of it.
		for _, tmpl := range []*JinjaTemplate{parts, str} {
			whole, err := tmpl.Render([]Message{m}, RenderOptions{})
			if err != nil {
				if !errors.Is(err, ErrBadMessage) && !errors.Is(err, ErrTemplate) {
					t.Fatalf("render %s: %v", b, err)
				}
				continue
			}
			cut, err := tmpl.Render([]Message{m}, RenderOptions{ContinueFinalMessage: true})
			if err != nil && !errors.Is(err, ErrTemplate) {
				t.Fatalf("render %s continued: %v", b, err)
			}
			if err == nil && !strings.HasPrefix(whole, cut) {
				t.Fatalf("render %s continued: %q is not a prefix of %q", b, cut, whole)
			}
		}
	})
}
