package grpcapi

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
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
	rs, err := httpapi.NewServer(config.Config{Pools: pools}, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		tb.Fatal(err)
	}
	s, err := New(rs, Config{Logger: slog.New(slog.DiscardHandler), ExtProc: ep})
	if err != nil {
		tb.Fatal(err)
	}
	return &extProc{s: s}, addrs
}

// FuzzExtProcDecide feeds arbitrary paths, headers, subset hints and bodies
// to the endpoint picker: it must answer a routed endpoint of the pool (in
// the hint, when one is given) or a client/availability error, never panic.
func FuzzExtProcDecide(f *testing.F) {
	f.Add("/v1/chat/completions", "", "", `{"model":"model-a","messages":[{"role":"user","content":"hi"}]}`, "")
	f.Add("/v1/completions", "b", "t1", `{"prompt":[1,2,3]}`, "10.0.1.2:8000")
	f.Add("/v1/completions", "", "", `{"model":"a-lora","prompt":"x","cache_salt":"s"}`, "10.0.0.1:8000,10.0.0.2:8000")
	f.Add("/invocations?x=1", "a", "", "\x00\xff raw body", "")
	f.Add("/v1/chat/completions", "", "", `{"messages":[{"content":[{"type":"text","text":"x"}]}]`, ",")
	f.Add("/v1/chat/completions", "zzz", "\x01", `null`, "1.2.3.4:5")
	x, addrs := newFuzzPicker(f, ExtProcConfig{Shed: true, MaxQueued: 1, MaxBodyBytes: 1 << 16})
	f.Fuzz(func(t *testing.T, path, pool, tenant, body, subset string) {
		st := &epStream{headers: map[string]string{":path": path}, body: []byte(body)}
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
	})
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
		st := &epStream{headers: hdrs, body: body}
		if _, _, imm, err := x.decide(ctx, st); imm != nil || err != nil {
			b.Fatal(imm, err)
		}
		st.inst.Release()
	}
}
