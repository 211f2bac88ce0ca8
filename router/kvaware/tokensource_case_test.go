package kvaware

import (
	"context"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// Keys are exact, as vLLM reads them: ChatCompletionRequest (pydantic,
// extra="allow", case-sensitive names) logs a key that differs from a field
// only in case as "present in the request but ignored", and the message
// TypedDicts read message["content"] and the like. A case variant is so
// ignored, never read as the field (encoding/json folds key case).
func TestChatKeysExact(t *testing.T) {
	src := &ChatTokenSource{Tokenizer: tokenizer.Local(tokenizer.Simple{})}
	parts := `{"role":"user","content":[{"type":"text","text":"alpha beta"}]}`
	cases := []struct{ name, body, same string }{
		{"Messages after messages", `{"messages":[` + parts + `],"Messages":[{"role":"user","content":"gamma delta"}]}`, `{"messages":[` + parts + `]}`},
		{"MESSAGES before messages", `{"MESSAGES":[{"role":"user","content":"gamma delta"}],"messages":[` + parts + `]}`, `{"messages":[` + parts + `]}`},
		{"Content in a message", `{"messages":[{"role":"user","content":[{"type":"text","text":"alpha beta"}],"Content":"zeta"}]}`, `{"messages":[` + parts + `]}`},
		{"Role in a message", `{"messages":[{"role":"user","content":[{"type":"text","text":"alpha beta"}],"Role":"assistant"}]}`, `{"messages":[` + parts + `]}`},
		{"Add_Generation_Prompt", `{"messages":[` + parts + `],"Add_Generation_Prompt":false}`, `{"messages":[` + parts + `]}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			want, err := src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: []byte(tc.same)})
			if err != nil {
				t.Fatal(err)
			}
			for _, ep := range []router.Endpoint{router.EndpointChatCompletions, router.EndpointInvoke} {
				req := &router.Request{Endpoint: ep, Body: []byte(tc.body)}
				if ep == router.EndpointChatCompletions {
					if req.Parsed, err = router.ParseOpenAI(ep, req.Body); err != nil {
						t.Fatal(err)
					}
				}
				got, err := src.Tokens(context.Background(), req)
				if err != nil || !slices.Equal(got, want) {
					t.Fatalf("endpoint %v: %v %v, want %v (the case variant ignored, as vLLM does)", ep, got, err, want)
				}
			}
		})
	}
	// Only a case variant of messages: vLLM answers 400 (messages is
	// required); the router has no tokens for it.
	body := []byte(`{"Messages":[` + parts + `]}`)
	for _, ep := range []router.Endpoint{router.EndpointChatCompletions, router.EndpointInvoke} {
		if ids, err := src.Tokens(context.Background(), &router.Request{Endpoint: ep, Body: body}); err == nil || len(ids) > 0 {
			t.Fatalf("endpoint %v: %v %v, want no tokens", ep, ids, err)
		}
	}
	if _, err := parseChatBody(body); err != nil {
		t.Fatal(err)
	}
	if b, _ := parseChatBody(body); len(b.Messages) != 0 {
		t.Fatalf("parseChatBody read Messages as messages: %+v", b.Messages)
	}
}
