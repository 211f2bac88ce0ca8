package tokenizer

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestOpen(t *testing.T) {
	tmpl := filepath.Join(t.TempDir(), "t.jinja")
	os.WriteFile(tmpl, []byte("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"), 0o644)
	ctx := context.Background()
	msgs := []Message{{Role: "user", Content: "hi"}}
	tests := []struct {
		name    string
		cfg     Config
		wantNil bool
		err     error
		chat    []uint32 // expected ids of msgs, when non-nil
	}{
		{name: "zero value is none", cfg: Config{}, wantNil: true},
		{name: "none", cfg: Config{Source: "none"}, wantNil: true},
		{name: "simple", cfg: Config{Source: "simple"}, chat: func() []uint32 { ids, _, _ := EncodeChat(Simple{}, msgs, RenderOptions{}); return ids }()},
		{name: "hf with template override", cfg: Config{Source: "HF", ModelDir: "testdata/sentencepiece/metaspace", ChatTemplateFile: tmpl},
			chat: func() []uint32 {
				tok, _ := LoadHF("testdata/sentencepiece/metaspace", HFConfig{})
				ids, _ := tok.Encode("[user]hi")
				return ids
			}()},
		{name: "hf without dir", cfg: Config{Source: "hf"}, err: ErrConfig},
		{name: "hf missing template file", cfg: Config{Source: "hf", ModelDir: "testdata/qwen3", ChatTemplateFile: "/nonexistent"}, err: ErrConfig},
		{name: "hf unsupported model", cfg: Config{Source: "hf", ModelDir: t.TempDir()}, err: os.ErrNotExist},
		{name: "remote without URL", cfg: Config{Source: "remote"}, err: ErrConfig},
		{name: "remote", cfg: Config{Source: "remote", URL: "http://127.0.0.1:1"}},
		{name: "unknown", cfg: Config{Source: "sentencepiece"}, err: ErrConfig},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Open(tt.cfg)
			if tt.err != nil {
				if !errors.Is(err, tt.err) {
					t.Fatalf("err = %v, want %v", err, tt.err)
				}
				return
			}
			if err != nil || (p == nil) != tt.wantNil {
				t.Fatalf("Open = %v, %v", p, err)
			}
			if tt.chat != nil {
				got, err := p.TokenizeChat(ctx, msgs, RenderOptions{})
				if err != nil || !slices.Equal(got, tt.chat) {
					t.Fatalf("TokenizeChat = %v, %v; want %v", got, err, tt.chat)
				}
			}
		})
	}
}

func TestLoadErrors(t *testing.T) {
	bad := []struct {
		name, json string
		err        error
	}{
		{"not json", `{`, ErrBadModelFile},
		{"wordpiece", `{"model":{"type":"WordPiece","vocab":{}}}`, ErrUnsupported},
		{"suffix", `{"model":{"type":"BPE","vocab":{"a":0},"merges":[],"end_of_word_suffix":"</w>"}}`, ErrUnsupported},
		{"unknown normalizer", `{"normalizer":{"type":"BertNormalizer"},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`, ErrUnsupported},
		{"unknown pre-tokenizer", `{"pre_tokenizer":{"type":"Whitespace"},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`, ErrUnsupported},
		{"bad split regex", `{"pre_tokenizer":{"type":"Split","pattern":{"Regex":"("},"behavior":"Isolated"},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`, ErrUnsupported},
		{"merge out of vocab", `{"model":{"type":"BPE","vocab":{"a":0},"merges":["a b"]}}`, ErrBadModelFile},
		{"merge without space", `{"model":{"type":"BPE","vocab":{"a":0},"merges":["ab"]}}`, ErrBadModelFile},
		{"byte-level without bytes", `{"pre_tokenizer":{"type":"ByteLevel","use_regex":false},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`, ErrBadModelFile},
		{"byte fallback without byte tokens", `{"model":{"type":"BPE","vocab":{"a":0},"merges":[],"byte_fallback":true}}`, ErrBadModelFile},
		{"unk not in vocab", `{"model":{"type":"BPE","vocab":{"a":0},"merges":[],"unk_token":"<unk>"}}`, ErrBadModelFile},
		{"bad decoder", `{"decoder":{"type":"WordPiece"},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`, ErrUnsupported},
	}
	for _, tt := range bad {
		if _, err := NewHF([]byte(tt.json), nil, HFConfig{}); !errors.Is(err, tt.err) {
			t.Errorf("%s: err = %v, want %v", tt.name, err, tt.err)
		}
	}
	minimal := []byte(`{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}}`)
	if _, err := NewHF(minimal, []byte(`{"chat_template":"{% for %}"}`), HFConfig{}); !errors.Is(err, ErrTemplate) {
		t.Errorf("bad template: err = %v", err)
	}
	tok, err := NewHF(minimal, []byte(`{"chat_template":[{"name":"tool_use","template":"T"},{"name":"default","template":"D{{ bos_token }}"}],"bos_token":{"content":"<s>"}}`), HFConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := tok.Render(nil, RenderOptions{}); err != nil || got != "D<s>" {
		t.Errorf("named templates: %q, %v", got, err)
	}
	if ids, _ := tok.Encode("abba"); !slices.Equal(ids, []uint32{2, 1, 0}) {
		t.Errorf("Encode(abba) = %v", ids)
	}
	noTmpl, _ := NewHF(minimal, nil, HFConfig{})
	if _, err := noTmpl.Render(nil, RenderOptions{}); !errors.Is(err, ErrNoChatTemplate) {
		t.Errorf("no template: %v", err)
	}
	if _, err := noTmpl.Decode([]uint32{7}); !errors.Is(err, ErrUnknownID) {
		t.Errorf("Decode unknown id: %v", err)
	}
}
