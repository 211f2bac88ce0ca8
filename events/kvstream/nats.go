package kvstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
)

// Headers on every kv.events message. The payload itself is the engine's
// bytes, unchanged; everything the bridge knows about it travels here.
const (
	// HeaderSeq is the engine publisher's sequence number (decimal). Absent
	// on synthetic messages, which the engine never sent.
	HeaderSeq = "Kv-Seq"
	// HeaderRank is the engine's data-parallel rank (decimal).
	HeaderRank = "Kv-Rank"
	// HeaderEncoding is the payload's event encoding: "array" or "map".
	HeaderEncoding = "Kv-Encoding"
	// HeaderInstance and HeaderPool repeat the subject's tokens so that a
	// message copied elsewhere still says where it came from.
	HeaderInstance = "Kv-Instance"
	HeaderPool     = "Kv-Pool"
	// HeaderModel is the served model name.
	HeaderModel = "Kv-Model"
	// HeaderSynthetic marks a message the bridge made rather than the
	// engine: its value is the reason (one of the Synthetic* constants).
	HeaderSynthetic = "Kv-Synthetic"
	// HeaderBatches marks a coalesced message: its payload is this many
	// (at least 2) consecutive engine payloads of the instance,
	// concatenated unchanged (msgpack values are self-delimiting), with
	// engine seqs HeaderSeq (the first) through HeaderSeqLast. A bridge
	// publishes one only with coalescing on (kvbridge --coalesce), which
	// needs every router reading the stream to understand it. A router
	// from before it counts such a message malformed (its decoder refuses
	// the bytes after the first batch), takes HeaderSeq as the message's
	// seq, and so meets a seq gap at the instance's next message and
	// reloads the snapshot: it never applies part of one.
	HeaderBatches = "Kv-Batches"
	// HeaderSeqLast is a coalesced message's last engine seq.
	HeaderSeqLast = "Kv-Seq-Last"
)

// MaxCoalesced bounds HeaderBatches: a reader refuses a larger count
// (the bridge's --coalesce is at most this).
const MaxCoalesced = 1024

// Reasons for synthetic messages (HeaderSynthetic values) and for clears.
const (
	// SyntheticGap: a clear after a gap the replay could not fill.
	SyntheticGap = "gap"
	// SyntheticRestart: a clear because the engine restarted.
	SyntheticRestart = "restart"
	// SyntheticResync: a clear followed by the bridge's whole block table,
	// published when a bridge starts (or recovers) so that consumers hold
	// exactly what the bridge can vouch for.
	SyntheticResync = "resync"
)

// ErrBadHeader is returned by ParseEventHeaders for a malformed header.
var ErrBadHeader = errors.New("kvstream: malformed kv header")

// EventHeaders are the parsed headers of one kv.events message.
type EventHeaders struct {
	Seq       uint64
	HasSeq    bool
	Rank      int
	Encoding  string
	Pool      string
	Instance  string
	Model     string
	Synthetic string
	// Batches is the number of engine payloads a coalesced message
	// carries (HeaderBatches), with seqs Seq..LastSeq(); 0 for a message
	// of one payload.
	Batches int
}

// Coalesced reports whether the message carries several engine payloads.
func (h EventHeaders) Coalesced() bool { return h.Batches > 1 }

// LastSeq is the last engine seq the message carries: Seq, or a
// coalesced message's Seq+Batches-1 (HeaderSeqLast on the wire).
func (h EventHeaders) LastSeq() uint64 {
	if h.Coalesced() {
		return h.Seq + uint64(h.Batches-1)
	}
	return h.Seq
}

// Header renders h as NATS headers.
func (h EventHeaders) Header() nats.Header {
	hd := nats.Header{}
	if h.HasSeq {
		hd.Set(HeaderSeq, strconv.FormatUint(h.Seq, 10))
	}
	hd.Set(HeaderRank, strconv.Itoa(h.Rank))
	if h.Encoding != "" {
		hd.Set(HeaderEncoding, h.Encoding)
	}
	if h.Pool != "" {
		hd.Set(HeaderPool, h.Pool)
	}
	if h.Instance != "" {
		hd.Set(HeaderInstance, h.Instance)
	}
	if h.Model != "" {
		hd.Set(HeaderModel, h.Model)
	}
	if h.Synthetic != "" {
		hd.Set(HeaderSynthetic, h.Synthetic)
	}
	if h.Batches > 1 {
		hd.Set(HeaderBatches, strconv.Itoa(h.Batches))
		hd.Set(HeaderSeqLast, strconv.FormatUint(h.LastSeq(), 10))
	}
	return hd
}

// ParseEventHeaders reads the kv headers of a message. Missing headers are
// zero; present but malformed numbers are an error.
func ParseEventHeaders(hd nats.Header) (EventHeaders, error) {
	var h EventHeaders
	if v := hd.Get(HeaderSeq); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return EventHeaders{}, fmt.Errorf("%w: %s %q", ErrBadHeader, HeaderSeq, v)
		}
		h.Seq, h.HasSeq = n, true
	}
	if v := hd.Get(HeaderRank); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return EventHeaders{}, fmt.Errorf("%w: %s %q", ErrBadHeader, HeaderRank, v)
		}
		h.Rank = n
	}
	h.Encoding = hd.Get(HeaderEncoding)
	h.Pool = hd.Get(HeaderPool)
	h.Instance = hd.Get(HeaderInstance)
	h.Model = hd.Get(HeaderModel)
	h.Synthetic = hd.Get(HeaderSynthetic)
	nv, lv := hd.Get(HeaderBatches), hd.Get(HeaderSeqLast)
	if nv == "" && lv == "" {
		return h, nil
	}
	// A coalesced message: n >= 2 engine payloads with consecutive seqs
	// Seq..Last, never synthetic.
	n, err := strconv.Atoi(nv)
	if err != nil || n < 2 || n > MaxCoalesced {
		return EventHeaders{}, fmt.Errorf("%w: %s %q (want 2..%d)", ErrBadHeader, HeaderBatches, nv, MaxCoalesced)
	}
	last, err := strconv.ParseUint(lv, 10, 64)
	if err != nil || !h.HasSeq || h.Synthetic != "" || last < h.Seq || last-h.Seq != uint64(n-1) {
		return EventHeaders{}, fmt.Errorf("%w: coalesced message with %s %q, %s %q, %s %q, %s %q", ErrBadHeader,
			HeaderSeq, hd.Get(HeaderSeq), HeaderSeqLast, lv, HeaderBatches, nv, HeaderSynthetic, h.Synthetic)
	}
	h.Batches = n
	return h, nil
}

// SplitPayload returns the engine payloads a message with headers h
// carries, appended to dst[:0] (they alias data): data itself, or a
// coalesced message's h.Batches payloads, the i-th with engine seq
// h.Seq+i. An error (wrapping events.ErrMalformed) means a coalesced
// payload that is not exactly h.Batches complete msgpack values: the
// message is unreadable as a whole.
func SplitPayload(h EventHeaders, data []byte, dst [][]byte) ([][]byte, error) {
	if !h.Coalesced() {
		return append(dst[:0], data), nil
	}
	return events.SplitValues(data, h.Batches, dst)
}

// StreamConfig is the JetStream stream over kv.events.>. Zero values mean
// the documented defaults.
type StreamConfig struct {
	// Name defaults to "KV_EVENTS".
	Name string
	// MaxAge defaults to 1h: long enough for a router restart or a NATS
	// upgrade; older state comes from snapshots, so the stream need not
	// hold an instance's whole life.
	MaxAge time.Duration
	// MaxBytes defaults to 1 GiB.
	MaxBytes int64
	// MaxMsgs defaults to unlimited (-1); tests use tiny values.
	MaxMsgs int64
	// Memory keeps the stream in memory instead of files.
	Memory bool
	// Replicas is how many JetStream servers hold the stream: 1 (the
	// default) for a single server, 3 on a 3-node cluster so that losing
	// one node loses nothing. At most MaxReplicas and at most the cluster's
	// size (the server refuses more: a configuration error).
	Replicas int
	// DuplicateWindow defaults to 2m: the bridge retries a publish with
	// the same message id after a lost ack; JetStream drops the copy.
	DuplicateWindow time.Duration
}

// MaxReplicas is JetStream's limit on a stream's replicas.
const MaxReplicas = 5

// DefaultStreamName is the stream name when StreamConfig.Name is empty.
const DefaultStreamName = "KV_EVENTS"

func (c StreamConfig) withDefaults() StreamConfig {
	if c.Name == "" {
		c.Name = DefaultStreamName
	}
	if c.MaxAge == 0 {
		c.MaxAge = time.Hour
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = 1 << 30
	}
	if c.MaxMsgs == 0 {
		c.MaxMsgs = -1
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = 2 * time.Minute
	}
	if c.MaxAge > 0 && c.DuplicateWindow > c.MaxAge {
		// JetStream rejects a dedup window longer than the retention.
		c.DuplicateWindow = c.MaxAge
	}
	return c
}

// storageOf is the JetStream storage of a stream or bucket kept in memory
// or, by default, in files.
func storageOf(memory bool) jetstream.StorageType {
	if memory {
		return jetstream.MemoryStorage
	}
	return jetstream.FileStorage
}

// EnsureStream returns the events stream, creating it when missing. An
// existing stream is left as it is (another bridge or the operator made it).
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	cfg = cfg.withDefaults()
	if cfg.MaxAge < 0 || cfg.MaxBytes < -1 || cfg.MaxMsgs < -1 || cfg.Replicas < 1 || cfg.Replicas > MaxReplicas {
		return nil, fmt.Errorf("%w: stream %s: limits out of range (max age %v, max bytes %d, max msgs %d, replicas %d of 1..%d)",
			ErrConfig, cfg.Name, cfg.MaxAge, cfg.MaxBytes, cfg.MaxMsgs, cfg.Replicas, MaxReplicas)
	}
	s, err := js.Stream(ctx, cfg.Name)
	if err == nil {
		return s, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("kvstream: look up stream %s: %w", cfg.Name, err)
	}
	storage := storageOf(cfg.Memory)
	s, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        cfg.Name,
		Description: "kvrouter: vLLM KV-cache events per pool and instance",
		Subjects:    []string{SubjectEvents + ".>"},
		MaxAge:      cfg.MaxAge,
		MaxBytes:    cfg.MaxBytes,
		MaxMsgs:     cfg.MaxMsgs,
		Storage:     storage,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
		Discard:     jetstream.DiscardOld,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || isSubjectOverlap(err) {
		// Another bridge or router created it between our look-up and
		// create. The server checks the name, then (after letting go of
		// its lock) the subjects, so losing that race can also read
		// "subjects overlap": a stream of this name now existing is the
		// answer; if none does, another stream holds the subjects.
		if s, lerr := js.Stream(ctx, cfg.Name); lerr == nil {
			return s, nil
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kvstream: create stream %s: %w%s", cfg.Name, err, replicasHint(err, cfg.Replicas))
	}
	return s, nil
}

// BucketConfig is the JetStream key-value bucket holding each instance's
// latest snapshot. Zero values mean defaults.
type BucketConfig struct {
	// Name defaults to "KV_SNAPSHOTS".
	Name string
	// TTL drops a snapshot not refreshed for this long (default 24h: an
	// instance gone for a day is not coming back with the same cache).
	TTL time.Duration
	// MaxValueSize bounds one snapshot (default: the server's max payload).
	MaxValueSize int32
	// Memory keeps the bucket in memory instead of files.
	Memory bool
	// Replicas of the bucket and of the object store, as
	// StreamConfig.Replicas (default 1).
	Replicas int
}

func (c BucketConfig) replicas() (int, error) {
	switch {
	case c.Replicas == 0:
		return 1, nil
	case c.Replicas < 0 || c.Replicas > MaxReplicas:
		return 0, fmt.Errorf("%w: bucket %s: replicas %d out of range 1..%d", ErrConfig, c.Name, c.Replicas, MaxReplicas)
	}
	return c.Replicas, nil
}

// DefaultBucketName is the bucket name when BucketConfig.Name is empty.
const DefaultBucketName = "KV_SNAPSHOTS"

// EnsureBucket returns the snapshot bucket, creating it when missing.
func EnsureBucket(ctx context.Context, js jetstream.JetStream, cfg BucketConfig) (jetstream.KeyValue, error) {
	if cfg.Name == "" {
		cfg.Name = DefaultBucketName
	}
	if cfg.TTL == 0 {
		cfg.TTL = 24 * time.Hour
	}
	if cfg.TTL < 0 || cfg.MaxValueSize < 0 {
		return nil, fmt.Errorf("%w: bucket %s: negative ttl %v or max value size %d", ErrConfig, cfg.Name, cfg.TTL, cfg.MaxValueSize)
	}
	replicas, err := cfg.replicas()
	if err != nil {
		return nil, err
	}
	kv, err := js.KeyValue(ctx, cfg.Name)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("kvstream: look up bucket %s: %w", cfg.Name, err)
	}
	storage := storageOf(cfg.Memory)
	kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:       cfg.Name,
		Description:  "kvrouter: latest block-table snapshot per pool.instance",
		History:      1,
		TTL:          cfg.TTL,
		MaxValueSize: cfg.MaxValueSize,
		Storage:      storage,
		Replicas:     replicas,
	})
	if errors.Is(err, jetstream.ErrBucketExists) || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || isSubjectOverlap(err) {
		// Made by another creator meanwhile (see EnsureStream).
		if kv, lerr := js.KeyValue(ctx, cfg.Name); lerr == nil || !isSubjectOverlap(err) {
			return kv, lerr
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kvstream: create bucket %s: %w%s", cfg.Name, err, replicasHint(err, replicas))
	}
	return kv, nil
}

// ObjectStoreName is the object store that holds snapshots too large for
// one message: the bucket's name + "_OBJ".
func (c BucketConfig) ObjectStoreName() string {
	if c.Name == "" {
		return DefaultBucketName + "_OBJ"
	}
	return c.Name + "_OBJ"
}

// EnsureObjectStore returns the snapshot object store (see
// BucketConfig.ObjectStoreName), creating it when missing.
func EnsureObjectStore(ctx context.Context, js jetstream.JetStream, cfg BucketConfig) (jetstream.ObjectStore, error) {
	name := cfg.ObjectStoreName()
	if cfg.TTL == 0 {
		cfg.TTL = 24 * time.Hour
	}
	replicas, err := cfg.replicas()
	if err != nil {
		return nil, err
	}
	obs, err := js.ObjectStore(ctx, name)
	if err == nil {
		return obs, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("kvstream: look up object store %s: %w", name, err)
	}
	storage := storageOf(cfg.Memory)
	obs, err = js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{
		Bucket:      name,
		Description: "kvrouter: block-table snapshots too large for one message",
		TTL:         cfg.TTL,
		Storage:     storage,
		Replicas:    replicas,
	})
	if errors.Is(err, jetstream.ErrBucketExists) || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || isSubjectOverlap(err) {
		// Made by another creator meanwhile (see EnsureStream).
		if obs, lerr := js.ObjectStore(ctx, name); lerr == nil || !isSubjectOverlap(err) {
			return obs, lerr
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kvstream: create object store %s: %w%s", name, err, replicasHint(err, replicas))
	}
	return obs, nil
}

// jsErrSubjectOverlap is the JetStream API error code for "subjects
// overlap with an existing stream" (nats-server JSStreamSubjectOverlapErr;
// nats.go has no constant for it).
const jsErrSubjectOverlap = 10065

func isSubjectOverlap(err error) bool {
	var je jetstream.JetStreamError
	if errors.As(err, &je) {
		if a := je.APIError(); a != nil {
			return a.ErrorCode == jsErrSubjectOverlap
		}
	}
	return false
}

// Heartbeat is what a bridge publishes on kv.instances.<pool>.<instance>.
type Heartbeat struct {
	Pool      string    `json:"pool"`
	Instance  string    `json:"instance"`
	URL       string    `json:"url,omitempty"`
	Model     string    `json:"model,omitempty"`
	BlockSize int       `json:"block_size,omitempty"`
	Adapters  []string  `json:"adapters,omitempty"`
	Rank      int       `json:"rank"`
	Blocks    int       `json:"blocks"`
	EngineSeq uint64    `json:"engine_seq"`
	StreamSeq uint64    `json:"stream_seq"`
	Time      time.Time `json:"time"`
	// IntervalMS is the bridge's heartbeat period, so a consumer can tell
	// how long a silence means the instance is gone.
	IntervalMS int64 `json:"interval_ms"`
	// EngineDown says the bridge sees the engine dead: its HTTP health
	// fails and it publishes no events. Its blocks must not count until a
	// heartbeat says otherwise; by then the bridge has cleared them if the
	// engine came back as a new process.
	EngineDown bool `json:"engine_down,omitempty"`
	// EngineStart is the engine process's start time (Unix seconds, from
	// its /metrics process_start_time_seconds), 0 when unknown: it changes
	// exactly when the engine restarts.
	EngineStart float64 `json:"engine_start,omitempty"`
	// Role is the engine's disaggregated-serving role (prefill, decode or
	// both; empty = both), so that discovered instances join the right set.
	Role string `json:"role,omitempty"`
}
