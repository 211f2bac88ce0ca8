package router_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// truncateTable is a one-pool prefix_aware table.
func truncateTable(t *testing.T) *router.Table {
	t.Helper()
	return onePoolTable(t, nil)
}

// onePoolTable is a table of pool "p" (model "m", prefix_aware, one
// instance), edit applied to its configuration first.
func onePoolTable(t *testing.T, edit func(*config.PoolConfig)) *router.Table {
	t.Helper()
	cfg := config.Config{Pools: []config.PoolConfig{{Name: "p", Model: "m",
		Routing:   config.RoutingConfig{Strategy: config.StrategyPrefixAware},
		Instances: []config.InstanceConfig{{ID: "i-0", URL: "http://i-0"}}}}}
	if edit != nil {
		edit(&cfg.Pools[0])
	}
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

// TestPrefixAwareKeysKeptTokens: prefix_aware's key is the prefix of what
// the engine caches, and with truncate_prompt_tokens k vLLM caches only a
// token-id prompt's last k ids (prompt_ids[-k:]). Two prompts whose kept
// tails are equal go to one home whatever their dropped heads; two that
// share a head but keep different tails are keyed apart.
func TestPrefixAwareKeysKeptTokens(t *testing.T) {
	tb := truncateTable(t)
	ids := func(seed, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprint(1000*seed + i)
		}
		return out
	}
	resolve := func(head, tail []string, extra string) *router.Request {
		t.Helper()
		body := `{"model":"m","prompt":[` + strings.Join(append(slices.Clone(head), tail...), ",") + `]` + extra + `}`
		req, _, err := tb.Resolve(router.Inbound{Endpoint: router.EndpointCompletions, Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		return req
	}
	const trunc = `,"truncate_prompt_tokens":32`
	headA, headB, tailX, tailY := ids(1, 2000), ids(2, 2000), ids(3, 32), ids(4, 32) // heads past prefix_length (8,192 characters)
	ax, bx, ay := resolve(headA, tailX, trunc), resolve(headB, tailX, trunc), resolve(headA, tailY, trunc)
	if ax.RoutingText != bx.RoutingText {
		t.Errorf("equal kept tails, different dropped heads: routing texts %.40q… and %.40q… differ", ax.RoutingText, bx.RoutingText)
	}
	if ax.RoutingText == ay.RoutingText {
		t.Errorf("equal dropped heads, different kept tails: one routing text %.40q…", ax.RoutingText)
	}
	insts := make([]*router.Instance, 64)
	for i := range insts {
		insts[i], _ = router.NewInstance(fmt.Sprintf("i-%d", i), fmt.Sprintf("http://10.0.0.%d", i+1))
	}
	pa := router.NewPrefixAware(64, nil)
	home := func(r *router.Request) string {
		d, err := pa.Pick(context.Background(), r, insts)
		if err != nil {
			t.Fatal(err)
		}
		return d.Instance.ID()
	}
	if home(ax) != home(bx) {
		t.Errorf("equal kept tails: homes %s and %s, want one", home(ax), home(bx))
	}
	// Without truncation the whole prompt is cached, and routes by its head.
	if a, b := resolve(headA, tailX, ""), resolve(headA, tailY, ""); a.RoutingText[:100] != b.RoutingText[:100] {
		t.Errorf("untruncated prompts sharing a head: routing texts %.40q… and %.40q…, want the head first", a.RoutingText, b.RoutingText)
	}
}
