package grpcapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// envoy plays Envoy's side of one ext_proc stream.
type envoy struct {
	t  *testing.T
	st extprocv3.ExternalProcessor_ProcessClient
}

func (h *harness) envoy(t *testing.T) *envoy {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	st, err := extprocv3.NewExternalProcessorClient(h.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &envoy{t: t, st: st}
}

func headerMap(kv ...string) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		// Recent Envoy sends raw_value; older ones value: send both kinds.
		if i%4 == 0 {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
		} else {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: kv[i], Value: kv[i+1]})
		}
	}
	return hm
}

func subsetHint(addrs ...string) *corev3.Metadata {
	vals := make([]any, len(addrs))
	for i, a := range addrs {
		vals[i] = a
	}
	s, err := structpb.NewStruct(map[string]any{grpcapi.SubsetKey: vals})
	if err != nil {
		panic(err)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{grpcapi.DefaultSubsetNamespace: s}}
}

func (e *envoy) send(r *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	e.t.Helper()
	if err := e.st.Send(r); err != nil {
		e.t.Fatal(err)
	}
	resp, err := e.st.Recv()
	if err != nil {
		e.t.Fatal(err)
	}
	return resp
}

func (e *envoy) headers(md *corev3.Metadata, eos bool, kv ...string) *extprocv3.ProcessingResponse {
	return e.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(kv...), EndOfStream: eos}}})
}

func (e *envoy) body(md *corev3.Metadata, body []byte) *extprocv3.ProcessingResponse {
	return e.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}})
}

// chat sends a chat completion of text to the hash pool, headers then
// body, and returns what the body's answer told Envoy.
func (e *envoy) chat(text string) outcome {
	e.t.Helper()
	e.headers(nil, false, ":method", "POST", ":path", "/v1/chat/completions")
	return outcomeOf(e.t, e.body(nil, chatBody(hashModel, text)))
}

// outcome is what an ext_proc answer told Envoy.
type outcome struct {
	status     int    // immediate response status, 0 = routed
	dest       string // x-gateway-destination-endpoint header
	mdDest     string // envoy.lb dynamic metadata
	reason     string
	instance   string
	clearCache bool
}

func outcomeOf(t *testing.T, r *extprocv3.ProcessingResponse) outcome {
	t.Helper()
	if imm := r.GetImmediateResponse(); imm != nil {
		var body struct {
			Error struct {
				Message string `json:"message"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal(imm.Body, &body); err != nil || body.Error.Code != int(imm.GetStatus().GetCode()) || body.Error.Message == "" {
			t.Errorf("immediate response body %q: want an OpenAI-style error", imm.Body)
		}
		return outcome{status: int(imm.GetStatus().GetCode())}
	}
	var common *extprocv3.CommonResponse
	switch {
	case r.GetRequestBody() != nil:
		common = r.GetRequestBody().GetResponse()
	case r.GetRequestHeaders() != nil:
		common = r.GetRequestHeaders().GetResponse()
	default:
		t.Fatalf("unexpected response %v", r)
	}
	o := outcome{clearCache: common.GetClearRouteCache()}
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		v := string(h.GetHeader().GetRawValue())
		switch strings.ToLower(h.GetHeader().GetKey()) {
		case grpcapi.DestinationHeader:
			o.dest = v
		case strings.ToLower(router.HeaderReason):
			o.reason = v
		case strings.ToLower(router.HeaderInstance):
			o.instance = v
		}
	}
	o.mdDest = r.GetDynamicMetadata().GetFields()[grpcapi.DefaultDestinationNamespace].GetStructValue().GetFields()[grpcapi.DestinationKey].GetStringValue()
	return o
}

func chatBody(model, text string) []byte {
	b, _ := json.Marshal(map[string]any{"model": model, "messages": []map[string]any{{"role": "user", "content": text}}})
	return b
}

// TestExtProc plays Envoy's side of the ext_proc stream (request headers,
// then the buffered body) and checks the GIE endpoint-picker answers.
func TestExtProc(t *testing.T) {
	p := routertest.Prompt(3, 6*bs)
	tokBody, _ := json.Marshal(map[string]any{"model": kvModel, "prompt": p})
	type setup func(h *harness) (release func())
	allBusy := func(pool string) setup {
		return func(h *harness) func() {
			pl, _ := h.srv.Pool(pool)
			for _, in := range pl.Instances() {
				in.Acquire()
			}
			return func() {
				for _, in := range pl.Instances() {
					in.Release()
				}
			}
		}
	}
	allDown := func(h *harness) func() {
		pl, _ := h.srv.Pool("hash")
		for _, in := range pl.Instances() {
			in.SetHealthy(false)
		}
		return func() {}
	}
	tests := []struct {
		name    string
		opts    []harnessOpt
		setup   setup
		path    string
		headers []string
		md      *corev3.Metadata
		body    []byte // nil: the headers end the stream
		status  int
		// want: the instance expected ("" = any instance of wantPool)
		want     string
		wantPool string
		reason   string
	}{
		{name: "chat routed by model", path: "/v1/chat/completions", body: chatBody(hashModel, "hello there"), wantPool: "hash", reason: string(router.ReasonHash)},
		{name: "kv_aware follows the index", path: "/v1/completions", body: tokBody, want: "kv-1", reason: string(router.ReasonKVMatch)},
		{name: "pool header", path: "/v1/chat/completions", headers: []string{"x-kvrouter-pool", "hash"}, body: chatBody("", "hi"), wantPool: "hash"},
		{name: "raw invoke, headers only", path: "/invocations", headers: []string{"x-kvrouter-pool", "hash"}, wantPool: "hash"},
		{name: "subset hint", path: "/v1/chat/completions", md: subsetHint("ADDR:hash-3"), body: chatBody(hashModel, "hello there"), want: "hash-3"},
		{name: "subset hint overrides the index", path: "/v1/completions", md: subsetHint("ADDR:kv-0", "10.9.9.9:1"), body: tokBody, want: "kv-0"},
		{name: "subset hint empty", path: "/v1/chat/completions", md: subsetHint(), body: chatBody(hashModel, "x"), status: 503},
		{name: "subset hint of strangers", path: "/v1/chat/completions", md: subsetHint("10.9.9.9:1"), body: chatBody(hashModel, "x"), status: 503},
		{name: "no healthy instance", setup: allDown, path: "/v1/chat/completions", body: chatBody(hashModel, "x"), status: 503},
		{name: "saturated without shedding routes", setup: allBusy("hash"), opts: []harnessOpt{threshold1}, path: "/v1/chat/completions", body: chatBody(hashModel, "x"), wantPool: "hash", reason: string(router.ReasonSaturated)},
		{name: "saturated with shedding", setup: allBusy("hash"), opts: []harnessOpt{threshold1, shed(0)}, path: "/v1/chat/completions", body: chatBody(hashModel, "x"), status: 429},
		{name: "saturated within the queue allowance", setup: allBusy("hash"), opts: []harnessOpt{threshold1, shed(1)}, path: "/v1/chat/completions", body: chatBody(hashModel, "x"), wantPool: "hash"},
		{name: "malformed body", path: "/v1/chat/completions", body: []byte(`{"model": "qwen-grpc", "messages": [`), status: 400},
		{name: "no messages", path: "/v1/chat/completions", body: []byte(`{"model": "qwen-grpc"}`), status: 400},
		{name: "bad tenant", path: "/v1/chat/completions", headers: []string{strings.ToLower(router.TenantHeader), "\x01"}, body: chatBody(hashModel, "x"), status: 400},
		{name: "unknown model", path: "/v1/chat/completions", body: chatBody("nope", "x"), status: 404},
		{name: "unknown pool", path: "/v1/chat/completions", headers: []string{"x-kvrouter-pool", "nope"}, body: chatBody(hashModel, "x"), status: 404},
		{name: "body too large", opts: []harnessOpt{maxBody(64)}, path: "/v1/chat/completions", body: chatBody(hashModel, strings.Repeat("x", 100)), status: 413},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.opts...)
			h.store("kv-1", p)
			if tc.setup != nil {
				defer tc.setup(h)()
			}
			md := tc.md
			if md != nil { // resolve ADDR:<instance> to the upstream's address
				for _, v := range md.FilterMetadata[grpcapi.DefaultSubsetNamespace].Fields[grpcapi.SubsetKey].GetListValue().GetValues() {
					if id, ok := strings.CutPrefix(v.GetStringValue(), "ADDR:"); ok {
						v.Kind = &structpb.Value_StringValue{StringValue: h.upAddr(id)}
					}
				}
			}
			e := h.envoy(t)
			hdrs := append([]string{":method", "POST", ":path", tc.path, "content-type", "application/json"}, tc.headers...)
			var resp *extprocv3.ProcessingResponse
			if tc.body == nil {
				resp = e.headers(md, true, hdrs...)
			} else {
				if r := e.headers(md, false, hdrs...); r.GetRequestHeaders() == nil {
					t.Fatalf("headers answered %v, want a headers response", r)
				}
				resp = e.body(md, tc.body)
			}
			o := outcomeOf(t, resp)
			if o.status != tc.status {
				t.Fatalf("status %d, want %d (%+v)", o.status, tc.status, o)
			}
			if tc.status != 0 {
				return
			}
			if o.dest == "" || o.dest != o.mdDest || !o.clearCache {
				t.Fatalf("header %q metadata %q clear_route_cache %v: want the same endpoint in both", o.dest, o.mdDest, o.clearCache)
			}
			if want := h.upAddr(o.instance); o.dest != want {
				t.Errorf("destination %q is not instance %s (%s)", o.dest, o.instance, want)
			}
			if tc.want != "" && o.instance != tc.want {
				t.Errorf("instance %s, want %s", o.instance, tc.want)
			}
			if tc.wantPool != "" && !strings.HasPrefix(o.instance, tc.wantPool+"-") {
				t.Errorf("instance %s, want one of pool %s", o.instance, tc.wantPool)
			}
			if tc.reason != "" && o.reason != tc.reason {
				t.Errorf("reason %s, want %s", o.reason, tc.reason)
			}
		})
	}
}

func threshold1(rc *config.Config, _ *grpcapi.Config) {
	for i := range rc.Pools {
		rc.Pools[i].Routing.ConcurrencyThreshold = 1
	}
}

func shed(maxQueued int) harnessOpt {
	return func(_ *config.Config, g *grpcapi.Config) { g.ExtProc.Shed, g.ExtProc.MaxQueued = true, maxQueued }
}

func maxBody(n int) harnessOpt {
	return func(_ *config.Config, g *grpcapi.Config) { g.ExtProc.MaxBodyBytes = n }
}

// TestExtProcInFlight: a pick counts as in flight on its instance until
// Envoy ends the stream, so the strategies see the load Envoy sends; the
// response phase passes through untouched.
func TestExtProcInFlight(t *testing.T) {
	h := newHarness(t)
	e := h.envoy(t)
	o := e.chat("count me")
	in := h.instance("hash", o.instance)
	if n := in.InFlight(); n != 1 {
		t.Fatalf("in flight during the request: %d, want 1", n)
	}
	// A second body (a misbehaving client) neither picks nor acquires again.
	if r := e.body(nil, chatBody(hashModel, "count me again")); r.GetRequestBody() == nil || r.GetRequestBody().GetResponse().GetHeaderMutation() != nil {
		t.Fatalf("second body answered %v, want an untouched continue", r)
	}
	if n := in.InFlight(); n != 1 {
		t.Fatalf("in flight after a second body: %d, want 1", n)
	}
	r := e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(":status", "200")}}})
	if r.GetResponseHeaders() == nil || r.GetResponseHeaders().GetResponse().GetHeaderMutation() != nil {
		t.Fatalf("response headers answered %v, want an untouched continue", r)
	}
	r = e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte("data"), EndOfStream: true}}})
	if r.GetResponseBody() == nil || r.GetResponseBody().GetResponse().GetBodyMutation() != nil {
		t.Fatalf("response body answered %v, want an untouched continue", r)
	}
	if err := e.st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.st.Recv(); err == nil {
		t.Fatal("stream still open after CloseSend")
	}
	deadline := time.Now().Add(5 * time.Second)
	for in.InFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("in flight after the stream ended: %d, want 0", in.InFlight())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestExtProcSpreads: distinct prompts through the endpoint picker land on
// every instance of the pool, and each answer is consistent.
func TestExtProcSpreads(t *testing.T) {
	h := newHarness(t)
	seen := map[string]int{}
	for i := range 40 {
		e := h.envoy(t)
		e.headers(nil, false, ":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json")
		o := outcomeOf(t, e.body(nil, chatBody(hashModel, fmt.Sprintf("prompt number %d", i))))
		if o.status != 0 || o.dest != h.upAddr(o.instance) {
			t.Fatalf("prompt %d: %+v", i, o)
		}
		seen[o.instance]++
		_ = e.st.CloseSend()
	}
	if len(seen) != 4 {
		t.Errorf("40 prompts reached %v, want all 4 instances", seen)
	}
}

// TestExtProcServedElsewhere: when Envoy reports that another endpoint
// served the request (x-gateway-destination-endpoint-served, after a
// retry), the in-flight count moves there.
func TestExtProcServedElsewhere(t *testing.T) {
	h := newHarness(t)
	e := h.envoy(t)
	o := e.chat("retry me")
	picked := h.instance("hash", o.instance)
	other := "hash-0"
	if o.instance == other {
		other = "hash-1"
	}
	served, err := structpb.NewStruct(map[string]any{grpcapi.ServedKey: h.upAddr(other)})
	if err != nil {
		t.Fatal(err)
	}
	e.send(&extprocv3.ProcessingRequest{
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{grpcapi.DefaultDestinationNamespace: served}},
		Request:         &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(":status", "200")}}})
	if a, b := picked.InFlight(), h.instance("hash", other).InFlight(); a != 0 || b != 1 {
		t.Fatalf("in flight: picked %d, served %d; want 0, 1", a, b)
	}
	_ = e.st.CloseSend()
	_, _ = e.st.Recv()
	deadline := time.Now().Add(5 * time.Second)
	for h.instance("hash", other).InFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("served instance still in flight after the stream ended")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestServeDrainTimeout: a graceful stop waits for an open ext_proc stream
// (Envoy's request still running) up to DrainTimeout, then cuts it; a
// stream that ends in time is not cut.
func TestServeDrainTimeout(t *testing.T) {
	const drain = time.Second
	tests := []struct {
		name     string
		finish   bool // Envoy ends the stream during the drain
		min, max time.Duration
	}{
		{"cut after the drain timeout", false, drain, 4 * time.Second},
		{"ended within the drain", true, 0, drain * 8 / 10},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.DrainTimeout = drain })
			e := h.envoy(t)
			if o := e.chat("drain me"); o.status != 0 {
				t.Fatalf("not routed: %+v", o)
			}
			if tc.finish {
				go func() {
					time.Sleep(drain / 10)
					_ = e.st.CloseSend()
				}()
			}
			if d := h.stop(); d < tc.min || d > tc.max {
				t.Errorf("stop took %v, want %v..%v", d, tc.min, tc.max)
			}
		})
	}
}
