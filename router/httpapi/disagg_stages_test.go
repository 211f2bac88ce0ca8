package httpapi_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/servertest"
	"github.com/kvrouter/kvrouter/sim"
)

// fakeEngine is an httptest engine that records the bodies and headers it
// receives and answers with answer.
type fakeEngine struct {
	mu     sync.Mutex
	bodies []map[string]any
	hdrs   []http.Header
	srv    *httptest.Server
}

func newFakeEngine(t *testing.T, answer func(w http.ResponseWriter, body map[string]any)) *fakeEngine {
	t.Helper()
	fe := &fakeEngine{}
	fe.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		fe.mu.Lock()
		fe.bodies = append(fe.bodies, m)
		fe.hdrs = append(fe.hdrs, r.Header.Clone())
		fe.mu.Unlock()
		answer(w, m)
	}))
	t.Cleanup(fe.srv.Close)
	return fe
}

// received is how many requests the engine received, and the last one's
// body and headers (nil before any).
func (fe *fakeEngine) received() (n int, body map[string]any, hdr http.Header) {
	fe.mu.Lock()
	defer fe.mu.Unlock()
	if n = len(fe.bodies); n > 0 {
		body, hdr = fe.bodies[n-1], fe.hdrs[n-1]
	}
	return n, body, hdr
}

// okCompletion answers a completion, with kv (a JSON member with its
// leading comma, or "") added.
func okCompletion(w http.ResponseWriter, kv string) {
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}]%s}`, kv)
}

// goodKV is a prefill's answer's transfer parameters.
const goodKV = `,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[1,2],"remote_host":"h","remote_port":1}`

// fakePrefill and fakeDecode are engines answering as a prefill instance
// (with goodKV) and a decode instance do.
func fakePrefill(t *testing.T) *fakeEngine {
	return newFakeEngine(t, func(w http.ResponseWriter, _ map[string]any) { okCompletion(w, goodKV) })
}

func fakeDecode(t *testing.T) *fakeEngine {
	return newFakeEngine(t, func(w http.ResponseWriter, _ map[string]any) { okCompletion(w, "") })
}

// fakePDRouter is a router in front of the engines, one pool "pd" with
// disaggregation dc (nil: none) and strategy (kv_aware over an index of
// its own, which no engine publishes to); prefill engines are p0, p1…,
// decode engines d0, d1…; mod edits the pool before it starts.
func fakePDRouter(t *testing.T, dc *config.DisaggregationConfig, strategy string, prefill, decode []*fakeEngine, mod ...func(*config.PoolConfig)) (*httptest.Server, *httpapi.Server) {
	t.Helper()
	pc := config.PoolConfig{Name: "pd", Model: sim.DefaultModel, Disaggregation: dc,
		Routing: config.RoutingConfig{Strategy: strategy},
		Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i, e := range prefill {
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("p%d", i), URL: e.srv.URL, Role: config.RolePrefill})
	}
	for i, e := range decode {
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("d%d", i), URL: e.srv.URL, Role: config.RoleDecode})
	}
	for _, m := range mod {
		m(&pc)
	}
	cfg := config.Config{Pools: []config.PoolConfig{pc}}.WithDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: sim.DefaultModel, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	srv, ts := servertest.Serve(t, cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })})
	return ts, srv
}

// TestClientTransferParamsStripped: the kv_transfer_params a client sends
// never reach an engine — not when a disaggregating pool serves the
// request aggregated (conditional mode, a short prompt), nor in a pool
// without disaggregation — so a client cannot make a decode engine pull KV
// from a host of its choosing, or pin blocks with do_remote_decode.
func TestClientTransferParamsStripped(t *testing.T) {
	evil := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "attacker-engine",
		"remote_block_ids": []int{0, 1, 2, 3, 4, 5}, "remote_host": "169.254.169.254", "remote_port": 5600}

	f := newDisaggFleet(t, config.DisaggregationConfig{Mode: config.DisaggConditional, MinPrefillTokens: 256}, 1, 1)
	resp, _ := f.post("/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(2, 100), "max_tokens": 3, "kv_transfer_params": evil})
	for _, rp := range f.sims["d0"].RemotePrefills() {
		if rp.EngineID == "attacker-engine" {
			t.Fatalf("decode instance d0 received the client's kv_transfer_params: %+v (served %q)", rp, resp.Header.Get(httpapi.HeaderDisagg))
		}
	}

	for _, dc := range []*config.DisaggregationConfig{nil, {Mode: config.DisaggConditional, MinPrefillTokens: 256}} {
		d := fakeDecode(t)
		ts, _ := fakePDRouter(t, dc, config.StrategyRoundRobin, nil, []*fakeEngine{d})
		for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
			body := map[string]any{"model": sim.DefaultModel, "max_tokens": 3, "kv_transfer_params": evil}
			if path == "/v1/completions" {
				body["prompt"] = "hello"
			} else {
				body["messages"] = []map[string]string{{"role": "user", "content": "hello"}}
			}
			if resp := testenv.PostJSON(t, ts.URL+path, body); resp.Status != http.StatusOK {
				t.Fatalf("%s: %d %s", path, resp.Status, resp.Body)
			}
			if _, got, _ := d.received(); got == nil || got["kv_transfer_params"] != nil || got["max_tokens"] == nil {
				t.Fatalf("disaggregation %v, %s: the engine received %v", dc, path, got)
			}
		}
		// A raw invocation's JSON object body too (vLLM's /invocations
		// serves OpenAI bodies).
		raw, _ := json.Marshal(map[string]any{"prompt": "hello", "max_tokens": 3, "kv_transfer_params": evil})
		if resp := testenv.Do(t, http.MethodPost, ts.URL+"/invocations", raw, map[string]string{"Content-Type": "application/json", "X-Kvrouter-Pool": "pd"}); resp.Status != http.StatusOK {
			t.Fatalf("/invocations: %d %s", resp.Status, resp.Body)
		}
		if _, got, _ := d.received(); got == nil || got["kv_transfer_params"] != nil || got["max_tokens"] == nil {
			t.Fatalf("disaggregation %v, /invocations: the engine received %v", dc, got)
		}
	}

	// A pool behind the operator's own disaggregating proxy passes them on.
	d := fakeDecode(t)
	ts, _ := fakePDRouter(t, nil, config.StrategyRoundRobin, nil, []*fakeEngine{d}, func(pc *config.PoolConfig) { pc.PassKVTransferParams = true })
	if resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3, "kv_transfer_params": evil}); resp.Status != http.StatusOK {
		t.Fatalf("pass_kv_transfer_params: %d %s", resp.Status, resp.Body)
	}
	if _, got, _ := d.received(); got == nil || got["kv_transfer_params"] == nil {
		t.Fatalf("pass_kv_transfer_params: the engine received %v, want the client's kv_transfer_params", got)
	}
}

// TestRawTransferParamsNeedStrictJSON: a raw invocation body that may hold
// kv_transfer_params and that the router cannot read as one strict JSON
// object is refused, not forwarded with the member: vLLM's json.loads
// reads NaN and Infinity, a UTF-8 BOM and UTF-16, which the router's
// parser does not (before, each of these reached the instance unchanged,
// with a 200). A body that cannot name the member goes as it came.
func TestRawTransferParamsNeedStrictJSON(t *testing.T) {
	h := servertest.New(t, 1, nil)
	evil := `"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"attacker.example"}`
	bodies := map[string]string{"plain text": `kv_transfer_params=x`, "array": `[{` + evil + `}]`}
	for _, num := range []string{"NaN", "Infinity", "-Infinity"} {
		bodies[num] = `{"prompt":"hello","temperature":` + num + `,` + evil + `}`
	}
	bodies["BOM"] = "\ufeff" + `{"prompt":"hello",` + evil + `}`
	var utf16 []byte
	for _, c := range []byte(`{"prompt":"hello",` + evil + `}`) {
		utf16 = append(utf16, c, 0)
	}
	bodies["UTF-16LE"] = string(utf16)
	bodies["escaped key"] = `{"prompt":"hello","kv_transfer_p\u0061rams":{"remote_host":"attacker.example"},"t":NaN}`
	for name, body := range bodies {
		before := string(h.Ups[0].LastBody())
		r := h.Do(http.MethodPost, "/invocations", []byte(body), nil)
		if msg, _ := servertest.ErrorOf(t, r); r.Status != http.StatusBadRequest || !strings.Contains(msg, "body must be a JSON object") {
			t.Errorf("%s: %d %s, want 400", name, r.Status, r.Body)
		}
		if got := string(h.Ups[0].LastBody()); got != before {
			t.Errorf("%s: forwarded %q", name, got)
		}
	}
	for _, body := range []string{`plain text`, `{"prompt":"hello","temperature":NaN}`} {
		if r := h.Do(http.MethodPost, "/invocations", []byte(body), nil); r.Status != http.StatusOK || string(h.Ups[0].LastBody()) != body {
			t.Fatalf("%s: %d, forwarded %s", body, r.Status, h.Ups[0].LastBody())
		}
	}
	// A strict body is forwarded without the member; a pool that passes
	// kv_transfer_params on forwards any body as it came.
	if r := h.Do(http.MethodPost, "/invocations", []byte(`{"prompt":"hello",`+evil+`}`), nil); r.Status != http.StatusOK || strings.Contains(string(h.Ups[0].LastBody()), "kv_transfer_params") {
		t.Fatalf("strict body: %d, forwarded %s", r.Status, h.Ups[0].LastBody())
	}
	pass := servertest.New(t, 1, func(c *config.Config) { c.Pools[0].PassKVTransferParams = true })
	if r := pass.Do(http.MethodPost, "/invocations", []byte(bodies["NaN"]), nil); r.Status != http.StatusOK || string(pass.Ups[0].LastBody()) != bodies["NaN"] {
		t.Fatalf("pass_kv_transfer_params: %d, forwarded %s", r.Status, pass.Ups[0].LastBody())
	}
}

// TestRoundRobinStagesRotateApart: round_robin's prefill and decode picks
// each rotate over their own set: 8 sequential requests over 2 prefill and
// 2 decode instances reach every instance 4 times (one shared rotation
// sent every prefill to p0 and every decode to d1).
func TestRoundRobinStagesRotateApart(t *testing.T) {
	ps := []*fakeEngine{fakePrefill(t), fakePrefill(t)}
	ds := []*fakeEngine{fakeDecode(t), fakeDecode(t)}
	ts, _ := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, ps, ds)
	for range 8 {
		resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3})
		if resp.Status != http.StatusOK || resp.Header.Get(httpapi.HeaderDisagg) != "disaggregated" {
			t.Fatalf("%d %q %s", resp.Status, resp.Header.Get(httpapi.HeaderDisagg), resp.Body)
		}
	}
	var counts []int
	for _, e := range append(ps, ds...) {
		n, _, _ := e.received()
		counts = append(counts, n)
	}
	if fmt.Sprint(counts) != "[4 4 4 4]" {
		t.Fatalf("8 sequential requests, round_robin: p0, p1, d0, d1 received %v, want [4 4 4 4]", counts)
	}
}

// TestStagesShareRequestID: the prefill and the decode request of one
// disaggregated request carry one X-Request-Id (as vLLM's toy proxy sends
// them; engines before vllm-project/vllm#29665 match the stages by it), the
// client's when it sent one, else one the router made, new per request.
func TestStagesShareRequestID(t *testing.T) {
	p, d := fakePrefill(t), fakeDecode(t)
	ts, _ := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, []*fakeEngine{p}, []*fakeEngine{d})
	body := []byte(`{"model":"` + sim.DefaultModel + `","prompt":"hello","max_tokens":3}`)
	var ids []string
	for _, hdr := range []map[string]string{nil, nil, {"X-Request-Id": "client-id-1"}, {"X-Request-Id": "client-id-1"}, {"X-Request-Id": "bad id"}} {
		h := map[string]string{"Content-Type": "application/json"}
		for k, v := range hdr {
			h[k] = v
		}
		if resp := testenv.Do(t, http.MethodPost, ts.URL+"/v1/completions", body, h); resp.Status != http.StatusOK {
			t.Fatalf("%d %s", resp.Status, resp.Body)
		}
		_, _, ph := p.received()
		_, _, dh := d.received()
		pid, did := ph.Get("X-Request-Id"), dh.Get("X-Request-Id")
		if pid == "" || pid != did || len(ph.Values("X-Request-Id")) != 1 || len(dh.Values("X-Request-Id")) != 1 {
			t.Fatalf("X-Request-Id: prefill %q, decode %q", ph.Values("X-Request-Id"), dh.Values("X-Request-Id"))
		}
		ids = append(ids, pid)
	}
	// The router makes every id: the client's, when it sent one that is
	// safe to log, goes in front, but never alone (another client could
	// send it too and disturb that request's transfer).
	if ids[0] == ids[1] || !strings.HasPrefix(ids[2], "client-id-1-") || !strings.HasPrefix(ids[3], "client-id-1-") || ids[2] == ids[3] ||
		strings.Contains(ids[4], "bad") {
		t.Fatalf("request ids %q: want ids the router made, each new, the client's in front when printable", ids)
	}
}

// TestBatchServedAggregated: a request for several sequences — a list of
// prompts, n or best_of above 1 — goes aggregated ("batch"): one prefill
// answers one set of transfer parameters, which the decode instance cannot
// share among several sequences. One prompt (in a list too) and n 1 go
// disaggregated.
func TestBatchServedAggregated(t *testing.T) {
	p, d := fakePrefill(t), fakeDecode(t)
	ts, _ := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, []*fakeEngine{p}, []*fakeEngine{d})
	cases := []struct {
		path string
		body map[string]any
		want string
	}{
		{"/v1/completions", map[string]any{"prompt": []string{"first prompt", "second prompt", "third"}}, "aggregated; batch"},
		{"/v1/completions", map[string]any{"prompt": [][]int{{1, 2, 3}, {4, 5, 6}}}, "aggregated; batch"},
		{"/v1/completions", map[string]any{"prompt": "hello", "n": 2}, "aggregated; batch"},
		{"/v1/completions", map[string]any{"prompt": "hello", "best_of": 3}, "aggregated; batch"},
		{"/v1/chat/completions", map[string]any{"messages": []map[string]string{{"role": "user", "content": "hi"}}, "n": 4}, "aggregated; batch"},
		{"/v1/completions", map[string]any{"prompt": []string{"one prompt"}, "n": 1, "best_of": nil}, "disaggregated"},
		{"/v1/chat/completions", map[string]any{"messages": []map[string]string{{"role": "user", "content": "hi"}}, "n": 1}, "disaggregated"},
	}
	for i, c := range cases {
		c.body["model"], c.body["max_tokens"] = sim.DefaultModel, 3
		before, _, _ := p.received()
		resp := testenv.PostJSON(t, ts.URL+c.path, c.body)
		after, _, _ := p.received()
		if resp.Status != http.StatusOK || resp.Header.Get(httpapi.HeaderDisagg) != c.want {
			t.Fatalf("case %d %v: %d, served %q, want %q", i, c.body, resp.Status, resp.Header.Get(httpapi.HeaderDisagg), c.want)
		}
		if prefilled := after > before; prefilled != (c.want == "disaggregated") {
			t.Fatalf("case %d: served %q, the prefill instance received %d requests", i, c.want, after-before)
		}
	}
}

// TestSaturatedPrefillNotPicked: in conditional mode, a request that finds
// every prefill instance at its concurrency threshold goes aggregated
// without a prefill pick being made and dropped: kv_aware counts no
// saturated decision (nor speculative entries, pending prefill, or a peer
// announcement) for a prefill that never runs.
func TestSaturatedPrefillNotPicked(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	p := newFakeEngine(t, func(w http.ResponseWriter, _ map[string]any) {
		<-release // every prefill waits: p0 stays at its threshold
		okCompletion(w, goodKV)
	})
	d := fakeDecode(t)
	ts, srv := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggConditional, MinPrefillTokens: 256}, config.StrategyKVAware,
		[]*fakeEngine{p}, []*fakeEngine{d}, func(pc *config.PoolConfig) { pc.Routing.ConcurrencyThreshold = 1 })
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // before the servers' Close (cleanups run last first)
	first := make(chan testenv.Result, 1)
	go func() {
		first <- testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(5, 400), "max_tokens": 3})
	}()
	waitFor(t, "the first request's prefill", func() bool { n, _, _ := p.received(); return n == 1 })

	resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(6, 400), "max_tokens": 3})
	if resp.Status != http.StatusOK || resp.Header.Get(httpapi.HeaderDisagg) != "aggregated; prefill_saturated" {
		t.Fatalf("second request, p0 at its threshold: %d, served %q", resp.Status, resp.Header.Get(httpapi.HeaderDisagg))
	}
	if n := testenv.Metric(t, srv.Registry(), "kvrouter_kv_decisions_total", map[string]string{"reason": "saturated"}); n != 0 {
		t.Fatalf("kvrouter_kv_decisions_total{reason=saturated} = %v: a prefill pick was made and dropped", n)
	}
	once.Do(func() { close(release) })
	if r := <-first; r.Status != http.StatusOK || r.Header.Get(httpapi.HeaderDisagg) != "disaggregated" {
		t.Fatalf("first request: %d, served %q", r.Status, r.Header.Get(httpapi.HeaderDisagg))
	}
}

// TestShadowKeepsConditionalShort: shadow scoring on does not turn off
// conditional mode's short-prompt test under kv_aware.
func TestShadowKeepsConditionalShort(t *testing.T) {
	f := newDisaggFleet(t, config.DisaggregationConfig{Mode: config.DisaggConditional, MinPrefillTokens: 256}, 1, 1,
		func(pc *config.PoolConfig) { pc.Routing.Shadow = true })
	resp, _ := f.post("/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": tokenPrompt(2, 100), "max_tokens": 3})
	if got := resp.Header.Get(httpapi.HeaderDisagg); got != "aggregated; short" {
		t.Fatalf("100-token prompt with shadow on: disagg %q (want \"aggregated; short\", as without shadow)", got)
	}
}

// TestDecodeNotRetriedOnceReached: a decode request that reached its
// instance is not retried on another for a retry status (here 504): the
// first may have pulled the prompt's KV, and the prefill's transfer
// parameters are for one decode. The client gets the status.
func TestDecodeNotRetriedOnceReached(t *testing.T) {
	p := fakePrefill(t)
	d0 := newFakeEngine(t, func(w http.ResponseWriter, _ map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusGatewayTimeout)
		fmt.Fprint(w, `{"error":{"message":"timed out"}}`)
	})
	d1 := fakeDecode(t)
	ts, _ := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, []*fakeEngine{p}, []*fakeEngine{d0, d1})
	resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3})
	n0, _, _ := d0.received()
	n1, body1, _ := d1.received()
	if resp.Header.Get(httpapi.HeaderDisagg) != "disaggregated" || n0 != 1 {
		t.Fatalf("served %q, d0 received %d (want the decode request on d0 first)", resp.Header.Get(httpapi.HeaderDisagg), n0)
	}
	if n1 != 0 || resp.Status != http.StatusGatewayTimeout {
		t.Fatalf("d0 answered 504: the client got %d, d1 received %d decode requests (kv_transfer_params %v)", resp.Status, n1, body1["kv_transfer_params"])
	}
}

// TestPrefillTimeoutBoundsTheStage: prefill_timeout bounds the whole
// prefill stage, not each attempt: a first prefill instance that hangs
// past it leaves no time for a second, and the request is served
// aggregated after one timeout, not two.
func TestPrefillTimeoutBoundsTheStage(t *testing.T) {
	release := make(chan struct{})
	hang := func(w http.ResponseWriter, _ map[string]any) {
		<-release
		okCompletion(w, goodKV)
	}
	ps := []*fakeEngine{newFakeEngine(t, hang), newFakeEngine(t, hang)}
	d := fakeDecode(t)
	ts, _ := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways, PrefillTimeout: 300 * time.Millisecond},
		config.StrategyRoundRobin, ps, []*fakeEngine{d})
	t.Cleanup(func() { close(release) }) // before the servers' Close (cleanups run last first)
	resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3})
	n0, _, _ := ps[0].received()
	n1, _, _ := ps[1].received()
	if resp.Status != http.StatusOK || resp.Header.Get(httpapi.HeaderDisagg) != "aggregated; prefill_failed" {
		t.Fatalf("%d, served %q", resp.Status, resp.Header.Get(httpapi.HeaderDisagg))
	}
	if n0+n1 > 1 {
		t.Fatalf("the prefill stage tried p0 %d and p1 %d times after the first hung past prefill_timeout: the stage took two timeouts", n0, n1)
	}
}

// TestPrefillWithoutRemotePrefill: a prefill answer whose
// kv_transfer_params do not say do_remote_prefill true ({} or false) gives
// the decode instance nothing to pull: served aggregated,
// no_transfer_params, with the client's body.
func TestPrefillWithoutRemotePrefill(t *testing.T) {
	for _, kv := range []string{`,"kv_transfer_params":{}`, `,"kv_transfer_params":{"do_remote_prefill":false}`, `,"kv_transfer_params":{"do_remote_prefill":"yes"}`} {
		p := newFakeEngine(t, func(w http.ResponseWriter, _ map[string]any) { okCompletion(w, kv) })
		d := fakeDecode(t)
		ts, _ := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, []*fakeEngine{p}, []*fakeEngine{d})
		resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3})
		_, body, _ := d.received()
		if got := resp.Header.Get(httpapi.HeaderDisagg); resp.Status != http.StatusOK || got != "aggregated; no_transfer_params" || body["kv_transfer_params"] != nil {
			t.Errorf("prefill answered %s: %d, served %q, decode got kv_transfer_params %v", kv, resp.Status, got, body["kv_transfer_params"])
		}
	}
}

// TestFlowControlBudgetsOnDecodeSet: a disaggregating pool's queue admits
// on its decode-capable instances, where an admitted request is bound for
// its whole generation. With one prefill and one decode instance, a second
// request waits in the queue while the first holds the decode instance at
// its concurrency threshold (before: the prefill instance doubled the
// pool's concurrency budget) or its per-instance prefill budget (before:
// the prefill instance, to which no ticket is ever bound, always had room,
// so the budget never held anyone back and the decode instance took both).
func TestFlowControlBudgetsOnDecodeSet(t *testing.T) {
	for _, c := range []struct {
		name string
		fc   config.FlowControlConfig
		thr  int
	}{
		{"concurrency", config.FlowControlConfig{Enabled: true}, 1},
		{"prefill budget", config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 1000}, 64},
	} {
		t.Run(c.name, func(t *testing.T) {
			release := make(chan struct{})
			var once sync.Once
			p := fakePrefill(t)
			d := newFakeEngine(t, func(w http.ResponseWriter, _ map[string]any) {
				<-release
				okCompletion(w, "")
			})
			ts, srv := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin,
				[]*fakeEngine{p}, []*fakeEngine{d}, func(pc *config.PoolConfig) {
					fc := c.fc
					pc.FlowControl, pc.Routing.ConcurrencyThreshold = &fc, c.thr
				})
			t.Cleanup(func() { once.Do(func() { close(release) }) })                                                                   // before the servers' Close
			body := map[string]any{"model": sim.DefaultModel, "prompt": strings.Repeat("word ", 640), "max_tokens": 3, "stream": true} // ~800 tokens
			replies := make(chan testenv.Result, 2)
			go func() { replies <- testenv.PostJSON(t, ts.URL+"/v1/completions", body) }()
			waitFor(t, "the first decode request", func() bool { n, _, _ := d.received(); return n == 1 })
			go func() { replies <- testenv.PostJSON(t, ts.URL+"/v1/completions", body) }()
			pool, _ := srv.Pool("pd")
			waitFor(t, "the second request queued or decoding", func() bool {
				n, _, _ := d.received()
				return n == 2 || pool.QueueStatus().Queue.Queued == 1
			})
			if n, _, _ := d.received(); n != 1 {
				st := pool.QueueStatus().Queue
				t.Fatalf("the decode instance took %d requests at once (queue: max_concurrency %d, instances %+v)", n, st.MaxConcurrency, st.Instances)
			}
			once.Do(func() { close(release) })
			for range 2 {
				if r := <-replies; r.Status != http.StatusOK {
					t.Fatalf("%d %s", r.Status, r.Body)
				}
			}
		})
	}
}

// TestPrefillRefusalNotRetried: a prefill instance refusing the request
// (vLLM answers a prompt over its context, or a bad parameter, 400 at
// once) says nothing against the instance: it is not tried on another
// prefill instance, which would refuse it again, nor counted a prefill
// error (an operator's alert on that metric is for sick instances); it is
// served aggregated at once ("prefill_refused"), where the decode-capable
// instance answers the client's own request. A 5xx still tries another.
func TestPrefillRefusalNotRetried(t *testing.T) {
	refuse := func(w http.ResponseWriter, _ map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprint(w, `{"error":{"message":"This model's maximum context length is 8192 tokens"}}`)
	}
	ps := []*fakeEngine{newFakeEngine(t, refuse), newFakeEngine(t, refuse)}
	d := fakeDecode(t)
	ts, srv := fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, ps, []*fakeEngine{d})
	resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3})
	n0, _, _ := ps[0].received()
	n1, _, _ := ps[1].received()
	errs := testenv.Metric(t, srv.Registry(), "kvrouter_disagg_prefill_errors_total", nil)
	if n0+n1 != 1 || errs != 0 || resp.Header.Get(httpapi.HeaderDisagg) != "aggregated; prefill_refused" {
		t.Fatalf("prefill answered 400: prefill instances tried %d times, %v prefill errors counted, served %q (%d)", n0+n1, errs, resp.Header.Get(httpapi.HeaderDisagg), resp.Status)
	}
	if nd, body, _ := d.received(); nd != 1 || body["kv_transfer_params"] != nil {
		t.Fatalf("the decode instance received %d requests (last %v), want the client's, once", nd, body)
	}

	// A status that names the instance, not the request (a 503, or a
	// prefill instance behind auth, on the wrong path or without the
	// model): an error counted and warned of, the other prefill instance
	// tried, so a misconfigured prefill set does not turn disaggregation
	// off unseen.
	for _, code := range []int{http.StatusServiceUnavailable, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound, http.StatusMethodNotAllowed} {
		answer := func(w http.ResponseWriter, _ map[string]any) { w.WriteHeader(code) }
		ps = []*fakeEngine{newFakeEngine(t, answer), newFakeEngine(t, answer)}
		ts, srv = fakePDRouter(t, &config.DisaggregationConfig{Mode: config.DisaggAlways}, config.StrategyRoundRobin, ps, []*fakeEngine{fakeDecode(t)})
		resp = testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": sim.DefaultModel, "prompt": "hello", "max_tokens": 3})
		n0, _, _ = ps[0].received()
		n1, _, _ = ps[1].received()
		if errs := testenv.Metric(t, srv.Registry(), "kvrouter_disagg_prefill_errors_total", nil); n0 != 1 || n1 != 1 || errs != 2 || resp.Header.Get(httpapi.HeaderDisagg) != "aggregated; prefill_failed" {
			t.Errorf("prefill answered %d: p0 %d, p1 %d tries, %v errors, served %q; want both tried, 2 errors, prefill_failed", code, n0, n1, errs, resp.Header.Get(httpapi.HeaderDisagg))
		}
	}
}
