package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/sim"
	simserver "github.com/kvrouter/kvrouter/sim/server"
)

// localFleet is kvsim instances and a kvrouter in this process, on
// loopback ports: what the demo and the live-mode tests drive.
type localFleet struct {
	routerURL string
	insts     []*simserver.Instance
	srv       *http.Server
	cancel    context.CancelFunc
	done      chan error
}

type fleetSpec struct {
	Instances int
	GPUTokens int64
	TimeScale float64
	Strategy  string
	Logger    *slog.Logger
}

func startLocalFleet(ctx context.Context, spec fleetSpec) (*localFleet, error) {
	if spec.Logger == nil {
		spec.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	ctx, cancel := context.WithCancel(ctx)
	f := &localFleet{cancel: cancel, done: make(chan error, 1)}
	pool := router.PoolConfig{Name: "demo", Model: demoModel, Routing: router.RoutingConfig{Strategy: spec.Strategy}}
	for i := range spec.Instances {
		in, err := simserver.Start(ctx, simserver.Config{
			Engine:    sim.Config{GPUBlocks: int(spec.GPUTokens / sim.DefaultBlockSize), HashSeed: uint64(i + 1)},
			TimeScale: spec.TimeScale,
			Logger:    spec.Logger,
		})
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("kvsim %d: %w", i, err)
		}
		f.insts = append(f.insts, in)
		pool.Instances = append(pool.Instances, router.InstanceConfig{ID: fmt.Sprintf("sim%d", i), URL: in.URL()})
	}
	srv, err := router.NewServer(router.Config{Listen: "127.0.0.1:0", Pools: []router.PoolConfig{pool}, DefaultPool: "demo"}, router.Options{Logger: spec.Logger})
	if err != nil {
		f.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Close()
		return nil, err
	}
	f.routerURL = "http://" + ln.Addr().String()
	f.srv = &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() { f.done <- f.srv.Serve(ln) }()
	return f, nil
}

// Close stops the router and the instances.
func (f *localFleet) Close() {
	if f.srv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = f.srv.Shutdown(sctx)
		cancel()
		<-f.done
	}
	for _, in := range f.insts {
		_ = in.Close()
	}
	f.cancel()
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	instances := fs.Int("instances", 4, "simulated vLLM instances")
	gpu := fs.String("gpu-tokens", "150K", "GPU KV capacity per instance, tokens (small, so that placement matters)")
	scale := fs.Float64("time-scale", 4, "engine virtual-time speed-up: the demo's traffic plays this many times faster than real time")
	dur := fs.Duration("duration", 60*time.Second, "wall-clock time per strategy, about")
	strategies := fs.String("strategies", "round_robin,prefix_aware", "strategies to compare")
	seed := fs.Int64("seed", 1, "workload seed")
	out := fs.String("out", "kvbench-demo", "directory for the report files")
	if err := fs.Parse(args); err != nil {
		return err
	}
	gpuTokens, err := parseTokens(*gpu)
	if err != nil {
		return fmt.Errorf("--gpu-tokens: %w", err)
	}
	if *instances < 1 || *scale <= 0 || *dur <= 0 {
		return errors.New("demo: need --instances >= 1, --time-scale > 0, --duration > 0")
	}
	// The mixed workload, cut to the requested wall-clock length.
	w, err := mixWorkload(*seed, 0)
	if err != nil {
		return err
	}
	horizon := time.Duration(float64(*dur) * *scale)
	n := 0
	for n < len(w.Requests) && w.Requests[n].At < horizon {
		n++
	}
	w.Requests = w.Requests[:n]
	fl, err := startLocalFleet(ctx, fleetSpec{Instances: *instances, GPUTokens: gpuTokens, TimeScale: *scale})
	if err != nil {
		return err
	}
	defer fl.Close()
	fmt.Fprintf(stdout, "demo: %d kvsim instances (%d GPU tokens each, time scale %g) behind kvrouter at %s\n", *instances, gpuTokens, *scale, fl.routerURL)
	c := newLiveClient(liveConfig{RouterURL: fl.routerURL, TimeScale: *scale, Reset: true})
	sums, err := liveCompare(ctx, c, w, splitList(*strategies), stdout, stderr)
	if err != nil {
		return err
	}
	if err := report.WriteMarkdown(stdout, sums); err != nil {
		return err
	}
	if *out != "" {
		if err := writeReports(*out, sums, 0); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "report written to %s/\n", *out)
	}
	return nil
}
