package grpcapi_test

import (
	"context"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// BenchmarkPick is one Router.Pick over loopback gRPC: a 2,048-token
// prompt on the kv_aware pool, half of it held by one instance (64-block
// key chain, one index lookup, scoring, speculative holds).
func BenchmarkPick(b *testing.B) {
	h := newHarness(b)
	p := routertest.Prompt(11, 2048)
	h.store("kv-1", p[:1024])
	req := &kvrouterv1.PickRequest{Pool: "kv", TokenIds: p}
	c := h.router()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.Pick(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLookup is one Index.Lookup over loopback gRPC of a 2,048-token
// prompt (128 keys) that two instances hold in part.
func BenchmarkLookup(b *testing.B) {
	h := newHarness(b)
	p := routertest.Prompt(12, 2048)
	h.store("kv-0", p[:1024])
	h.store("kv-2", p[:512])
	req := &kvrouterv1.LookupRequest{Pool: "kv", TokenIds: p}
	c := h.index()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		r, err := c.Lookup(ctx, req)
		if err != nil || len(r.Matches) != 2 {
			b.Fatal(r, err)
		}
	}
}

// BenchmarkExtProc is one whole endpoint-picker exchange as Envoy makes it
// over loopback gRPC: open the stream, request headers, an 8 KiB chat body
// (buffered), the pick, close.
func BenchmarkExtProc(b *testing.B) {
	h := newHarness(b)
	body := chatBody(hashModel, strings.Repeat("You are a helpful assistant. ", 280))
	c := extprocv3.NewExternalProcessorClient(h.conn)
	hdrs := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json")}}}
	bodyReq := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		st, err := c.Process(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range []*extprocv3.ProcessingRequest{hdrs, bodyReq} {
			if err := st.Send(r); err != nil {
				b.Fatal(err)
			}
			if _, err := st.Recv(); err != nil {
				b.Fatal(err)
			}
		}
		_ = st.CloseSend()
		if _, err := st.Recv(); err == nil {
			b.Fatal("stream open after CloseSend")
		}
	}
}
