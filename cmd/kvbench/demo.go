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
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
	"github.com/kvrouter/kvrouter/workload"
)

// localFleet is kvsim instances and a kvrouter in this process, on
// loopback ports: what the demo and the live-mode tests drive. With
// events, it is the whole pipeline: each kvsim publishes its KV events over
// ZMQ, a kvbridge per instance forwards them to an embedded NATS server
// (JetStream), and the router's events consumer applies them to its
// in-memory index, which kv_aware reads.
type localFleet struct {
	routerURL string
	insts     []*simserver.Instance
	srv       *http.Server
	natsDir   string
	conn      *nats.Conn // the bridges'
	kv        *kvstate.Pipeline
	index     kvindex.Index
	cancel    context.CancelFunc
	done      chan error
	// bg counts the bridges' goroutines.
	bg sync.WaitGroup
}

type fleetSpec struct {
	Instances int
	GPUTokens int64
	TimeScale float64
	Strategy  string
	// Events runs the KV-event pipeline (NATS, bridges, consumer, index),
	// which kv_aware needs.
	Events bool
	Logger *slog.Logger
}

// freeTCP returns a loopback port that was free a moment ago.
func freeTCP() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startLocalFleet(ctx context.Context, spec fleetSpec) (*localFleet, error) {
	if spec.Logger == nil {
		spec.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	ctx, cancel := context.WithCancel(ctx)
	f := &localFleet{cancel: cancel, done: make(chan error, 1)}
	fail := func(err error) (*localFleet, error) {
		f.Close()
		return nil, err
	}
	const pool = "demo"
	pc := config.PoolConfig{Name: pool, Model: demoModel, Routing: config.RoutingConfig{Strategy: spec.Strategy}}
	var sources []bridge.Source
	for i := range spec.Instances {
		id := fmt.Sprintf("sim%d", i)
		cfg := simserver.Config{
			Engine:    sim.Config{GPUBlocks: int(spec.GPUTokens / sim.DefaultBlockSize), HashSeed: uint64(i + 1)},
			TimeScale: spec.TimeScale,
			Logger:    spec.Logger,
		}
		if spec.Events {
			pub, err := freeTCP()
			if err != nil {
				return fail(err)
			}
			rep, err := freeTCP()
			if err != nil {
				return fail(err)
			}
			cfg.Events = simserver.EventsConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pub), ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", rep)}
		}
		in, err := simserver.Start(ctx, cfg)
		if err != nil {
			return fail(fmt.Errorf("kvsim %d: %w", i, err))
		}
		f.insts = append(f.insts, in)
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: id, URL: in.URL()})
		if spec.Events {
			sources = append(sources, bridge.Source{Instance: id, Endpoint: cfg.Events.Endpoint, ReplayEndpoint: cfg.Events.ReplayEndpoint, URL: in.URL(), FirstSeq: simserver.FirstSeq})
		}
	}
	opts := httpapi.Options{Logger: spec.Logger, Admin: admin.Routes(nil)}
	if spec.Events {
		if err := f.startEvents(ctx, pc, sources, spec.Logger); err != nil {
			return fail(err)
		}
		pc.Tokenizer = &config.TokenizerConfig{Source: kvaware.TokenSourceSimple}
		opts.KV, opts.KVEvents, opts.Admin = kvaware.NewSource(f.kv.KV), f.kv, admin.Routes(f.kv)
	}
	srv, err := httpapi.NewServer(config.Config{Listen: "127.0.0.1:0", Pools: []config.PoolConfig{pc}, DefaultPool: pool}, opts)
	if err != nil {
		return fail(err)
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

// startEvents starts the router's KV events pipeline as kvrouter does
// (kvstate.Start: embedded NATS, the pool's consumer and memory
// index) and one bridge per instance publishing to it.
func (f *localFleet) startEvents(ctx context.Context, pc config.PoolConfig, sources []bridge.Source, log *slog.Logger) error {
	dir, err := os.MkdirTemp("", "kvbench-nats-")
	if err != nil {
		return err
	}
	f.natsDir = dir
	// In-memory stream and bucket: the demo's state need not outlive it.
	stream := kvstream.StreamConfig{Memory: true}
	bucket := kvstream.BucketConfig{Memory: true}
	discover := false // the fleet's instances are configured
	cfg := config.Config{
		Events: &config.EventsConfig{NATS: config.NATSConfig{Listen: "127.0.0.1:0", StoreDir: dir}, DiscoverInstances: &discover},
		Pools:  []config.PoolConfig{pc},
	}
	f.kv, err = kvstate.Start(ctx, cfg, kvstate.Options{Logger: log, Stream: stream, Bucket: bucket})
	if err != nil {
		return err
	}
	f.conn, err = nats.Connect(f.kv.NATSURL(), nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	for _, src := range sources {
		b, err := bridge.New(bridge.Config{Pool: pc.Name, Model: demoModel, BlockSize: sim.DefaultBlockSize, Sources: []bridge.Source{src},
			Conn: f.conn, Stream: stream, Bucket: bucket, Logger: log})
		if err != nil {
			return err
		}
		f.bg.Add(1)
		go func() {
			defer f.bg.Done()
			_ = b.Run(ctx)
		}()
	}
	f.index, _ = f.kv.KV(pc)
	c, ok := f.kv.Consumer(pc.Name)
	if f.index == nil || !ok {
		return fmt.Errorf("demo: no KV state for pool %s", pc.Name)
	}
	// Wait until the consumer runs and every instance is live (the bridges
	// have announced themselves), so the first requests route exactly.
	deadline := time.Now().Add(15 * time.Second)
	for {
		ready := c.Healthy()
		for _, src := range sources {
			ready = ready && c.Live(src.Instance)
		}
		if ready {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: events pipeline not ready after 15s: %+v", c.Instances())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Close stops the router, the pipeline and the instances.
func (f *localFleet) Close() {
	if f.srv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = f.srv.Shutdown(sctx)
		cancel()
		<-f.done
	}
	f.cancel()
	f.bg.Wait()
	for _, in := range f.insts {
		_ = in.Close()
	}
	if f.conn != nil {
		f.conn.Close()
	}
	if f.kv != nil {
		f.kv.Close()
	}
	if f.natsDir != "" {
		_ = os.RemoveAll(f.natsDir)
	}
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench demo [--duration D] [--instances N] [--out DIR]", "Starts embedded NATS, simulated vLLM instances, one kvbridge each and a kvrouter in this process,\nplays a shared-prefix workload against each strategy for --duration, and prints the comparison\n(what `make demo` runs). Exits by itself.", []string{"kvbench demo", "kvbench demo --duration 10s --strategies prefix_aware,kv_aware"})
	instances := fs.Int("instances", 4, "simulated vLLM instances")
	gpu := fs.String("gpu-tokens", "150K", "GPU KV capacity per instance, tokens (small, so that placement matters)")
	scale := fs.Float64("time-scale", 1, "engine virtual-time speed-up: traffic plays this many times faster than real time (router overheads, which are real time, then count this many times over)")
	dur := fs.Duration("duration", 60*time.Second, "wall-clock time per strategy, about")
	strategies := fs.String("strategies", "prefix_aware,kv_aware", "strategies to compare")
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
	fl, err := startLocalFleet(ctx, fleetSpec{Instances: *instances, GPUTokens: gpuTokens, TimeScale: *scale, Events: true})
	if err != nil {
		return err
	}
	defer fl.Close()
	fmt.Fprintf(stdout, "demo: embedded NATS, %d kvsim instances (%d GPU tokens each, time scale %g) with kvbridges, kvrouter with the in-memory index at %s\n", *instances, gpuTokens, *scale, fl.routerURL)
	c := newLiveClient(liveConfig{RouterURL: fl.routerURL, TimeScale: *scale, Reset: true})
	// of_bound: the hit rate of one LRU cache as large as the whole fleet's
	// GPU KV, which no routing of these requests can beat.
	b, boundHits, err := workload.RequestsBoundPerRequest(w.Requests, sim.DefaultBlockSize, gpuTokens*int64(*instances), false)
	if err != nil {
		return err
	}
	sums, err := liveCompare(ctx, c, w, splitList(*strategies), boundHits, stdout, stderr)
	if err != nil {
		return err
	}
	if err := report.WriteCompact(stdout, sums); err != nil {
		return err
	}
	if *out != "" {
		if err := writeReports(*out, sums, b.TokenRatio()); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "report written to %s/ (report.md has every column: balance, overflow, busy, decision time)\n", *out)
	}
	return nil
}
