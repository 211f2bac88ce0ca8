package kvaware

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// vectorLine is one line of tokenizer/testdata/<model>/vectors.jsonl:
// reference ids computed by Hugging Face's own implementation.
type vectorLine struct {
	Text                *string         `json:"text"`
	Messages            json.RawMessage `json:"messages"`
	AddGenerationPrompt bool            `json:"add_generation_prompt"`
	IDs                 []uint32        `json:"ids"`
}

func readVectors(t *testing.T, model string) []vectorLine {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "..", "tokenizer", "testdata", model, "vectors.jsonl"))
	if err != nil {
		t.Fatalf("reference vectors: %v", err)
	}
	defer f.Close()
	var out []vectorLine
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		var v vectorLine
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestTokenSourceMatchesReference: the router's token source turns the
// reference vectors' OpenAI requests into exactly the reference ids — chat
// bodies through the model's template, completions text through Encode,
// and the raw invoke path with either shape.
func TestTokenSourceMatchesReference(t *testing.T) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		t.Run(model, func(t *testing.T) {
			src, err := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceFiles, Path: filepath.Join("..", "..", "tokenizer", "testdata", model)}, config.PoolConfig{Model: model})
			if err != nil {
				t.Fatal(err)
			}
			chats, texts := 0, 0
			for i, v := range readVectors(t, model) {
				var reqs []*router.Request
				switch {
				case v.Messages != nil:
					body, _ := json.Marshal(map[string]any{"model": model, "messages": v.Messages, "add_generation_prompt": v.AddGenerationPrompt})
					parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, body)
					if err != nil {
						t.Fatal(err)
					}
					// Parsed once (the proxy's path) and from the body alone.
					reqs = []*router.Request{{Endpoint: router.EndpointChatCompletions, Body: body, Parsed: parsed}, {Endpoint: router.EndpointChatCompletions, Body: body}, {Endpoint: router.EndpointInvoke, Body: body}}
					chats++
				case v.Text != nil:
					body, _ := json.Marshal(map[string]any{"model": model, "prompt": *v.Text})
					parsed, err := router.ParseOpenAI(router.EndpointCompletions, body)
					if err != nil {
						t.Fatal(err)
					}
					reqs = []*router.Request{{Endpoint: router.EndpointCompletions, Body: body, Parsed: parsed}, {Endpoint: router.EndpointInvoke, Body: body}}
					texts++
				default:
					continue
				}
				want := v.IDs
				if v.Text != nil {
					// Completions prompts are encoded with add_special_tokens=true
					// (vLLM's default there): the model's post-processor adds its
					// affixes to the reference's add_special_tokens=false ids.
					want = slices.Concat(textAffix[model][0], v.IDs, textAffix[model][1])
				}
				for _, req := range reqs {
					ids, err := src.Tokens(context.Background(), req)
					if len(v.IDs) == 0 && errors.Is(err, router.ErrNoTokens) {
						continue
					}
					if err != nil {
						t.Fatalf("line %d endpoint %d: %v", i+1, req.Endpoint, err)
					}
					if !slices.Equal(ids, want) {
						t.Fatalf("line %d endpoint %d: ids differ from the reference\n got %v\nwant %v", i+1, req.Endpoint, ids, want)
					}
				}
				if v.Text != nil {
					// The request may turn the special tokens off, as vLLM allows.
					body, _ := json.Marshal(map[string]any{"model": model, "prompt": *v.Text, "add_special_tokens": false})
					parsed, _ := router.ParseOpenAI(router.EndpointCompletions, body)
					ids, err := src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointCompletions, Body: body, Parsed: parsed})
					if err != nil || !slices.Equal(ids, v.IDs) {
						t.Fatalf("line %d add_special_tokens=false: %v %v, want %v", i+1, ids, err, v.IDs)
					}
				}
			}
			if chats == 0 || texts == 0 {
				t.Fatalf("%d chat and %d text vectors: the reference file changed shape", chats, texts)
			}
		})
	}
}

// textAffix is what each model's tokenizer.json post-processor adds to a
// single text: Llama 3 prepends <|begin_of_text|> (128000); Qwen3's
// ByteLevel post-processor adds nothing.
var textAffix = map[string][2][]uint32{
	"llama-3.1": {{128000}, nil},
	"qwen3":     {nil, nil},
}

func TestNewTokenSource(t *testing.T) {
	pool := config.PoolConfig{Name: "p", Model: "m", Instances: []config.InstanceConfig{{ID: "a", URL: "http://127.0.0.1:8000"}}}
	tests := []struct {
		cfg     *config.TokenizerConfig
		wantNil bool
		wantErr bool
	}{
		{nil, true, false},
		{&config.TokenizerConfig{}, true, false},
		{&config.TokenizerConfig{Source: TokenSourceNone}, true, false},
		{&config.TokenizerConfig{Source: TokenSourceSimple}, false, false},
		{&config.TokenizerConfig{Source: TokenSourceFiles}, true, true},
		{&config.TokenizerConfig{Source: TokenSourceFiles, Path: "/nonexistent"}, true, true},
		{&config.TokenizerConfig{Source: TokenSourceEngine}, false, false},
		{&config.TokenizerConfig{Source: TokenSourceEngine, URL: "not a url"}, true, true},
		{&config.TokenizerConfig{Source: "magic"}, true, true},
	}
	for i, tc := range tests {
		src, err := NewTokenSource(tc.cfg, pool)
		if (err != nil) != tc.wantErr || (src == nil) != tc.wantNil {
			t.Errorf("%d: %+v: source %v err %v", i, tc.cfg, src, err)
		}
		if err != nil && !errors.Is(err, router.ErrTokenSource) {
			t.Errorf("%d: err %v does not wrap ErrTokenSource", i, err)
		}
	}
}

func TestSimpleTokenSourceShapes(t *testing.T) {
	src, _ := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceSimple}, config.PoolConfig{})
	ctx := context.Background()
	tests := []struct {
		name    string
		req     *router.Request
		wantErr error
		wantLen int
	}{
		{"chat", &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(`{"messages":[{"role":"user","content":"hello there"}]}`)}, nil, -1},
		{"chat no messages", &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(`{"messages":[]}`)}, router.ErrNoTokens, 0},
		{"chat bad json", &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(`{"messages":`)}, router.ErrTokenSource, 0},
		{"invoke token ids", &router.Request{Endpoint: router.EndpointInvoke, Body: []byte(`{"prompt":[5,6,7]}`)}, nil, 3},
		{"invoke inputs", &router.Request{Endpoint: router.EndpointInvoke, Body: []byte(`{"inputs":"a b c"}`)}, nil, 3},
		{"invoke nothing", &router.Request{Endpoint: router.EndpointInvoke, Body: []byte(`{"x":1}`)}, router.ErrNoTokens, 0},
		{"invoke not json", &router.Request{Endpoint: router.EndpointInvoke, Body: []byte(`hello`)}, router.ErrTokenSource, 0},
		{"completions without text", &router.Request{Endpoint: router.EndpointCompletions}, router.ErrNoTokens, 0},
	}
	for _, tc := range tests {
		ids, err := src.Tokens(ctx, tc.req)
		if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
			t.Errorf("%s: err %v, want %v", tc.name, err, tc.wantErr)
			continue
		}
		if tc.wantLen >= 0 && err == nil && len(ids) != tc.wantLen {
			t.Errorf("%s: %d ids %v, want %d", tc.name, len(ids), ids, tc.wantLen)
		}
		if tc.wantLen < 0 && len(ids) == 0 {
			t.Errorf("%s: no ids", tc.name)
		}
	}
}

// TestParseChatBodyPaths: the fast path (string contents) and the general
// one (parts, null, tool calls) give the messages tokenizer.Message would.
func TestParseChatBodyPaths(t *testing.T) {
	bodies := []string{
		`{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi \u00e9\n","name":"bob"}],"add_generation_prompt":false}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}],"tools":[{"type":"function","function":{"name":"f"}}]}`,
		`{"messages":[{"role":"assistant","reasoning_content":"hmm","content":"ok"}],"chat_template_kwargs":{"enable_thinking":false}}`,
	}
	for i, body := range bodies {
		parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		once, ok, err := parsedChatBody(parsed)
		if err != nil {
			t.Fatalf("%d: %v", i, err)
		}
		// Content parts and tool calls need the full decode.
		if wantOK := i == 0 || i == 3; ok != wantOK {
			t.Fatalf("%d: parsed path taken %v, want %v", i, ok, wantOK)
		}
		got, err := parseChatBody([]byte(body))
		if ok {
			oj, _ := json.Marshal(once)
			gj, _ := json.Marshal(got)
			if string(oj) != string(gj) {
				t.Errorf("%d: parsed path differs\n got %s\nwant %s", i, oj, gj)
			}
		}
		if err != nil {
			t.Fatalf("%d: %v", i, err)
		}
		var want chatBody
		if err := json.Unmarshal([]byte(body), &want); err != nil {
			t.Fatal(err)
		}
		gj, _ := json.Marshal(got)
		wj, _ := json.Marshal(want)
		if string(gj) != string(wj) {
			t.Errorf("%d: fast path differs\n got %s\nwant %s", i, gj, wj)
		}
	}
	if _, err := parseChatBody([]byte(`{"messages":[{"role":"user","content":5}]}`)); !errors.Is(err, router.ErrTokenSource) {
		t.Errorf("bad content: %v", err)
	}
	// Wrong types fail tokenization (not the request), on both paths.
	for _, body := range []string{
		`{"messages":[{"role":"user","content":"x","name":5}]}`,
		`{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":"yes"}`,
		`{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]}`,
		`{"messages":[{"role":"user","content":"x"}],"continue_final_message":1}`,
	} {
		parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, []byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if _, _, err := parsedChatBody(parsed); !errors.Is(err, router.ErrTokenSource) {
			t.Errorf("%s: parsed path: %v", body, err)
		}
		if _, err := parseChatBody([]byte(body)); !errors.Is(err, router.ErrTokenSource) {
			t.Errorf("%s: full decode: %v", body, err)
		}
	}
}

// FuzzChatTokenSource: any body on any endpoint yields ids or an error,
// never a panic, and the fast chat path agrees with the general one.
func FuzzChatTokenSource(f *testing.F) {
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi there"}]}`), uint8(router.EndpointChatCompletions))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"tools":[]}`), uint8(router.EndpointInvoke))
	f.Add([]byte(`{"prompt":[1,2,3]}`), uint8(router.EndpointInvokeStream))
	f.Add([]byte(`{"inputs":"x y"}`), uint8(router.EndpointInvoke))
	f.Add([]byte(`{"messages":[{"role":"user","content":"a b","name":"n"}],"add_generation_prompt":false,"chat_template_kwargs":{"x":1}}`), uint8(router.EndpointChatCompletions-1))
	// vLLM's edge cases (tokfix3): empty tools, documents, empty reasoning,
	// a non-function tool call, a tool result as parts, media parts.
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi"}],"tools":[],"documents":[{"title":"t","text":"x"}]}`), uint8(router.EndpointChatCompletions-1))
	f.Add([]byte(`{"messages":[{"role":"assistant","content":"a","reasoning":""},{"role":"assistant","content":null,"reasoning":null,"reasoning_content":"r"}]}`), uint8(router.EndpointChatCompletions-1))
	f.Add([]byte(`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"custom","custom":{"name":"f","input":"x"}}]}]}`), uint8(router.EndpointChatCompletions-1))
	f.Add([]byte(`{"messages":[{"role":"tool","tool_call_id":"1","content":[{"type":"text","text":"a"},{"type":"text","text":""},"b"]}]}`), uint8(router.EndpointInvoke-1))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}],"Content":"b"}],"Messages":[]}`), uint8(router.EndpointChatCompletions-1))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"d","format":"wav"}},{"video_url":{"url":"u"},"x":1},{"type":"tool_reference","name":"n"}]}]}`), uint8(router.EndpointChatCompletions-1))
	src := &ChatTokenSource{Tokenizer: tokenizer.Local(tokenizer.Simple{})}
	f.Fuzz(func(t *testing.T, body []byte, ep uint8) {
		req := &router.Request{Endpoint: router.Endpoint(ep%5 + 1), Body: body}
		ids, terr := src.Tokens(context.Background(), req)
		if req.Endpoint == router.EndpointChatCompletions {
			// Parsed once, as the proxy does: the same ids as the body alone,
			// unless keys differ only in case (encoding/json folds them).
			if parsed, err := router.ParseOpenAI(req.Endpoint, body); err == nil && routertest.ComparableWithStd(body) {
				pids, perr := src.Tokens(context.Background(), &router.Request{Endpoint: req.Endpoint, Body: body, Parsed: parsed})
				if (terr == nil) != (perr == nil) || !slices.Equal(ids, pids) {
					t.Fatalf("%q: parsed once %v %v, from the body %v %v", body, pids, perr, ids, terr)
				}
			}
		}
		fast, err := parseChatBody(body)
		var slow chatBody
		// encoding/json folds key case, parseChatBody does not (vLLM's exact
		// keys): they agree on bodies without case variants.
		if err == nil && routertest.ComparableWithStd(body) && json.Unmarshal(body, &slow) == nil {
			if len(fast.Messages) == 0 && len(slow.Messages) == 0 {
				fast.Messages, slow.Messages = nil, nil
			}
			fj, _ := json.Marshal(fast)
			sj, _ := json.Marshal(slow)
			if string(fj) != string(sj) {
				t.Fatalf("fast path differs\nfast %s\nslow %s", fj, sj)
			}
		}
	})
}

func TestTokenSourceBodyCap(t *testing.T) {
	src, _ := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceSimple}, config.PoolConfig{})
	body := []byte(`{"messages":[{"role":"user","content":"` + strings.Repeat("a ", config.MaxTokenizeBytes/2) + `"}]}`)
	if _, err := src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: body}); !errors.Is(err, router.ErrTokenSource) {
		t.Fatalf("oversized body: %v", err)
	}
}

// TestAddSpecialTokensExactKey: only the exact key, false, turns the
// special tokens off (vLLM's pydantic model does not fold case).
func TestAddSpecialTokensExactKey(t *testing.T) {
	for _, c := range []struct {
		body string
		want bool
	}{
		{`{"prompt":"p"}`, true},
		{`{"prompt":"p","add_special_tokens":false}`, false},
		{`{"prompt":"p","add_special_tokens":true}`, true},
		{`{"prompt":"p","add_special_tokens":null}`, true},
		{`{"prompt":"p","add_special_tokens":"no"}`, true},
		{`{"prompt":"p","Add_Special_Tokens":false}`, true},
		{`{"prompt":"p","add\u005fspecial_tokens":false}`, false},
		{`{"prompt":"p","x":{"add_special_tokens":false}}`, true},
		{`{"prompt":"p","add_special_tokens":false,"add_special_tokens":true}`, true},
	} {
		if got := addSpecialTokens([]byte(c.body)); got != c.want {
			t.Errorf("%s: got %v, want %v", c.body, got, c.want)
		}
		if p, err := router.ParseOpenAI(router.EndpointCompletions, []byte(c.body)); err != nil || rawAddSpecialTokens(p.AddSpecialTokens) != c.want {
			t.Errorf("%s: parsed: %v", c.body, err)
		}
	}
}

// TestRawChatBodyAllocationBounded: a raw /invocations chat body (no
// parse of the router's before it) is read within the default limits
// before encoding/json builds it. A body just under max_tokenize_bytes of
// empty messages allocated ~957 MB (228× the body) before.
func TestRawChatBodyAllocationBounded(t *testing.T) {
	src, _ := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceSimple}, config.PoolConfig{})
	body := []byte(`{"messages":[` + strings.Repeat(`{},`, (config.MaxTokenizeBytes-64)/3) + `{}]}`)
	var err error
	alloc := testenv.Allocated(func() {
		_, err = src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointInvoke, Body: body})
	})
	if !errors.Is(err, router.ErrTokenSource) {
		t.Fatalf("a body of %d messages: err %v, want a token-source error (routed on the fallback)", (config.MaxTokenizeBytes-64)/3+1, err)
	}
	t.Logf("a %d-byte raw chat body of empty messages: %d bytes allocated", len(body), alloc)
	if alloc > 16*uint64(len(body)) {
		t.Fatalf("a %d-byte raw chat body allocated %d bytes (%.0fx)", len(body), alloc, float64(alloc)/float64(len(body)))
	}
}
