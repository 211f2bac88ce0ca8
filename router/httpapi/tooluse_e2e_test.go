package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// toolChat is an agent's chat after a tool round trip: the assistant's tool
// call (no content), the tool's answer, and the follow-up.
const toolChat = `{"model":"tool-model","max_tokens":2,"messages":[
 {"role":"system","content":"You are a weather assistant. Answer in one short sentence, citing the tool output verbatim when it helps the user."},
 {"role":"user","content":"What is the weather in Paris and in Lyon today, and should I take an umbrella for the evening walk?"},
 {"role":"assistant","content":null,"tool_calls":[
   {"id":"call_paris_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\", \"unit\": \"celsius\", \"hours\": [18, 19, 20, 21]}"}},
   {"id":"call_lyon_2","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Lyon\", \"unit\": \"celsius\", \"hours\": [18, 19, 20, 21]}"}}]},
 {"role":"tool","tool_call_id":"call_paris_1","content":"Paris: 18C at 18h, light rain from 19h to 21h, wind 20 km/h from the west, humidity 85 percent."},
 {"role":"tool","tool_call_id":"call_lyon_2","content":"Lyon: 22C at 18h, clear sky all evening, wind 5 km/h from the south, humidity 40 percent."},
 {"role":"user","content":"Thanks. Summarise both cities for me."}],
 "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]}`

// llmdSimChat plays the engine's side: llm-d-inference-sim's dummy
// tokenizer, written here from its source (llm-d/llm-d-inference-sim at
// eec055a39e6b: pkg/tokenizer/tokenizer.go SimpleTokenizer.RenderMessages,
// pkg/api/response.go Message.PlainText) rather than taken from
// tokenizer.Simple, so that the router's rendering is checked against it.
type llmdSimChat struct{ tokenizer.Simple }

func (llmdSimChat) Render(msgs []tokenizer.Message, _ tokenizer.RenderOptions) (string, error) {
	var out string
	for _, m := range msgs {
		role := m.Role
		if m.ToolCallID != "" {
			role += "(" + m.ToolCallID + ")"
		}
		text := role + ": " + m.Content
		for _, tc := range m.ToolCalls {
			var args string
			if err := json.Unmarshal(tc.Function.Arguments, &args); err != nil {
				return "", err
			}
			text += "[" + tc.Function.Name + "(" + args + ")]"
		}
		out += "### " + text + "\n"
	}
	return out, nil
}

// TestToolChatPredictionMatchesEngine sends a tool-calling chat twice
// through kv_aware (the Simple token source) in front of a simulated engine
// (sim/simserver) that renders chats as llm-d-inference-sim does and whose KV
// events feed the index: the second time, the router's predicted cached
// tokens equal what the engine reports it served from cache. Keying tool
// calls short (without the tool call id and [name(args)]) predicted only
// the blocks before the first tool call.
func TestToolChatPredictionMatchesEngine(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	const model = "tool-model"
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: model, BlockSize: sim.DefaultBlockSize})
	if err != nil {
		t.Fatal(err)
	}
	port := testenv.FreePort(t)
	sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port), Bind: true})
	if err != nil {
		t.Fatal(err)
	}
	subCtx, stopSub := context.WithCancel(ctx)
	subDone := make(chan struct{})
	go func() {
		defer close(subDone)
		_ = sub.Run(subCtx, func(m enginezmq.Message) {
			if b, err := events.Decode(m.Payload); err == nil {
				_, _ = idx.Apply(ctx, "engine", b.Events)
			}
		})
	}()
	t.Cleanup(func() { stopSub(); <-subDone })
	log := slog.New(slog.DiscardHandler)
	in, err := simserver.Start(ctx, simserver.Config{Engine: sim.Config{Model: model}, TimeScale: 100, Logger: log, Tokenizer: llmdSimChat{},
		Events: simserver.EventsConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port), Dial: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = in.Close() })
	waitUntil(t, "events subscribed", in.EventsSubscribed)

	pc := config.PoolConfig{Name: "tools", Model: model,
		// Speculative entries would count the router's own keys as held:
		// expire them at once, so the prediction comes from engine events.
		Routing:   config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{SpeculativeTTL: time.Millisecond}},
		Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
		Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
		Instances: []config.InstanceConfig{{ID: "engine", URL: in.URL()}}}
	_, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: log,
		KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })})
	chat := func() (predicted string, cached int) {
		t.Helper()
		resp := servertest.Do(t, ts.URL, "POST", "/v1/chat/completions", []byte(toolChat), nil)
		var body struct {
			Usage routertest.Usage `json:"usage"`
		}
		if err := json.Unmarshal(resp.Body, &body); err != nil || resp.Status != 200 {
			t.Fatalf("chat: %d %v", resp.Status, err)
		}
		if body.Usage.PromptTokens < 8*sim.DefaultBlockSize {
			t.Fatalf("prompt of %d tokens: too short to tell", body.Usage.PromptTokens)
		}
		return resp.Header.Get(router.HeaderMatchedTokens), body.Usage.Details.Cached
	}
	if _, cached := chat(); cached != 0 {
		t.Fatalf("first chat: engine cached %d", cached)
	}
	waitUntil(t, "the engine's blocks in the index", func() bool { n, _ := idx.Len(ctx); return n >= 8 })
	predicted, cached := chat()
	if want := fmt.Sprintf("gpu=%d,cpu=0,disk=0,shared=0", cached); cached == 0 || predicted != want {
		t.Fatalf("repeated tool chat: router predicted %q, engine served %d tokens from cache (want %q)", predicted, cached, want)
	}
}

// TestWarmPrefixCopyServesTheChat: a warm-up copy of a chat's prefix, sent
// as the completion of the first Warm.Tokens token ids the router derived
// from the chat (its token source, the template rendered), makes the
// engine it goes to hold the chat's leading blocks: the chat itself, sent
// to that engine afterwards, is served those tokens from cache. A copy of
// the client's request (no Tokens) makes it hold the whole prompt's full
// blocks. The engine (sim/simserver) renders chats as llm-d-inference-sim
// does and keys blocks from token ids, adapter and cache_salt as vLLM.
func TestWarmPrefixCopyServesTheChat(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	const model = "tool-model"
	log := slog.New(slog.DiscardHandler)
	start := func() *simserver.Instance {
		in, err := simserver.Start(ctx, simserver.Config{Engine: sim.Config{Model: model}, TimeScale: 100, Logger: log, Tokenizer: llmdSimChat{}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = in.Close() })
		return in
	}
	engines := []*simserver.Instance{start(), start()}
	pc := config.PoolConfig{Name: "tools", Model: model,
		Routing:   config.RoutingConfig{Strategy: config.StrategyKVAware},
		Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
		Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i, in := range engines {
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("engine-%d", i), URL: in.URL()})
	}
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: model, BlockSize: sim.DefaultBlockSize})
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{Logger: log,
		KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })})
	pool := srv.Pools()[0]
	chatOn := func(in *simserver.Instance) (prompt, cached int) {
		t.Helper()
		resp := servertest.Do(t, in.URL(), "POST", "/v1/chat/completions", []byte(toolChat), nil)
		var body struct {
			Usage routertest.Usage `json:"usage"`
		}
		if err := json.Unmarshal(resp.Body, &body); err != nil || resp.Status != 200 {
			t.Fatalf("chat: %d %v", resp.Status, err)
		}
		return body.Usage.PromptTokens, body.Usage.Details.Cached
	}
	copyTo := func(i int, tokens int) {
		t.Helper()
		req, _, err := srv.Resolve(router.Inbound{Endpoint: router.EndpointChatCompletions, Body: []byte(toolChat), Forwards: true})
		if err != nil {
			t.Fatal(err)
		}
		// The decision the copy rides on: kv_aware tokenizes the chat
		// with the pool's token source, as on the data plane.
		_, strat := pool.Routing()
		d, err := strat.Pick(ctx, req, pool.Instances())
		if err != nil {
			t.Fatal(err)
		}
		if d.Observer != nil {
			d.Observer.Done(200, -1)
		}
		inst := poolInstance(t, pool, fmt.Sprintf("engine-%d", i))
		o := &doneObserver{status: make(chan int, 1)}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		httpapi.SendWarm(srv, r, pool, req, "/v1/chat/completions", &router.Warm{Instance: inst, Observer: o, Tokens: tokens}, nil)
		select {
		case st := <-o.status:
			if st != http.StatusOK {
				t.Fatalf("copy to engine-%d answered %d", i, st)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the copy's observer never ended")
		}
	}

	const bs = sim.DefaultBlockSize
	prefix := 4 * bs
	copyTo(0, prefix)
	prompt, cached := chatOn(engines[0])
	if prompt < 8*bs {
		t.Fatalf("prompt of %d tokens: too short to tell", prompt)
	}
	if cached != prefix {
		t.Fatalf("the chat after a copy of its first %d tokens: %d served from cache, want %d", prefix, cached, prefix)
	}
	copyTo(1, 0)
	if _, cached := chatOn(engines[1]); cached != prompt/bs*bs && cached != (prompt-1)/bs*bs {
		t.Fatalf("the chat after a copy of the whole request: %d of %d served from cache, want its full blocks", cached, prompt)
	}
}
