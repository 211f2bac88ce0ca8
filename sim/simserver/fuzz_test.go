package simserver

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/sim"
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

// FuzzHandlers sends arbitrary bodies to every POST endpoint of a running
// instance: each answer must be a 2xx, 4xx or 503 with a body, never a
// panic, a 5xx or a hang; the instance must still serve afterwards.
func FuzzHandlers(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"hello","max_tokens":3}`, `{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"messages":[{"role":"user","content":"hi"}],"stream":true}`, `{"lora_name":"a","lora_path":"/a"}`,
		`{"prompt":"x","model":"a"}`, `{"prompt":["a","b"],"max_tokens":2,"stream":true}`, `{"prompt":"x","cache_salt":"s"}`,
		`{"prompt":[[1,2,3],[4]],"truncate_prompt_tokens":2}`, `{"messages":[{"role":"user","content":"hi"}],"truncate_prompt_tokens":-1}`,
		`{"prompt":"x y z","truncate_prompt_tokens":0}`,
	} {
		for p := range uint8(8) {
			f.Add(p, []byte(s))
		}
	}
	in, err := Start(context.Background(), Config{Engine: sim.Config{Model: "m", GPUBlocks: 300, MaxModelLen: 2048}, TimeScale: 1e5})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { in.Close() })
	paths := []string{"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/load_lora_adapter",
		"/v1/unload_lora_adapter", "/reset_prefix_cache", "/sleep", "/wake_up"}
	f.Fuzz(func(t *testing.T, p uint8, body []byte) {
		path := paths[int(p)%len(paths)]
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
		in.http.Handler.ServeHTTP(rec, req)
		if rec.Code >= 500 && rec.Code != http.StatusServiceUnavailable {
			t.Fatalf("%s %q: status %d %s", path, body, rec.Code, rec.Body)
		}
		if path == "/sleep" {
			in.sleeping.Store(false) // keep the instance serving for the next input
		}
	})
}
