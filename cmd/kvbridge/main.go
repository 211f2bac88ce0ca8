// Command kvbridge is the sidecar that carries one vLLM engine's KV-cache
// events from its ZMQ PUB socket (one per data-parallel rank) to NATS
// JetStream, repairs gaps from the engine's replay socket, keeps the
// instance's live block table for snapshots, and publishes heartbeats and
// eviction records. See docs/transport.md.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/liblog"
)

func main() {
	cli.Main("kvbridge", 1, func(ctx context.Context, args []string) error {
		err := run(ctx, args, os.Getenv, os.Stderr)
		if errors.Is(err, context.Canceled) {
			return nil // stopped by a signal
		}
		return err
	})
}

// options are the parsed flags.
type options struct {
	natsURL, natsCreds, tlsCA, tlsCert, tlsKey string

	pool, instance, model, engineURL string
	adapters                         string
	role                             string
	blockSize                        int

	zmqEndpoint, replayEndpoint, topic string
	zmqBind                            bool
	dpSize                             int
	firstSeq                           uint64

	maxBlocks, buffer, publishWindow        int
	bufferBytes, replayBytes                int
	coalesce, coalesceBytes                 int
	heartbeat, snapshotEvery, replayTimeout time.Duration
	engineProbe                             time.Duration

	stream         string
	streamMaxAge   time.Duration
	streamMaxBytes int64
	streamReplicas int
	bucket         string

	listen, logLevel string

	format       string        // --format: vllm, sglang, trtllm-json (trtllm.go)
	pollInterval time.Duration // trtllm-json: wait between empty polls
	trtllmWindow int           // trtllm-json: the full-attention window
	ageOut       string        // --age-out tier=duration,...
}

// HeartbeatKeyEnv holds the hex key heartbeats are signed with (the
// router's KVROUTER_HEARTBEAT_KEY); unset = unsigned heartbeats.
const HeartbeatKeyEnv = "KVBRIDGE_HEARTBEAT_KEY"

func envOr(getenv func(string) string, def string, keys ...string) string {
	for _, k := range keys {
		if v := getenv(k); v != "" {
			return v
		}
	}
	return def
}

func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("kvbridge", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cli.SetUsage(fs, stderr, "kvbridge: carry one vLLM engine's KV-cache events from ZMQ to NATS JetStream (docs/transport.md)\n\nusage: kvbridge --pool POOL [flags]\n\n",
		"\nEnvironment (a secret, never a flag):\n  "+HeartbeatKeyEnv+"  hex key (>= 16 bytes) heartbeats are signed with (the router's\n                          KVROUTER_HEARTBEAT_KEY); unset: unsigned heartbeats\n")
	host, _ := os.Hostname()
	fs.StringVar(&o.natsURL, "nats-url", envOr(getenv, "nats://127.0.0.1:4222", "NATS_URL"), "NATS server URL(s), comma-separated (env NATS_URL)")
	fs.StringVar(&o.natsCreds, "nats-creds", envOr(getenv, "", "NATS_CREDS"), "NATS credentials file (env NATS_CREDS)")
	fs.StringVar(&o.tlsCA, "nats-tls-ca", "", "CA file to verify the NATS server")
	fs.StringVar(&o.tlsCert, "nats-tls-cert", "", "client certificate for NATS mutual TLS")
	fs.StringVar(&o.tlsKey, "nats-tls-key", "", "client key for NATS mutual TLS")
	fs.StringVar(&o.pool, "pool", envOr(getenv, "", "KVBRIDGE_POOL"), "pool (model deployment) name (env KVBRIDGE_POOL); required")
	fs.StringVar(&o.instance, "instance", envOr(getenv, host, "KVBRIDGE_INSTANCE", "POD_NAME"), "instance name (env KVBRIDGE_INSTANCE, POD_NAME; default hostname)")
	fs.StringVar(&o.model, "model", envOr(getenv, "", "KVBRIDGE_MODEL", "MODEL"), "served model name (env KVBRIDGE_MODEL, MODEL)")
	fs.StringVar(&o.engineURL, "engine-url", envOr(getenv, "", "KVBRIDGE_ENGINE_URL"), "the engine's HTTP base URL, advertised in heartbeats and probed (env KVBRIDGE_ENGINE_URL; default http://$POD_IP:8000)")
	fs.StringVar(&o.adapters, "adapters", envOr(getenv, "", "KVBRIDGE_ADAPTERS"), "LoRA adapters served, comma-separated (env KVBRIDGE_ADAPTERS)")
	fs.IntVar(&o.blockSize, "block-size", 0, "engine block size in tokens for heartbeats (0: learn from events)")
	fs.StringVar(&o.zmqEndpoint, "zmq-endpoint", envOr(getenv, "tcp://127.0.0.1:5557", "KVBRIDGE_ZMQ_ENDPOINT"), "engine KV-events PUB endpoint (rank r uses port+r)")
	fs.BoolVar(&o.zmqBind, "zmq-bind", false, "bind the endpoint instead of connecting (engines that dial, e.g. llm-d-inference-sim)")
	fs.StringVar(&o.replayEndpoint, "replay-endpoint", envOr(getenv, "tcp://127.0.0.1:5558", "KVBRIDGE_REPLAY_ENDPOINT"), "engine replay ROUTER endpoint (rank r uses port+r); empty: no replay, gaps clear the instance")
	fs.StringVar(&o.topic, "topic", "", "ZMQ topic prefix to subscribe to (empty: all)")
	fs.Uint64Var(&o.firstSeq, "first-seq", 0, "seq of the engine's first message: 0 for vLLM and SGLang, 1 for llm-d-inference-sim and kvsim; a replayed history starting later lost its first messages (not used with trtllm-json)")
	fs.IntVar(&o.dpSize, "dp-size", 1, "data-parallel ranks; each rank is its own instance <instance>-dp<r> served at engine-url port+r")
	fs.IntVar(&o.maxBlocks, "max-blocks", 0, "bound on the block table: the engine's KV cache blocks over all tiers (default 1048576)")
	fs.IntVar(&o.buffer, "buffer", 0, "engine messages buffered while NATS is unreachable (default 10000)")
	fs.IntVar(&o.bufferBytes, "buffer-bytes", 0, fmt.Sprintf("most engine payload bytes in that buffer; a message past either bound is dropped and replayed later (default %d, 128 MiB)", bridge.DefaultBufferBytes))
	fs.IntVar(&o.replayBytes, "replay-bytes", 0, fmt.Sprintf("most payload bytes one replay request reads; a longer replay fails, as after a gap it cannot fill (default %d, 128 MiB)", enginezmq.DefaultReplayBytes))
	fs.IntVar(&o.coalesce, "coalesce", 0, fmt.Sprintf("most engine messages of an instance joined into one NATS message when a backlog is queued behind the publish window (0: off; advised %d, at most %d). Turn it on only once every router reading the stream understands coalesced messages (kvrouter from the release that added it): an older router drops them and reloads snapshots", bridge.DefaultCoalesce, kvstream.MaxCoalesced))
	fs.IntVar(&o.coalesceBytes, "coalesce-bytes", 0, "most payload bytes of one coalesced NATS message (default and most: a quarter of the NATS server's max payload)")
	fs.IntVar(&o.publishWindow, "publish-window", 0, fmt.Sprintf("engine messages per instance published to JetStream and not yet acknowledged (default %d; 1: wait for each ack before the next publish)", bridge.DefaultPublishWindow))
	fs.DurationVar(&o.heartbeat, "heartbeat", 0, "heartbeat interval (default 5s)")
	fs.DurationVar(&o.snapshotEvery, "snapshot-interval", 0, "snapshot bucket refresh interval (default 30s)")
	fs.DurationVar(&o.replayTimeout, "replay-timeout", 0, "timeout of one replay request (default 5s)")
	fs.DurationVar(&o.engineProbe, "engine-probe-interval", 0, "how often engine-url's /health and /metrics (process_start_time_seconds) are read to tell a dead or restarted engine (default 1s; negative: never)")
	fs.StringVar(&o.stream, "stream", "", "JetStream stream name (default KV_EVENTS)")
	fs.DurationVar(&o.streamMaxAge, "stream-max-age", 0, "stream retention when the bridge creates it (default 1h)")
	fs.Int64Var(&o.streamMaxBytes, "stream-max-bytes", 0, "stream size bound when the bridge creates it (default 1 GiB)")
	fs.IntVar(&o.streamReplicas, "stream-replicas", 0, "replicas of the stream, snapshot bucket and object store when the bridge creates them: 3 on a 3-node JetStream cluster (default 1; at most the cluster's size)")
	fs.StringVar(&o.bucket, "bucket", "", "snapshot key-value bucket (default KV_SNAPSHOTS)")
	fs.StringVar(&o.listen, "listen", envOr(getenv, ":9400", "KVBRIDGE_LISTEN"), "address for /metrics, /healthz and /readyz")
	fs.StringVar(&o.logLevel, "log-level", envOr(getenv, "info", "KVBRIDGE_LOG_LEVEL"), "debug, info, warn or error")
	fs.StringVar(&o.role, "role", envOr(getenv, "both", "KVBRIDGE_ROLE"), "the engine's disaggregated-serving role, announced in heartbeats so a discovered instance joins the right set: both, prefill or decode (env KVBRIDGE_ROLE; docs/disaggregation.md)")
	fs.StringVar(&o.format, "format", envOr(getenv, formatVLLM, "KVBRIDGE_FORMAT"), "engine event format: vllm, sglang (both msgpack on ZMQ) or trtllm-json (polls the engine-url's POST /kv_cache_events) (env KVBRIDGE_FORMAT)")
	fs.DurationVar(&o.pollInterval, "poll-interval", 100*time.Millisecond, "trtllm-json: wait after an empty poll")
	fs.IntVar(&o.trtllmWindow, "trtllm-full-window", 0, "trtllm-json: attention window of the full-attention layers; events of other window_size values are a sliding-window group the router does not index (0: one window)")
	fs.StringVar(&o.ageOut, "age-out", "", "stores-only tiers and their block lifetime, e.g. cpu=10m,shared=1h: blocks not stored again within it are removed (for sources that never report removals, such as LMCache)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.engineURL == "" {
		o.engineURL = "http://" + envOr(getenv, "127.0.0.1", "POD_IP") + ":8000"
	}
	if o.pool == "" {
		return nil, errors.New("--pool (or KVBRIDGE_POOL) is required")
	}
	if o.dpSize < 1 || o.dpSize > 1024 {
		return nil, fmt.Errorf("--dp-size %d out of range 1..1024", o.dpSize)
	}
	switch o.role {
	case "both", "prefill", "decode":
	default:
		return nil, fmt.Errorf("--role %q: want both, prefill or decode", o.role)
	}
	if err := validFormat(o.format); err != nil {
		return nil, err
	}
	for _, n := range []struct {
		flag string
		v    int
	}{{"--buffer-bytes", o.bufferBytes}, {"--replay-bytes", o.replayBytes}} {
		if n.v < 0 {
			return nil, fmt.Errorf("%s %d: must not be negative (0: the default)", n.flag, n.v)
		}
	}
	if o.pollInterval <= 0 || o.trtllmWindow < 0 {
		return nil, errors.New("--poll-interval must be positive and --trtllm-full-window not negative")
	}
	if _, err := bridge.ParseAgeOut(o.ageOut); err != nil {
		return nil, fmt.Errorf("--age-out: %w", err)
	}
	if o.streamReplicas < 0 || o.streamReplicas > kvstream.MaxReplicas {
		return nil, fmt.Errorf("--stream-replicas %d out of range 1..%d", o.streamReplicas, kvstream.MaxReplicas)
	}
	for _, n := range []struct{ flag, v string }{{"--stream", o.stream}, {"--bucket", o.bucket}} {
		if n.v != "" && !config.JetStreamName(n.v) {
			return nil, fmt.Errorf("%s %q: not a JetStream name (at most 255 bytes; no whitespace, '.', '*', '>', '/' or '\\')", n.flag, n.v)
		}
	}
	return o, nil
}

// withPortOffset adds off to the port of a tcp:// endpoint or http(s) URL.
func withPortOffset(endpoint string, off int) (string, error) {
	if off == 0 || endpoint == "" {
		return endpoint, nil
	}
	scheme, rest, ok := strings.Cut(endpoint, "://")
	if !ok {
		return "", fmt.Errorf("endpoint %q has no scheme", endpoint)
	}
	hostport, path, _ := strings.Cut(rest, "/")
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p+off > 65535 {
		return "", fmt.Errorf("endpoint %q: bad port for rank offset %d", endpoint, off)
	}
	out := scheme + "://" + net.JoinHostPort(host, strconv.Itoa(p+off))
	if path != "" {
		out += "/" + path
	}
	return out, nil
}

// sources expands the endpoints per data-parallel rank.
func (o *options) sources() ([]bridge.Source, error) {
	if _, err := url.Parse(o.engineURL); err != nil {
		return nil, fmt.Errorf("--engine-url: %w", err)
	}
	var out []bridge.Source
	for r := 0; r < o.dpSize; r++ {
		s := bridge.Source{Instance: o.instance, Rank: r, Bind: o.zmqBind, Topic: o.topic, FirstSeq: o.firstSeq}
		if o.dpSize > 1 {
			s.Instance = fmt.Sprintf("%s-dp%d", o.instance, r)
		}
		var err error
		if s.Endpoint, err = withPortOffset(o.zmqEndpoint, r); err != nil {
			return nil, err
		}
		if s.ReplayEndpoint, err = withPortOffset(o.replayEndpoint, r); err != nil {
			return nil, err
		}
		if s.URL, err = withPortOffset(o.engineURL, r); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	o, err := parseFlags(args, getenv, stderr)
	if err != nil {
		return err
	}
	log, err := cli.Logger(stderr, o.logLevel)
	if err != nil {
		return err
	}
	srcs, err := o.sources()
	if err != nil {
		return err
	}
	ageOut, _ := bridge.ParseAgeOut(o.ageOut) // validated by parseFlags
	var trt *bridge.TRTLLMPoller
	if o.format == formatTRTLLM {
		if trt, err = bridge.NewTRTLLMPoller(ctx, bridge.TRTLLMConfig{EngineURL: o.engineURL, Ranks: o.dpSize,
			Interval: o.pollInterval, FullWindow: o.trtllmWindow, Logger: log}); err != nil {
			return fmt.Errorf("--format trtllm-json: %w", err)
		}
		defer trt.Close()
		// Every rank's URL is the one server: TensorRT-LLM gathers every
		// rank's events on rank 0's.
		for r := range srcs {
			srcs[r] = trt.Source(r, srcs[r].Instance, o.engineURL)
		}
	}
	// A secret, so only from the environment (never a flag, which ps shows).
	hbKey, err := kvstream.DecodeHeartbeatKey(getenv(HeartbeatKeyEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", HeartbeatKeyEnv, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	libs, err := liblog.New(reg, log, "kvbridge_library_log_lines_total")
	if err != nil {
		return err
	}
	nc, err := kvstream.NATSConfig{URL: o.natsURL, CredsFile: o.natsCreds, TLSCA: o.tlsCA, TLSCert: o.tlsCert, TLSKey: o.tlsKey,
		Name: "kvbridge " + o.pool + "/" + o.instance, Logger: log, ErrorHandler: libs.NATSErrorHandler()}.Connect()
	if err != nil {
		return err
	}
	defer nc.Close()

	var adapters []string
	for _, a := range strings.Split(o.adapters, ",") {
		if a = strings.TrimSpace(a); a != "" {
			adapters = append(adapters, a)
		}
	}
	br, err := bridge.New(bridge.Config{
		Pool: o.pool, Model: o.model, BlockSize: o.blockSize, Adapters: adapters, Role: o.role, Sources: srcs, Conn: nc,
		Stream:              kvstream.StreamConfig{Name: o.stream, MaxAge: o.streamMaxAge, MaxBytes: o.streamMaxBytes, Replicas: o.streamReplicas},
		Bucket:              kvstream.BucketConfig{Name: o.bucket, Replicas: o.streamReplicas},
		MaxBlocks:           o.maxBlocks,
		Buffer:              o.buffer,
		BufferBytes:         o.bufferBytes,
		ReplayBytes:         o.replayBytes,
		PublishWindow:       o.publishWindow,
		Coalesce:            o.coalesce,
		CoalesceBytes:       o.coalesceBytes,
		HeartbeatInterval:   o.heartbeat,
		SnapshotInterval:    o.snapshotEvery,
		ReplayTimeout:       o.replayTimeout,
		EngineProbeInterval: o.engineProbe,
		HeartbeatKey:        hbKey,
		AgeOut:              ageOut,
		Registerer:          reg,
		Logger:              log,
	})
	if err != nil {
		return err
	}

	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !br.Ready() {
			http.Error(w, "not ready: NATS unreachable or start-up resync running", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		serveStatus(w, *o, br.Ready(), br.Stats())
	})
	srv := &http.Server{Addr: o.listen, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", o.listen, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	srvErr := make(chan error, 1)
	go func() { srvErr <- srv.Serve(ln) }()
	log.Info("kvbridge starting", "pool", o.pool, "instance", o.instance, "ranks", o.dpSize, "zmq", o.zmqEndpoint,
		"replay", o.replayEndpoint, "nats", o.natsURL, "listen", ln.Addr().String())

	runErr := make(chan error, 1)
	go func() { runErr <- br.Run(ctx) }()
	trtDone := make(chan struct{})
	if trt != nil {
		go func() { defer close(trtDone); trt.Run(ctx) }()
	} else {
		close(trtDone)
	}
	select {
	case err = <-runErr:
	case err = <-srvErr:
		cancel()
		<-runErr
	}
	cancel()
	<-trtDone // before the deferred close of its publishers
	shutdownCtx, c2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer c2()
	_ = srv.Shutdown(shutdownCtx)
	return err
}

// bridgeStatus is GET /status: the bridge's identity and each instance's
// counters (one per data-parallel rank).
type bridgeStatus struct {
	Pool      string         `json:"pool"`
	Model     string         `json:"model,omitempty"`
	Ready     bool           `json:"ready"`
	Instances []bridge.Stats `json:"instances"`
}

func serveStatus(w http.ResponseWriter, o options, ready bool, stats []bridge.Stats) {
	slices.SortFunc(stats, func(a, b bridge.Stats) int { return strings.Compare(a.Instance, b.Instance) })
	b, err := json.MarshalIndent(bridgeStatus{Pool: o.pool, Model: o.model, Ready: ready, Instances: stats}, "", "  ")
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '\n'))
}
