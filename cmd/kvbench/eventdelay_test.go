package main

import (
	"context"
	"flag"
	"io"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// timedIndex notes the virtual time of every batch applied.
type timedIndex struct {
	des.IndexWriter
	now     *time.Duration
	applied []time.Duration
}

func (x *timedIndex) Apply(ctx context.Context, inst string, evs []events.Event) (kvindex.ApplyResult, error) {
	x.applied = append(x.applied, *x.now)
	return x.IndexWriter.Apply(ctx, inst, evs)
}

// TestEventDelayZeroFlag: --event-delay 0 is no delay, every KV event batch
// applied to the router's index at the virtual time the engine emitted it
// (des reads 0 in its config as its 5 ms default).
func TestEventDelayZeroFlag(t *testing.T) {
	for _, tc := range []struct {
		arg  string
		want time.Duration
	}{{"0", 0}, {"5ms", 5 * time.Millisecond}} {
		var ff fleetFlags
		fs := flag.NewFlagSet("des", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		ff.register(fs, 2)
		if err := fs.Parse([]string{"--event-delay", tc.arg, "--gpu-tokens", "100k"}); err != nil {
			t.Fatal(err)
		}
		scfg, _, err := ff.simConfig()
		if err != nil {
			t.Fatal(err)
		}
		rt, err := newStrategyRouterSized("kv_aware", ff.routing(), 1, sim.DefaultModel, indexCapacity(ff.instances, scfg))
		if err != nil {
			t.Fatal(err)
		}
		dc := rt.desConfig(ff.instances, scfg)
		ff.configure(&dc)
		var now time.Duration
		var emitted []time.Duration
		clock, factory := dc.Clock, dc.NewEngine
		dc.Clock = func(t time.Duration) { now = t; clock(t) }
		dc.NewEngine = func(name string, sink func(events.Batch)) (des.Engine, error) {
			return factory(name, func(b events.Batch) { emitted = append(emitted, now); sink(b) })
		}
		idx := &timedIndex{IndexWriter: dc.Index, now: &now}
		dc.Index = idx
		w, err := workload.Chat{Sessions: 5}.Generate(1)
		if err != nil {
			t.Fatal(err)
		}
		w.Requests = w.Requests[:min(40, len(w.Requests))]
		if _, err := des.Run(context.Background(), dc, w); err != nil {
			t.Fatal(err)
		}
		if len(emitted) == 0 || len(idx.applied) != len(emitted) {
			t.Fatalf("--event-delay %s: %d batches emitted, %d applied", tc.arg, len(emitted), len(idx.applied))
		}
		for i := range emitted {
			if d := idx.applied[i] - emitted[i]; d != tc.want {
				t.Fatalf("--event-delay %s: batch %d emitted at %v applied %v later, want %v", tc.arg, i, emitted[i], d, tc.want)
			}
		}
	}
}
