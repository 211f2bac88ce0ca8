package grpcapi

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// newFuzzPicker builds an endpoint picker over a router whose instances
// are never contacted (ext_proc only names them).
func newFuzzPicker(tb testing.TB, ep ExtProcConfig) (*extProc, map[string]bool) {
	tb.Helper()
	addrs := map[string]bool{}
	var pools []config.PoolConfig
	for _, pc := range []struct{ name, model, strategy string }{{"a", "model-a", config.StrategyPrefixAware}, {"b", "model-b", config.StrategyLeastOutstanding}} {
		cfg := config.PoolConfig{Name: pc.name, Model: pc.model, Adapters: []string{pc.name + "-lora"}, Routing: config.RoutingConfig{Strategy: pc.strategy, ConcurrencyThreshold: 2},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
		for i := range 3 {
			addr := fmt.Sprintf("10.0.%d.%d:8000", len(pools), i)
			addrs[addr] = true
			cfg.Instances = append(cfg.Instances, config.InstanceConfig{ID: fmt.Sprintf("%s-%d", pc.name, i), URL: "http://" + addr})
		}
		pools = append(pools, cfg)
	}
	// Pool a salts its tenants' bodies and strips kv_transfer_params;
	// pool b passes them on and does not salt.
	pools[0].CacheSalt = &config.CacheSaltConfig{Enabled: true}
	pools[1].PassKVTransferParams = true
	rs, err := httpapi.NewServer(config.Config{Pools: pools, CacheSaltSecret: fuzzSaltSecret}, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		tb.Fatal(err)
	}
	s, err := New(rs, Config{Logger: slog.New(slog.DiscardHandler), ExtProc: ep})
	if err != nil {
		tb.Fatal(err)
	}
	return &extProc{s: s}, addrs
}

var fuzzSaltSecret = []byte("0123456789abcdef0123456789abcdef")

// FuzzExtProcDecide feeds arbitrary paths, headers, subset hints and bodies
// to the endpoint picker: it must answer a routed endpoint of the pool (in
// the hint, when one is given) or a client/availability error, never panic.
// The body Envoy forwards (the picker's body mutation, else the body as
// received) is held to what the pool asks: with a body mutation it is one
// JSON object, its content-length set to its length; a JSON object body to
// pool a carries no kv_transfer_params, and the tenant header's derived
// cache_salt when one was given.
func FuzzExtProcDecide(f *testing.F) {
	f.Add("/v1/chat/completions", "", "", `{"model":"model-a","messages":[{"role":"user","content":"hi"}]}`, "")
	f.Add("/v1/completions", "b", "t1", `{"prompt":[1,2,3]}`, "10.0.1.2:8000")
	f.Add("/v1/completions", "", "", `{"model":"a-lora","prompt":"x","cache_salt":"s"}`, "10.0.0.1:8000,10.0.0.2:8000")
	f.Add("/invocations?x=1", "a", "", "\x00\xff raw body", "")
	f.Add("/v1/chat/completions", "", "", `{"messages":[{"content":[{"type":"text","text":"x"}]}]`, ",")
	f.Add("/v1/chat/completions", "zzz", "\x01", `null`, "1.2.3.4:5")
	f.Add("/v1/completions", "", "t1", `{"model":"model-a","prompt":"x","cache_salt":"mine","kv_transfer_params":{"remote_host":"h"}}`, "")
	f.Add("/invocations", "a", "", `{"prompt":"x","kv_transfer_p\u0061rams":{},"kv_transfer_params":1}`, "")
	f.Add("/invocations", "a", "t2", `{"prompt":"x","temperature":NaN}`, "")
	f.Add("/invocations", "b", "t2", `{"prompt":"x","kv_transfer_params":{}}`, "")
	f.Add("/invocations", "a", "", `{"prompt":"x","vllm_xargs":{"kv_transfer_param\u0073":"h"}}`, "")
	f.Add("/v1/completions", "", "t1", `{"model":"model-a","prompt":"x","vllm_xargs":{"a":1},"vllm_xargs":{"kv_transfer_params":["h"]}}`, "")
	f.Add("/v1/chat/completions", "", "", `{"model":"model-a","prompt_cache_key":"k","messages":[{"role":"user","content":"hi"}]}`, "")
	x, addrs := newFuzzPicker(f, ExtProcConfig{Shed: true, MaxQueued: 1, MaxBodyBytes: 1 << 16})
	f.Fuzz(func(t *testing.T, path, pool, tenant, body, subset string) {
		st := &epStream{headers: map[string]string{":path": path, "content-length": strconv.Itoa(len(body))}, body: []byte(body), chunks: 1}
		if pool != "" {
			st.headers[x.s.cfg.ExtProc.PoolHeader] = pool
		}
		if tenant != "" {
			st.headers[strings.ToLower(router.TenantHeader)] = tenant
		}
		if subset != "" {
			st.hasSubset = true
			for _, a := range strings.Split(subset, ",") {
				st.subset = append(st.subset, strings.TrimSpace(a))
			}
		}
		common, md, imm, err := x.decide(context.Background(), st)
		if err != nil {
			t.Fatalf("decide under a live context: %v", err)
		}
		if imm != nil {
			switch c := int(imm.GetImmediateResponse().GetStatus().GetCode()); c {
			case http.StatusBadRequest, http.StatusNotFound, http.StatusServiceUnavailable, http.StatusTooManyRequests:
			default:
				t.Fatalf("immediate status %d", c)
			}
			if st.inst != nil {
				t.Fatal("an instance stays acquired after an immediate response")
			}
			return
		}
		defer st.inst.Release()
		dest := string(common.GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue())
		if !addrs[dest] {
			t.Fatalf("destination %q is no instance", dest)
		}
		if st.hasSubset && !containsAddr(st.subset, dest) {
			t.Fatalf("destination %q outside the subset %v", dest, st.subset)
		}
		if got := md.GetFields()[DefaultDestinationNamespace].GetStructValue().GetFields()[DestinationKey].GetStringValue(); got != dest {
			t.Fatalf("metadata %q != header %q", got, dest)
		}
		checkForwarded(t, common, []byte(body), strings.HasPrefix(dest, "10.0.0."), tenant)
	})
}

// checkForwarded holds the body Envoy forwards after common to pool a's
// rules (salted, kv_transfer_params stripped) when toA, else to pool b's
// (passed on, unsalted: never rewritten).
func checkForwarded(t *testing.T, common *extprocv3.CommonResponse, received []byte, toA bool, tenant string) {
	t.Helper()
	forwarded, cl := received, ""
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "content-length" {
			cl = string(h.GetHeader().GetRawValue())
		}
	}
	if bm := common.GetBodyMutation(); bm != nil {
		forwarded = bm.GetBody()
		if !toA {
			t.Fatalf("pool b's body rewritten: %q", forwarded)
		}
		if !json.Valid(forwarded) || len(forwarded) == 0 || forwarded[0] != '{' {
			t.Fatalf("rewritten body %q is not a JSON object", forwarded)
		}
		if cl != strconv.Itoa(len(forwarded)) {
			t.Fatalf("content-length %q for a rewritten body of %d bytes", cl, len(forwarded))
		}
	} else if cl != "" {
		t.Fatalf("content-length %q set on a body not rewritten", cl)
	}
	if !toA || !routertest.ComparableWithStd(forwarded) {
		return
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(forwarded, &m) != nil {
		return
	}
	if _, ok := m["kv_transfer_params"]; ok {
		t.Fatalf("pool a forwards kv_transfer_params: %q (received %q)", forwarded, received)
	}
	var xargs map[string]json.RawMessage
	if json.Unmarshal(m["vllm_xargs"], &xargs) == nil && routertest.ComparableWithStd(m["vllm_xargs"]) {
		if _, ok := xargs["kv_transfer_params"]; ok {
			t.Fatalf("pool a forwards vllm_xargs.kv_transfer_params: %q (received %q)", forwarded, received)
		}
	}
	if router.ValidTenantKey(tenant) {
		if want := strconv.Quote(router.DeriveCacheSalt(fuzzSaltSecret, tenant)); string(m["cache_salt"]) != want {
			t.Fatalf("pool a forwards cache_salt %s for tenant %q, want %s: %q", m["cache_salt"], tenant, want, forwarded)
		}
	}
}

// BenchmarkExtProcDecide is the endpoint picker's own work for an 8 KiB
// chat body, without gRPC: parse, pool, candidates, prefix_aware pick,
// header mutation and dynamic metadata.
func BenchmarkExtProcDecide(b *testing.B) {
	x, _ := newFuzzPicker(b, ExtProcConfig{})
	body := []byte(`{"model":"model-a","messages":[{"role":"user","content":"` + strings.Repeat("You are a helpful assistant. ", 280) + `"}]}`)
	hdrs := map[string]string{":path": "/v1/chat/completions", ":method": "POST"}
	ctx := context.Background()
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		st := &epStream{headers: hdrs, body: body, chunks: 1}
		if _, _, imm, err := x.decide(ctx, st); imm != nil || err != nil {
			b.Fatal(imm, err)
		}
		st.inst.Release()
	}
}
