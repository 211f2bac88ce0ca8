package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/des"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/workload"
)

// workloadNames lists what --workload accepts.
var workloadNames = []string{"long-context", "chat", "rag", "code", "multi-tenant", "agent", "cache-pressure", "mix", "mooncake",
	"synth-calibrated", "synth-shared-prompts", "synth-bursty-long"}

// synthPrefix names synthesised traces: "synth-<shape>" is a trace drawn
// from --trace's fitted profile moved by workload.SynthShapes[shape].
const synthPrefix = "synth-"

// workloadFlags are the knobs shared by des, live and demo.
type workloadFlags struct {
	name      string
	seed      int64
	rate      float64
	conc      int
	limit     int
	scale     bool
	trace     string
	speed     float64
	spread    bool
	replicate int
	// shapesFile names a JSON file of synth shapes beyond the built-in
	// ones (--synth-shapes); shapes is what it held, read once.
	shapesFile string
	shapes     map[string]workload.SynthShape
	fleetToks  int64 // for cache-pressure: the fleet's GPU capacity
	fs         *flag.FlagSet
	// traces caches parsed traces by path across builds (a sweep builds
	// many workloads from one trace); nil = no cache. Records are never
	// modified once read.
	traces map[string][]workload.TraceRecord
}

// built is a workload ready to run, with what a report records about it.
type built struct {
	w *workload.Workload
	// recs are the trace records in request order (trace workloads only),
	// for the pooled-cache bound.
	recs []workload.TraceRecord
	// trace, speed, replicate: how a trace was played (trace empty for
	// generated workloads; replicate applies to both).
	trace     string
	speed     float64
	spread    bool
	replicate int
}

// isTrace reports whether the named workload replays a trace.
func isTrace(name string) bool { return name == "mooncake" || strings.HasPrefix(name, synthPrefix) }

func (f *workloadFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.name, "workload", "long-context", "workload: "+strings.Join(workloadNames, ", "))
	fs.Int64Var(&f.seed, "seed", 1, "seed for generated and synth-* workloads and for the strategies' random choices (random, least-outstanding ties; same seed, same run); a trace replayed with kv_aware or prefix_aware is the same under every seed")
	fs.Float64Var(&f.rate, "rate", 0, "arrival rate, requests/s (0 = the workload's default)")
	fs.IntVar(&f.conc, "concurrency", 0, "closed loop: keep N requests in flight instead of Poisson arrivals (generated workloads)")
	fs.IntVar(&f.limit, "limit", 0, "keep only the first N requests (0 = all)")
	fs.BoolVar(&f.scale, "scale", false, "add a scale-out (+2 instances at 1/3) and a scale-in (-2 at 2/3); 2 per copy with --replicate")
	fs.StringVar(&f.trace, "trace", workload.DefaultTracePath, "trace for --workload mooncake, and the trace synth-* workloads are calibrated to (default: the bundled Mooncake conversation trace)")
	fs.Float64Var(&f.speed, "speed", 1, "trace replay speed factor (2 = twice as fast)")
	fs.BoolVar(&f.spread, "spread", false, "trace workloads: spread the requests that share an arrival time evenly over the gap to the next arrival time (the Mooncake trace's timestamps are 3 s epochs of ~10 requests each; with --replicate, within each copy)")
	fs.StringVar(&f.shapesFile, "synth-shapes", "", synthShapesUsage)
	fs.IntVar(&f.replicate, "replicate", 1, "play N disjoint copies of the workload at once (offset hash ids or seeds, shifted starts): the same per-instance load on an N-times larger fleet")
	f.fs = fs
}

// synthShapesUsage documents --synth-shapes wherever it is offered.
const synthShapesUsage = "JSON file of synth shapes beyond the built-in ones, {\"name\": {\"burst_scale\": 8, ...}}, used as synth-<name> (docs/kvbench.md; docs/benchmarks/shapes-probe.json is one)"

// synthShapes reads --synth-shapes once (nil without it).
func (f *workloadFlags) synthShapes() (map[string]workload.SynthShape, error) {
	if f.shapes != nil {
		return f.shapes, nil
	}
	shapes, err := readSynthShapes(f.shapesFile)
	f.shapes = shapes
	return shapes, err
}

// readSynthShapes reads a --synth-shapes file (at most 1 MiB); no path,
// no shapes.
func readSynthShapes(path string) (map[string]workload.SynthShape, error) {
	if path == "" {
		return nil, nil
	}
	fh, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--synth-shapes: %w", err)
	}
	defer fh.Close()
	data, err := io.ReadAll(io.LimitReader(fh, 1<<20+1))
	if err != nil {
		return nil, fmt.Errorf("--synth-shapes %s: %w", path, err)
	}
	if len(data) > 1<<20 {
		return nil, fmt.Errorf("--synth-shapes %s: larger than 1 MiB", path)
	}
	shapes, err := workload.ParseSynthShapes(data)
	if err != nil {
		return nil, fmt.Errorf("--synth-shapes %s: %w", path, err)
	}
	return shapes, nil
}

// setFlags are the flags given on the command line.
func (f *workloadFlags) setFlags() map[string]bool {
	set := map[string]bool{}
	if f.fs != nil {
		f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	}
	return set
}

// build makes the workload; flags the chosen workload would ignore are
// errors, not silently dropped.
func (f *workloadFlags) build() (*workload.Workload, error) {
	b, err := f.buildAll()
	if err != nil {
		return nil, err
	}
	return b.w, nil
}

func (f *workloadFlags) buildAll() (built, error) {
	set := f.setFlags()
	if set["trace"] && !set["workload"] {
		// --trace FILE alone replays that trace (the usage's
		// "--workload W | --trace FILE").
		f.name = "mooncake"
	}
	if f.replicate < 1 {
		return built{}, fmt.Errorf("--replicate %d: want >= 1", f.replicate)
	}
	if set["synth-shapes"] && !strings.HasPrefix(f.name, synthPrefix) {
		return built{}, fmt.Errorf("--synth-shapes applies to synth-* workloads only (--workload synth-NAME), not %s", f.name)
	}
	if isTrace(f.name) {
		for _, fl := range []string{"rate", "concurrency"} {
			if set[fl] {
				return built{}, fmt.Errorf("--%s: a trace replays at its own times (use --speed)", fl)
			}
		}
		recs, err := f.openTrace()
		if err != nil {
			return built{}, err
		}
		// Requests play in arrival order and the bound is taken request
		// by request in that order, so the records are put in it first,
		// before --limit keeps the first N.
		recs = inTimeOrder(recs)
		if shape, ok := strings.CutPrefix(f.name, synthPrefix); ok {
			shapes, err := f.synthShapes()
			if err != nil {
				return built{}, err
			}
			// Draw only the requests kept (--limit), as many as the trace otherwise.
			if recs, err = workload.Synthesise(recs, shape, shapes, max(f.limit, 0), uint64(f.seed)); err != nil {
				return built{}, err
			}
			recs = inTimeOrder(recs)
		}
		if f.limit > 0 && f.limit < len(recs) {
			recs = recs[:f.limit]
		}
		name := f.name
		if name == "mooncake" && f.trace != workload.DefaultTracePath {
			name = "trace:" + filepath.Base(f.trace) // not the bundled Mooncake trace
		}
		w, recs, err := f.replay(name, recs)
		if err != nil {
			return built{}, err
		}
		if f.scale {
			// Each copy brings its own scale events, as a generated
			// workload's do (workload.Replicate).
			by := 2 * f.replicate
			if w, err = (workload.Scale{OutBy: by, InBy: by}).Apply(w); err != nil {
				return built{}, err
			}
		}
		return built{w: w, recs: recs, trace: f.trace, speed: f.speed, spread: f.spread, replicate: f.replicate}, nil
	}
	for _, fl := range []string{"speed", "trace", "spread"} {
		if set[fl] {
			return built{}, fmt.Errorf("--%s applies to trace workloads only (--workload mooncake or synth-*; %s is generated: use --rate)", fl, f.name)
		}
	}
	w, err := f.generate()
	if err != nil {
		return built{}, err
	}
	if f.scale {
		if w, err = (workload.Scale{}).Apply(w); err != nil {
			return built{}, err
		}
	}
	if f.replicate > 1 {
		// After the scale events, so that each copy brings its own.
		if w, err = workload.Replicate(w, f.replicate); err != nil {
			return built{}, err
		}
	}
	return built{w: w, replicate: f.replicate}, nil
}

// inTimeOrder is recs stably sorted by timestamp: recs itself when it is,
// else a sorted clone (the sweep's trace cache is shared, never modified).
func inTimeOrder(recs []workload.TraceRecord) []workload.TraceRecord {
	byTime := func(a, b workload.TraceRecord) int { return cmp.Compare(a.Timestamp, b.Timestamp) }
	if slices.IsSortedFunc(recs, byTime) {
		return recs
	}
	recs = slices.Clone(recs)
	slices.SortStableFunc(recs, byTime)
	return recs
}

// replay plays recs (one copy, in time order) as --replicate copies at
// --speed, and returns the workload with the records in its request order.
// --spread spreads one copy's epochs over the gaps to its own next epoch
// before the copies are merged: spreading after would spread each epoch
// over the gap to the next copy's, compressing every burst N-fold.
func (f *workloadFlags) replay(name string, recs []workload.TraceRecord) (*workload.Workload, []workload.TraceRecord, error) {
	tr := workload.TraceReplay{Name: name, Speed: f.speed}
	var spread []time.Duration // by record of one copy: --spread's delay
	if f.spread {
		one, err := tr.Workload(recs)
		if err != nil {
			return nil, nil, err
		}
		spread = make([]time.Duration, len(recs))
		for i := range one.Requests {
			spread[i] = -one.Requests[i].At
		}
		spreadBatches(one.Requests)
		for i := range one.Requests {
			spread[i] += one.Requests[i].At
		}
	}
	all, src, err := workload.ReplicateTraceSources(recs, f.replicate)
	if err != nil {
		return nil, nil, err
	}
	w, err := tr.Workload(all)
	if err != nil {
		return nil, nil, err
	}
	if spread == nil {
		return w, all, nil
	}
	// all is in time order, so request j plays all[j]; delay each, then
	// put requests and records back in arrival order together.
	order := make([]int, len(all))
	for j := range w.Requests {
		w.Requests[j].At += spread[src[j]]
		order[j] = j
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(w.Requests[a].At, w.Requests[b].At) })
	reqs := make([]workload.Request, len(order))
	sorted := make([]workload.TraceRecord, len(order))
	for j, k := range order {
		reqs[j], sorted[j] = w.Requests[k], all[k]
		reqs[j].ID = j
	}
	w.Requests = reqs
	return w, sorted, nil
}

// openTrace reads --trace, through the cache when there is one.
func (f *workloadFlags) openTrace() ([]workload.TraceRecord, error) {
	if recs, ok := f.traces[f.trace]; ok {
		return recs, nil
	}
	recs, err := workload.OpenTrace(f.trace)
	if err == nil && f.traces != nil {
		f.traces[f.trace] = recs
	}
	return recs, err
}

// generate builds a generated workload (one copy, before replication).
func (f *workloadFlags) generate() (*workload.Workload, error) {
	arr := workload.Arrivals{Rate: f.rate, Concurrency: f.conc}
	var (
		w   *workload.Workload
		err error
	)
	switch f.name {
	case "long-context":
		w, err = workload.LongContext{Arrivals: arr}.Generate(f.seed)
	case "chat":
		w, err = workload.Chat{Arrivals: arr}.Generate(f.seed)
	case "rag":
		w, err = workload.RAG{Arrivals: arr}.Generate(f.seed)
	case "code":
		w, err = workload.Code{Arrivals: arr}.Generate(f.seed)
	case "multi-tenant":
		w, err = workload.MultiTenant{Arrivals: arr}.Generate(f.seed)
	case "agent":
		w, err = workload.Agent{Arrivals: arr}.Generate(f.seed)
	case "cache-pressure":
		// Sized for the fleet one copy will see when replicated.
		w, err = workload.CachePressure{FleetTokens: f.fleetToks / int64(f.replicate), Arrivals: arr}.Generate(f.seed)
	case "mix":
		if f.conc > 0 {
			return nil, fmt.Errorf("--concurrency: the mix workload is open-loop only")
		}
		w, err = mixWorkload(f.seed, f.rate)
	default:
		return nil, fmt.Errorf("unknown workload %q: want one of %s", f.name, strings.Join(workloadNames, ", "))
	}
	if err != nil {
		return nil, err
	}
	if f.limit > 0 && f.limit < len(w.Requests) {
		w.Requests = w.Requests[:f.limit]
	}
	return w, nil
}

// mixWorkload is chat, RAG, code and multi-tenant traffic at once, each at
// a quarter of the rate (default 2 req/s each).
func mixWorkload(seed int64, rate float64) (*workload.Workload, error) {
	r := workload.Arrivals{Rate: 2}
	if rate > 0 {
		r.Rate = rate / 4
	}
	var parts []*workload.Workload
	for _, g := range []interface {
		Generate(seed int64) (*workload.Workload, error)
	}{
		workload.Chat{Sessions: 150, Arrivals: r},
		workload.RAG{Requests: 600, Arrivals: r},
		workload.Code{Users: 24, Arrivals: r},
		workload.MultiTenant{Requests: 600, Arrivals: r},
	} {
		w, err := g.Generate(seed)
		if err != nil {
			return nil, err
		}
		parts = append(parts, w)
	}
	return workload.Merge("mix", parts...)
}

// fleetFlags size the simulated engines.
type fleetFlags struct {
	instances int
	gpuTokens string
	cpuTokens string
	delay     time.Duration
	threshold int
	prefixLen int
	kvWeight  float64
	salt      bool
	// decisions, when set, receives the account of a KV-aware strategy's
	// decisions (des --decisions, decisions.go).
	decisions io.Writer
	// requestsDir, when set, receives requests-<strategy>.csv: one row per
	// request of a single-router run (des --out), to find where a tail
	// came from.
	requestsDir string
}

func (f *fleetFlags) register(fs *flag.FlagSet, instances int) {
	fs.IntVar(&f.instances, "instances", instances, "instances at the start")
	fs.StringVar(&f.gpuTokens, "gpu-tokens", "1.35M", "GPU KV capacity per instance in tokens (docs/reference/workload-facts.md §3: Llama 3.1 70B BF16 on 8×H100)")
	fs.StringVar(&f.cpuTokens, "cpu-tokens", "0", "CPU offload tier per instance in tokens (0 = none)")
	fs.DurationVar(&f.delay, "event-delay", 5*time.Millisecond, "engine-to-index KV event delay (0 = none: each batch reaches the index when its engine emits it)")
	fs.IntVar(&f.threshold, "concurrency-threshold", 0, "router concurrency_threshold (0 = router default, 64)")
	fs.IntVar(&f.prefixLen, "prefix-length", 0, "router prefix_length in characters (0 = router default, 8192)")
	fs.Float64Var(&f.kvWeight, "kv-prefill-cost-weight", 0, "kv_aware routing.kv.prefill_cost_weight (0 = the router's default)")
	fs.BoolVar(&f.salt, "salt-by-tenant", false, "send the tenant key as cache_salt")
}

// configure sets the fleet flags' event delay, prefix length and salting
// in a des configuration.
func (f *fleetFlags) configure(dc *des.Config) {
	dc.EventDelay, dc.PrefixLength, dc.SaltByTenant = f.eventDelay(), f.prefixLen, f.salt
}

// eventDelay is --event-delay as des.Config spells it: des reads 0 as its
// 5 ms default and a negative delay as none, so --event-delay 0 is -1.
func (f *fleetFlags) eventDelay() time.Duration {
	if f.delay == 0 {
		return -1
	}
	return f.delay
}

// routing is the router configuration the fleet flags ask for.
func (f *fleetFlags) routing() config.RoutingConfig {
	rc := config.RoutingConfig{ConcurrencyThreshold: f.threshold, PrefixLength: f.prefixLen}
	// The router is told the simulated engines' step budget (simConfig).
	rc.KV = &config.KVScoringConfig{PrefillCostWeight: f.kvWeight, MaxNumBatchedTokens: sim.DefaultMaxNumBatchedTokens}
	return rc
}

func (f *fleetFlags) simConfig() (sim.Config, int64, error) {
	gpu, err := parseTokens(f.gpuTokens)
	if err != nil {
		return sim.Config{}, 0, fmt.Errorf("--gpu-tokens: %w", err)
	}
	cpu, err := parseTokens(f.cpuTokens)
	if err != nil {
		return sim.Config{}, 0, fmt.Errorf("--cpu-tokens: %w", err)
	}
	bs := int64(sim.DefaultBlockSize)
	if gpu < bs {
		return sim.Config{}, 0, fmt.Errorf("--gpu-tokens %d is under one block", gpu)
	}
	// The engines' step budget is the one routing gives the router.
	return sim.Config{GPUBlocks: int(gpu / bs), CPUBlocks: int(cpu / bs), MaxNumBatchedTokens: sim.DefaultMaxNumBatchedTokens}, gpu, nil
}

func runDES(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("des", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench des [--workload W | --trace FILE] [--instances N] [--strategies a,b] [flags]", "Discrete-event comparison: the real strategies (the router's code) over simulated vLLM engines\non a virtual clock. Prints hit rate, TTFT percentiles, engine busy fractions and decision CPU\ntime per strategy; --out writes Markdown, CSV, JSON and SVG reports.", []string{"kvbench des --workload mooncake --instances 8 --strategies prefix_aware,kv_aware", "kvbench des --workload chat --instances 32 --speed 2"})
	var wf workloadFlags
	var ff fleetFlags
	wf.register(fs)
	ff.register(fs, 7)
	strategies := fs.String("strategies", "random,round_robin,least_outstanding,prefix_aware,kv_aware", "comma-separated strategies to compare")
	out := fs.String("out", "", "directory for report.md, report.csv, report.json, hit_rate.svg, ttft.svg and, for single-router runs, requests-<strategy>.csv (one row per request)")
	bound := fs.Bool("bound", true, "report hit rate as a fraction of the pooled-cache bound: one LRU cache of the whole fleet's GPU tokens (GPU and --cpu-tokens together when there is a CPU tier)")
	progress := fs.Bool("progress", true, "progress bar on stderr (only when it is a terminal)")
	var rf replicaFlags
	rf.register(fs)
	decisions := fs.Bool("decisions", false, "for kv_aware: print where its hit rate went, per decision reason (tokens the best holder held, lost moving off it, lost to evictions)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run (simulation and decisions) to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	stop, err := startCPUProfile(*cpuProfile)
	if err != nil {
		return err
	}
	defer stop()
	scfg, gpuTokens, err := ff.simConfig()
	if err != nil {
		return err
	}
	runs, err := rf.runs()
	if err != nil {
		return err
	}
	wf.fleetToks = gpuTokens * int64(ff.instances)
	if *decisions {
		ff.decisions = stdout
		// Its bookkeeping runs inside each timed decision.
		fmt.Fprintln(stdout, "note: with --decisions the decision time columns include its own bookkeeping (several times a decision's cost); compare them from a run without it")
	}
	if *out != "" {
		if err := os.MkdirAll(*out, 0o755); err != nil {
			return err
		}
		ff.requestsDir = *out
	}
	b, err := wf.buildAll()
	if err != nil {
		return err
	}
	w := b.w
	var boundHits []int64
	poolBound := 0.0
	if *bound {
		capTokens := boundTokens(gpuTokens, scfg, ff.instances)
		pb, hits, err := b.pooledBound(capTokens, ff.salt)
		if err != nil {
			return err
		}
		boundHits, poolBound = hits, pb.TokenRatio()
		if b.recs != nil {
			inf := workload.InfiniteBound(b.recs)
			fmt.Fprintf(stdout, "bounds: pooled LRU of %d tokens %.3f (tokens), infinite %.3f\n", capTokens, poolBound, inf.TokenRatio())
		} else {
			fmt.Fprintf(stdout, "bounds: pooled LRU of %d tokens %.3f (tokens, %d-token blocks)\n", capTokens, poolBound, sim.DefaultBlockSize)
		}
	}
	fmt.Fprintf(stdout, "workload %s: %d requests, %d prompt tokens, %.0f s; fleet %d × %d GPU tokens%s\n",
		w.Name, len(w.Requests), w.InputTokens(), w.Duration().Seconds(), ff.instances, gpuTokens, b.describe())
	var sums []report.Summary
	for _, name := range splitList(*strategies) {
		for _, run := range runs {
			var bar *report.Progress
			if *progress {
				if f, ok := stderr.(*os.File); ok {
					bar = report.NewProgress(f, run.label(name))
				}
			}
			var s report.Summary
			if run.routers == 1 {
				s, err = runStrategy(ctx, name, &ff, scfg, &b, boundHits, uint64(wf.seed), bar)
			} else {
				s, err = runReplicated(ctx, name, run, &rf, &ff, scfg, &b, boundHits, uint64(wf.seed), bar, stdout)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(stderr, "%s (%.1f s wall)\n", s, s.WallSec)
			sums = append(sums, s)
		}
	}
	if err := report.WriteMarkdown(stdout, sums); err != nil {
		return err
	}
	if err := report.WriteFailures(stdout, sums); err != nil {
		return err
	}
	if *out != "" {
		return writeReports(*out, sums, poolBound)
	}
	return nil
}

// runStrategy runs one strategy over the built workload on the fleet and
// summarises it (against the pooled bound when boundHits is set).
func runStrategy(ctx context.Context, name string, ff *fleetFlags, scfg sim.Config, b *built, boundHits []int64, seed uint64, bar *report.Progress) (report.Summary, error) {
	rt, err := newStrategyRouterSized(name, ff.routing(), seed, sim.DefaultModel, indexCapacity(ff.instances, scfg))
	if err != nil {
		return report.Summary{}, err
	}
	dc := rt.desConfig(ff.instances, scfg)
	ff.configure(&dc)
	dc.Progress = bar.Update
	var trace *decisionTrace
	if ff.decisions != nil && rt.kv != nil {
		trace = newDecisionTrace(rt)
		dc.Router = trace
		trace.bound = boundHits
		trace.life = newLifeTracker(dc.Index, func() time.Duration { return rt.kv.now })
		dc.Index = trace.life
	}
	res, err := des.Run(ctx, dc, b.w)
	bar.Done()
	if err != nil {
		return report.Summary{}, fmt.Errorf("%s: %w", name, err)
	}
	if trace != nil {
		rows, prompt := trace.breakdown(res)
		if err := writeBreakdown(ff.decisions, name, rows, prompt); err != nil {
			return report.Summary{}, err
		}
		if err := writeGapAccount(ff.decisions, trace.gapAccount(res), trace.beyond, prompt); err != nil {
			return report.Summary{}, err
		}
		if err := writeGapIdentity(ff.decisions, rows, prompt); err != nil {
			return report.Summary{}, err
		}
		if err := writeMoveAccount(ff.decisions, trace.moves, prompt); err != nil {
			return report.Summary{}, err
		}
		if err := trace.writeMoveOutcomes(ff.decisions, res, prompt); err != nil {
			return report.Summary{}, err
		}
		if err := trace.writeTurnover(ff.decisions); err != nil {
			return report.Summary{}, err
		}
		if err := trace.writeQueueProfile(ff.decisions, res); err != nil {
			return report.Summary{}, err
		}
	}
	if ff.requestsDir != "" {
		if err := writeRequestsCSV(filepath.Join(ff.requestsDir, "requests-"+name+".csv"), res); err != nil {
			return report.Summary{}, err
		}
	}
	s := report.Summarize(res, 0)
	if boundHits != nil {
		s = report.SummarizeBound(res, boundHits, aloneFloor(scfg))
	}
	b.record(&s)
	return s, nil
}

// aloneFloor is a request's TTFT alone on an idle engine of scfg (the
// summaries' floor percentiles); 0 when AloneTTFT refuses it (an empty
// prompt or an invalid configuration). Prompts past the model's length
// are priced anyway: the engine refuses them, so they failed and no
// summary counts them.
func aloneFloor(scfg sim.Config) func(prompt, cached int) time.Duration {
	return func(prompt, cached int) time.Duration {
		d, err := scfg.AloneTTFT(prompt, cached)
		if err != nil {
			return 0
		}
		return d
	}
}

// pooledBound is the pooled-cache bound of capTokens tokens over b's
// requests, with each request's hit tokens in it: a trace's from its
// records' block ids, a generated workload's from its token blocks (with
// each request's adapter, and its tenant as cache salt when salt is set,
// as the engines hash them).
func (b *built) pooledBound(capTokens int64, salt bool) (workload.Bound, []int64, error) {
	if b.recs != nil {
		return workload.PooledBoundPerRequest(b.recs, sim.DefaultBlockSize, capTokens)
	}
	return workload.RequestsBoundPerRequest(b.w.Requests, sim.DefaultBlockSize, capTokens, salt)
}

// boundTokens is the pooled bound's capacity for a fleet of instances
// engines of scfg with gpuTokens GPU tokens each: their GPU and CPU-tier
// tokens together. The engines count a prefix promoted from the CPU tier
// as a hit, so a bound of the GPU tokens alone is no bound with
// --cpu-tokens (a strategy reached 1.66 of it). The bound is one LRU of
// both tiers' capacity: a pooled two-tier cache, CPU tier included, holds
// at most that many distinct blocks.
func boundTokens(gpuTokens int64, scfg sim.Config, instances int) int64 {
	return (gpuTokens + int64(scfg.CPUBlocks)*sim.DefaultBlockSize) * int64(instances)
}

// record notes in s how the workload was played.
func (b *built) record(s *report.Summary) {
	s.Trace, s.Speed = b.trace, b.speed
	if b.replicate > 1 {
		s.Replicate = b.replicate
	}
}

// describe is the replay's settings for the run's header line.
func (b *built) describe() string {
	var parts []string
	if b.trace != "" {
		parts = append(parts, fmt.Sprintf("trace %s at speed %g", b.trace, b.speed))
		if b.spread {
			parts = append(parts, "same-time arrivals spread to the next arrival time")
		}
	}
	if b.replicate > 1 {
		parts = append(parts, fmt.Sprintf("%d disjoint copies", b.replicate))
	}
	if len(parts) == 0 {
		return ""
	}
	return "; " + strings.Join(parts, ", ")
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// writeReports writes every report format into dir.
func writeReports(dir string, sums []report.Summary, bound float64) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	files := []struct {
		name  string
		write func(io.Writer) error
	}{
		{"report.md", func(w io.Writer) error {
			if err := report.WriteMarkdown(w, sums); err != nil {
				return err
			}
			if len(sums) > 0 && (sums[0].Trace != "" || sums[0].Replicate > 1) {
				fmt.Fprintf(w, "\ntrace %q, speed %g, replicate %d\n", sums[0].Trace, sums[0].Speed, max(sums[0].Replicate, 1))
			}
			return report.WriteFailures(w, sums)
		}},
		{"report.csv", func(w io.Writer) error { return report.WriteCSV(w, sums) }},
		{"report.json", func(w io.Writer) error { return report.WriteJSON(w, sums) }},
		{"hit_rate.svg", report.HitRateChart(sums, bound).WriteSVG},
		{"ttft.svg", report.TTFTChart(sums).WriteSVG},
	}
	for _, f := range files {
		fh, err := os.Create(filepath.Join(dir, f.name))
		if err != nil {
			return err
		}
		werr := f.write(fh)
		cerr := fh.Close()
		if werr != nil {
			return fmt.Errorf("%s: %w", f.name, werr)
		}
		if cerr != nil {
			return cerr
		}
	}
	return nil
}

func routingDefaults() config.RoutingConfig { return config.RoutingConfig{} }

// runDESOnce runs w on n default engines of gpuTokens each and summarises.
func runDESOnce(ctx context.Context, n int, gpuTokens int64, rt *strategyRouter, w *workload.Workload) (report.Summary, error) {
	res, err := des.Run(ctx, rt.desConfig(n, sim.Config{GPUBlocks: int(gpuTokens / sim.DefaultBlockSize)}), w)
	if err != nil {
		return report.Summary{}, err
	}
	return report.Summarize(res, 0), nil
}

// spreadBatches spreads each run of requests that share an arrival time
// (reqs in arrival order) evenly over the gap to the next arrival time:
// request k of n arrives k/n of the gap later. The last run takes the
// gap before it. Order, and every other field, are unchanged.
func spreadBatches(reqs []workload.Request) {
	var gap time.Duration
	for i := 0; i < len(reqs); {
		j := i + 1
		for j < len(reqs) && reqs[j].At == reqs[i].At {
			j++
		}
		if j < len(reqs) {
			gap = reqs[j].At - reqs[i].At
		}
		at, n := reqs[i].At, time.Duration(j-i)
		for k := i; k < j; k++ {
			reqs[k].At = at + gap*time.Duration(k-i)/n
		}
		i = j
	}
}
