package httpapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// doneObserver records what a warm-up copy's observer was told.
type doneObserver struct {
	first  int
	status chan int
}

func (o *doneObserver) FirstByte()              { o.first++ }
func (o *doneObserver) Done(status, cached int) { o.status <- status }

// TestWarmCopy: a warm-up copy goes to its instance as the client's
// request rewritten to one output token, not streamed, one choice (the
// prompt and its options kept; the members vLLM would refuse beside
// max_tokens 1 removed), with the client's headers; the instance counts
// it in flight until it ends, and its observer ends whatever the answer:
// 200, an error status, or a body the router cannot rewrite.
func TestWarmCopy(t *testing.T) {
	h := newHarness(t, 2, nil)
	pool := h.srv.Pools()[0]
	inst := poolInstance(t, pool, h.ups[1].ID)
	body := `{"model":"` + model + `","messages":[{"role":"system","content":"tools"},{"role":"user","content":"go"}],` +
		`"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":500,"min_tokens":5,"n":2,"cache_salt":"s1","temperature":0.2}`
	gate, err := flowcontrol.NewGate(flowcontrol.Config{InstancePrefill: 8192, MaxConcurrency: 8},
		flowcontrol.WithInstances(func() []string { return []string{h.ups[0].ID, inst.ID()} }))
	if err != nil {
		t.Fatal(err)
	}
	send := func(body string) (int, *doneObserver) {
		t.Helper()
		// The request the copy rides on, admitted and bound to the holder;
		// the copy holds its own instance's budget until it ends.
		tk, err := gate.Acquire(context.Background(), flowcontrol.Item{Prefill: 3000, Cost: 3500})
		if err != nil {
			t.Fatal(err)
		}
		defer tk.Done()
		tk.Bind(h.ups[0].ID)
		wt := tk.Companion(inst.ID())
		if wt == nil {
			t.Fatal("no companion ticket for an admitted request")
		}
		if l := instanceLoad(gate, inst.ID()); l.InFlight != 1 || l.PendingPrefill != 3000 {
			t.Fatalf("the copy's instance before it was sent: %+v, want 1 in flight, 3,000 pending", l)
		}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		r.Header.Set("Authorization", "Bearer k")
		req := &router.Request{Endpoint: router.EndpointChatCompletions, Pool: pool.Name(), Model: model, Body: []byte(body)}
		o := &doneObserver{status: make(chan int, 1)}
		httpapi.SendWarm(h.srv, r, pool, req, "/v1/chat/completions", &router.Warm{Instance: inst, Observer: o}, wt)
		select {
		case st := <-o.status:
			if l := instanceLoad(gate, inst.ID()); l.InFlight != 0 || l.PendingPrefill != 0 {
				t.Errorf("the copy's instance after it ended: %+v, want nothing held", l)
			}
			return st, o
		case <-time.After(30 * time.Second):
			t.Fatal("the warm-up copy's observer never ended")
		}
		return 0, nil
	}

	st, o := send(body)
	if st != http.StatusOK || o.first != 1 {
		t.Fatalf("warm-up copy: status %d, first byte %d times; want 200 once", st, o.first)
	}
	var got map[string]any
	if err := json.Unmarshal(h.ups[1].LastBody(), &got); err != nil {
		t.Fatalf("upstream body: %v: %s", err, h.ups[1].LastBody())
	}
	for k, want := range map[string]any{"max_tokens": 1.0, "max_completion_tokens": 1.0, "stream": false, "cache_salt": "s1", "temperature": 0.2, "model": model} {
		if got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
	for _, k := range []string{"stream_options", "min_tokens", "n"} {
		if _, ok := got[k]; ok {
			t.Errorf("%s kept: vLLM refuses it beside one output token or a non-streamed answer", k)
		}
	}
	if m, _ := got["messages"].([]any); len(m) != 2 {
		t.Errorf("messages = %v, want the client's two", got["messages"])
	}
	if n := inst.InFlight(); n != 0 {
		t.Errorf("instance in flight %d after the copy ended, want 0", n)
	}

	h.ups[1].Set(routertest.Status, http.StatusServiceUnavailable, 0)
	svc := gate.Stats().ServiceTTFT
	if st, o := send(body); st != http.StatusServiceUnavailable || o.first != 0 {
		t.Errorf("refused copy: observer ended with %d, first byte told %d times; want 503, never", st, o.first)
	}
	if got := gate.Stats().ServiceTTFT; got != svc {
		t.Errorf("a refused copy taught the queue a service time: %v, was %v", got, svc)
	}
	h.ups[1].Set(routertest.Normal, 0, 0)
	before := len(h.ups[1].Paths())
	if st, _ := send(`{"messages":`); st != 0 || len(h.ups[1].Paths()) != before {
		t.Errorf("unrewritable body: observer ended with %d and %d requests sent, want 0 and none", st, len(h.ups[1].Paths())-before)
	}
	if n := inst.InFlight(); n != 0 {
		t.Errorf("instance in flight %d at the end, want 0", n)
	}
}

// poolInstance is pool's instance id.
func poolInstance(t *testing.T, pool *router.Pool, id string) *router.Instance {
	t.Helper()
	for _, c := range pool.Instances() {
		if c.ID() == id {
			return c
		}
	}
	t.Fatalf("no instance %s in pool %s", id, pool.Name())
	return nil
}

// instanceLoad is the gate's load on instance (zero when it holds none).
func instanceLoad(g *flowcontrol.Gate, instance string) flowcontrol.InstanceLoad {
	for _, l := range g.Stats().Instances {
		if l.Instance == instance {
			return l
		}
	}
	return flowcontrol.InstanceLoad{}
}

// warmPick decides as kv_aware does when it buys a hot prefix's copy by
// warming it: the request to one instance, a warm-up copy to another.
type warmPick struct {
	to, warm *router.Instance
	obs      router.Observer
}

func (p *warmPick) Name() string { return "warm-pick" }

func (p *warmPick) Pick(context.Context, *router.Request, []*router.Instance) (router.Decision, error) {
	return router.Decision{Instance: p.to, Strategy: "warm-pick", Reason: router.ReasonKVMatch,
		Warm: &router.Warm{Instance: p.warm, Observer: p.obs}}, nil
}

// TestRouteWarmCopyHoldsFlowBudget: with a flow-control queue, the data
// plane counts a decision's warm-up copy beside the request
// (Ticket.Companion), and the copy's budget is free again once it ends.
func TestRouteWarmCopyHoldsFlowBudget(t *testing.T) {
	h := newHarness(t, 2, nil)
	pool := h.srv.Pools()[0]
	byID := map[string]*router.Instance{}
	for _, c := range pool.Instances() {
		byID[c.ID()] = c
	}
	holder, other := byID[h.ups[0].ID], byID[h.ups[1].ID]
	gate, err := flowcontrol.NewGate(flowcontrol.Config{InstancePrefill: 8192, MaxConcurrency: 8},
		flowcontrol.WithInstances(func() []string { return []string{holder.ID(), other.ID()} }))
	if err != nil {
		t.Fatal(err)
	}
	tk, err := gate.Acquire(context.Background(), flowcontrol.Item{Prefill: 3000, Cost: 3500})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"go"}],"max_tokens":20}`
	req := &router.Request{Endpoint: router.EndpointChatCompletions, Pool: pool.Name(), Model: model, Body: []byte(body)}
	o := &doneObserver{status: make(chan int, 1)}
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	rec := httptest.NewRecorder()
	httpapi.RouteForTest(h.srv, rec, r, pool, &warmPick{to: holder, warm: other, obs: o}, req, tk, "/v1/chat/completions")
	if rec.Code != http.StatusOK {
		t.Fatalf("request: %d %s", rec.Code, rec.Body.String())
	}
	select {
	case <-o.status:
	case <-time.After(30 * time.Second):
		t.Fatal("the warm-up copy's observer never ended")
	}
	tk.Done()
	st := gate.Stats()
	if st.Counts.Companions != 1 {
		t.Errorf("companions counted %d, want the one warm-up copy", st.Counts.Companions)
	}
	if st.InFlight != 0 || st.PendingPrefill != 0 {
		t.Errorf("queue after the request and its copy ended: %d in flight, %d pending", st.InFlight, st.PendingPrefill)
	}
	if got := h.ups[1].Paths(); len(got) != 1 {
		t.Errorf("the copy's instance got %d requests, want the one copy", len(got))
	}
}

// fixedTokens is a token source that answers ids, or err.
type fixedTokens struct {
	ids []uint32
	err error
}

func (f fixedTokens) Tokens(context.Context, *router.Request) ([]uint32, error) { return f.ids, f.err }

// TestWarmCopyPrefix: a copy that names a prefix (Warm.Tokens) goes to
// the engine's completions endpoint as the request's first Tokens token
// ids, with its model (adapter) and cache_salt — what the engine hashes
// the request's leading blocks from — for one output token, whatever the
// client's endpoint; where the request's ids cannot be had, the copy is
// the client's request rewritten, on the client's path.
func TestWarmCopyPrefix(t *testing.T) {
	h := newHarness(t, 2, nil)
	pool := h.srv.Pools()[0]
	inst := poolInstance(t, pool, h.ups[1].ID)
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"go"}],"stream":true,"cache_salt":"s1","max_completion_tokens":50,"priority":-5}`
	ids := []uint32{101, 7, 65535, 70000, 3, 9, 12, 4}
	send := func(src router.TokenSource) (path string, got map[string]any) {
		t.Helper()
		before := len(h.ups[1].Paths())
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		req := &router.Request{Endpoint: router.EndpointChatCompletions, Pool: pool.Name(), Model: model, Body: []byte(body), Tokenizer: src}
		o := &doneObserver{status: make(chan int, 1)}
		httpapi.SendWarm(h.srv, r, pool, req, "/v1/chat/completions", &router.Warm{Instance: inst, Observer: o, Tokens: 5}, nil)
		select {
		case st := <-o.status:
			if st != http.StatusOK {
				t.Fatalf("copy answered %d, want 200", st)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the warm-up copy's observer never ended")
		}
		paths := h.ups[1].Paths()
		if len(paths) != before+1 {
			t.Fatalf("%d requests reached the instance, want 1", len(paths)-before)
		}
		if err := json.Unmarshal(h.ups[1].LastBody(), &got); err != nil {
			t.Fatalf("upstream body: %v: %s", err, h.ups[1].LastBody())
		}
		return paths[len(paths)-1], got
	}

	path, got := send(fixedTokens{ids: ids})
	if path != "/v1/completions" {
		t.Errorf("prefix copy sent to %s, want /v1/completions", path)
	}
	prompt, _ := got["prompt"].([]any)
	if len(prompt) != 5 {
		t.Fatalf("prompt = %v, want the first 5 of %v", got["prompt"], ids)
	}
	for i, v := range prompt {
		if v != float64(ids[i]) {
			t.Errorf("prompt[%d] = %v, want %d", i, v, ids[i])
		}
	}
	for k, want := range map[string]any{"model": model, "max_tokens": 1.0, "stream": false, "cache_salt": "s1", "priority": -5.0} {
		if got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
	if _, ok := got["messages"]; ok {
		t.Error("prefix copy carries the client's messages: the engine would template them, not reuse the ids")
	}

	// No ids (the token source failed, or fewer ids than the prefix):
	// the client's request rewritten, on its own path.
	for name, src := range map[string]router.TokenSource{
		"error": fixedTokens{err: router.ErrTokenSource},
		"short": fixedTokens{ids: ids[:3]},
	} {
		path, got := send(src)
		if path != "/v1/chat/completions" || got["max_completion_tokens"] != 1.0 || got["cache_salt"] != "s1" {
			t.Errorf("%s: copy to %s with %v; want the client's request for one token on its own path", name, path, got)
		}
	}
}

// TestWarmCopyPrefixMedia: a request with an image (or any content part
// without text) is copied as the client's request rewritten, on its own
// path, never as token ids: vLLM hashes the blocks an image's placeholder
// tokens fill from the image too (its multimodal extra keys), which a
// prompt of bare ids lacks, so an id copy would compute blocks the
// request never reads, and its events, keyed by the ids alone, would
// draw the prefix's requests to an instance that does not hold them.
func TestWarmCopyPrefixMedia(t *testing.T) {
	h := newHarness(t, 2, nil)
	pool := h.srv.Pools()[0]
	inst := poolInstance(t, pool, h.ups[1].ID)
	body := `{"model":"` + model + `","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"what is it"}]}],"max_tokens":50}`
	parsed, err := router.ParseOpenAI(router.EndpointChatCompletions, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	req := &router.Request{Endpoint: router.EndpointChatCompletions, Pool: pool.Name(), Model: model, Body: []byte(body), Parsed: parsed,
		Tokenizer: fixedTokens{ids: []uint32{101, 7, 151655, 151655, 151655, 3, 9, 12}}}
	o := &doneObserver{status: make(chan int, 1)}
	before := len(h.ups[1].Paths())
	httpapi.SendWarm(h.srv, r, pool, req, "/v1/chat/completions", &router.Warm{Instance: inst, Observer: o, Tokens: 5}, nil)
	select {
	case <-o.status:
	case <-time.After(30 * time.Second):
		t.Fatal("the warm-up copy's observer never ended")
	}
	paths := h.ups[1].Paths()
	if len(paths) != before+1 {
		t.Fatalf("%d requests reached the instance, want 1", len(paths)-before)
	}
	var got map[string]any
	if err := json.Unmarshal(h.ups[1].LastBody(), &got); err != nil {
		t.Fatalf("upstream body: %v: %s", err, h.ups[1].LastBody())
	}
	if p := paths[len(paths)-1]; p != "/v1/chat/completions" || got["messages"] == nil || got["prompt"] != nil || got["max_tokens"] != 1.0 {
		t.Errorf("copy of an image request to %s with %v; want the client's request for one token, image included, on its own path", p, got)
	}
}
