package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"reflect"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/kvrouter/kvrouter/internal/zero"
)

// ErrInvalidConfig wraps every configuration validation error.
var ErrInvalidConfig = errors.New("config: invalid config")

// invalidf is a validator's error constructor: ErrInvalidConfig, then
// path (the YAML path of the section checked, ending in "." unless empty),
// then the message.
func invalidf(path string) func(format string, a ...any) error {
	return func(format string, a ...any) error {
		return fmt.Errorf("%w: %s"+format, append([]any{ErrInvalidConfig, path}, a...)...)
	}
}

// Config is the whole router configuration (YAML file, see docs/configuration.md).
// The zero value of every field means its documented default; Validate checks
// ranges and WithDefaults fills the defaults in.
type Config struct {
	// Listen is the data-plane address. Default ":8080".
	Listen string `yaml:"listen" json:"listen"`
	// AdminListen serves the admin API and /metrics; empty = served on Listen.
	AdminListen string `yaml:"admin_listen" json:"admin_listen,omitempty"`
	// AdminToken, when set, is required as "Authorization: Bearer <token>" on
	// /admin/* and on the gRPC admin methods. It is a secret: never in the
	// file, only from the environment (KVROUTER_ADMIN_TOKEN); yaml:"-" so a
	// file cannot set it.
	AdminToken string `yaml:"-" json:"-"`
	// MaxBodyBytes caps request bodies (413 above). Default 32 MiB.
	MaxBodyBytes int64 `yaml:"max_body_bytes" json:"max_body_bytes,omitempty"`
	// Limits bounds every other client input (docs/security.md).
	Limits LimitsConfig `yaml:"limits" json:"limits"`
	// TLS serves the data-plane and admin listeners over TLS, with
	// certificates re-read on change (docs/security.md); nil = plaintext.
	TLS *ServerTLSConfig `yaml:"tls,omitempty" json:"tls,omitempty"`
	// CacheSaltSecret is the HMAC key of pools' cache salts. A secret: only
	// from KVROUTER_CACHE_SALT_SECRET (hex, see DecodeCacheSaltSecret).
	CacheSaltSecret []byte `yaml:"-" json:"-"`
	// HeartbeatKey, when set, is the key bridge heartbeats must be signed
	// with (kvstream.SignHeartbeat) to count: a secret, only from
	// KVROUTER_HEARTBEAT_KEY (hex, at least 16 bytes; docs/security.md).
	HeartbeatKey []byte `yaml:"-" json:"-"`
	// DefaultPool serves raw /invocations requests without a pool header and
	// OpenAI requests without a "model". Empty = the first pool for the raw
	// path; OpenAI requests without a model are then rejected.
	DefaultPool string `yaml:"default_pool" json:"default_pool,omitempty"`
	// Log configures structured logging.
	Log LogConfig `yaml:"log" json:"log"`
	// Proxy configures the upstream HTTP client and retries.
	Proxy ProxyConfig `yaml:"proxy" json:"proxy"`
	// Index and Events configure the KV state of exact routing: the block
	// index backend and where KV events come from (docs/operations.md;
	// KVEventsWanted says when they are used).
	Index  *IndexConfig  `yaml:"index,omitempty" json:"index,omitempty"`
	Events *EventsConfig `yaml:"events,omitempty" json:"events,omitempty"`
	// GRPC serves the gRPC API and the Envoy endpoint picker (package
	// grpcapi, docs/grpc.md); off unless grpc.listen is set.
	GRPC GRPCConfig `yaml:"grpc" json:"grpc"`
	// Tracing exports OpenTelemetry spans of each data-plane request
	// (TracingConfig, docs/operations.md); off by default.
	Tracing TracingConfig `yaml:"tracing" json:"tracing"`
	// Pools are the model deployments, one per served base model.
	Pools []PoolConfig `yaml:"pools" json:"pools"`
}

// GRPCConfig is the grpc: section. Package router only holds and validates
// it: the services live in package grpcapi, which the kvrouter command
// wires (router itself stays free of gRPC). The zero value is off.
type GRPCConfig struct {
	// Listen serves kvrouter.v1 (Router, Index, Events), grpc.health.v1,
	// reflection and Envoy's ext_proc endpoint picker on this host:port,
	// with the tls: section's certificates when set; empty = no gRPC.
	Listen string `yaml:"listen" json:"listen,omitempty"`
	// TokenForPick also requires the admin token on Router.Pick (Index.Lookup
	// and Events.Watch always need it when KVROUTER_ADMIN_TOKEN is set).
	TokenForPick bool `yaml:"token_for_pick" json:"token_for_pick,omitempty"`
	// ExtProc configures the Envoy endpoint picker.
	ExtProc GRPCExtProcConfig `yaml:"ext_proc" json:"ext_proc"`
}

// GRPCExtProcConfig is grpc.ext_proc: (docs/envoy.md). Zero = never shed,
// pool from X-Kvrouter-Pool, body limit max_body_bytes.
type GRPCExtProcConfig struct {
	// PoolHeader names the request header that selects the pool; default
	// X-Kvrouter-Pool (HeaderPool).
	PoolHeader string `yaml:"pool_header" json:"pool_header,omitempty"`
	// Shed answers 429 when every candidate is at its concurrency threshold
	// and MaxQueued or more requests are queued beyond the thresholds; off,
	// a saturated pool still routes to the least loaded instance, as the
	// HTTP data plane does.
	Shed bool `yaml:"shed" json:"shed,omitempty"`
	// MaxQueued is the queue allowance under Shed; 0 = shed as soon as
	// every candidate is full.
	MaxQueued int `yaml:"max_queued" json:"max_queued,omitempty"`
	// MaxBodyBytes caps the buffered request body Envoy sends (413 above);
	// 0 = max_body_bytes.
	MaxBodyBytes int `yaml:"max_body_bytes" json:"max_body_bytes,omitempty"`
}

// validate checks the grpc: section; adminToken is the configured admin
// token (token_for_pick needs one).
func (g GRPCConfig) validate(adminToken string) error {
	bad := invalidf("grpc.")
	if g.Listen != "" {
		if _, _, err := net.SplitHostPort(g.Listen); err != nil {
			return bad("listen %q: want host:port", g.Listen)
		}
	}
	if g.TokenForPick && adminToken == "" {
		return bad("token_for_pick needs an admin token (KVROUTER_ADMIN_TOKEN)")
	}
	e := g.ExtProc
	if e.PoolHeader != "" && !validHeaderName(e.PoolHeader) {
		return bad("ext_proc.pool_header %q: not an HTTP header name", e.PoolHeader)
	}
	if e.MaxQueued < 0 || e.MaxQueued > 1<<20 {
		return bad("ext_proc.max_queued %d out of range 0..%d", e.MaxQueued, 1<<20)
	}
	if e.MaxBodyBytes != 0 && (e.MaxBodyBytes < 1024 || e.MaxBodyBytes > 1<<30) {
		return bad("ext_proc.max_body_bytes %d out of range 1024..%d (0 = max_body_bytes)", e.MaxBodyBytes, 1<<30)
	}
	return nil
}

// validHeaderName reports whether s is an HTTP field name: a token (RFC 9110
// §5.1, §5.6.2), which also rules out HTTP/2 pseudo-headers such as :path.
func validHeaderName(s string) bool {
	if s == "" || len(s) > 256 {
		return false
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", b) >= 0) {
			return false
		}
	}
	return true
}

// LogConfig configures log/slog output.
type LogConfig struct {
	// Level: debug | info | warn | error. Default info.
	Level string `yaml:"level" json:"level,omitempty"`
	// Format: json | text. Default json (machine-readable in production).
	Format string `yaml:"format" json:"format,omitempty"`
}

// ProxyConfig configures forwarding to instances.
type ProxyConfig struct {
	// DisableRetry turns off the one retry on the next candidate when an
	// upstream fails before any byte reached the client.
	DisableRetry bool `yaml:"disable_retry" json:"disable_retry,omitempty"`
	// RetryStatuses are upstream statuses treated as "failed before any byte":
	// the response is discarded and the request retried once elsewhere.
	// Default [502, 503, 504] (gateway errors and overload; a 500 from vLLM is
	// usually the request's fault and would fail again). Set [0] for none.
	RetryStatuses []int `yaml:"retry_statuses" json:"retry_statuses,omitempty"`
	// DialTimeout bounds connecting to an instance. Default 2s.
	DialTimeout time.Duration `yaml:"dial_timeout" json:"dial_timeout,omitempty"`
	// ResponseHeaderTimeout bounds the wait for response headers (prefill of a
	// long prompt under load can take minutes). Default 0 = no limit.
	ResponseHeaderTimeout time.Duration `yaml:"response_header_timeout" json:"response_header_timeout,omitempty"`
	// MaxIdleConnsPerHost keeps connections to each instance warm. Default 256.
	MaxIdleConnsPerHost int `yaml:"max_idle_conns_per_host" json:"max_idle_conns_per_host,omitempty"`
}

// IndexConfig selects the KV block index backend (kv_aware, shadow mode, admin lookups).
type IndexConfig struct {
	// Backend: memory | redis. Default memory.
	Backend string `yaml:"backend" json:"backend,omitempty"`
	// Capacity bounds the memory backend in (block, instance) entries; 0 = backend default.
	Capacity int `yaml:"capacity" json:"capacity,omitempty"`
	// Redis configures the redis backend.
	Redis *RedisConfig `yaml:"redis,omitempty" json:"redis,omitempty"`
}

// RedisConfig configures a Redis (or Redis Cluster) index backend.
type RedisConfig struct {
	Addrs []string `yaml:"addrs" json:"addrs,omitempty"`
	// Cluster: the addresses are Redis Cluster seeds even when there is
	// only one (several addresses always are).
	Cluster   bool          `yaml:"cluster" json:"cluster,omitempty"`
	DB        int           `yaml:"db" json:"db,omitempty"`
	KeyPrefix string        `yaml:"key_prefix" json:"key_prefix,omitempty"`
	TTL       time.Duration `yaml:"ttl" json:"ttl,omitempty"`
	TLS       bool          `yaml:"tls" json:"tls,omitempty"`
	// TLSCAFile verifies the server with this CA bundle (implies tls).
	TLSCAFile string `yaml:"tls_ca_file" json:"tls_ca_file,omitempty"`
	// Username is the Redis ACL user (Redis 6+); empty = default user.
	Username string `yaml:"username" json:"username,omitempty"`
	// Password comes from KVROUTER_REDIS_PASSWORD, never from the file.
	Password string `yaml:"-" json:"-"`
}

// EventsConfig configures where KV events come from (docs/operations.md).
type EventsConfig struct {
	// Enabled: nil or true consumes KV events whenever a pool can use them
	// (an index: section, or a pool with kv_aware or shadow); false runs
	// the router without NATS and without KV state (kv_aware rejected).
	Enabled *bool      `yaml:"enabled,omitempty" json:"enabled,omitempty"`
	NATS    NATSConfig `yaml:"nats" json:"nats"`
	// Bucket is the snapshot key-value bucket. Default KV_SNAPSHOTS.
	Bucket string `yaml:"bucket" json:"bucket,omitempty"`
	// StaleAfter: an instance silent this long (no heartbeat, no event)
	// stops counting for exact routing. Default 15s (three 5s heartbeats).
	StaleAfter time.Duration `yaml:"stale_after" json:"stale_after,omitempty"`
	// PurgeAfter: a silent instance's blocks are dropped from the index and
	// a heartbeat-discovered instance leaves its pool. Default 10m.
	PurgeAfter time.Duration `yaml:"purge_after" json:"purge_after,omitempty"`
	// MaxLag: further behind the stream than this, the pool's stream counts
	// as down and kv_aware falls back to prefix_aware. Default 5s.
	MaxLag time.Duration `yaml:"max_lag" json:"max_lag,omitempty"`
	// DiscoverInstances adds instances announced by bridge heartbeats
	// (kv.instances.<pool>.<instance>, with a URL) to their pool's
	// candidates beside the configured ones. nil = true.
	DiscoverInstances *bool `yaml:"discover_instances,omitempty" json:"discover_instances,omitempty"`
	// MaxInstances caps each pool's instance records (names known from
	// heartbeats, configuration or snapshots); a new name beyond it is
	// dropped and counted. Default 4096 (consumer.DefaultMaxInstances).
	MaxInstances int `yaml:"max_instances" json:"max_instances,omitempty"`
	// ReadyTimeout: /readyz waits for every pool's index to be rebuilt
	// (snapshots loaded, stream caught up) at most this long after start;
	// past it the router reports ready anyway and kv_aware routes
	// heuristically until the stream is healthy. Default 30s.
	ReadyTimeout time.Duration `yaml:"ready_timeout" json:"ready_timeout,omitempty"`
	// ReplicaSync shares load and speculative blocks between router
	// replicas (docs/replicas.md); nil or enabled: false = off.
	ReplicaSync *ReplicaSyncConfig `yaml:"replica_sync,omitempty" json:"replica_sync,omitempty"`
}

// NATSConfig configures the NATS connection for KV events.
type NATSConfig struct {
	// URL of the NATS server(s), comma separated.
	URL string `yaml:"url" json:"url,omitempty"`
	// CredsFile is a NATS credentials file path.
	CredsFile string `yaml:"creds_file" json:"creds_file,omitempty"`
	// TLS client settings.
	TLS *TLSConfig `yaml:"tls,omitempty" json:"tls,omitempty"`
	// Embedded starts an in-process NATS server with JetStream (single
	// machine); also what an empty URL means.
	Embedded bool `yaml:"embedded" json:"embedded,omitempty"`
	// Listen is the embedded server's client address, where bridges
	// connect. Default 127.0.0.1:4222 (set 0.0.0.0:4222 for bridges on
	// other hosts).
	Listen string `yaml:"listen" json:"listen,omitempty"`
	// StoreDir holds the embedded server's JetStream files (stream and
	// snapshots survive a router restart). Default $TMPDIR/kvrouter-nats-<port>-<hash
	// of the pools> (DefaultEmbeddedStoreDir); one running server per store.
	StoreDir string `yaml:"store_dir" json:"store_dir,omitempty"`
	// Stream is the JetStream stream name over kv.events.>. Default KV_EVENTS.
	Stream string `yaml:"stream" json:"stream,omitempty"`
	// StreamReplicas is how many servers hold the stream, the snapshot
	// bucket and its object store when this router creates them: 1 (the
	// default) on one server, 3 on a 3-node JetStream cluster. At most 5
	// and at most the cluster's size (the server refuses more, and the
	// router says so at start); needs url (the embedded server is one node).
	StreamReplicas int `yaml:"stream_replicas" json:"stream_replicas,omitempty"`
}

// TLSConfig names certificate files.
type TLSConfig struct {
	CAFile   string `yaml:"ca_file" json:"ca_file,omitempty"`
	CertFile string `yaml:"cert_file" json:"cert_file,omitempty"`
	KeyFile  string `yaml:"key_file" json:"key_file,omitempty"`
}

// TokenizerConfig configures how a pool turns prompts into token ids for
// kv_aware routing, shadow scoring and lookups by prompt text.
type TokenizerConfig struct {
	// Source: simple | files | engine | none. Default none (heuristic only).
	Source string `yaml:"source" json:"source,omitempty"`
	// Path to a directory with tokenizer.json and tokenizer_config.json
	// (and chat_template.jinja when the template is kept apart); source files.
	Path string `yaml:"path" json:"path,omitempty"`
	// URL of an engine whose /tokenize to call; source engine. Empty = the
	// pool's first instance.
	URL string `yaml:"url" json:"url,omitempty"`
}

// PoolConfig is one model deployment: a set of instances serving one base
// model (and possibly LoRA adapters on top).
type PoolConfig struct {
	// Name identifies the pool in metrics, admin paths and the pool header.
	Name string `yaml:"name" json:"name"`
	// Model is the served model name; OpenAI requests select the pool by it.
	Model string `yaml:"model" json:"model"`
	// Adapters are LoRA adapters every instance of the pool holds (all
	// started with the same --lora-modules); adapters held by only some
	// instances go in instances[].adapters or are discovered.
	Adapters []string `yaml:"adapters" json:"adapters,omitempty"`
	// AdapterFallback: what to do when no eligible instance holds the
	// requested adapter: "none" (503) or "all" (route among all instances,
	// vLLM may load the adapter on demand). Default none.
	AdapterFallback string `yaml:"adapter_fallback" json:"adapter_fallback,omitempty"`
	// InvokePath is the upstream path for POST /invocations. Default /invocations.
	InvokePath string `yaml:"invoke_path" json:"invoke_path,omitempty"`
	// InvokeStreamPath is the upstream path for POST
	// /invocations-response-stream. Default /invocations (vLLM's SageMaker
	// endpoint streams when the body asks for it).
	InvokeStreamPath string `yaml:"invoke_stream_path" json:"invoke_stream_path,omitempty"`
	// CanonicalizeJSON re-serialises JSON bodies on the raw path (sorted
	// keys, no insignificant whitespace) before taking the routing prefix, so
	// equal requests serialised differently route together.
	CanonicalizeJSON bool `yaml:"canonicalize_json" json:"canonicalize_json,omitempty"`
	// Routing is the strategy and its parameters; changeable at runtime.
	Routing RoutingConfig `yaml:"routing" json:"routing"`
	// Health configures active health checks.
	Health HealthConfig `yaml:"health" json:"health"`
	// Discovery configures adapter discovery from instances' /v1/models.
	Discovery DiscoveryConfig `yaml:"discovery" json:"discovery"`
	// Tokenizer turns prompts into token ids for kv_aware (nil = source none:
	// only requests that carry token ids route exactly).
	Tokenizer *TokenizerConfig `yaml:"tokenizer,omitempty" json:"tokenizer,omitempty"`
	// CacheSalt injects a per-tenant cache_salt into forwarded bodies so
	// engines keep tenants' KV caches apart (docs/security.md).
	CacheSalt *CacheSaltConfig `yaml:"cache_salt,omitempty" json:"cache_salt,omitempty"`
	// FlowControl queues, prioritises and sheds requests in front of the
	// pool's engines (nil or enabled: false = off; docs/flow-control.md).
	FlowControl *FlowControlConfig `yaml:"flow_control,omitempty" json:"flow_control,omitempty"`
	// Disaggregation routes requests in two stages, prefill then decode
	// (config/disagg.go; nil = off).
	Disaggregation *DisaggregationConfig `yaml:"disaggregation,omitempty" json:"disaggregation,omitempty"`
	// PassKVTransferParams forwards a client's kv_transfer_params to the
	// engines. Off by default: the member steers an engine's KV connector
	// (where to pull a prompt's KV from, blocks to hold for a remote
	// decode), so only a disaggregating proxy of the operator's own in
	// front of kvrouter (vLLM's toy proxy, llm-d's sidecar) may send it;
	// such a pool sets this, and must not be reachable by clients
	// directly. Not allowed with disaggregation on, where kvrouter runs
	// the protocol itself.
	PassKVTransferParams bool `yaml:"pass_kv_transfer_params,omitempty" json:"pass_kv_transfer_params,omitempty"`
	// Instances is the static instance list.
	Instances []InstanceConfig `yaml:"instances" json:"instances"`
	// AllowedInstanceURLs bounds where heartbeat-discovered instances may
	// serve: CIDR networks or addresses (matched against IP-literal URL
	// hosts; names are never resolved for this) and URL patterns
	// scheme://host[:port] with * and ? globs in host and port (no port =
	// any). A heartbeat announcing another URL is refused, logged and
	// counted. Empty = any http(s) URL (docs/security.md).
	AllowedInstanceURLs []string `yaml:"allowed_instance_urls" json:"allowed_instance_urls,omitempty"`
}

// InstanceConfig is one model server.
type InstanceConfig struct {
	ID  string `yaml:"id" json:"id"`
	URL string `yaml:"url" json:"url"`
	// Adapters held by this instance, known up front.
	Adapters []string `yaml:"adapters" json:"adapters,omitempty"`
	// Role in disaggregated serving: both (default), prefill or decode
	// (config/disagg.go). A prefill instance receives only prefill
	// requests of a pool with disaggregation on.
	Role string `yaml:"role" json:"role,omitempty"`
}

// Strategy names.
const (
	StrategyRandom           = "random"
	StrategyRoundRobin       = "round_robin"
	StrategyLeastOutstanding = "least_outstanding"
	StrategyPrefixAware      = "prefix_aware"
)

// Routing parameter ranges (the SageMaker PREFIX_AWARE ranges).
const (
	MinPrefixLength          = 1024
	MaxPrefixLength          = 65536
	DefaultPrefixLength      = 8192
	MinConcurrencyThreshold  = 1
	MaxConcurrencyThreshold  = 1024
	DefaultConcurrencyThresh = 64
	DefaultStrategy          = StrategyPrefixAware
)

// RoutingConfig selects a pool's strategy. Zero values mean the defaults:
// prefix_aware, 8192, 64.
type RoutingConfig struct {
	// Strategy: random | round_robin | least_outstanding | prefix_aware | kv_aware.
	Strategy string `yaml:"strategy" json:"strategy,omitempty"`
	// PrefixLength: characters (OpenAI path) or bytes (raw path) of the
	// prompt that form the routing text, 1024..65536. Default 8192.
	PrefixLength int `yaml:"prefix_length" json:"prefix_length,omitempty"`
	// ConcurrencyThreshold: in-flight requests at which an instance counts as
	// full and requests overflow, 1..1024. Default 64.
	ConcurrencyThreshold int `yaml:"concurrency_threshold" json:"concurrency_threshold,omitempty"`
	// KV holds the kv_aware strategy's scoring constants (nil = defaults).
	KV *KVScoringConfig `yaml:"kv,omitempty" json:"kv,omitempty"`
	// Shadow also scores every request with the strategy not in use
	// (kv_aware beside a heuristic, prefix_aware beside kv_aware) and
	// records the comparison (GET /admin/pools/{pool}/compare). Needs the
	// pool's KV index.
	Shadow bool `yaml:"shadow" json:"shadow,omitempty"`
}

// KVScoringConfig holds the kv_aware scoring constants (ARCHITECTURE
// "Scoring"); zero means the default, whose reasoning is in score.go,
// tiers.CostModel and docs/kv-aware.md.
type KVScoringConfig struct {
	// PrefillTokensPerSecond is P. Default 25,000 (tiers.CostModel).
	PrefillTokensPerSecond float64 `yaml:"prefill_tokens_per_second" json:"prefill_tokens_per_second,omitempty"`
	// CPULoadTokensPerSecond is X_cpu. Default ≈ 1.22M (tiers.CostModel).
	CPULoadTokensPerSecond float64 `yaml:"cpu_load_tokens_per_second" json:"cpu_load_tokens_per_second,omitempty"`
	// DiskLoadTokensPerSecond is X_disk. Default 420,000 (tiers.CostModel).
	DiskLoadTokensPerSecond float64 `yaml:"disk_load_tokens_per_second" json:"disk_load_tokens_per_second,omitempty"`
	// SharedLoadTokensPerSecond is X_shared. Default ≈ 305,000 (tiers.CostModel).
	SharedLoadTokensPerSecond float64 `yaml:"shared_load_tokens_per_second" json:"shared_load_tokens_per_second,omitempty"`
	// BlockSize overrides the block size learned from events.
	BlockSize int `yaml:"block_size" json:"block_size,omitempty"`
	// WaitingRequestTokens is the prefill assumed per engine-reported
	// waiting request beyond this router's own. Default 1,024.
	WaitingRequestTokens int `yaml:"waiting_request_tokens" json:"waiting_request_tokens,omitempty"`
	// RunningRequestSeconds is what each running request adds to a new
	// request's TTFT. Default 0.0005.
	RunningRequestSeconds float64 `yaml:"running_request_seconds" json:"running_request_seconds,omitempty"`
	// DecodeStepSeconds is the engine's step time with a decode batch and
	// no prefill: a request arriving while the engine runs steps waits for
	// the one in progress, half of it on average. Default 0.008.
	DecodeStepSeconds float64 `yaml:"decode_step_seconds" json:"decode_step_seconds,omitempty"`
	// MaxNumBatchedTokens is the engines' per-step token budget (vLLM's
	// --max-num-batched-tokens): under chunked prefill a new request's
	// first prefill chunk shares a step with the last chunks of the
	// requests waiting ahead of it, and the budget says which those are.
	// Default 8,192 (vLLM's default for the OpenAI server on GPUs of 70 GiB
	// or more other than A100); negative = off (no step-sharing term).
	MaxNumBatchedTokens int `yaml:"max_num_batched_tokens" json:"max_num_batched_tokens,omitempty"`
	// PrefillCostWeight w: the pick minimises predicted TTFT plus w × the
	// prefill time it makes the fleet do (docs/kv-aware.md). 0 = adaptive
	// (the default): w = max(1, ρ/(1−ρ)², the requests measured queued
	// behind others in a prefill busy period) for the fleet's busy fraction
	// ρ averaged over time, at most 19; > 0 = that fixed weight (100: a
	// move must save 100× its recompute, hit rate first; docs/kv-aware.md
	// "Hit rate or tails"); negative = 0 (pure TTFT).
	PrefillCostWeight float64 `yaml:"prefill_cost_weight" json:"prefill_cost_weight,omitempty"`
	// TieTolerance: predicted TTFTs this close are a tie, broken by
	// rendezvous order. Default 1ms.
	TieTolerance time.Duration `yaml:"tie_tolerance" json:"tie_tolerance,omitempty"`
	// LoadBound ε: the prompt's hash-home, when nobody holds the prompt,
	// keeps it while its load (the predicted queue without the decode step
	// in progress) is at most (1+ε) × the candidates' mean; past that the
	// request spills (docs/kv-aware.md). It also turns on the replication
	// of hot prefixes. 0 = default 0.25; negative = off (plain
	// prefix_aware for cold prompts, no replication).
	LoadBound float64 `yaml:"load_bound" json:"load_bound,omitempty"`
	// SpeculativeTTL: a routed request's blocks count as held by its
	// instance this long, until events confirm them. Default 2s; negative = off.
	SpeculativeTTL time.Duration `yaml:"speculative_ttl" json:"speculative_ttl,omitempty"`
	// SpeculativeCapacity bounds the speculative overlay in (block,
	// instance) entries. Default 262,144.
	SpeculativeCapacity int `yaml:"speculative_capacity" json:"speculative_capacity,omitempty"`
	// ScrapeInterval of instances' /metrics (vllm:num_requests_waiting,
	// running). Default 1s; negative = off. Read when the pool's loops start.
	ScrapeInterval time.Duration `yaml:"scrape_interval" json:"scrape_interval,omitempty"`
	// ScrapeTimeout bounds one scrape. Default 500ms.
	ScrapeTimeout time.Duration `yaml:"scrape_timeout" json:"scrape_timeout,omitempty"`
	// ScrapePath is the instances' metrics path. Default /metrics.
	ScrapePath string `yaml:"scrape_path" json:"scrape_path,omitempty"`
	// TokenizeTimeout bounds producing a request's token ids (the engine
	// source is a network call); past it the request routes heuristically.
	// Default 200ms.
	TokenizeTimeout time.Duration `yaml:"tokenize_timeout" json:"tokenize_timeout,omitempty"`
	// Engine is the pool's engine kind, for the most of a prompt it reuses
	// from its prefix cache: vllm (default) and sglang reuse whole blocks
	// and never the last token, ⌊(T − 1)/B⌋·B; trtllm (TensorRT-LLM with
	// its default enable_partial_reuse) reuses up to T − 1 tokens, the
	// last held block partly (docs/kv-aware.md, "What an engine reuses").
	Engine string `yaml:"engine" json:"engine,omitempty"`
}

// Engine kinds of routing.kv.engine.
const (
	EngineVLLM   = "vllm"
	EngineSGLang = "sglang"
	EngineTRTLLM = "trtllm"
)

// WithDefaults returns r with zero fields replaced by their defaults.
func (r RoutingConfig) WithDefaults() RoutingConfig {
	if r.Strategy == "" {
		r.Strategy = DefaultStrategy
	}
	zero.Default(&r.PrefixLength, DefaultPrefixLength)
	zero.Default(&r.ConcurrencyThreshold, DefaultConcurrencyThresh)
	return r
}

// Validate checks r (after defaults) and names the offending field and its range.
func (r RoutingConfig) Validate() error { return r.validate("routing") }

func (r RoutingConfig) validate(f string) error {
	r = r.WithDefaults()
	if !KnownStrategy(r.Strategy) {
		return fmt.Errorf("%w: %s.strategy %q: want one of %s", ErrInvalidConfig, f, r.Strategy, strings.Join(StrategyNames(), ", "))
	}
	if r.PrefixLength < MinPrefixLength || r.PrefixLength > MaxPrefixLength {
		return fmt.Errorf("%w: %s.prefix_length %d out of range %d..%d", ErrInvalidConfig, f, r.PrefixLength, MinPrefixLength, MaxPrefixLength)
	}
	if r.ConcurrencyThreshold < MinConcurrencyThreshold || r.ConcurrencyThreshold > MaxConcurrencyThreshold {
		return fmt.Errorf("%w: %s.concurrency_threshold %d out of range %d..%d", ErrInvalidConfig, f, r.ConcurrencyThreshold, MinConcurrencyThreshold, MaxConcurrencyThreshold)
	}
	if k := r.KV; k != nil {
		if k.PrefillTokensPerSecond < 0 || k.CPULoadTokensPerSecond < 0 || k.SharedLoadTokensPerSecond < 0 {
			return fmt.Errorf("%w: %s.kv throughputs must be >= 0", ErrInvalidConfig, f)
		}
		if k.BlockSize < 0 || k.BlockSize > 1024 {
			return fmt.Errorf("%w: %s.kv.block_size %d out of range 0..1024", ErrInvalidConfig, f, k.BlockSize)
		}
		if err := k.ValidateKV(f + ".kv"); err != nil {
			return err
		}
	}
	return nil
}

// HealthConfig configures active health checks of a pool's instances.
type HealthConfig struct {
	// Disable turns active checks off; instances are then always healthy.
	Disable bool `yaml:"disable" json:"disable,omitempty"`
	// Path probed with GET; 2xx = success. Default /health (vLLM's).
	Path string `yaml:"path" json:"path,omitempty"`
	// Interval between probes of one instance. Default 5s.
	Interval time.Duration `yaml:"interval" json:"interval,omitempty"`
	// Timeout of one probe. Default 2s.
	Timeout time.Duration `yaml:"timeout" json:"timeout,omitempty"`
	// UnhealthyThreshold consecutive failures eject an instance. Default 3.
	UnhealthyThreshold int `yaml:"unhealthy_threshold" json:"unhealthy_threshold,omitempty"`
	// HealthyThreshold consecutive successes re-admit it. Default 2.
	HealthyThreshold int `yaml:"healthy_threshold" json:"healthy_threshold,omitempty"`
}

// WithDefaults returns h with zero fields replaced by their defaults.
func (h HealthConfig) WithDefaults() HealthConfig {
	if h.Path == "" {
		h.Path = "/health"
	}
	zero.Default(&h.Interval, 5*time.Second)
	zero.Default(&h.Timeout, 2*time.Second)
	zero.Default(&h.UnhealthyThreshold, 3)
	zero.Default(&h.HealthyThreshold, 2)
	return h
}

// DiscoveryConfig configures LoRA adapter discovery from GET /v1/models.
type DiscoveryConfig struct {
	// Disable stops polling /v1/models; only configured adapters count.
	Disable bool `yaml:"disable" json:"disable,omitempty"`
	// Interval between polls. Default 30s (adapters change rarely).
	Interval time.Duration `yaml:"interval" json:"interval,omitempty"`
}

// WithDefaults fills defaults into every zero field of c (pools included).
func (c Config) WithDefaults() Config {
	if c.Listen == "" {
		c.Listen = ":8080"
	}
	zero.Default(&c.MaxBodyBytes, 32<<20)
	c.Limits = c.Limits.WithDefaults()
	if c.Log.Level == "" {
		c.Log.Level = "info"
	}
	if c.Log.Format == "" {
		c.Log.Format = "json"
	}
	if c.Proxy.RetryStatuses == nil {
		c.Proxy.RetryStatuses = []int{502, 503, 504}
	}
	zero.Default(&c.Proxy.DialTimeout, 2*time.Second)
	zero.Default(&c.Proxy.MaxIdleConnsPerHost, 256)
	pools := make([]PoolConfig, len(c.Pools))
	for i, p := range c.Pools {
		if p.AdapterFallback == "" {
			p.AdapterFallback = "none"
		}
		if p.InvokePath == "" {
			p.InvokePath = "/invocations"
		}
		if p.InvokeStreamPath == "" {
			p.InvokeStreamPath = "/invocations"
		}
		p.Routing = p.Routing.WithDefaults()
		p.Health = p.Health.WithDefaults()
		zero.Default(&p.Discovery.Interval, 30*time.Second)
		if p.Disaggregation != nil {
			d := *p.Disaggregation
			d.applyDefaults()
			p.Disaggregation = &d
		}
		pools[i] = p
	}
	c.Pools = pools
	return c
}

// Validate checks c (after defaults) and returns the first problem, naming
// the field by its YAML path.
func (c Config) Validate() error {
	c = c.WithDefaults()
	bad := invalidf("")
	if c.MaxBodyBytes < 1024 || c.MaxBodyBytes > 1<<30 {
		return bad("max_body_bytes %d out of range 1024..%d", c.MaxBodyBytes, 1<<30)
	}
	if err := c.validateSecurity(); err != nil {
		return err
	}
	if err := c.validateListeners(); err != nil {
		return err
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		return bad("log.level %q: want debug, info, warn or error", c.Log.Level)
	}
	switch c.Log.Format {
	case "json", "text":
	default:
		return bad("log.format %q: want json or text", c.Log.Format)
	}
	for i, s := range c.Proxy.RetryStatuses {
		if s != 0 && (s < 400 || s > 599) {
			return bad("proxy.retry_statuses[%d] %d out of range 400..599 (or 0 for none)", i, s)
		}
	}
	if c.Proxy.DialTimeout < 0 || c.Proxy.ResponseHeaderTimeout < 0 {
		return bad("proxy timeouts must be >= 0")
	}
	if c.Proxy.MaxIdleConnsPerHost < 0 || c.Proxy.MaxIdleConnsPerHost > 100000 {
		return bad("proxy.max_idle_conns_per_host %d out of range 0..100000", c.Proxy.MaxIdleConnsPerHost)
	}
	if c.Index != nil {
		switch c.Index.Backend {
		case "", "memory":
		case "redis":
			if c.Index.Redis == nil || len(c.Index.Redis.Addrs) == 0 {
				return bad("index.redis.addrs: required when index.backend is redis")
			}
		default:
			return bad("index.backend %q: want memory or redis", c.Index.Backend)
		}
		if c.Index.Capacity < 0 {
			return bad("index.capacity %d must be >= 0", c.Index.Capacity)
		}
	}
	if e := c.Events; e != nil {
		if e.NATS.URL != "" && e.NATS.Embedded {
			return bad("events.nats: url and embedded exclude each other")
		}
		if e.NATS.Listen != "" {
			if _, _, err := net.SplitHostPort(e.NATS.Listen); err != nil {
				return bad("events.nats.listen %q: want host:port", e.NATS.Listen)
			}
		}
		for _, n := range []struct{ key, v string }{{"events.nats.stream", e.NATS.Stream}, {"events.bucket", e.Bucket}} {
			if n.v != "" && !JetStreamName(n.v) {
				return bad("%s %q: not a JetStream name (at most 255 bytes; no whitespace, '.', '*', '>', '/' or '\\')", n.key, n.v)
			}
		}
		if r := e.NATS.StreamReplicas; r < 0 || r > 5 { // JetStream's limit (kvstream.MaxReplicas)
			return bad("events.nats.stream_replicas %d out of range 0..5", r)
		} else if r > 1 && e.NATS.URL == "" {
			return bad("events.nats.stream_replicas %d needs events.nats.url (a JetStream cluster): the embedded server is one node", r)
		}
		if t := e.NATS.TLS; t != nil && (t.CertFile == "") != (t.KeyFile == "") {
			return bad("events.nats.tls: cert_file and key_file go together")
		}
		if e.StaleAfter < 0 || e.PurgeAfter < 0 || e.MaxLag < 0 || e.ReadyTimeout < 0 {
			return bad("events: stale_after, purge_after, max_lag and ready_timeout must be >= 0")
		}
		if err := e.ReplicaSync.validate(); err != nil {
			return err
		}
		if e.MaxInstances < 0 || e.MaxInstances > 1<<20 {
			return bad("events.max_instances %d out of range 0..%d", e.MaxInstances, 1<<20)
		}
		if e.StaleAfter > 0 && e.PurgeAfter > 0 && e.PurgeAfter < e.StaleAfter {
			return bad("events.purge_after %v is shorter than stale_after %v", e.PurgeAfter, e.StaleAfter)
		}
	}
	if err := c.GRPC.validate(c.AdminToken); err != nil {
		return err
	}
	if err := c.Tracing.validate(); err != nil {
		return err
	}
	if len(c.Pools) == 0 {
		return bad("pools: at least one pool is required")
	}
	names := map[string]bool{}
	models := map[string]string{}
	// With KV events pool names and instance ids are NATS subject tokens
	// (kv.events.<pool>.<instance>, kvstream.ValidToken): a dot would
	// split the token, and kvbridge refuses one, so no bridge could ever
	// publish for that name.
	events := KVEventsWanted(c)
	const dotWithEvents = "%s %q: '.' cannot be used with KV events (names are NATS subject tokens; kvbridge --pool/--instance must equal them): use letters, digits, '-', '_'"
	for i, p := range c.Pools {
		f := fmt.Sprintf("pools[%d]", i)
		if !ValidName(p.Name) {
			return bad("%s.name %q: want 1-64 characters of [A-Za-z0-9_.-]", f, p.Name)
		}
		if events && strings.Contains(p.Name, ".") {
			return bad(dotWithEvents, f+".name", p.Name)
		}
		if names[p.Name] {
			return bad("%s.name %q: duplicate pool name", f, p.Name)
		}
		names[p.Name] = true
		if p.Model == "" {
			return bad("%s.model: required", f)
		}
		if other, ok := models[p.Model]; ok {
			return bad("%s.model %q: already served by pool %q", f, p.Model, other)
		}
		models[p.Model] = p.Name
		for _, a := range p.Adapters {
			if other, ok := models[a]; ok && other != p.Name {
				return bad("%s.adapters %q: already served by pool %q", f, a, other)
			}
			models[a] = p.Name
		}
		switch p.AdapterFallback {
		case "none", "all":
		default:
			return bad("%s.adapter_fallback %q: want none or all", f, p.AdapterFallback)
		}
		for _, path := range []struct{ name, v string }{{"invoke_path", p.InvokePath}, {"invoke_stream_path", p.InvokeStreamPath}, {"health.path", p.Health.Path}} {
			if !strings.HasPrefix(path.v, "/") {
				return bad("%s.%s %q: must start with /", f, path.name, path.v)
			}
		}
		if err := p.Routing.validate(f + ".routing"); err != nil {
			return err
		}
		if err := p.FlowControl.validate(f + ".flow_control"); err != nil {
			return err
		}
		h := p.Health
		if h.Interval < 100*time.Millisecond || h.Interval > time.Hour {
			return bad("%s.health.interval %v out of range 100ms..1h", f, h.Interval)
		}
		if h.Timeout < 10*time.Millisecond || h.Timeout > time.Minute {
			return bad("%s.health.timeout %v out of range 10ms..1m", f, h.Timeout)
		}
		if h.UnhealthyThreshold < 1 || h.UnhealthyThreshold > 100 {
			return bad("%s.health.unhealthy_threshold %d out of range 1..100", f, h.UnhealthyThreshold)
		}
		if h.HealthyThreshold < 1 || h.HealthyThreshold > 100 {
			return bad("%s.health.healthy_threshold %d out of range 1..100", f, h.HealthyThreshold)
		}
		if p.Discovery.Interval < time.Second || p.Discovery.Interval > 24*time.Hour {
			return bad("%s.discovery.interval %v out of range 1s..24h", f, p.Discovery.Interval)
		}
		if t := p.Tokenizer; t != nil {
			switch t.Source {
			case "", "none", "simple", "files", "engine":
			default:
				return bad("%s.tokenizer.source %q: want none, simple, files or engine", f, t.Source)
			}
		}
		if len(p.Instances) == 0 && !(KVEventsWanted(c) && DiscoverEnabled(c)) {
			return bad("%s.instances: at least one instance is required (or heartbeat discovery: events with discover_instances)", f)
		}
		if err := p.Disaggregation.validate(f, p.Instances); err != nil {
			return err
		}
		if p.PassKVTransferParams && p.Disaggregation.Enabled() {
			return bad("%s.pass_kv_transfer_params: not with disaggregation on (kvrouter writes kv_transfer_params itself)", f)
		}
		if _, err := ParseAllowList(p.AllowedInstanceURLs); err != nil {
			return bad("%s.allowed_instance_urls: %v", f, err)
		}
		ids := map[string]bool{}
		for j, in := range p.Instances {
			fi := fmt.Sprintf("%s.instances[%d]", f, j)
			if !ValidName(in.ID) {
				return bad("%s.id %q: want 1-64 characters of [A-Za-z0-9_.-]", fi, in.ID)
			}
			if events && strings.Contains(in.ID, ".") {
				return bad(dotWithEvents, fi+".id", in.ID)
			}
			if ids[in.ID] {
				return bad("%s.id %q: duplicate instance id in pool", fi, in.ID)
			}
			ids[in.ID] = true
			u, err := url.Parse(in.URL)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				return bad("%s.url %q: want an absolute http(s) URL", fi, in.URL)
			}
		}
	}
	if c.DefaultPool != "" && !names[c.DefaultPool] {
		return bad("default_pool %q: no such pool", c.DefaultPool)
	}
	return nil
}

// JetStreamName reports whether s is a name the NATS server accepts for a
// stream (and so for a key-value bucket, whose stream is KV_<bucket>): at
// most 255 bytes, no whitespace or control characters, none of '.', '*',
// '>' (subject tokens) nor '/', '\\' (the server stores streams in
// directories of that name). The server refuses any other at creation,
// after which nothing is consumed and every kv_aware decision falls back:
// refused here instead, at load.
func JetStreamName(s string) bool {
	if len(s) == 0 || len(s) > 255 {
		return false
	}
	for _, r := range s {
		if r <= ' ' || r == 0x7f || strings.ContainsRune(".*>/\\", r) {
			return false
		}
	}
	return true
}

// validName accepts names safe in metrics labels, URLs and NATS subjects.
func ValidName(s string) bool { return nameOf(s, 64, true) }

// nameOf reports whether s is 1..maxLen bytes of [A-Za-z0-9_-], and of
// '.' when dot.
func nameOf(s string, maxLen int, dot bool) bool {
	if len(s) == 0 || len(s) > maxLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '_' || b == '-' || dot && b == '.') {
			return false
		}
	}
	return true
}

// validateListeners refuses two listeners on one port: the second bind
// would fail at start, or — with admin_listen equal to listen — the admin
// API would look separate while sharing the data port.
func (c Config) validateListeners() error {
	type listener struct{ key, addr string }
	ls := []listener{{"listen", c.Listen}, {"admin_listen", c.AdminListen}, {"grpc.listen", c.GRPC.Listen}}
	if c.Events != nil && c.Events.NATS.Embedded {
		ls = append(ls, listener{"events.nats.listen", c.Events.NATS.Listen})
	}
	for i, a := range ls {
		for _, b := range ls[:i] {
			if a.addr != "" && b.addr != "" && sameListenAddr(a.addr, b.addr) {
				hint := "give each its own port"
				if a.key == "admin_listen" {
					hint = "leave admin_listen empty to serve the admin API on listen, or give it its own port"
				}
				return fmt.Errorf("%w: %s %q is the same address as %s %q: %s", ErrInvalidConfig, a.key, a.addr, b.key, b.addr, hint)
			}
		}
	}
	return nil
}

// sameListenAddr says whether two host:port listen addresses collide: the
// same port, and the same host or either one every interface.
func sameListenAddr(a, b string) bool {
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil {
		return a == b
	}
	if pa != pb || pa == "0" {
		return false
	}
	any := func(h string) bool { return h == "" || h == "0.0.0.0" || h == "::" || h == "[::]" }
	return ha == hb || any(ha) || any(hb)
}

// ParseConfig decodes a YAML configuration; unknown fields are errors, so a
// typo fails loudly instead of silently meaning a default. It does not
// validate (flags may still override fields); call Validate.
func ParseConfig(r io.Reader) (Config, error) {
	var c Config
	doc, err := io.ReadAll(r)
	if err != nil {
		return c, fmt.Errorf("config: read: %w", err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(doc))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		if errors.Is(err, io.EOF) {
			return c, nil
		}
		return c, fmt.Errorf("%w: %w", ErrInvalidConfig, explainYAML(doc, reflect.TypeOf(c), err))
	}
	return c, nil
}

// LoadConfig reads and parses a YAML configuration file.
func LoadConfig(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("config: read: %w", err)
	}
	c, err := ParseConfig(bytes.NewReader(b))
	if err != nil {
		return c, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}
