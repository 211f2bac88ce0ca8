package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
)

// TensorRT-LLM reports KV-cache events through its executor API
// (tensorrt_llm.bindings.executor KVCacheEvent: event_id, data, window_size,
// attention_dp_rank) and serves them as JSON from trtllm-serve's
// POST /kv_cache_events, which drains the engine's event buffer (gathered
// onto rank 0 under attention DP). The JSON is what KVCacheEventSerializer
// writes (NVIDIA/TensorRT-LLM, tensorrt_llm/_utils.py @ ed53795):
//
//	{"event_id": n, "window_size": n, "attention_dp_rank": n (when set),
//	 "data": {"type": "created", "num_blocks_per_cache_level": [n, ...]}
//	       | {"type": "stored", "parent_hash": n|null,
//	          "blocks": [{"type": "stored_block", "block_hash": n,
//	                      "tokens": [{"type": "unique_token", "token_id": n, "token_extra_id": n}],
//	                      "cache_level": n, "priority": n}]}
//	       | {"type": "removed", "block_hashes": [n, ...]}
//	       | {"type": "updated", "block_hash": n,
//	          "cache_level": {"type": "event_diff", "new_value": n, "old_value": n},
//	          "priority": {...}}}
//
// DecodeTRTLLM reads that list; TRTLLMConverter turns it into vLLM-shaped
// events, which kvbridge --format trtllm-json publishes like any engine's.

// TRTLLMEvent is one serialized executor KV-cache event.
type TRTLLMEvent struct {
	EventID    uint64
	WindowSize int
	// DPRank is attention_dp_rank; HasDPRank is false when absent.
	DPRank    int
	HasDPRank bool

	Type string // created, stored, removed, updated (others are kept and counted)

	// created
	BlocksPerLevel []int
	// stored
	ParentHash uint64
	HasParent  bool
	Blocks     []TRTLLMBlock
	// removed
	Hashes []uint64
	// updated: BlockHash with the cache level's move when HasLevel.
	BlockHash          uint64
	HasLevel           bool
	OldLevel, NewLevel int
}

// TRTLLMBlock is one stored block.
type TRTLLMBlock struct {
	Hash       uint64
	Tokens     []uint32
	ExtraIDs   bool // some token had a non-zero token_extra_id (multimodal / prompt-tuning ids)
	CacheLevel int  // 0 primary (GPU), 1 secondary (host memory)
	Priority   int
}

// ErrTRTLLM wraps every TensorRT-LLM JSON decode error.
var ErrTRTLLM = errors.New("events: malformed tensorrt-llm kv events")

type trtRaw struct {
	EventID    *json.Number `json:"event_id"`
	WindowSize *json.Number `json:"window_size"`
	DPRank     *json.Number `json:"attention_dp_rank"`
	Data       *struct {
		Type           string        `json:"type"`
		BlocksPerLevel []json.Number `json:"num_blocks_per_cache_level"`
		ParentHash     *json.Number  `json:"parent_hash"`
		Blocks         []trtRawBlock `json:"blocks"`
		BlockHashes    []json.Number `json:"block_hashes"`
		BlockHash      *json.Number  `json:"block_hash"`
		CacheLevel     *trtRawDiff   `json:"cache_level"`
		Priority       *trtRawDiff   `json:"priority"`
	} `json:"data"`
}

type trtRawBlock struct {
	BlockHash *json.Number `json:"block_hash"`
	Tokens    []struct {
		TokenID      *json.Number `json:"token_id"`
		TokenExtraID *json.Number `json:"token_extra_id"`
	} `json:"tokens"`
	CacheLevel *json.Number `json:"cache_level"`
	Priority   *json.Number `json:"priority"`
}

type trtRawDiff struct {
	NewValue *json.Number `json:"new_value"`
	OldValue *json.Number `json:"old_value"`
}

// DecodeTRTLLM parses the JSON list POST /kv_cache_events returns (a single
// event object is accepted too). Hashes are integers of up to 64 bits,
// negative ones taken as two's complement (the streaming path's int64
// hashes). Unknown event types are kept with their Type so the converter
// counts them; missing required fields, wrong types and out-of-range
// numbers are errors wrapping ErrTRTLLM.
func DecodeTRTLLM(data []byte) ([]TRTLLMEvent, error) {
	data = bytes.TrimSpace(data)
	var raws []trtRaw
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if len(data) > 0 && data[0] == '{' {
		var one trtRaw
		if err := dec.Decode(&one); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrTRTLLM, err)
		}
		raws = []trtRaw{one}
	} else if err := dec.Decode(&raws); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrTRTLLM, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: trailing data", ErrTRTLLM)
	}
	out := make([]TRTLLMEvent, 0, len(raws))
	for i := range raws {
		e, err := trtEvent(&raws[i])
		if err != nil {
			return nil, fmt.Errorf("%w: event %d: %v", ErrTRTLLM, i, err)
		}
		out = append(out, e)
	}
	return out, nil
}

func trtEvent(r *trtRaw) (TRTLLMEvent, error) {
	var e TRTLLMEvent
	var err error
	if r.EventID == nil || r.Data == nil {
		return e, errors.New("event_id and data are required")
	}
	if e.EventID, err = trtHash(*r.EventID); err != nil {
		return e, fmt.Errorf("event_id: %w", err)
	}
	if r.WindowSize != nil {
		if e.WindowSize, err = trtInt(*r.WindowSize); err != nil {
			return e, fmt.Errorf("window_size: %w", err)
		}
	}
	if r.DPRank != nil {
		if e.DPRank, err = trtInt(*r.DPRank); err != nil {
			return e, fmt.Errorf("attention_dp_rank: %w", err)
		}
		e.HasDPRank = true
	}
	d := r.Data
	e.Type = d.Type
	switch d.Type {
	case "created":
		for _, n := range d.BlocksPerLevel {
			v, err := trtInt(n)
			if err != nil {
				return e, fmt.Errorf("num_blocks_per_cache_level: %w", err)
			}
			e.BlocksPerLevel = append(e.BlocksPerLevel, v)
		}
	case "stored":
		if d.ParentHash != nil {
			if e.ParentHash, err = trtHash(*d.ParentHash); err != nil {
				return e, fmt.Errorf("parent_hash: %w", err)
			}
			e.HasParent = true
		}
		e.Blocks = make([]TRTLLMBlock, 0, len(d.Blocks))
		for j := range d.Blocks {
			b, err := trtBlock(&d.Blocks[j])
			if err != nil {
				return e, fmt.Errorf("blocks[%d]: %w", j, err)
			}
			e.Blocks = append(e.Blocks, b)
		}
	case "removed":
		for _, n := range d.BlockHashes {
			h, err := trtHash(n)
			if err != nil {
				return e, fmt.Errorf("block_hashes: %w", err)
			}
			e.Hashes = append(e.Hashes, h)
		}
	case "updated":
		if d.BlockHash == nil {
			return e, errors.New("updated: block_hash is required")
		}
		if e.BlockHash, err = trtHash(*d.BlockHash); err != nil {
			return e, fmt.Errorf("block_hash: %w", err)
		}
		if c := d.CacheLevel; c != nil && c.NewValue != nil && c.OldValue != nil {
			if e.NewLevel, err = trtInt(*c.NewValue); err != nil {
				return e, fmt.Errorf("cache_level: %w", err)
			}
			if e.OldLevel, err = trtInt(*c.OldValue); err != nil {
				return e, fmt.Errorf("cache_level: %w", err)
			}
			e.HasLevel = true
		}
	}
	return e, nil
}

func trtBlock(r *trtRawBlock) (TRTLLMBlock, error) {
	var b TRTLLMBlock
	var err error
	if r.BlockHash == nil {
		return b, errors.New("block_hash is required")
	}
	if b.Hash, err = trtHash(*r.BlockHash); err != nil {
		return b, fmt.Errorf("block_hash: %w", err)
	}
	b.Tokens = make([]uint32, len(r.Tokens))
	for i, t := range r.Tokens {
		if t.TokenID == nil {
			return b, fmt.Errorf("tokens[%d]: token_id is required", i)
		}
		v, err := strconv.ParseUint(t.TokenID.String(), 10, 32)
		if err != nil {
			return b, fmt.Errorf("tokens[%d]: token_id: %w", i, err)
		}
		b.Tokens[i] = uint32(v)
		if t.TokenExtraID != nil && t.TokenExtraID.String() != "0" {
			b.ExtraIDs = true
		}
	}
	if r.CacheLevel != nil {
		if b.CacheLevel, err = trtInt(*r.CacheLevel); err != nil {
			return b, fmt.Errorf("cache_level: %w", err)
		}
	}
	if r.Priority != nil {
		if b.Priority, err = trtInt(*r.Priority); err != nil {
			return b, fmt.Errorf("priority: %w", err)
		}
	}
	return b, nil
}

// trtHash reads an integer of up to 64 bits; negative values (int64
// hashes) are taken as two's complement.
func trtHash(n json.Number) (uint64, error) {
	s := n.String()
	if v, err := strconv.ParseUint(s, 10, 64); err == nil {
		return v, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a 64-bit integer", s)
	}
	return uint64(v), nil
}

func trtInt(n json.Number) (int, error) {
	v, err := strconv.ParseInt(n.String(), 10, 32)
	if err != nil || v < 0 || v > math.MaxInt32 {
		return 0, fmt.Errorf("%q is not a non-negative 32-bit integer", n.String())
	}
	return int(v), nil
}

// TRTLLMConverter turns TensorRT-LLM events into vLLM-shaped ones, one
// converter per engine (it keeps, per attention-DP rank, the last event id
// to tell restarts and lost events).
type TRTLLMConverter struct {
	// FullWindow is the attention window of the model's full-attention
	// layers. Events of another window_size (variable sliding-window
	// attention keeps one pool per window) are marked as a sliding-window
	// group, which the index does not use. 0: every window is taken as
	// full attention (right for models with a single window size).
	FullWindow int

	last map[int]uint64 // per rank: last event id seen
	// level is, per rank, the cache level of each block the engine holds,
	// so that a removal names the one tier it leaves. Bounded by
	// trtMaxTracked per rank: past it (events were lost, or an engine
	// larger than any GPU and host pool), untracked removals name both.
	level map[int]map[uint64]int8
}

// trtMaxTracked bounds the blocks tracked per rank: 4M, beyond the GPU and
// host blocks of any single engine (an 8×H100 node with 2 TB of host memory
// holds about 1M 32-token blocks of a 70B model).
const trtMaxTracked = 1 << 22

func (c *TRTLLMConverter) setLevel(rank int, h uint64, level int) {
	m := c.level[rank]
	if m == nil {
		m = make(map[uint64]int8)
		c.level[rank] = m
	}
	if _, ok := m[h]; ok || len(m) < trtMaxTracked {
		m[h] = int8(min(level, 2))
	}
}

// Forget drops what the converter knows of every rank (last event ids,
// block levels): the events after a lost answer are taken as a new start,
// not as a gap, once the caller has cleared every rank itself.
func (c *TRTLLMConverter) Forget() {
	c.last, c.level = nil, nil
}

// TRTLLMStats counts what a conversion could not carry over.
type TRTLLMStats struct {
	// Gaps: event ids skipped forward (the engine's event buffer,
	// event_buffer_max_size, overflowed): a clear was emitted for the rank.
	Gaps int
	// Restarts: event ids went backwards or a "created" event came (a new
	// engine or KV cache manager): a clear was emitted for the rank.
	Restarts int
	// ExtraIDBlocks: stored blocks with non-zero token_extra_id (multimodal
	// or prompt-tuning tokens) the router cannot key from plain token ids;
	// they and the rest of their event's chain were dropped.
	ExtraIDBlocks int
	// Ignored: priority-only updates and events of unknown type.
	Ignored int
}

// TRTLLMLevelMedium names a TensorRT-LLM cache level as a vLLM medium:
// level 0 is the primary (GPU) pool, level 1 the secondary (host-memory
// offload) pool; deeper levels, if any appear, are taken as disk.
func TRTLLMLevelMedium(level int) string {
	switch level {
	case 0:
		return "GPU"
	case 1:
		return "CPU"
	}
	return "DISK"
}

// Convert turns events (in the order the engine reported them) into one
// event list per attention-DP rank (rank 0 when the engine sets none).
// "created" becomes AllBlocksCleared; "stored" one BlockStored per run of
// blocks in one cache level, chained; "removed" a BlockRemoved from the
// level the converter last saw the block in (the block left the engine's
// radix tree), or from GPU and CPU when it never saw the block;
// an "updated" that moves a block between levels a tokenless BlockStored
// in the new level and a BlockRemoved from the old one.
func (c *TRTLLMConverter) Convert(evs []TRTLLMEvent) (map[int][]Event, TRTLLMStats) {
	out := make(map[int][]Event)
	if c.last == nil {
		c.last = make(map[int]uint64)
		c.level = make(map[int]map[uint64]int8)
	}
	clearRank := func(rank int) {
		out[rank] = append(out[rank], Event{Kind: AllBlocksCleared})
		delete(c.level, rank)
	}
	var st TRTLLMStats
	for i := range evs {
		e := &evs[i]
		rank := 0
		if e.HasDPRank {
			rank = e.DPRank
		}
		if last, ok := c.last[rank]; ok && e.Type != "created" {
			switch {
			case e.EventID <= last:
				st.Restarts++
				clearRank(rank)
			case e.EventID > last+1:
				st.Gaps++
				clearRank(rank)
			}
		}
		c.last[rank] = e.EventID
		group, kind, window := 0, "", 0
		if c.FullWindow > 0 && e.WindowSize != 0 && e.WindowSize != c.FullWindow {
			group, kind, window = 1, "sliding_window", e.WindowSize
		}
		switch e.Type {
		case "created":
			st.Restarts++
			clearRank(rank)
		case "stored":
			out[rank] = c.stored(out[rank], rank, e, group, kind, window, &st)
		case "removed":
			// Per level the blocks were in; untracked ones leave every level.
			var by [3][]uint64
			var unknown []uint64
			for _, h := range e.Hashes {
				if l, ok := c.level[rank][h]; ok {
					by[l] = append(by[l], h)
					delete(c.level[rank], h)
				} else {
					unknown = append(unknown, h)
				}
			}
			for l := range by {
				if hs := append(by[l], unknown...); len(hs) > 0 && (len(by[l]) > 0 || l < 2) {
					out[rank] = append(out[rank], Event{Kind: BlockRemoved, BlockHashes: hs, Medium: TRTLLMLevelMedium(l),
						GroupIdx: group, SpecKind: kind, SlidingWindow: window})
				}
			}
		case "updated":
			if !e.HasLevel || e.OldLevel == e.NewLevel {
				st.Ignored++
				continue
			}
			h := []uint64{e.BlockHash}
			c.setLevel(rank, e.BlockHash, e.NewLevel)
			out[rank] = append(out[rank],
				Event{Kind: BlockStored, BlockHashes: h, Medium: TRTLLMLevelMedium(e.NewLevel), GroupIdx: group, SpecKind: kind, SlidingWindow: window},
				Event{Kind: BlockRemoved, BlockHashes: h, Medium: TRTLLMLevelMedium(e.OldLevel), GroupIdx: group, SpecKind: kind, SlidingWindow: window})
		default:
			st.Ignored++
		}
	}
	return out, st
}

func (c *TRTLLMConverter) stored(dst []Event, rank int, e *TRTLLMEvent, group int, kind string, window int, st *TRTLLMStats) []Event {
	parent, hasParent := e.ParentHash, e.HasParent
	var cur *Event
	for j := range e.Blocks {
		b := &e.Blocks[j]
		if b.ExtraIDs {
			st.ExtraIDBlocks += len(e.Blocks) - j
			break
		}
		medium := TRTLLMLevelMedium(b.CacheLevel)
		if cur == nil || cur.Medium != medium || len(b.Tokens) != cur.BlockSize {
			dst = append(dst, Event{Kind: BlockStored, ParentHash: parent, HasParent: hasParent,
				BlockSize: len(b.Tokens), Medium: medium, GroupIdx: group, SpecKind: kind, SlidingWindow: window})
			cur = &dst[len(dst)-1]
		}
		cur.BlockHashes = append(cur.BlockHashes, b.Hash)
		c.setLevel(rank, b.Hash, b.CacheLevel)
		cur.TokenIDs = append(cur.TokenIDs, b.Tokens...)
		parent, hasParent = b.Hash, true
	}
	return dst
}

// AppendTRTLLMJSON appends evs as trtllm-serve's POST /kv_cache_events
// returns them: KVCacheEventSerializer's dicts in its key order, rendered
// by Starlette's JSONResponse (compact separators). A level move's
// priority diff is written as 35 → 35, TensorRT-LLM's default retention
// priority. For the simulator (kvsim --engine trtllm).
func AppendTRTLLMJSON(dst []byte, evs []TRTLLMEvent) []byte {
	dst = append(dst, '[')
	for i := range evs {
		if i > 0 {
			dst = append(dst, ","...)
		}
		e := &evs[i]
		dst = append(dst, `{"event_id":`...)
		dst = strconv.AppendUint(dst, e.EventID, 10)
		dst = append(dst, `,"data":`...)
		switch e.Type {
		case "created":
			dst = append(dst, `{"type":"created","num_blocks_per_cache_level":[`...)
			for j, n := range e.BlocksPerLevel {
				if j > 0 {
					dst = append(dst, ","...)
				}
				dst = strconv.AppendInt(dst, int64(n), 10)
			}
			dst = append(dst, "]}"...)
		case "stored":
			dst = append(dst, `{"type":"stored","parent_hash":`...)
			if e.HasParent {
				dst = strconv.AppendUint(dst, e.ParentHash, 10)
			} else {
				dst = append(dst, "null"...)
			}
			dst = append(dst, `,"blocks":[`...)
			for j := range e.Blocks {
				b := &e.Blocks[j]
				if j > 0 {
					dst = append(dst, ","...)
				}
				dst = append(dst, `{"type":"stored_block","block_hash":`...)
				dst = strconv.AppendUint(dst, b.Hash, 10)
				dst = append(dst, `,"tokens":[`...)
				for k, t := range b.Tokens {
					if k > 0 {
						dst = append(dst, ","...)
					}
					dst = append(dst, `{"type":"unique_token","token_id":`...)
					dst = strconv.AppendUint(dst, uint64(t), 10)
					dst = append(dst, `,"token_extra_id":0}`...)
				}
				dst = append(dst, `],"cache_level":`...)
				dst = strconv.AppendInt(dst, int64(b.CacheLevel), 10)
				dst = append(dst, `,"priority":`...)
				dst = strconv.AppendInt(dst, int64(b.Priority), 10)
				dst = append(dst, '}')
			}
			dst = append(dst, "]}"...)
		case "removed":
			dst = append(dst, `{"type":"removed","block_hashes":[`...)
			for j, h := range e.Hashes {
				if j > 0 {
					dst = append(dst, ","...)
				}
				dst = strconv.AppendUint(dst, h, 10)
			}
			dst = append(dst, "]}"...)
		case "updated":
			dst = append(dst, `{"type":"updated","block_hash":`...)
			dst = strconv.AppendUint(dst, e.BlockHash, 10)
			dst = append(dst, `,"cache_level":{"type":"event_diff","new_value":`...)
			dst = strconv.AppendInt(dst, int64(e.NewLevel), 10)
			dst = append(dst, `,"old_value":`...)
			dst = strconv.AppendInt(dst, int64(e.OldLevel), 10)
			dst = append(dst, `},"priority":{"type":"event_diff","new_value":35,"old_value":35}}`...)
		default:
			dst = append(dst, `{"type":`...)
			dst = strconv.AppendQuote(dst, e.Type)
			dst = append(dst, '}')
		}
		dst = append(dst, `,"window_size":`...)
		dst = strconv.AppendInt(dst, int64(e.WindowSize), 10)
		if e.HasDPRank {
			dst = append(dst, `,"attention_dp_rank":`...)
			dst = strconv.AppendInt(dst, int64(e.DPRank), 10)
		}
		dst = append(dst, '}')
	}
	return append(dst, ']')
}
