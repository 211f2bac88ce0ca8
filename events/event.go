// Package events is vLLM's KV-cache event codec: the event types, and the
// decoding and encoding of event batches in both the array-era and map-era
// msgpack encodings. It imports only the standard library, so that every
// package that needs an Event (the index, the simulator) stays free of the
// transports: the engine's ZMQ sockets are in events/enginezmq and the NATS
// side (subjects, headers, JetStream, snapshots) in events/kvstream.
package events

// Kind is the type of a KV-cache event.
type Kind uint8

const (
	// BlockStored: blocks entered a tier of the engine's cache.
	BlockStored Kind = iota + 1
	// BlockRemoved: blocks left one tier of the engine's cache.
	BlockRemoved
	// AllBlocksCleared: the engine dropped its whole cache (reset, sleep, restart).
	AllBlocksCleared
)

func (k Kind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "Unknown"
}

// Event is one decoded KV-cache event. It is a flat struct rather than an
// interface so that decoding a batch does not allocate per event.
//
// Block hashes are the engine's own (sha256 or builtin, low 64 bits, or the
// last 8 bytes big-endian when the engine sends bytes); the router never
// recomputes them, it maps them to its own block keys (package kvindex).
type Event struct {
	Kind Kind

	// BlockHashes: stored or removed blocks, in chain order for stores.
	BlockHashes []uint64
	// ParentHash is the engine hash of the block before BlockHashes[0];
	// HasParent is false when the chain starts at block 0 (nil, or 0 as
	// some engines send).
	ParentHash uint64
	HasParent  bool
	// TokenIDs covers the stored full blocks only (len = len(BlockHashes)*BlockSize
	// for GPU stores; empty for CPU-tier stores).
	TokenIDs  []uint32
	BlockSize int

	// LoRA adapter, when the blocks belong to one.
	LoraID    int64
	HasLoraID bool
	LoraName  string

	// Medium as the engine wrote it ("GPU", "CPU", ...); see tiers.FromMedium.
	Medium string

	// CacheSalt from the first block's extra_keys, when present, or from
	// SGLang's BlockStored metadata (then ExtraKeys is built to carry it).
	CacheSalt string

	// GroupIdx is the KV-cache group; only group 0 (full attention) is indexed.
	GroupIdx int
	// SpecKind is kv_cache_spec_kind when present (e.g. "full_attention",
	// "sliding_window"); SlidingWindow is kv_cache_spec_sliding_window.
	SpecKind      string
	SlidingWindow int

	// ExtraKeys is the event's extra_keys value exactly as received
	// (msgpack, one entry per block: LoRA name, multimodal hashes, the
	// cache salt on block 0), or nil. CacheSalt is decoded from it. For an
	// SGLang store whose metadata carries a salt and that has no extra_keys,
	// it is the vLLM form that carries the salt (Encode writes that back).
	ExtraKeys []byte

	// Layout records the wire layout for byte-exact re-encoding (see
	// EventLayout); the zero value means the modern vLLM form.
	Layout EventLayout
}

// Batch is one EventBatch: [ts, events, data_parallel_rank].
type Batch struct {
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank; HasDPRank is false for engines that
	// send a two-element batch or nil.
	DPRank    int
	HasDPRank bool

	// Encoding the events arrived in (of the first event); 0 for a batch
	// built by hand.
	Encoding Encoding
	// Unknown counts events of unknown type that Decode skipped.
	Unknown int
	// Invalid counts events Decode skipped because they could not be read:
	// well-formed msgpack, but not an event the codec knows how to read (a
	// field of another type or out of range, no tag). The other events of
	// the batch are kept. InvalidErr is the first one's reason (wrapping
	// ErrMalformed), for logs.
	Invalid    int
	InvalidErr error
	// InvalidRemovals counts, of Invalid, the BlockRemoved and
	// AllBlocksCleared events (their tag read, a field not): blocks the
	// engine dropped that no index can be told of. The bridge clears the
	// instance after such a batch, as after a gap it cannot fill.
	InvalidRemovals int
	// Layout records the envelope's wire layout (see BatchLayout).
	Layout BatchLayout
}
