package events

import (
	"errors"
	"fmt"
	"strings"
)

// Encoding is the msgpack shape of the events inside a batch. vLLM sent
// events as tagged positional arrays until vllm-project/vllm#42892
// (2026-05) and as tagged maps since; the batch itself stayed a 3-element
// array in vLLM 0.26, while kv_events.py @ 0181ea3 declares it as a map too
// (Decode reads both; Batch.Layout.Map records which).
type Encoding uint8

const (
	// EncodingArray: ["BlockStored", block_hashes, parent_block_hash, ...].
	EncodingArray Encoding = iota + 1
	// EncodingMap: {"type": "BlockStored", "block_hashes": ..., ...}.
	EncodingMap
)

func (e Encoding) String() string {
	switch e {
	case EncodingArray:
		return "array"
	case EncodingMap:
		return "map"
	}
	return fmt.Sprintf("Encoding(%d)", uint8(e))
}

// ParseEncoding is the inverse of String ("array" or "map", any case).
func ParseEncoding(s string) (Encoding, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "array":
		return EncodingArray, nil
	case "map":
		return EncodingMap, nil
	}
	return 0, fmt.Errorf("%w: %q (want \"array\" or \"map\")", ErrEncoding, s)
}

var (
	// ErrMalformed wraps every decode error: the payload is not a valid
	// vLLM event batch (truncated, wrong types, impossible lengths).
	ErrMalformed = errors.New("events: malformed payload")
	// ErrEncoding: an unknown Encoding value was given.
	ErrEncoding = errors.New("events: unknown encoding")
	// ErrInvalidEvent: Encode was given an event it cannot write.
	ErrInvalidEvent = errors.New("events: invalid event")

	errTruncated = fmt.Errorf("%w: truncated", ErrMalformed)
)

func wrongType(want string, marker byte) error {
	return fmt.Errorf("%w: expected %s, got %s (0x%02x)", ErrMalformed, want, typeOf(marker), marker)
}

// Field ids of the wire fields, shared by the array positions and the map
// keys. They are stable: EventLayout stores them.
const (
	fType = iota
	fHashes
	fParent
	fTokens
	fBlockSize
	fLoraID
	fMedium
	fLoraName
	fExtraKeys
	fGroupIdx
	fSpecKind
	fSlidingWindow
	nFields
)

// fieldNames are the map-era keys (vllm/distributed/kv_events.py).
var fieldNames = [nFields]string{
	"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
	"lora_id", "medium", "lora_name", "extra_keys", "group_idx",
	"kv_cache_spec_kind", "kv_cache_spec_sliding_window",
}

// Array-era positions per event type, as the msgspec structs declared them
// (array_like=True, fields appended over time: medium #19737, lora_name
// #27577, extra_keys #33304, group_idx #37688, kv_cache_spec_* #40984).
var (
	storedFields = [...]uint8{fType, fHashes, fParent, fTokens, fBlockSize, fLoraID,
		fMedium, fLoraName, fExtraKeys, fGroupIdx, fSpecKind, fSlidingWindow}
	removedFields = [...]uint8{fType, fHashes, fMedium, fGroupIdx}
	clearedFields = [...]uint8{fType}
)

func kindFields(k Kind) []uint8 {
	switch k {
	case BlockStored:
		return storedFields[:]
	case BlockRemoved:
		return removedFields[:]
	case AllBlocksCleared:
		return clearedFields[:]
	}
	return nil
}

// kindMask is the set of fields an event type has.
func kindMask(k Kind) uint16 {
	var m uint16
	for _, f := range kindFields(k) {
		m |= 1 << f
	}
	return m
}

// kindMasks is kindMask by kind, for the decoder's per-event use.
var kindMasks = [...]uint16{
	BlockStored:      kindMask(BlockStored),
	BlockRemoved:     kindMask(BlockRemoved),
	AllBlocksCleared: kindMask(AllBlocksCleared),
}

// Layout flags.
const (
	// FlagHashFixed64: every integer hash (and the parent) was written with
	// the fixed-width 0xcf marker, as Go encoders of uint64 do.
	FlagHashFixed64 uint8 = 1 << iota
	// FlagTokenFixed32: every token id was written with the 0xce marker.
	FlagTokenFixed32
	// FlagHashBin: hashes were raw digest bytes (bin), not integers.
	FlagHashBin
	// FlagJoined: the event joins a run of one-hash BlockRemoved events,
	// one per hash (Decoder.JoinRemovals); Encode writes it as one event.
	FlagJoined
)

// EventLayout records how one event was laid out on the wire so that Encode
// reproduces the received bytes exactly. Decode fills it; the zero value
// (Encoding 0) means "no recorded layout": Encode then writes the modern
// form that current vLLM sends. A layout that would drop a field the event
// carries (one set after decoding) is ignored, so Encode never loses data;
// clear Layout to force the modern form.
type EventLayout struct {
	// Encoding the event arrived in; Encode uses the layout only when it
	// writes the same encoding.
	Encoding Encoding
	// N is the array length (tag included) or the number of known map keys
	// recorded in Order (at most 16).
	N uint8
	// Order is the map key order: the field id of key i in bits 4i..4i+3.
	Order uint64
	// Nil has bit f set when field f was present as nil.
	Nil uint16
	// Flags: FlagHashFixed64, FlagTokenFixed32, FlagHashBin, FlagJoined.
	Flags uint8
}

// BatchLayout records the batch envelope's shape, like EventLayout.
type BatchLayout struct {
	// N is the batch array length (2: no rank; 3: rank) or, when Map is set,
	// the number of known keys in Order. 0 means no recorded layout.
	N uint8
	// Map: the batch itself was a map {"ts", "events", "data_parallel_rank"}.
	Map bool
	// Order is the map key order, 2 bits per key (0 ts, 1 events, 2 rank).
	Order uint8
	// RankNil: data_parallel_rank was present as nil.
	RankNil bool
	// TSFloat32: ts was a float32 (0xca) rather than a float64.
	TSFloat32 bool
}

// Full-attention spec kinds, the values of vLLM's KVCacheSpecKind for
// which a group's blocks form a plain prefix chain (vllm/v1/kv_cache_interface.py).
func fullAttentionKind(kind string) bool {
	switch kind {
	case "", "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

// FullAttention reports whether the event belongs to a full-attention KV
// cache group, the only kind whose blocks form a prefix chain the router
// can index: a full-attention spec kind (full, MLA, sink), in whatever
// group the model put it (Kimi-K3 has its MLA attention in group 3, after
// three mamba groups), or, from engines that send no spec kind (before
// vllm-project/vllm#40984), group 0. Sliding-window, chunked-local and
// mamba groups, or a non-zero sliding window, are not.
func (e Event) FullAttention() bool {
	if e.SlidingWindow != 0 {
		return false
	}
	if e.SpecKind == "" {
		return e.GroupIdx == 0
	}
	return fullAttentionKind(e.SpecKind)
}

// EngineEvents is how many of the engine's events e stands for: one, or
// a joined removal's one per hash (FlagJoined), so that counts of engine
// events do not change with Decoder.JoinRemovals.
func (e *Event) EngineEvents() int {
	if e.Layout.Flags&FlagJoined != 0 {
		return len(e.BlockHashes)
	}
	return 1
}
