package router_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// truncateTable is a one-pool prefix_aware table.
func truncateTable(t *testing.T) *router.Table {
	t.Helper()
	cfg := config.Config{Pools: []config.PoolConfig{{Name: "p", Model: "m",
		Routing:   config.RoutingConfig{Strategy: config.StrategyPrefixAware},
		Instances: []config.InstanceConfig{{ID: "i-0", URL: "http://i-0"}}}}}
	tb, commit, err := router.NewTable(cfg, nil, func(config.PoolConfig, *router.Pool) (router.Exact, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	commit()
	return tb
}

// TestRVTruncatePromptTokens: vLLM keeps a token-id prompt's last k ids
// when the request sets truncate_prompt_tokens k (the serving layer's
// _normalize_prompt_tokens_to_input: prompt_ids[-k:]), so the engine's
// blocks start at token len − k: the router keys those same ids. -1
// truncates to the model's max_model_len, which the router does not know:
// it routes heuristically and says why.
func TestRVTruncatePromptTokens(t *testing.T) {
	ids := make([]string, 64)
	for i := range ids {
		ids[i] = fmt.Sprint(1000 + i)
	}
	tb := truncateTable(t)
	tokens := func(extra string) ([]uint32, error) {
		t.Helper()
		body := `{"model":"m","prompt":[` + strings.Join(ids, ",") + `]` + extra + `}`
		req, _, err := tb.Resolve(router.Inbound{Endpoint: router.EndpointCompletions, Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		return req.TokenIDs(context.Background())
	}
	got, err := tokens(`,"truncate_prompt_tokens":32`)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 32 || got[0] != 1032 {
		t.Fatalf("router keys %d tokens starting with %d; vLLM prefills the last 32 (from 1032)", len(got), got[0])
	}
	for _, extra := range []string{``, `,"truncate_prompt_tokens":null`, `,"truncate_prompt_tokens":64`, `,"truncate_prompt_tokens":100`} {
		if got, err := tokens(extra); err != nil || len(got) != 64 || got[0] != 1000 {
			t.Errorf("%q: %d ids from %v (%v), want the whole prompt", extra, len(got), got[:min(1, len(got))], err)
		}
	}
	for _, extra := range []string{`,"truncate_prompt_tokens":-1`, `,"truncate_prompt_tokens":0`, `,"truncate_prompt_tokens":"32"`} {
		got, err := tokens(extra)
		if got != nil || !errors.Is(err, router.ErrTokenSource) || !strings.Contains(err.Error(), "truncate_prompt_tokens") {
			t.Errorf("%q: %d ids, err %v; want none and a token source error naming truncate_prompt_tokens (heuristic routing)", extra, len(got), err)
		}
	}
}
