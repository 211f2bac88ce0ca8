package tokenizer

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

// vllmTokenize serves vLLM's /tokenize request/response shapes from an in-process
// tokenizer, recording each request body it decodes.
type vllmTokenize struct {
	tok   ChatTokenizer
	calls atomic.Int64
	last  atomic.Value // map[string]any of the last request
}

func (v *vllmTokenize) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	v.calls.Add(1)
	if r.Method != http.MethodPost || r.URL.Path != "/tokenize" {
		http.Error(w, `{"error":"not found"}`, http.StatusNotFound)
		return
	}
	var req struct {
		Model               string          `json:"model"`
		Prompt              *string         `json:"prompt"`
		Messages            []Message       `json:"messages"`
		AddGenerationPrompt *bool           `json:"add_generation_prompt"`
		AddSpecialTokens    *bool           `json:"add_special_tokens"`
		Tools               json.RawMessage `json:"tools"`
		ChatTemplateKwargs  map[string]any  `json:"chat_template_kwargs"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, `{"error":"bad json"}`, http.StatusBadRequest)
		return
	}
	v.last.Store(req.AddSpecialTokens != nil && !*req.AddSpecialTokens)
	var ids []uint32
	var err error
	if req.Prompt != nil {
		// vLLM's default for a text prompt is add_special_tokens=true.
		if req.AddSpecialTokens == nil || *req.AddSpecialTokens {
			ids, err = v.tok.(SpecialEncoder).EncodeSpecial(*req.Prompt)
		} else {
			ids, err = v.tok.Encode(*req.Prompt)
		}
	} else {
		agp := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt // vLLM's default
		ast := req.AddSpecialTokens != nil && *req.AddSpecialTokens       // false for chats
		ids, _, err = EncodeChat(v.tok, req.Messages, RenderOptions{AddGenerationPrompt: agp, Tools: req.Tools, Vars: req.ChatTemplateKwargs, AddSpecialTokens: ast})
	}
	if err != nil {
		http.Error(w, `{"error":"`+err.Error()+`"}`, http.StatusBadRequest)
		return
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "max_model_len": 40960, "tokens": ids})
}

func TestRemoteAgreesWithLocal(t *testing.T) {
	tok := loadModel(t, "qwen3")
	srv := &vllmTokenize{tok: tok}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	remote, err := NewRemote(RemoteConfig{URL: ts.URL, Model: "qwen3"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	loc := Local(tok)
	for _, v := range readJSONLines[toolVector](t, "testdata/tools/qwen3.jsonl") {
		opts := RenderOptions{AddGenerationPrompt: v.AddGenerationPrompt, Tools: v.Tools}
		if v.EnableThinking != nil {
			opts.Vars = map[string]any{"enable_thinking": *v.EnableThinking}
		}
		got, err := remote.TokenizeChat(ctx, v.Messages, opts)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := loc.TokenizeChat(ctx, v.Messages, opts)
		if !slices.Equal(got, want) || !slices.Equal(got, v.IDs) {
			t.Errorf("remote chat ids differ:\n got %v\nwant %v", got, v.IDs)
		}
		if sent, _ := srv.last.Load().(bool); !sent {
			t.Error("chat request did not send add_special_tokens=false")
		}
	}
	ids, err := remote.Encode("Hello, world!")
	if want := []uint32{9707, 11, 1879, 0}; err != nil || !slices.Equal(ids, want) {
		t.Fatalf("Encode = %v, %v; want %v", ids, err, want)
	}
	if sent, _ := srv.last.Load().(bool); !sent {
		t.Error("text request did not send add_special_tokens=false")
	}
}

func TestRemoteCache(t *testing.T) {
	srv := &vllmTokenize{tok: Simple{}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	remote, err := NewRemote(RemoteConfig{URL: ts.URL + "/", CacheEntries: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, text := range []string{"a b", "a b", "c d", "a b", "e f", "c d"} {
		ids, err := remote.Encode(text)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := Simple{}.Encode(text)
		if !slices.Equal(ids, want) {
			t.Fatalf("%q: %v want %v", text, ids, want)
		}
		ids[0]++ // callers own their slice; the cache must not see this
	}
	// "a b" miss, hit, "c d" miss, "a b" hit, "e f" miss (evicts "c d"), "c d" miss.
	if got := srv.calls.Load(); got != 4 {
		t.Fatalf("%d server calls, want 4", got)
	}
	if n := remote.CachedPrompts(); n != 2 {
		t.Fatalf("cache holds %d, want 2", n)
	}
	noCache, _ := NewRemote(RemoteConfig{URL: ts.URL, CacheEntries: -1})
	for range 3 {
		if _, err := noCache.Encode("x"); err != nil {
			t.Fatal(err)
		}
	}
	if got := srv.calls.Load(); got != 7 {
		t.Fatalf("%d server calls with the cache off, want 7", got)
	}
}

func TestRemoteErrors(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/500/tokenize", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, `{"error":"model not loaded"}`, http.StatusInternalServerError)
	})
	mux.HandleFunc("/garbage/tokenize", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("{not json")) })
	mux.HandleFunc("/notokens/tokenize", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte(`{"count":0}`)) })
	mux.HandleFunc("/badcount/tokenize", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte(`{"count":3,"tokens":[1]}`)) })
	mux.HandleFunc("/slow/tokenize", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	ts := httptest.NewServer(mux)
	defer ts.Close()
	for _, path := range []string{"/500", "/garbage", "/notokens", "/badcount", "/slow", "/missing"} {
		r, err := NewRemote(RemoteConfig{URL: ts.URL + path, Timeout: 200 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Encode("x"); !errors.Is(err, ErrRemote) {
			t.Errorf("%s: err = %v, want ErrRemote", path, err)
		}
		if r.CachedPrompts() != 0 {
			t.Errorf("%s: a failure was cached", path)
		}
	}
	for _, bad := range []RemoteConfig{{}, {URL: "localhost:8000"}, {URL: "ftp://x"}, {URL: "http://x", Timeout: -1}} {
		if _, err := NewRemote(bad); err == nil {
			t.Errorf("NewRemote(%+v) accepted", bad)
		}
	}
}

func BenchmarkRemoteCacheHit(b *testing.B) {
	ts := httptest.NewServer(&vllmTokenize{tok: Simple{}})
	defer ts.Close()
	r, _ := NewRemote(RemoteConfig{URL: ts.URL})
	text := benchCorpus(b)[:32<<10]
	if _, err := r.Encode(text); err != nil {
		b.Fatal(err)
	}
	cpuLoop(b, 0, func() {
		if _, err := r.Encode(text); err != nil {
			b.Fatal(err)
		}
	})
}

// TestRemoteSpecialTokens: a completion prompt goes with add_special_tokens=true (the
// engine adds BOS), TokenizeText and Encode without; the two are cached apart.
func TestRemoteSpecialTokens(t *testing.T) {
	tok, err := LoadHF("testdata/sentencepiece/llama2", HFConfig{})
	if err != nil {
		t.Fatal(err)
	}
	srv := &vllmTokenize{tok: tok}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	remote, _ := NewRemote(RemoteConfig{URL: ts.URL})
	ctx := context.Background()
	plain, _ := tok.Encode("hello world")
	for i := range 2 {
		got, err := remote.TokenizeCompletion(ctx, "hello world", true)
		if err != nil || !slices.Equal(got, append([]uint32{1}, plain...)) {
			t.Fatalf("TokenizeCompletion = %v, %v; want BOS + %v", got, err, plain)
		}
		if sentFalse, _ := srv.last.Load().(bool); i == 0 && sentFalse {
			t.Fatal("TokenizeCompletion sent add_special_tokens=false")
		}
		if got, err := remote.Encode("hello world"); err != nil || !slices.Equal(got, plain) {
			t.Fatalf("Encode = %v, %v; want %v", got, err, plain)
		}
		if got, err := remote.TokenizeText(ctx, "hello world"); err != nil || !slices.Equal(got, plain) {
			t.Fatalf("TokenizeText = %v, %v; want %v", got, err, plain)
		}
	}
	if n := srv.calls.Load(); n != 2 {
		t.Fatalf("%d calls, want 2 (one per variant, then cache hits)", n)
	}
	// Local gives the same as the engine for both kinds of prompt.
	loc := Local(tok).(CompletionTokenizer)
	if ids, _ := loc.TokenizeCompletion(ctx, "hello world", true); !slices.Equal(ids, append([]uint32{1}, plain...)) {
		t.Fatalf("Local TokenizeCompletion(true) = %v", ids)
	}
	if ids, _ := loc.TokenizeCompletion(ctx, "hello world", false); !slices.Equal(ids, plain) {
		t.Fatalf("Local TokenizeCompletion(false) = %v", ids)
	}
}
