package events

import (
	"fmt"
	"math"
)

// SGLang publishes KV events over the same ZMQ framing as vLLM
// ([topic, seq, payload], replay on a ROUTER socket, port + rank per
// attention-DP rank) and with the same msgspec array-like, tagged structs,
// so Decode reads them as they are (sgl-project/sglang,
// python/sglang/srt/disaggregation/kv_events.py, commit 612d579):
//
//	EventBatch   [ts, events, attn_dp_rank]   (attn_dp_rank omitted when None, as
//	                                            msgspec's omit_defaults drops a
//	                                            trailing default; absent before the
//	                                            field was added, commit 006d053)
//	BlockStored  ["BlockStored", block_hashes, parent_block_hash, token_ids,
//	              block_size, lora_id(, medium)]
//	BlockRemoved ["BlockRemoved", block_hashes(, medium)]
//	AllBlocksCleared ["AllBlocksCleared"]
//
// medium (sgl-project/sglang#18205: "GPU", "CPU_TIER1", "CPU_TIER2") sits
// where vLLM's does, so tiers.FromMedium reads it. What differs is what the
// engine puts in the fields (python/sglang/srt/mem_cache, the KV-event
// mixin): one BlockStored per page (page_size tokens: the router's block
// size must equal SGLang's --page-size), hashes that are signed int64
// (hash_str_to_int64; Decode takes a negative integer as two's
// complement), a parent of None at the radix root, no extra_keys (so no
// LoRA name), and no group fields. Since 0.5.18 (sgl-project/sglang#30827)
// a salted store appends a metadata map {"cache_salt", "session_id"} as an
// 8th element, where vLLM has lora_name; since #37482 events are maps with
// the salt under "metadata" or "cache_salt". Decode reads the salt into
// CacheSalt (see sglangMetadata in codec_decode.go).

// SGLangOptions selects which SGLang release's shape EncodeSGLang writes.
type SGLangOptions struct {
	// Medium writes BlockStored/BlockRemoved with the 7th/3rd "medium"
	// field (SGLang releases since sgl-project/sglang#18205).
	Medium bool
	// NoRank writes a two-element batch [ts, events] (SGLang before
	// attn_dp_rank was added to EventBatch).
	NoRank bool
}

// EncodeSGLang appends b as an SGLang engine publishes it: every
// BlockStored split into one event per block (page), each with its own
// parent (the previous page's hash, or the event's parent for the first),
// block hashes written as signed int64, lora_id nil unless set, and every
// BlockRemoved split into one event per block. Integers use msgspec's
// smallest forms. It exists for the simulator (kvsim --engine sglang) and
// the fixtures' cross-check; the router reads SGLang payloads with Decode.
func EncodeSGLang(dst []byte, b Batch, o SGLangOptions) ([]byte, error) {
	n := 0
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Kind {
		case BlockStored:
			if len(e.TokenIDs) > 0 && (e.BlockSize <= 0 || len(e.TokenIDs) != e.BlockSize*len(e.BlockHashes)) {
				return dst, fmt.Errorf("%w: sglang stores need block_size and one page of tokens per hash", ErrInvalidEvent)
			}
			n += len(e.BlockHashes)
		case BlockRemoved:
			n += len(e.BlockHashes)
		case AllBlocksCleared:
			n++
		default:
			return dst, fmt.Errorf("%w: kind %d", ErrInvalidEvent, e.Kind)
		}
	}
	if o.NoRank {
		dst = appendArrayHeader(dst, 2)
	} else {
		dst = appendArrayHeader(dst, 3)
	}
	dst = appendTS(dst, b.TS, false)
	dst = appendArrayHeader(dst, n)
	for i := range b.Events {
		e := &b.Events[i]
		switch e.Kind {
		case BlockStored:
			parent, hasParent := e.ParentHash, e.HasParent
			for j, h := range e.BlockHashes {
				dst = appendSGLangBlock(dst, "BlockStored", 6, o.Medium, h)
				if hasParent {
					dst = appendInt(dst, int64(parent))
				} else {
					dst = append(dst, 0xc0)
				}
				if len(e.TokenIDs) == 0 {
					// A page known by hash only (HiCache's storage
					// prefetch sends token_ids=[]).
					dst = appendArrayHeader(dst, 0)
				} else {
					dst = appendArrayHeader(dst, e.BlockSize)
					for _, t := range e.TokenIDs[j*e.BlockSize : (j+1)*e.BlockSize] {
						dst = appendUint(dst, uint64(t))
					}
				}
				dst = appendInt(dst, int64(max(e.BlockSize, 0)))
				dst = appendOptInt(dst, e.LoraID, !e.HasLoraID)
				if o.Medium {
					dst = appendStr(dst, sglangMedium(e.Medium))
				}
				parent, hasParent = h, true
			}
		case BlockRemoved:
			for _, h := range e.BlockHashes {
				dst = appendSGLangBlock(dst, "BlockRemoved", 2, o.Medium, h)
				if o.Medium {
					dst = appendStr(dst, sglangMedium(e.Medium))
				}
			}
		case AllBlocksCleared:
			dst = appendArrayHeader(dst, 1)
			dst = appendStr(dst, "AllBlocksCleared")
		}
	}
	if !o.NoRank {
		if !b.HasDPRank || b.DPRank < 0 || b.DPRank > math.MaxInt32 {
			dst = append(dst, 0xc0)
		} else {
			dst = appendInt(dst, int64(b.DPRank))
		}
	}
	return dst, nil
}

// appendSGLangBlock starts an SGLang event about one block, as SGLang
// sends one per block: its array header (fields, one more when the medium
// follows the event's other fields), its tag and its one-hash list.
func appendSGLangBlock(dst []byte, tag string, fields int, medium bool, hash uint64) []byte {
	if medium {
		fields++
	}
	dst = appendArrayHeader(dst, fields)
	dst = appendStr(dst, tag)
	dst = appendArrayHeader(dst, 1)
	return appendInt(dst, int64(hash))
}

// sglangMedium names a tier as SGLang's StorageMedium does: GPU for device
// pages, CPU_TIER1 for HiCache's host tier, CPU_TIER2 for its storage tier.
func sglangMedium(m string) string {
	switch m {
	case "", "GPU":
		return "GPU"
	case "CPU":
		return "CPU_TIER1"
	case "DISK":
		return "CPU_TIER2"
	}
	return m
}
