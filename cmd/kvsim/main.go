// Command kvsim runs a fleet of simulated vLLM servers in one process: each
// instance serves vLLM's OpenAI-compatible API, /tokenize, /metrics, LoRA
// loading and /reset_prefix_cache on its own port, and publishes KV-cache
// events over ZMQ (PUB + replay per data-parallel rank) exactly as vLLM
// does, so kvbridge and kvrouter run against it unchanged. The engine model
// (package sim) and its timing defaults are documented in docs/kvsim.md.
//
//	kvsim --instances 4 --port 8000 --zmq-port 5557 --replay-port 5600
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/internal/cli"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/simserver"
	"github.com/kvrouter/kvrouter/tokenizer"
)

func main() {
	cli.Main("kvsim", 2, func(ctx context.Context, args []string) error {
		return run(ctx, args, os.Stdout, os.Stderr, nil)
	})
}

// options are the command-line flags.
type options struct {
	instances, port, dp               int
	host                              string
	model, tokenizerDir, loraModules  string
	blockSize, gpuBlocks, cpuBlocks   int
	maxBatched, maxSeqs, maxModelLen  int
	hashSeed                          uint64
	events                            bool
	zmqHost                           string
	zmqPort, replayPort               int
	zmqDial, legacyReplay             bool
	cpuWriteThrough                   bool
	topic, encoding, hashAlgo         string
	engine                            string // --engine: vllm, sglang, trtllm
	bufferSteps                       int
	timeScale                         float64
	defaultMaxTokens, maxLoRAs        int
	flops, flopsPerToken, attnPerPair float64
	weightRead, stepOverhead          time.Duration
	kvReadPerToken, cpuLoadRate       float64
	kvTransferRate                    float64
	logLevel, role                    string
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("kvsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cli.SetUsage(fs, stderr, "usage: kvsim [flags]\n\nRuns simulated vLLM instances (HTTP API + ZMQ KV events). Instance i serves HTTP on\n--port+i; rank r of instance i publishes on --zmq-port + i*dp + r (replay likewise).\nZero-valued engine flags take the defaults documented in docs/kvsim.md (Llama 3.1 70B, TP8, 8×H100).\n\n", "")
	fs.IntVar(&o.instances, "instances", 1, "number of simulated vLLM servers")
	fs.StringVar(&o.host, "host", "127.0.0.1", "HTTP listen host")
	fs.IntVar(&o.port, "port", 8000, "HTTP port of instance 0 (instance i uses port+i; 0 = free ports)")
	fs.IntVar(&o.dp, "data-parallel-size", 1, "engines (DP ranks) per instance")
	fs.StringVar(&o.model, "model", sim.DefaultModel, "served model name")
	fs.StringVar(&o.tokenizerDir, "tokenizer-dir", "", "directory with tokenizer.json + tokenizer_config.json (default: the Simple tokenizer)")
	fs.StringVar(&o.loraModules, "lora-modules", "", "LoRA adapters loaded at start: name=path[,name=path...]")
	fs.IntVar(&o.blockSize, "block-size", 0, "tokens per KV block (0: 16)")
	fs.IntVar(&o.gpuBlocks, "gpu-blocks", 0, "GPU KV capacity in blocks (0: 84375 = 1.35M tokens)")
	fs.IntVar(&o.cpuBlocks, "cpu-blocks", 0, "CPU offload tier capacity in blocks (0: no offloading)")
	fs.BoolVar(&o.cpuWriteThrough, "cpu-write-through", false, "copy blocks to the CPU tier when computed (vLLM's OffloadingConnector) instead of when evicted")
	fs.IntVar(&o.maxBatched, "max-num-batched-tokens", 0, "per-step token budget (0: 8192)")
	fs.IntVar(&o.maxSeqs, "max-num-seqs", 0, "max requests per step (0: 1024)")
	fs.IntVar(&o.maxModelLen, "max-model-len", 0, "max prompt+output tokens (0: 131072)")
	fs.StringVar(&o.hashAlgo, "prefix-caching-hash-algo", "sha256", "engine block hash: sha256 (vLLM's default) or xxhash")
	fs.Uint64Var(&o.hashSeed, "hash-seed", 0, "block hash seed of instance 0 (instance i uses seed+i, as separate processes would differ)")
	fs.BoolVar(&o.events, "kv-events", true, "publish KV-cache events over ZMQ")
	fs.StringVar(&o.zmqHost, "zmq-host", "127.0.0.1", "host of the ZMQ endpoints (bind address, or the SUB's address with --zmq-dial)")
	fs.IntVar(&o.zmqPort, "zmq-port", 5557, "PUB port of instance 0 rank 0")
	fs.IntVar(&o.replayPort, "replay-port", 0, "replay ROUTER port of instance 0 rank 0 (0: no replay)")
	fs.BoolVar(&o.zmqDial, "zmq-dial", false, "connect the PUB sockets to a binding SUB instead of binding")
	fs.BoolVar(&o.legacyReplay, "legacy-replay", false, "answer replay with [seq, payload] (older vLLM) instead of [topic, seq, payload]")
	fs.StringVar(&o.topic, "topic", "kv@{host}:{port}@{model}", "event topic; {host}, {port} (HTTP), {rank} and {model} are expanded (vLLM's default is \"kv\")")
	fs.StringVar(&o.encoding, "event-encoding", "array", "event encoding: array (older vLLM) or map (vLLM ≥ mid-2026)")
	fs.StringVar(&o.engine, "engine", "vllm", "whose KV events to emit: vllm, sglang (SGLang's msgpack on the same ZMQ sockets) or trtllm (TensorRT-LLM's JSON from POST /kv_cache_events, no ZMQ, and its partial reuse: up to T-1 tokens of held blocks)")
	fs.IntVar(&o.bufferSteps, "buffer-steps", 10000, "replay buffer length in batches")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "run virtual time this many times faster than real time")
	fs.IntVar(&o.defaultMaxTokens, "default-max-tokens", 16, "max_tokens when a request sets none")
	fs.IntVar(&o.maxLoRAs, "max-loras", 1, "max_lora reported in vllm:lora_requests_info (not enforced)")
	fs.Float64Var(&o.flops, "flops", 0, "effective FLOP/s of one engine (0: 3.956e15)")
	fs.Float64Var(&o.flopsPerToken, "flops-per-token", 0, "dense FLOPs per token (0: 141.2e9)")
	fs.Float64Var(&o.attnPerPair, "attn-flops-per-pair", 0, "attention FLOPs per (query, context) token pair (0: 2621440)")
	fs.DurationVar(&o.weightRead, "weight-read-time", 0, "memory-bound floor of a step (0: 7.088ms)")
	fs.Float64Var(&o.kvReadPerToken, "kv-read-seconds-per-token", 0, "time to read one context token's KV (0: 1.365e-8)")
	fs.DurationVar(&o.stepOverhead, "step-overhead", 0, "fixed cost per step (0: 1.5ms)")
	fs.Float64Var(&o.cpuLoadRate, "cpu-load-tokens-per-sec", 0, "CPU→GPU promotion rate (0: 1.22e6)")
	fs.Float64Var(&o.kvTransferRate, "kv-transfer-tokens-per-sec", 0, "rate a decode worker receives a remote prefill's KV (0: 305e3, an 800 Gb/s NIC per 8-GPU node)")
	fs.StringVar(&o.role, "role", "both", "disaggregated-serving role (vLLM's kv_role): both, prefill (only prefill requests: kv_transfer_params.do_remote_decode) or decode (never those)")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.instances < 1 || o.instances > 1024 {
		return nil, fmt.Errorf("--instances %d out of [1, 1024]", o.instances)
	}
	if o.port < 0 || o.port+o.instances-1 > 65535 {
		return nil, fmt.Errorf("--port %d: ports out of range for %d instances", o.port, o.instances)
	}
	if o.dp < 1 {
		return nil, fmt.Errorf("--data-parallel-size %d < 1", o.dp)
	}
	if err := simserver.ValidFormat(o.engine); err != nil {
		return nil, fmt.Errorf("--engine: %w", err)
	}
	last := o.instances*o.dp - 1
	if o.events && (o.zmqPort < 1 || o.zmqPort+last > 65535 || o.replayPort < 0 || (o.replayPort > 0 && o.replayPort+last > 65535)) {
		return nil, fmt.Errorf("--zmq-port/--replay-port out of range for %d instances × %d ranks", o.instances, o.dp)
	}
	return o, nil
}

func parseLoRAs(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		name, path, ok := strings.Cut(kv, "=")
		if !ok || name == "" || path == "" {
			return nil, fmt.Errorf("--lora-modules: %q is not name=path", kv)
		}
		out[name] = path
	}
	return out, nil
}

// run starts the fleet and serves until ctx ends; ready, if set, is called
// with the started instances (tests use it).
func run(ctx context.Context, args []string, stdout, stderr io.Writer, ready func([]*simserver.Instance)) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	log, err := cli.Logger(stderr, o.logLevel)
	if err != nil {
		return err
	}
	enc, err := events.ParseEncoding(o.encoding)
	if err != nil {
		return fmt.Errorf("--event-encoding: %w", err)
	}
	algo, err := sim.ParseHashAlgo(o.hashAlgo)
	if err != nil {
		return fmt.Errorf("--prefix-caching-hash-algo: %w", err)
	}
	loras, err := parseLoRAs(o.loraModules)
	if err != nil {
		return err
	}
	var tok tokenizer.ChatTokenizer = tokenizer.Simple{}
	if o.tokenizerDir != "" {
		hf, err := tokenizer.LoadHF(o.tokenizerDir, tokenizer.HFConfig{})
		if err != nil {
			return fmt.Errorf("--tokenizer-dir: %w", err)
		}
		tok = hf
	}

	var fleet []*simserver.Instance
	defer func() {
		for _, in := range fleet {
			in.Close()
		}
	}()
	for i := range o.instances {
		cfg := simserver.Config{
			Engine: sim.Config{
				Model: o.model, BlockSize: o.blockSize, GPUBlocks: o.gpuBlocks, CPUBlocks: o.cpuBlocks, CPUWriteThrough: o.cpuWriteThrough,
				MaxNumBatchedTokens: o.maxBatched, MaxNumSeqs: o.maxSeqs, MaxModelLen: o.maxModelLen,
				HashSeed: o.hashSeed + uint64(i), HashAlgo: algo,
				PartialReuse: o.engine == simserver.FormatTRTLLM,
				Timing: sim.Timing{
					FLOPS: o.flops, FLOPsPerToken: o.flopsPerToken, AttnFLOPsPerPair: o.attnPerPair,
					WeightReadTime: o.weightRead, KVReadSecondsPerToken: o.kvReadPerToken,
					StepOverhead: o.stepOverhead, CPULoadTokensPerSec: o.cpuLoadRate,
					KVTransferTokensPerSec: o.kvTransferRate,
				},
			},
			Listen:           net.JoinHostPort(o.host, strconv.Itoa(portFor(o.port, i))),
			DataParallelSize: o.dp,
			Tokenizer:        tok,
			TimeScale:        o.timeScale,
			LoRAs:            loras,
			DefaultMaxTokens: o.defaultMaxTokens,
			MaxLoRAs:         o.maxLoRAs,
			Role:             o.role,
			Logger:           log,
		}
		if o.events {
			cfg.Events = simserver.EventsConfig{
				Endpoint: fmt.Sprintf("tcp://%s:%d", o.zmqHost, o.zmqPort+i*o.dp),
				Dial:     o.zmqDial, Topic: o.topic, Encoding: enc,
				BufferSteps: o.bufferSteps, LegacyReplay: o.legacyReplay, Format: o.engine,
			}
			if o.replayPort > 0 {
				cfg.Events.ReplayEndpoint = fmt.Sprintf("tcp://%s:%d", o.zmqHost, o.replayPort+i*o.dp)
			}
		}
		in, err := simserver.Start(ctx, cfg)
		if err != nil {
			return fmt.Errorf("instance %d: %w", i, err)
		}
		fleet = append(fleet, in)
		line := fmt.Sprintf("kvsim instance %d: %s model=%s ranks=%d", i, in.URL(), in.Model(), o.dp)
		if o.events {
			line += fmt.Sprintf(" events=%s", cfg.Events.Endpoint)
			if cfg.Events.ReplayEndpoint != "" {
				line += " replay=" + cfg.Events.ReplayEndpoint
			}
			if o.dp > 1 {
				line += " (+rank)"
			}
		}
		fmt.Fprintln(stdout, line)
	}
	if ready != nil {
		ready(fleet)
	}
	<-ctx.Done()
	return nil
}

func portFor(base, i int) int {
	if base == 0 {
		return 0
	}
	return base + i
}
