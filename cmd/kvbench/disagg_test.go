package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// TestDisaggDES plays one long-context workload aggregated and
// disaggregated (2 prefill + 2 decode) with kv_aware picking both stages:
// every request completes; a disaggregated one is prefilled in the prefill
// set, decoded in the decode set, and its KV moves between them; decode
// instances that never prefill generate at a steadier pace (time per
// output token) than instances that mix prefills into their batches; and
// conditional mode with a threshold above every prompt keeps all of them
// aggregated.
func TestDisaggDES(t *testing.T) {
	ctx := context.Background()
	w, err := workload.LongContext{Groups: 10, RequestsPerGroup: 8, PrefixTokens: 6000, QuestionTokens: 200, OutputTokens: 64,
		Arrivals: workload.Arrivals{Rate: 4}}.Generate(5)
	if err != nil {
		t.Fatal(err)
	}
	scfg := sim.Config{GPUBlocks: 1_350_000 / 16}
	play := func(d *des.Disagg) (*des.Result, disaggRow) {
		rt, err := newStrategyRouterSized("kv_aware", routingDefaults(), 1, sim.DefaultModel, indexCapacity(4, scfg))
		if err != nil {
			t.Fatal(err)
		}
		dc := rt.desConfig(4, scfg)
		if d != nil {
			d.Uncached = rt.uncached
		}
		dc.Disagg = d
		res, err := des.Run(ctx, dc, w)
		if err != nil {
			t.Fatal(err)
		}
		prefill := 0
		if d != nil {
			prefill = d.Prefill
		}
		return res, summarizeDisagg(disaggSetup{prefill: prefill}, res)
	}
	_, agg := play(nil)
	res, dis := play(&des.Disagg{Prefill: 2, Handoff: time.Millisecond})
	if agg.failed != 0 || dis.failed != 0 || dis.disaggregated != len(w.Requests) {
		t.Fatalf("failed %d / %d, disaggregated %d of %d", agg.failed, dis.failed, dis.disaggregated, len(w.Requests))
	}
	for _, o := range res.Outcomes {
		if (o.PrefillInstance != "i00" && o.PrefillInstance != "i01") || (o.Instance != "i02" && o.Instance != "i03") {
			t.Fatalf("request %d: prefilled on %q, decoded on %q", o.ID, o.PrefillInstance, o.Instance)
		}
	}
	if res.RemoteTokens == 0 || dis.kvMovedGB <= 0 {
		t.Fatalf("no KV moved: %d tokens", res.RemoteTokens)
	}
	if dis.tpot99 >= agg.tpot99 {
		t.Errorf("time per output token p99: disaggregated %.2f ms, aggregated %.2f ms", dis.tpot99, agg.tpot99)
	}
	t.Logf("aggregated: ttft p50 %.0f p99 %.0f ms, tpot p50 %.2f p99 %.2f ms; disaggregated: ttft p50 %.0f p99 %.0f ms, tpot p50 %.2f p99 %.2f ms, %.1f GB moved",
		agg.ttft50, agg.ttft99, agg.tpot50, agg.tpot99, dis.ttft50, dis.ttft99, dis.tpot50, dis.tpot99, dis.kvMovedGB)

	res, cond := play(&des.Disagg{Prefill: 2, Conditional: true, MinPrefillTokens: 1 << 20})
	if cond.disaggregated != 0 || res.RemoteTokens != 0 || cond.failed != 0 {
		t.Fatalf("conditional above every prompt: %d disaggregated, %d tokens moved", cond.disaggregated, res.RemoteTokens)
	}

	var out, errb bytes.Buffer
	if err := run(ctx, []string{"disagg", "--workload", "long-context", "--instances", "3", "--limit", "40", "--ratios", "1:2"}, &out, &errb); err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	for _, want := range []string{"| aggregated |", "| disagg 1:2 (1P+2D) |", "| conditional 1P+2D (min 256) |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("kvbench disagg output lacks %q:\n%s", want, out.String())
		}
	}
	if err := run(ctx, []string{"disagg", "--ratios", "0:1"}, &out, &errb); err == nil {
		t.Error("--ratios 0:1 accepted")
	}
}
