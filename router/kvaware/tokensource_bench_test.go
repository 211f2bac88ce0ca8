package kvaware

import (
	"context"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkRawChatTokens: a raw /invocations chat body (not parsed by the
// router before) of a ~32 KiB system prompt and a question, to token ids
// with the simple tokenizer: the body's decoding is most of it.
func BenchmarkRawChatTokens(b *testing.B) {
	src, _ := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceSimple}, config.PoolConfig{})
	body := []byte(`{"messages":[{"role":"system","content":"` + strings.Repeat("you are a careful assistant. ", 1100) +
		`"},{"role":"user","content":"what changed?"}],"max_tokens":16}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointInvoke, Body: body}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParsedChatTokensEscaped: a parsed chat body of a ~37 KiB system
// prompt written with \u escapes (Python's json.dumps ensure_ascii, Go's
// encoding/json HTML escapes), to token ids with the simple tokenizer: the
// members the token source reads come from the parse, not another scan.
func BenchmarkParsedChatTokensEscaped(b *testing.B) {
	src, _ := NewTokenSource(&config.TokenizerConfig{Source: TokenSourceSimple}, config.PoolConfig{})
	body := []byte(`{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat(`caf\u00e9 \u003cb\u003e na\u00efve text. `, 1100) +
		`"},{"role":"user","content":"what changed?"}],"max_tokens":16}`)
	parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, body)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: body, Parsed: parsed}); err != nil {
			b.Fatal(err)
		}
	}
}
