package openai_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/openai"
)

// defaults are the router's default limits (config.LimitsConfig).
var defaults = openai.Limits{Messages: 4096, ContentParts: 8192, Prompts: 4096, TokenIDs: 1 << 20}

// TestParseAllocationBounded: parsing a body costs a few times the body at
// most, whatever its lists hold. Before the limits were checked inside the
// scan, a 3 MiB body of "{}," messages allocated 862 MB (274x) before its
// 400, and a prompt of "[0]," lists 354 MB (84x), with no limit at all.
func TestParseAllocationBounded(t *testing.T) {
	const n = 1 << 20
	for _, tc := range []struct {
		name string
		kind openai.Kind
		body string
		lim  openai.Limits
	}{
		{"messages", openai.Chat, `{"model":"m","messages":[` + strings.Repeat(`{},`, n) + `{}]}`, defaults},
		{"null messages", openai.Chat, `{"model":"m","messages":[` + strings.Repeat(`null,`, n) + `{}]}`, defaults},
		{"content parts", openai.Chat, `{"model":"m","messages":[{"role":"user","content":[` + strings.Repeat(`{},`, n) + `{}]}]}`, defaults},
		{"content parts over messages", openai.Chat, `{"model":"m","messages":[` + strings.Repeat(`{"content":[{},{},{},{}]},`, n/8) + `{}]}`, defaults},
		{"token-id lists", openai.Completions, `{"model":"m","prompt":[` + strings.Repeat(`[0],`, n) + `[0]]}`, defaults},
		{"string list", openai.Completions, `{"model":"m","prompt":[` + strings.Repeat(`"",`, n) + `""]}`, defaults},
		{"null token ids", openai.Completions, `{"model":"m","prompt":[null` + strings.Repeat(`,0`, n) + `]}`, defaults},
		{"flat token ids", openai.Completions, `{"model":"m","prompt":[` + strings.Repeat(`0,`, n) + `0]}`, defaults},
		// Without limits each list is still built at its size, never grown.
		{"token-id lists, no limits", openai.Completions, `{"model":"m","prompt":[` + strings.Repeat(`[0],`, n) + `[0]]}`, openai.Limits{}},
		{"string list, no limits", openai.Completions, `{"model":"m","prompt":[` + strings.Repeat(`"",`, n) + `""]}`, openai.Limits{}},
		// A repeated member reuses the slice of the one it replaces.
		{"repeated messages", openai.Chat, `{"model":"m"` + strings.Repeat(`,"messages":[`+strings.Repeat(`{},`, 4095)+`{}]`, 256) + `}`, defaults},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			alloc := testenv.Allocated(func() { _, _ = openai.Parse(tc.kind, body, tc.lim) })
			if alloc > 8*uint64(len(body)) {
				t.Fatalf("parsing a %d-byte body allocated %d bytes (%.0fx)", len(body), alloc, float64(alloc)/float64(len(body)))
			}
			t.Logf("%d-byte body: %d bytes allocated (%.2fx)", len(body), alloc, float64(alloc)/float64(len(body)))
		})
	}
}

// TestParseLimits: a body over a limit is a *LimitError naming how many it
// holds, as the check after the parse said before.
func TestParseLimits(t *testing.T) {
	lim := openai.Limits{Messages: 2, ContentParts: 3, Prompts: 2, TokenIDs: 4}
	for _, tc := range []struct {
		kind openai.Kind
		body string
		msg  string // "" = accepted
	}{
		{openai.Chat, `{"messages":[{},null]}`, ""},
		{openai.Chat, `{"messages":[{},null,{},{}]}`, "messages: 4 messages exceed the limit of 2"},
		{openai.Chat, `{"messages":[{},{},{}],"messages":[{}]}`, "messages: 3 messages exceed the limit of 2"},
		{openai.Chat, `{"messages":[{"content":[{},{}]},{"content":[{"text":"x"}]}]}`, ""},
		{openai.Chat, `{"messages":[{"content":[{},{}]},{"content":[{},{}]}]}`, "messages: content parts exceed the limit of 3"},
		{openai.Chat, `{"messages":[{"content":[{},{},{}]}],"messages":[{"content":[{},{},{}]}]}`, ""}, // per value
		{openai.Completions, `{"prompt":["a","b"]}`, ""},
		{openai.Completions, `{"prompt":["a","b",null]}`, "prompt: 3 prompts exceed the limit of 2"},
		{openai.Completions, `{"prompt":[[1],[2],[3]]}`, "prompt: 3 prompts exceed the limit of 2"},
		{openai.Completions, `{"prompt":[[1,2,3],[4,5]]}`, "prompt: 5 token ids exceed the limit of 4"},
		{openai.Completions, `{"prompt":[1,2,3,4,5]}`, "prompt: 5 token ids exceed the limit of 4"},
		{openai.Completions, `{"prompt":[1,2,3,4]}`, ""},
		{openai.Completions, `{"prompt":[null,2,3,4,5,6]}`, "prompt: 6 token ids exceed the limit of 4"},
		{openai.Completions, `{"prompt":"a long text is not counted as ids"}`, ""},
		// Malformed JSON in the list counted is malformed, as before.
		{openai.Chat, `{"messages":[{},{},{},{]}`, "malformed JSON body"},
		{openai.Completions, `{"prompt":[1,2,3,4,5,]}`, "malformed JSON body"},
	} {
		_, err := openai.Parse(tc.kind, []byte(tc.body), lim)
		switch {
		case tc.msg == "" && err != nil:
			t.Errorf("%s: %v", tc.body, err)
		case tc.msg != "" && (err == nil || !strings.Contains(err.Error(), tc.msg)):
			t.Errorf("%s: error %v, want %q", tc.body, err, tc.msg)
		case err != nil && strings.Contains(tc.msg, "exceed"):
			if le := (*openai.LimitError)(nil); !errors.As(err, &le) {
				t.Errorf("%s: %T is not a *LimitError", tc.body, err)
			}
		}
	}
}
