package router

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/openai"
	"github.com/kvrouter/kvrouter/router/routertest"
)

func TestOpenAIRoutingText(t *testing.T) {
	tests := []struct {
		name  string
		ep    Endpoint
		body  string
		limit int
		want  string
	}{
		{"chat strings", EndpointChatCompletions, `{"messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}]}`, 100, "sys\nhi"},
		{"chat parts", EndpointChatCompletions, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]}`, 100, "a\nb"},
		{"chat null content", EndpointChatCompletions, `{"messages":[{"role":"assistant","content":null,"tool_calls":[]},{"role":"user","content":"q"}]}`, 100, "q"},
		{"cut at limit", EndpointChatCompletions, `{"messages":[{"role":"user","content":"abcdef"},{"role":"user","content":"ghi"}]}`, 4, "abcd"},
		{"cut counts separator", EndpointChatCompletions, `{"messages":[{"role":"user","content":"abc"},{"role":"user","content":"def"}]}`, 5, "abc\nd"},
		{"characters not bytes", EndpointChatCompletions, `{"messages":[{"role":"user","content":"héllo wörld"}]}`, 7, "héllo w"},
		{"cjk", EndpointChatCompletions, `{"messages":[{"role":"user","content":"日本語のテキスト"}]}`, 3, "日本語"},
		{"prompt string", EndpointCompletions, `{"prompt":"once upon"}`, 100, "once upon"},
		{"prompt list", EndpointCompletions, `{"prompt":["a","b"]}`, 100, "a\nb"},
		{"prompt tokens", EndpointCompletions, `{"prompt":[1,22,333]}`, 100, "1 22 333"},
		{"prompt token lists", EndpointCompletions, `{"prompt":[[1,2],[3]]}`, 100, "1 2\n3"},
		{"prompt tokens cut", EndpointCompletions, `{"prompt":[12345,67890]}`, 7, "12345 6"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseOpenAI(tc.ep, []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if got := openai.RoutingText(r, tc.limit); got != tc.want {
				t.Fatalf("routing text %q, want %q", got, tc.want)
			}
		})
	}
}

func TestPromptTokens(t *testing.T) {
	r, err := ParseOpenAI(EndpointCompletions, []byte(`{"prompt":[[7,8,9],[1]]}`))
	if err != nil {
		t.Fatal(err)
	}
	req := &Request{PromptTokens: openai.FirstTokens(r.Prompt)}
	ids, err := req.TokenIDs(t.Context())
	if err != nil || len(ids) != 3 || ids[2] != 9 {
		t.Fatalf("TokenIDs %v %v", ids, err)
	}
	if _, err := (&Request{}).TokenIDs(t.Context()); err != ErrNoTokens {
		t.Fatalf("no tokens: %v", err)
	}
}

func TestRawRoutingText(t *testing.T) {
	body := []byte(`{ "b": 1, "a": {"y": [1, 2.50, "<x>"], "x": null} }`)
	if got := RawRoutingText(body, 1024, false); got != string(body) {
		t.Fatalf("raw %q", got)
	}
	if got := RawRoutingText(body, 5, false); got != `{ "b"` {
		t.Fatalf("raw cut %q", got)
	}
	want := `{"a":{"x":null,"y":[1,2.50,"<x>"]},"b":1}`
	if got := RawRoutingText(body, 1024, true); got != want {
		t.Fatalf("canonical %q, want %q", got, want)
	}
	// Not JSON: routes by its bytes.
	if got := RawRoutingText([]byte("plain text body"), 1024, true); got != "plain text body" {
		t.Fatalf("non-JSON %q", got)
	}
	if got := RawRoutingText([]byte(`{"b":1} {"a":2}`), 1024, true); got != `{"b":1} {"a":2}` {
		t.Fatalf("two documents canonicalised: %q", got)
	}
}

// TestRawRoutingTextAllocationBounded: canonicalising a raw body writes
// only the routing text's bytes. Decoding the document into `any`, as it
// was, allocated ~270x a 3 MiB body of "{}," items.
func TestRawRoutingTextAllocationBounded(t *testing.T) {
	for _, body := range [][]byte{
		[]byte(`{"input":[` + strings.Repeat(`{},`, 1<<20) + `{}]}`),
		[]byte(`{"input":{` + strings.Repeat(`"k":0,`, 1<<19) + `"k":1}}`),
		[]byte(`{"input":[` + strings.Repeat(`"é",`, 1<<18) + `""]}`),
	} {
		if alloc := testenv.Allocated(func() { _ = RawRoutingText(body, 1024, true) }); alloc > 8*uint64(len(body)) {
			t.Fatalf("canonicalising a %d-byte body allocated %d bytes", len(body), alloc)
		}
	}
}

func TestValidTenantKey(t *testing.T) {
	tests := []struct {
		in string
		ok bool
	}{
		{"a", true}, {strings.Repeat("x", 64), true}, {"tenant 42 ~!", true},
		{"", false}, {strings.Repeat("x", 65), false}, {"tab\there", false}, {"é", false}, {"nl\n", false},
	}
	for _, tc := range tests {
		if got := ValidTenantKey(tc.in); got != tc.ok {
			t.Errorf("ValidTenantKey(%q) = %v", tc.in, got)
		}
	}
}

// FuzzParseOpenAI: any body either fails with ErrBadRequest or yields a
// routing text of at most limit runes that is a prefix-shaped cut.
func FuzzParseOpenAI(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
		`{"model":"m","prompt":[1,2,3]}`,
		`{"model":"m","prompt":[[1],[2,3]]}`,
		`{"model":"m","prompt":["a","b"],"stream":true,"prompt_cache_key":"k"}`,
		`{"prompt":[-1]}`, `[]`, `{`, `null`,
		`{"messages":[{},{},{},{}]}`, `{"messages":[{"content":[{},{},{}]},{"content":[{"text":"a"},{}]}]}`,
		`{"prompt":["a","b","c"]}`, `{"prompt":[[1,2],[3,4],[5]]}`, `{"prompt":[1,2,3,4,5,6]}`, `{"prompt":[[1,2,3],[4,5,6]]}`,
		`{"prompt":[1,2,3,4,5,6],"truncate_prompt_tokens":2}`, `{"prompt":[[1,2,3],[4]],"truncate_prompt_tokens":1}`,
		`{"prompt":"abc","truncate_prompt_tokens":-1}`,
		`{"prompt":[1,2,3,4,5,6],"truncate_prompt_tokens":2,"truncation_side":"right"}`, `{"prompt":[1,2,3],"truncate_prompt_tokens":2,"truncation_side":"left"}`,
		`{"prompt":[1,2,3],"truncation_side":"right"}`, `{"prompt":[1,2],"truncate_prompt_tokens":1,"truncation_side":7}`,
	} {
		f.Add([]byte(s), uint16(4))
	}
	small := config.LimitsConfig{MaxMessages: 3, MaxContentParts: 4, MaxPrompts: 2, MaxPromptTokenIDs: 5}
	f.Fuzz(func(t *testing.T, body []byte, lim uint16) {
		limit := int(lim)%200 + 1
		for _, ep := range []Endpoint{EndpointChatCompletions, EndpointCompletions} {
			r, err := ParseOpenAI(ep, body)
			// Within small limits: refused exactly when a count passes
			// one, else the same request (a repeated member apart: its
			// first value is held to the limits too).
			rs, serr := parseOpenAI(ep, body, small)
			if err != nil {
				if r != nil {
					t.Fatal("error with a result")
				}
				if serr == nil {
					t.Fatalf("%q: refused without limits (%v), taken within them", body, err)
				}
				continue
			}
			if routertest.ComparableWithStd(body) {
				if over := overSmall(body, r); over != (serr != nil) {
					t.Fatalf("%q: over the small limits %v, error %v", body, over, serr)
				} else if !over && !reflect.DeepEqual(r, rs) {
					t.Fatalf("%q: within the limits, parsed differently", body)
				}
			}
			txt := openai.RoutingText(r, limit)
			if n := utf8.RuneCountInString(txt); n > limit {
				t.Fatalf("routing text of %d runes over limit %d", n, limit)
			}
			if txt2 := openai.RoutingText(r, limit+50); !strings.HasPrefix(txt2, txt) {
				t.Fatalf("routing text %q is not a prefix of the longer %q", txt, txt2)
			}
			// The kept part's routing text (truncate_prompt_tokens): the
			// same bounds, and the untruncated text when nothing is cut.
			if keep, err := PromptTruncation(r.TruncatePromptTokens); err == nil {
				kt := openai.RoutingTextKeep(r, limit, keep)
				if n := utf8.RuneCountInString(kt); n > limit {
					t.Fatalf("kept routing text of %d runes over limit %d", n, limit)
				}
				if kt2 := openai.RoutingTextKeep(r, limit+50, keep); !strings.HasPrefix(kt2, kt) {
					t.Fatalf("kept routing text %q is not a prefix of the longer %q", kt, kt2)
				}
				if (r.Prompt == nil || len(r.Prompt.Tokens) == 0) && kt != txt {
					t.Fatalf("%q: no token ids, yet the kept routing text %q differs from %q", body, kt, txt)
				}
				// truncation_side: "left" or none keeps that k; any other keeps
				// no tail (an error, keep 0: the routing text from the start).
				ks, serr := PromptTruncationSide(r.TruncatePromptTokens, r.TruncationSide)
				side := strings.TrimSpace(string(r.TruncationSide))
				if tail := keep == 0 || side == "" || side == "null" || side == `"left"`; tail != (serr == nil) || (serr == nil && ks != keep) || (serr != nil && ks != 0) {
					t.Fatalf("%q: keep %d, side %s: PromptTruncationSide %d, %v", body, keep, side, ks, serr)
				}
			}
		}
	})
}

// overSmall reports whether the parsed r (and its body, for content
// parts) passes FuzzParseOpenAI's small limits.
func overSmall(body []byte, r *openai.Request) bool {
	var v struct {
		Messages []struct {
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	parts := 0
	if json.Unmarshal(body, &v) == nil {
		for _, m := range v.Messages {
			var list []json.RawMessage
			if json.Unmarshal(m.Content, &list) == nil {
				parts += len(list)
			}
		}
	}
	prompts, ids := 0, 0
	if p := r.Prompt; p != nil {
		prompts = max(len(p.Texts), len(p.Tokens))
		for _, s := range p.Tokens {
			ids += len(s)
		}
	}
	return len(r.Messages) > 3 || parts > 4 || prompts > 2 || ids > 5
}

// FuzzCanonicalJSON: canonical form is idempotent and valid JSON, and the
// raw routing text within its limit (openai's FuzzCanonicalPrefixMatchesStd
// holds the form to encoding/json's).
func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[1,2,{"d":null,"c":"x"}]}`, ` [1, 2.50e3, "\u003c"] `, `"s"`, `{`, `1 2`, `{"a":1,"a":2}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		c, ok := openai.CanonicalPrefix(body, 1<<20)
		if !ok {
			return
		}
		c2, ok := openai.CanonicalPrefix(c, 1<<20)
		if !ok || !bytes.Equal(c, c2) {
			t.Fatalf("not idempotent: %q -> %q (%v)", c, c2, ok)
		}
		if !json.Valid(c) {
			t.Fatalf("canonical form not valid JSON: %q", c)
		}
		if txt := RawRoutingText(body, 16, true); len(txt) > 16 {
			t.Fatalf("raw routing text over limit: %d", len(txt))
		}
	})
}

// parseOpenAIStd is the encoding/json reading of a body: the reference the
// hand-written decoder is held to.
func parseOpenAIStd(body []byte) (*openai.Request, error) {
	var r openai.Request
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// FuzzDecodeOpenAIMatchesStd holds the hand-written decoder to
// encoding/json: same accept/reject and the same fields.
func FuzzDecodeOpenAIMatchesStd(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi \u00e9 \ud83d\ude00 \ud800 x"}],"stream":true}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url"}]},null]}`,
		`{"model":"m","prompt":[1,2,3],"prompt_cache_key":"k","extra":{"a":[1.5e3,-0,true,false,null]}}`,
		`{"model":"m","prompt":"long \"quoted\" \\ text\n"}`, `{"prompt":[[1],[2,3]]}`, `{"prompt":["a",null]}`,
		`null`, ` {} `, `{"model":null,"stream":null,"messages":null,"prompt":null}`,
		`{"model":5}`, `{"stream":"yes"}`, `{"messages":{}}`, `{"messages":[5]}`, `{"messages":[{"content":7}]}`,
		`[1]`, `"s"`, `{"a":01}`, `{"a":1.}`, `{"a":-}`, `{"a":"\x01"}`, `{"a":"\q"}`, `{"a":"\u12"}`, `{} x`, `{"a" 1}`, `{,}`, `{"a":1,}`, "{\"a\":\"\xff\"}",
		`{"model":"m"}` + "\n", `{"Model":"m"}`, `{"model":"a","model":"b"}`,
		`{"cache_salt":"s\u00e9","add_generation_prompt":false,"continue_final_message":null,"add_special_tokens":5,"tools":[{"type":"function"}],"chat_template_kwargs":{"enable_thinking":true}}`,
		`{"messages":[{"role":"tool","name":"n","tool_call_id":"c1","reasoning_content":null,"tool_calls":[{"id":"c1"}],"content":"x"}]}`,
		`{"cache_salt":{"nested":[1,2]},"tools":null}`, `{"Cache_Salt":"x"}`,
		`{"messages":[{"role":"developer","content":"x","tools":[{"type":"function","function":{"name":"f"}}]},{"role":"developer","tools":null}]}`,
		`{"vllm_xargs":{"kv_transfer_params":"x"},"vllm_xargs":{"a":1}}`, `{"vllm_xargs":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var fast openai.Request
		ferr := openai.Decode(body, &fast, openai.Limits{})
		std, serr := parseOpenAIStd(body)
		if !routertest.ComparableWithStd(body) {
			return
		}
		if (ferr == nil) != (serr == nil) {
			t.Fatalf("%q: fast err %v, encoding/json err %v", body, ferr, serr)
		}
		if ferr != nil {
			return
		}
		a, _ := json.Marshal(fast)
		b, _ := json.Marshal(std)
		if !bytes.Equal(a, b) {
			t.Fatalf("%q:\nfast %s\nstd  %s", body, a, b)
		}
	})
}

// TestDecodeVLLMFields: the fields rendering and block keys need are kept
// raw, with exact keys; rawString reads them as encoding/json would.
func TestDecodeVLLMFields(t *testing.T) {
	body := []byte(`{"Cache_Salt":"no","cache_salt":"a","cache_salt" : "b\u00e9","Tools":[1],"tools": [ {"x":1} ],` +
		`"add_generation_prompt":false,"continue_final_message":true,"add_special_tokens":false,"chat_template_kwargs":{"k":[1]},` +
		`"messages":[{"role":"tool","Name":"no","name":"fn","tool_call_id":"c\n1","reasoning_content":null,"tool_calls":[{"id":"c1"}],"content":[{"type":"text","text":"t"}]}]}`)
	r, err := ParseOpenAI(EndpointChatCompletions, body)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		got, want string
	}{
		{"cache_salt", string(r.CacheSalt), `"b\u00e9"`},
		{"tools", string(r.Tools), `[ {"x":1} ]`},
		{"add_generation_prompt", string(r.AddGenerationPrompt), `false`},
		{"continue_final_message", string(r.ContinueFinalMessage), `true`},
		{"add_special_tokens", string(r.AddSpecialTokens), `false`},
		{"chat_template_kwargs", string(r.ChatTemplateKwargs), `{"k":[1]}`},
		{"name", string(r.Messages[0].Name), `"fn"`},
		{"tool_call_id", string(r.Messages[0].ToolCallID), `"c\n1"`},
		{"reasoning_content", string(r.Messages[0].ReasoningContent), `null`},
		{"tool_calls", string(r.Messages[0].ToolCalls), `[{"id":"c1"}]`},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %s, want %s", c.name, c.got, c.want)
		}
	}
	if !r.Messages[0].Content.Array {
		t.Error("content parts not marked as an array")
	}
	for _, c := range []struct {
		raw  string
		want string
		ok   bool
	}{
		{``, "", true}, {`null`, "", true}, {`"b\u00e9"`, "bé", true}, {`5`, "", false}, {`"a" `, "", false}, {`{"a":1}`, "", false},
	} {
		if got, ok := openai.RawString([]byte(c.raw)); got != c.want || ok != c.ok {
			t.Errorf("rawString(%q) = %q, %v; want %q, %v", c.raw, got, ok, c.want, c.ok)
		}
	}
	// Appending to a kept value must not write into the body.
	salt := r.CacheSalt
	_ = append(salt, 'X')
	if !bytes.Equal(body, r.Source()) || bytes.Contains(body, []byte(`"b\u00e9"X`)) {
		t.Error("a raw value aliases the body's capacity")
	}
}

func TestDecodeDepthLimit(t *testing.T) {
	deep := `{"x":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `}`
	if _, err := ParseOpenAI(EndpointChatCompletions, []byte(deep)); err == nil {
		t.Fatal("20,000-deep document accepted")
	}
}
