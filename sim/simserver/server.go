// Package simserver serves simulated vLLM engines (package sim) over vLLM's
// HTTP API and KV-event ZMQ sockets, in real time or scaled time. One
// Instance is one vLLM server (one HTTP port, one engine per data-parallel
// rank, a ZMQ PUB and replay socket per rank); cmd/kvsim runs many in one
// process, and kvbench and tests start them in-process.
package simserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// Config describes one simulated vLLM server. Zero values mean the
// documented defaults.
type Config struct {
	// Engine is the per-rank engine model; Engine.Model is the served model
	// name. DPRank and Epoch are set per rank by the server.
	Engine sim.Config
	// Listen is the HTTP address (default "127.0.0.1:0": a free port).
	Listen string
	// DataParallelSize is the number of engines (ranks) behind the HTTP port
	// (default 1). Requests go to the rank with the fewest queued+running.
	DataParallelSize int
	// Tokenizer turns prompts into tokens (default tokenizer.Simple).
	Tokenizer tokenizer.ChatTokenizer
	// TimeScale runs virtual time this many times faster than the wall
	// clock (default 1).
	TimeScale float64
	// LoRAs are loaded at start (name → path), like vLLM's --lora-modules.
	LoRAs map[string]string
	// DefaultMaxTokens applies when a request sets none (default 16, as
	// vLLM's completions; chat defaults to the same here).
	DefaultMaxTokens int
	// MaxLoRAs is reported as max_lora in vllm:lora_requests_info (default
	// 1, vLLM's --max-loras default); the simulated engine does not limit
	// adapters per batch.
	MaxLoRAs int
	// Role is the disaggregated-serving role: both (default), prefill or
	// decode (disagg.go).
	Role string

	// Events configures the KV-event sockets; an empty Endpoint disables them.
	Events EventsConfig
	// NoStartTime leaves process_start_time_seconds out of /metrics, as
	// llm-d-inference-sim does (it registers no process collector): a
	// bridge then cannot tell a restart from the start time.
	NoStartTime bool

	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// EventsConfig is vLLM's --kv-events-config, per server.
type EventsConfig struct {
	// Endpoint is the PUB endpoint of rank 0, e.g. "tcp://127.0.0.1:5557";
	// rank r uses the port + r. Empty disables KV events.
	Endpoint string
	// Dial connects the PUB socket to Endpoint (a SUB that binds) instead of binding.
	Dial bool
	// ReplayEndpoint is the replay ROUTER endpoint of rank 0 (port + r per
	// rank); empty disables replay.
	ReplayEndpoint string
	// Topic is the first frame; "{host}", "{port}" (the HTTP port),
	// "{rank}" and "{model}" are expanded (default "kv@{host}:{port}@{model}",
	// the llm-d-inference-sim convention; vLLM's own default is "kv"). All
	// ranks of an instance share it by default, as in vLLM, where the rank
	// is told apart by its port and the batch's data_parallel_rank.
	Topic string
	// Encoding of the events (default events.EncodingArray).
	Encoding events.Encoding
	// BufferSteps is the replay buffer length (default 10000, vLLM's buffer_steps).
	BufferSteps int
	// HWM is the publish queue length beyond which batches are dropped for
	// subscribers (still replayable), as a PUB socket's high-water mark
	// (default 100000, vLLM's hwm).
	HWM int
	// LegacyReplay answers replay with [seq, payload] instead of [topic, seq, payload].
	LegacyReplay bool
	// ReplayDelay binds the replay socket that long after the PUB socket
	// (llm-d-inference-sim sets its replay up once its publisher is
	// connected); 0: at once.
	ReplayDelay time.Duration
	// Format is the engine whose events the server emits: FormatVLLM
	// (default), FormatSGLang or FormatTRTLLM (engines.go). With
	// FormatTRTLLM there are no ZMQ sockets: Endpoint only switches events
	// on, and POST /kv_cache_events serves them. FormatTRTLLM also makes
	// the engines reuse as TensorRT-LLM does (sim.Config.PartialReuse).
	Format string
}

// ErrConfig wraps configuration errors.
var ErrConfig = errors.New("server: invalid config")

// Instance is one running simulated vLLM server.
type Instance struct {
	cfg      Config
	model    string
	tok      tokenizer.ChatTokenizer
	log      *slog.Logger
	ln       net.Listener
	http     *http.Server
	ranks    []*driver
	pubs     []*enginezmq.Publisher
	registry *prometheus.Registry
	metrics  *metrics
	created  int64

	cancel context.CancelFunc
	wg     sync.WaitGroup

	loraMu    sync.Mutex // guards loraPaths (engines keep their own LoRA tables)
	loraPaths map[string]string

	sleeping atomic.Bool // between /sleep and /wake_up: the KV cache is gone, requests are refused

	disagg disaggState
}

// Start listens, starts the engines' drivers and serves until ctx ends or
// Close is called.
func Start(ctx context.Context, cfg Config) (*Instance, error) {
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.DataParallelSize == 0 {
		cfg.DataParallelSize = 1
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = tokenizer.Simple{}
	}
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1
	}
	if cfg.DefaultMaxTokens == 0 {
		cfg.DefaultMaxTokens = 16
	}
	if cfg.MaxLoRAs == 0 {
		cfg.MaxLoRAs = 1
	}
	role, err := validateRole(cfg.Role)
	if err != nil {
		return nil, err
	}
	cfg.Role = role
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ev := &cfg.Events
	if ev.Topic == "" {
		ev.Topic = "kv@{host}:{port}@{model}"
	}
	if ev.Encoding == 0 {
		ev.Encoding = events.EncodingArray
	}
	if ev.BufferSteps == 0 {
		ev.BufferSteps = 10000
	}
	if ev.HWM == 0 {
		ev.HWM = 100000
	}
	if err := ValidFormat(ev.Format); err != nil {
		return nil, err
	}
	switch {
	case cfg.DataParallelSize < 1 || cfg.DataParallelSize > 64:
		return nil, fmt.Errorf("%w: data-parallel size %d out of [1, 64]", ErrConfig, cfg.DataParallelSize)
	case !(cfg.TimeScale > 0) || cfg.TimeScale > 1e6:
		return nil, fmt.Errorf("%w: time scale %v out of (0, 1e6]", ErrConfig, cfg.TimeScale)
	case cfg.DefaultMaxTokens < 1:
		return nil, fmt.Errorf("%w: default max tokens %d < 1", ErrConfig, cfg.DefaultMaxTokens)
	case ev.BufferSteps < 1 || ev.HWM < 1:
		return nil, fmt.Errorf("%w: event buffer steps and HWM must be positive", ErrConfig)
	}
	if ev.Encoding != events.EncodingArray && ev.Encoding != events.EncodingMap {
		return nil, fmt.Errorf("%w: event encoding %v", ErrConfig, ev.Encoding)
	}
	model := cfg.Engine.Model
	if model == "" {
		model = sim.DefaultModel
	}

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("server: listen %s: %w", cfg.Listen, err)
	}
	host, portStr, _ := net.SplitHostPort(ln.Addr().String())
	port, _ := strconv.Atoi(portStr)

	ctx, cancel := context.WithCancel(ctx)
	in := &Instance{
		cfg: cfg, model: model, tok: cfg.Tokenizer, log: cfg.Logger.With("instance", ln.Addr().String()),
		ln: ln, registry: prometheus.NewRegistry(), created: time.Now().Unix(),
		cancel: cancel, loraPaths: make(map[string]string), disagg: disaggState{role: cfg.Role},
	}
	fail := func(err error) (*Instance, error) {
		cancel()
		ln.Close()
		for _, p := range in.pubs {
			p.Close()
		}
		return nil, err
	}
	clock := Clock{Start: time.Now(), Scale: cfg.TimeScale}
	for r := range cfg.DataParallelSize {
		ec := cfg.Engine
		ec.Model = model
		ec.DPRank = r
		ec.Epoch = float64(clock.Start.UnixNano()) / 1e9
		if ev.Format == FormatTRTLLM {
			// TensorRT-LLM reuses with enable_partial_reuse, its default
			// (sim.Config.PartialReuse), as routing.kv.engine: trtllm assumes.
			ec.PartialReuse = true
		}
		var pub *enginezmq.Publisher
		var trt *trtBuffer
		if ev.Endpoint != "" && ev.Format == FormatTRTLLM {
			trt = newTRTBuffer(r, cfg.DataParallelSize > 1)
		} else if ev.Endpoint != "" {
			pubEP, err := offsetEndpoint(ev.Endpoint, r)
			if err != nil {
				return fail(err)
			}
			replayEP := ""
			if ev.ReplayEndpoint != "" {
				if replayEP, err = offsetEndpoint(ev.ReplayEndpoint, r); err != nil {
					return fail(err)
				}
			}
			topic := strings.NewReplacer("{host}", host, "{port}", strconv.Itoa(port), "{rank}", strconv.Itoa(r), "{model}", model).Replace(ev.Topic)
			pub, err = enginezmq.NewPublisher(ctx, enginezmq.PublisherConfig{
				Endpoint: pubEP, Dial: ev.Dial, ReplayEndpoint: replayEP, Topic: topic,
				BufferSteps: ev.BufferSteps, LegacyReplay: ev.LegacyReplay, ReplayDelay: ev.ReplayDelay,
				FirstSeq: FirstSeq,
			})
			if err != nil {
				return fail(fmt.Errorf("server: rank %d events: %w", r, err))
			}
			in.pubs = append(in.pubs, pub)
		}
		var p publisher
		if pub != nil {
			p = pub
		}
		d, err := newDriver(ec, clock, ev.Encoding, ev.HWM, p, in.log.With("rank", r), trt)
		if err != nil {
			return fail(fmt.Errorf("%w: %w", ErrConfig, err))
		}
		d.format = ev.Format
		in.ranks = append(in.ranks, d)
	}
	for name, path := range cfg.LoRAs {
		if err := in.LoadLoRA(name, path); err != nil {
			return fail(err)
		}
	}
	in.metrics = newMetrics(in.registry, model, in.ranks, cfg.MaxLoRAs)
	// vLLM exports its process's start time through Prometheus's process
	// collector; a simulated server's "process" starts with Start, so a
	// restart (a new Instance on the same ports) shows as a new value.
	started := float64(time.Now().UnixNano()) / 1e9
	if !cfg.NoStartTime {
		in.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "process_start_time_seconds",
			Help: "Start time of the process since unix epoch in seconds."}, func() float64 { return started }))
	}

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", in.handleCompletions)
	mux.HandleFunc("POST /v1/chat/completions", in.handleChat)
	mux.HandleFunc("GET /v1/models", in.handleModels)
	mux.HandleFunc("POST /v1/load_lora_adapter", in.handleLoadLoRA)
	mux.HandleFunc("POST /v1/unload_lora_adapter", in.handleUnloadLoRA)
	mux.HandleFunc("POST /tokenize", in.handleTokenize)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("POST /reset_prefix_cache", in.handleReset)
	mux.HandleFunc("POST /sleep", in.handleSleep)
	mux.HandleFunc("POST /wake_up", in.handleWake)
	mux.HandleFunc("GET /is_sleeping", in.handleIsSleeping)
	if ev.Format == FormatTRTLLM {
		mux.HandleFunc("POST /kv_cache_events", in.handleKVCacheEvents)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(in.registry, promhttp.HandlerOpts{}))
	in.http = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, BaseContext: func(net.Listener) context.Context { return ctx }}

	for _, d := range in.ranks {
		in.wg.Add(1)
		go func() { defer in.wg.Done(); d.run(ctx) }()
		if d.pub != nil {
			in.wg.Add(1)
			go func() { defer in.wg.Done(); d.runPublisher(ctx) }()
		}
	}
	in.wg.Add(1)
	go func() {
		defer in.wg.Done()
		if err := in.http.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			in.log.Error("kvsim: serve", "err", err)
		}
	}()
	in.wg.Add(1)
	go func() {
		defer in.wg.Done()
		<-ctx.Done()
		sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer scancel()
		_ = in.http.Shutdown(sctx)
	}()
	return in, nil
}

// offsetEndpoint adds r to the port of a tcp endpoint ("tcp://host:port").
func offsetEndpoint(ep string, r int) (string, error) {
	i := strings.LastIndexByte(ep, ':')
	if i < 0 {
		return "", fmt.Errorf("%w: endpoint %q has no port", ErrConfig, ep)
	}
	p, err := strconv.Atoi(ep[i+1:])
	if err != nil || p < 0 || p+r > 65535 {
		return "", fmt.Errorf("%w: endpoint %q: bad port", ErrConfig, ep)
	}
	return ep[:i+1] + strconv.Itoa(p+r), nil
}

// URL is the instance's base URL, e.g. "http://127.0.0.1:8000".
func (in *Instance) URL() string { return "http://" + in.ln.Addr().String() }

// Addr is the HTTP listen address.
func (in *Instance) Addr() string { return in.ln.Addr().String() }

// Model is the served base model name.
func (in *Instance) Model() string { return in.model }

// Ranks is the data-parallel size.
func (in *Instance) Ranks() int { return len(in.ranks) }

// Engine runs f with rank r's engine, locked against the driver (tests,
// snapshots). f must not keep the engine.
func (in *Instance) Engine(r int, f func(e *sim.Engine)) { in.ranks[r].with(f) }

// Close stops serving, the engines and the sockets, and waits for them.
func (in *Instance) Close() error {
	in.cancel()
	in.wg.Wait()
	var err error
	for _, p := range in.pubs {
		err = errors.Join(err, p.Close())
	}
	return err
}

// LoadLoRA loads an adapter on every rank.
func (in *Instance) LoadLoRA(name, path string) error {
	in.loraMu.Lock()
	defer in.loraMu.Unlock()
	if _, ok := in.loraPaths[name]; ok {
		return fmt.Errorf("%w: %q", sim.ErrAdapterExists, name)
	}
	if name == in.model {
		return fmt.Errorf("%w: adapter name %q is the base model's", sim.ErrAdapterExists, name)
	}
	for i, d := range in.ranks {
		var err error
		d.with(func(e *sim.Engine) { _, err = e.LoadLoRA(name, path) })
		if err != nil {
			for _, u := range in.ranks[:i] {
				u.with(func(e *sim.Engine) { _ = e.UnloadLoRA(name) })
			}
			return err
		}
	}
	in.loraPaths[name] = path
	return nil
}

// UnloadLoRA unloads an adapter from every rank.
func (in *Instance) UnloadLoRA(name string) error {
	in.loraMu.Lock()
	defer in.loraMu.Unlock()
	if _, ok := in.loraPaths[name]; !ok {
		return fmt.Errorf("%w: %q", sim.ErrUnknownAdapter, name)
	}
	for _, d := range in.ranks {
		d.with(func(e *sim.Engine) { _ = e.UnloadLoRA(name) })
	}
	delete(in.loraPaths, name)
	return nil
}

// LoRAs returns loaded adapters' names and paths, sorted by name.
func (in *Instance) LoRAs() [][2]string {
	in.loraMu.Lock()
	defer in.loraMu.Unlock()
	out := make([][2]string, 0, len(in.loraPaths))
	for n, p := range in.loraPaths {
		out = append(out, [2]string{n, p})
	}
	sortPairs(out)
	return out
}

func (in *Instance) hasLoRA(name string) bool {
	in.loraMu.Lock()
	defer in.loraMu.Unlock()
	_, ok := in.loraPaths[name]
	return ok
}

// pick chooses the data-parallel rank with the least work.
func (in *Instance) pick() *driver {
	best, bestLoad := in.ranks[0], -1
	for _, d := range in.ranks {
		if l := d.load(); bestLoad < 0 || l < bestLoad {
			best, bestLoad = d, l
		}
	}
	return best
}

// ResetPrefixCache clears every rank's cache; ErrBusy if a rank holds blocks.
func (in *Instance) ResetPrefixCache() error {
	var errs error
	for _, d := range in.ranks {
		d.with(func(e *sim.Engine) {
			errs = errors.Join(errs, e.ResetPrefixCache(d.clock.virtual(time.Now())))
		})
	}
	return errs
}

// EventsSubscribed reports whether every rank's PUB socket has a
// subscriber (messages published before that are lost, as in ZMQ); true
// when events are off.
func (in *Instance) EventsSubscribed() bool {
	for _, p := range in.pubs {
		if !p.Subscribed() {
			return false
		}
	}
	return true
}
