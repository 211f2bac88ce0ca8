package tokenizer

import (
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
)

// models are the real tokenizer files in testdata (see testdata/README.md).
var models = []string{"llama-3.1", "qwen3"}

type vector struct {
	Text                *string   `json:"text"`
	Messages            []Message `json:"messages"`
	AddGenerationPrompt bool      `json:"add_generation_prompt"`
	Rendered            string    `json:"rendered"`
	IDs                 []uint32  `json:"ids"`
}

var (
	loadOnce sync.Mutex // guards loaded
	loaded   = map[string]*HF{}
)

// loadModel loads (once per test binary) a model from testdata; loading takes ~1 s.
func loadModel(t testing.TB, name string) *HF {
	t.Helper()
	loadOnce.Lock()
	defer loadOnce.Unlock()
	if tok, ok := loaded[name]; ok {
		return tok
	}
	tok, err := LoadHF("testdata/"+name, HFConfig{})
	if err != nil {
		t.Fatalf("load %s: %v", name, err)
	}
	loaded[name] = tok
	return tok
}

// TestReferenceVectors is the bar: every line of both vectors.jsonl files (computed by
// Hugging Face's own implementations) must agree exactly, with the cache cold and warm.
func TestReferenceVectors(t *testing.T) {
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			tok := loadModel(t, name)
			vecs := readVectors[vector](t, "testdata/"+name+"/vectors.jsonl", 100)
			texts, chats := 0, 0
			for pass := range 2 { // pass 1 runs on a warm cache
				for i, v := range vecs {
					label := fmt.Sprintf("pass %d line %d", pass, i+1)
					if v.Text != nil {
						texts++
						got, err := tok.Encode(*v.Text)
						if err != nil || !slices.Equal(got, v.IDs) {
							t.Errorf("%s: Encode(%q)\n got %v %v\nwant %v", label, *v.Text, got, err, v.IDs)
						}
						continue
					}
					chats++
					checkChat(t, label, tok, v.Messages, RenderOptions{AddGenerationPrompt: v.AddGenerationPrompt}, v.Rendered, v.IDs)
				}
			}
			if texts == 0 || chats == 0 {
				t.Fatalf("texts=%d chats=%d: both kinds must be present", texts, chats)
			}
		})
	}
}

// checkChat renders and encodes msgs with tok as a chat and reports, under
// label, where the prompt text or its ids differ from the reference's.
func checkChat(t *testing.T, label string, tok ChatTokenizer, msgs []Message, opts RenderOptions, rendered string, ids []uint32) {
	t.Helper()
	gotIDs, got, err := EncodeChat(tok, msgs, opts)
	if err != nil {
		t.Errorf("%s: %v", label, err)
		return
	}
	if got != rendered {
		t.Errorf("%s: rendered\n got %q\nwant %q", label, got, rendered)
	}
	if !slices.Equal(gotIDs, ids) {
		t.Errorf("%s: ids of the rendered chat\n got %v\nwant %v", label, gotIDs, ids)
	}
}

func TestMessageJSON(t *testing.T) {
	tests := []struct {
		in      string
		content string
		parts   int
		null    bool
		out     string
	}{
		{`{"role":"user","content":"hi"}`, "hi", 0, false, `{"role":"user","content":"hi"}`},
		{`{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]}`, "", 0, true,
			`{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}],"content":null}`},
		{`{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}`, "a\nb", 3, false,
			`{"role":"user","content":[{"text":"a","type":"text"},{"image_url":{"url":"x"},"type":"image_url"},{"text":"b","type":"text"}]}`},
		{`{"role":"user"}`, "", 0, true, `{"role":"user","content":null}`},
	}
	for _, tt := range tests {
		var m Message
		if err := json.Unmarshal([]byte(tt.in), &m); err != nil {
			t.Fatalf("%s: %v", tt.in, err)
		}
		if m.Content != tt.content || len(m.Parts) != tt.parts || m.ContentNull != tt.null {
			t.Errorf("%s: got content %q parts %d null %v", tt.in, m.Content, len(m.Parts), m.ContentNull)
		}
		out, err := json.Marshal(m)
		if err != nil || string(out) != tt.out {
			t.Errorf("%s: marshal = %s, %v; want %s", tt.in, out, err, tt.out)
		}
	}
	for _, bad := range []string{`{"role":"user","content":5}`, `{"role":"user","content":[1]}`, `[]`} {
		var m Message
		if err := json.Unmarshal([]byte(bad), &m); err == nil {
			t.Errorf("%s: no error", bad)
		}
	}
}
