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
