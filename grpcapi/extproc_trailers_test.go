package grpcapi_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvrouter/kvrouter/grpcapi"
)

// TestExtProcBufferedBodyBeforeTrailers: in BUFFERED request_body_mode a
// request with trailers (HTTP/2, or HTTP/1 with enable_trailers) has its
// whole body sent in one message whose end_of_stream is false, the
// trailers being still to come; with request_trailer_mode SKIP nothing
// follows it (envoyproxy/envoy source/extensions/filters/http/ext_proc/
// ext_proc.cc, Filter::onTrailers: "setupBodyChunk(state,
// *state.bufferedData(), false)", v1.33+). The picker must pick and rewrite
// on that message: let through untouched, the request goes upstream to the
// endpoint the client put in x-gateway-destination-endpoint, with its own
// kv_transfer_params. Envoy names the mode in the stream's first message
// (ProcessingRequest.protocol_config).
func TestExtProcBufferedBodyBeforeTrailers(t *testing.T) {
	h := newHarness(t)
	e := h.envoy(t)
	body := []byte(`{"model":"` + hashModel + `","prompt":"hello","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"attacker.example"}}`)
	e.send(&extprocv3.ProcessingRequest{
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocfilterv3.ProcessingMode_BUFFERED},
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(
			":method", "POST", ":path", "/v1/completions", "content-type", "application/json",
			grpcapi.DestinationHeader, "203.0.113.7:8000")}}})
	r := e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: false}}})
	o := outcomeOf(t, r)
	if o.status != 0 {
		t.Fatalf("buffered body before trailers: %+v, want routed", o)
	}
	if o.dest == "" || o.dest == "203.0.113.7:8000" {
		t.Fatalf("buffered body before trailers: destination %q, want the pick (the body was let through unpicked)", o.dest)
	}
	bm := r.GetRequestBody().GetResponse().GetBodyMutation()
	if bm == nil || strings.Contains(string(bm.GetBody()), "kv_transfer_params") {
		t.Fatalf("buffered body before trailers: body mutation %v, want the body without kv_transfer_params", bm)
	}
}

// TestExtProcClientDestinationRemoved: a request the picker has not
// picked yet (its body to come) loses the client's own
// x-gateway-destination-endpoint at the headers answer, so that one Envoy
// lets through without the picker's answer (request_body_mode STREAMED,
// whose headers go on before the body; BUFFERED_PARTIAL over its buffer;
// an Envoy that names no mode) cannot reach the endpoint a client chose.
func TestExtProcClientDestinationRemoved(t *testing.T) {
	h := newHarness(t)
	e := h.envoy(t)
	r := e.headers(nil, false, ":method", "POST", ":path", "/v1/completions", "content-type", "application/json",
		grpcapi.DestinationHeader, "203.0.113.7:8000")
	if rm := r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders(); !slices.Contains(rm, grpcapi.DestinationHeader) {
		t.Fatalf("headers answer removes %q, want %s removed", rm, grpcapi.DestinationHeader)
	}
}

// TestExtProcPartialBodyRefused: a BUFFERED_PARTIAL body over the
// filter's buffer comes as one message with end_of_stream false, and Envoy
// streams the rest upstream without sending it here: the picker can
// neither read the body whole nor rewrite it, so it refuses (413) instead
// of answering "continue" and waiting for an end that never comes.
func TestExtProcPartialBodyRefused(t *testing.T) {
	h := newHarness(t)
	e := h.envoy(t)
	e.send(&extprocv3.ProcessingRequest{
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL},
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(
			":method", "POST", ":path", "/v1/completions", "content-type", "application/json")}}})
	r := e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(`{"model":"` + hashModel + `","prompt":"hel`), EndOfStream: false}}})
	if o := outcomeOf(t, r); o.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("partial body: %+v, want 413", o)
	}
}

// TestExtProcStreamedModeRefused: with request_body_mode STREAMED (or
// FULL_DUPLEX_STREAMED, the picker answering headers at once) Envoy lets
// the request headers go on to the router filter, which picks the upstream
// host, on the headers answer, before the body's (envoyproxy/envoy
// source/extensions/filters/http/ext_proc/processor_state.cc,
// handleHeadersResponse: STREAMED continues at once): the picker's pick
// could never be applied, yet it would be counted in flight on an
// instance that never gets the request. Named in protocol_config, such a
// mode is refused at the headers.
func TestExtProcStreamedModeRefused(t *testing.T) {
	h := newHarness(t)
	for _, mode := range []extprocfilterv3.ProcessingMode_BodySendMode{extprocfilterv3.ProcessingMode_STREAMED, extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED} {
		e := h.envoy(t)
		r := e.send(&extprocv3.ProcessingRequest{
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode},
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(
				":method", "POST", ":path", "/v1/completions", "content-type", "application/json")}}})
		if o := outcomeOf(t, r); o.status != http.StatusInternalServerError {
			t.Fatalf("%v: headers answered %+v, want 500", mode, o)
		}
	}
}
