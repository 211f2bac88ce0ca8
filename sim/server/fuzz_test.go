package server

import (
	"encoding/json"
	"testing"

	"github.com/kvrouter/kvrouter/tokenizer"
)

// FuzzRequestParsing feeds arbitrary bodies to the request decoders of
// /v1/completions, /v1/chat/completions and /tokenize: they must return a
// prompt or an error, never panic.
func FuzzRequestParsing(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"hello"}`, `{"prompt":["a","b"]}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1,2],[3]]}`,
		`{"prompt":{"x":1}}`, `{"prompt":null}`, `{"prompt":[]}`, `{"prompt":[-1]}`,
		`{"messages":[{"role":"user","content":"hi"}]}`, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`,
		`{"messages":[{"role":"user","content":7}]}`, `{"max_tokens":-3,"stream":true,"stream_options":{"include_usage":true}}`,
	} {
		f.Add([]byte(s))
	}
	in := &Instance{tok: tokenizer.Simple{}}
	f.Fuzz(func(t *testing.T, body []byte) {
		var c completionRequest
		if json.Unmarshal(body, &c) == nil {
			ps, err := in.completionPrompts(c.Prompt)
			if err == nil && len(ps) == 0 {
				t.Fatal("no prompts and no error")
			}
		}
		var ch chatRequest
		if json.Unmarshal(body, &ch) == nil {
			_, _ = in.chatTokens(&ch)
		}
	})
}
