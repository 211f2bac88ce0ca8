package router_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// TestTruncationSideRight: vLLM main takes a request's truncation_side
// ("right" keeps the first N tokens, "left" the last; absent: the
// tokenizer's, left for generative models) with truncate_prompt_tokens
// (ChatCompletionRequest/CompletionRequest.truncation_side, TokenizeParams
// _token_truncation; vllm/entrypoints/openai/chat_completion/protocol.py @
// 002032ee). With "right" the engine caches the prompt's first k ids, so
// the router must not key its last k: prefix_aware keys the prompt's start
// (what the kept head begins with), and no token ids are claimed (kv_aware
// routes heuristically). A side vLLM refuses is refused alike.
func TestTruncationSideRight(t *testing.T) {
	ids := make([]string, 64)
	for i := range ids {
		ids[i] = fmt.Sprint(1000 + i)
	}
	tb := truncateTable(t)
	resolve := func(extra string) *router.Request {
		t.Helper()
		body := `{"model":"m","prompt":[` + strings.Join(ids, ",") + `],"truncate_prompt_tokens":32` + extra + `}`
		req, _, err := tb.Resolve(router.Inbound{Endpoint: router.EndpointCompletions, Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		return req
	}
	right := resolve(`,"truncation_side":"right"`)
	if !strings.HasPrefix(right.RoutingText, "1000 1001 ") {
		t.Errorf(`"right" keeps the first 32 ids; routing text %.30q…, want it to start at 1000`, right.RoutingText)
	}
	if got, err := right.TokenIDs(context.Background()); got != nil && (len(got) != 32 || got[0] != 1000) {
		t.Errorf(`"right": router keys %d ids from %d (%v); vLLM prefills the first 32 (from 1000)`, len(got), got[0], err)
	}
	for _, extra := range []string{`,"truncation_side":"left"`, `,"truncation_side":null`} {
		if got, err := resolve(extra).TokenIDs(context.Background()); err != nil || len(got) != 32 || got[0] != 1032 {
			t.Errorf("%q: %d ids (%v), want the last 32 (from 1032)", extra, len(got), err)
		}
	}
	if got, err := resolve(`,"truncation_side":"middle"`).TokenIDs(context.Background()); got != nil || !errors.Is(err, router.ErrTokenSource) {
		t.Errorf(`"middle": %d ids, %v; want none and a token source error`, len(got), err)
	}
}
