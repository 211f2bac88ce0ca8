package events

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Encode appends the msgpack EventBatch for b to dst, with events in the
// given encoding. Events (and the batch) that carry a recorded layout of
// that encoding (from Decode) are written exactly as they were received;
// the rest take the form current vLLM sends:
//
//   - the batch: [ts float64, events, data_parallel_rank or nil];
//   - array events: ["BlockStored", block_hashes, parent_block_hash,
//     token_ids, block_size, lora_id, medium, lora_name] followed by
//     extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
//     up to the last one that is set (msgspec omit_defaults drops trailing
//     defaults); ["BlockRemoved", block_hashes, medium(, group_idx)];
//     ["AllBlocksCleared"];
//   - map events: the same fields by name, "type" first; lora_id, medium
//     and lora_name are always present (nil when unset), group_idx always,
//     extra_keys and the spec fields only when set.
//
// Integers are written in their smallest form; unset optional values as
// nil. When CacheSalt is set and ExtraKeys is nil, extra_keys is synthesised
// the way vLLM builds it (the LoRA name, if any, on every block, the salt on
// block 0 when the event has no parent).
func Encode(dst []byte, b Batch, enc Encoding) ([]byte, error) {
	if enc != EncodingArray && enc != EncodingMap {
		return dst, fmt.Errorf("%w: %d", ErrEncoding, uint8(enc))
	}
	for i := range b.Events {
		if err := checkEvent(&b.Events[i]); err != nil {
			return dst, fmt.Errorf("event %d: %w", i, err)
		}
	}
	l := b.Layout
	if !batchLayoutUsable(l, b.HasDPRank) {
		l = BatchLayout{N: 3}
	}
	if l.Map {
		dst = appendMapHeader(dst, int(l.N))
		for i := 0; i < int(l.N); i++ {
			switch (l.Order >> (2 * i)) & 3 {
			case 0:
				dst = appendStr(dst, "ts")
				dst = appendTS(dst, b.TS, l.TSFloat32)
			case 1:
				dst = appendStr(dst, "events")
				dst = appendEvents(dst, b.Events, enc)
			default:
				dst = appendStr(dst, "data_parallel_rank")
				dst = appendRank(dst, b)
			}
		}
		return dst, nil
	}
	n := min(int(l.N), 3)
	dst = appendArrayHeader(dst, n)
	dst = appendTS(dst, b.TS, l.TSFloat32)
	dst = appendEvents(dst, b.Events, enc)
	if n == 3 {
		dst = appendRank(dst, b)
	}
	return dst, nil
}

// batchLayoutUsable reports whether a recorded envelope layout has room for
// ts, events and (when set) the rank.
func batchLayoutUsable(l BatchLayout, hasRank bool) bool {
	if l.N == 0 {
		return false
	}
	if !l.Map {
		return l.N >= 2 && (!hasRank || l.N >= 3)
	}
	var have [3]bool
	for i := 0; i < int(l.N); i++ {
		have[(l.Order>>(2*i))&3%3] = true
	}
	return have[0] && have[1] && (!hasRank || have[2])
}

func checkEvent(e *Event) error {
	if kindFields(e.Kind) == nil {
		return fmt.Errorf("%w: kind %d", ErrInvalidEvent, e.Kind)
	}
	if e.BlockSize < 0 || e.GroupIdx < 0 || e.SlidingWindow < 0 {
		return fmt.Errorf("%w: negative block_size, group_idx or sliding window", ErrInvalidEvent)
	}
	if len(e.ExtraKeys) > 0 {
		r := reader{b: e.ExtraKeys}
		if err := r.skip(); err != nil || r.remaining() != 0 {
			return fmt.Errorf("%w: ExtraKeys is not one msgpack value", ErrInvalidEvent)
		}
	}
	return nil
}

func appendTS(dst []byte, ts float64, f32 bool) []byte {
	if f32 {
		dst = append(dst, 0xca)
		return binary.BigEndian.AppendUint32(dst, math.Float32bits(float32(ts)))
	}
	dst = append(dst, 0xcb)
	return binary.BigEndian.AppendUint64(dst, math.Float64bits(ts))
}

func appendRank(dst []byte, b Batch) []byte {
	if !b.HasDPRank {
		return append(dst, 0xc0)
	}
	return appendInt(dst, int64(b.DPRank))
}

func appendEvents(dst []byte, evs []Event, enc Encoding) []byte {
	dst = appendArrayHeader(dst, len(evs))
	for i := range evs {
		dst = appendEvent(dst, &evs[i], enc)
	}
	return dst
}

// setFields is the set of fields whose value differs from the zero value,
// i.e. that a layout must be able to carry.
func setFields(e *Event) uint16 {
	var m uint16
	set := func(f int, ok bool) {
		if ok {
			m |= 1 << f
		}
	}
	set(fHashes, len(e.BlockHashes) > 0)
	set(fParent, e.HasParent)
	set(fTokens, len(e.TokenIDs) > 0)
	set(fBlockSize, e.BlockSize != 0)
	set(fLoraID, e.HasLoraID)
	set(fMedium, e.Medium != "")
	set(fLoraName, e.LoraName != "")
	set(fExtraKeys, len(e.ExtraKeys) > 0 || e.CacheSalt != "")
	set(fGroupIdx, e.GroupIdx != 0)
	set(fSpecKind, e.SpecKind != "")
	set(fSlidingWindow, e.SlidingWindow != 0)
	return m & kindMask(e.Kind)
}

// usableLayout reports whether e's recorded layout can write e in enc
// without dropping a field it carries.
func usableLayout(e *Event, enc Encoding) bool {
	l := &e.Layout
	if l.Encoding != enc || l.N == 0 {
		return false
	}
	var covered uint16
	if enc == EncodingArray {
		fields := kindFields(e.Kind)
		for i := 0; i < int(l.N) && i < len(fields); i++ {
			covered |= 1 << fields[i]
		}
	} else {
		for i := 0; i < int(l.N); i++ {
			covered |= 1 << ((l.Order >> (4 * i)) & 0xf)
		}
	}
	// CacheSalt alone cannot be written back into raw ExtraKeys that lack
	// it; a decoded event's salt came from its ExtraKeys, so that is fine.
	need := setFields(e)
	if len(e.ExtraKeys) > 0 {
		need |= 1 << fExtraKeys
	}
	return need&^covered == 0 && covered&(1<<fType) != 0
}

// defaultFields lists the fields of the modern form of e in enc.
func defaultFields(e *Event, enc Encoding, buf *[nFields]uint8) []uint8 {
	out := buf[:0]
	set := setFields(e)
	switch e.Kind {
	case BlockStored:
		out = append(out, storedFields[:8]...)
		if enc == EncodingArray {
			last := 7
			for i := 8; i < len(storedFields); i++ {
				if set&(1<<storedFields[i]) != 0 {
					last = i
				}
			}
			out = append(out, storedFields[8:last+1]...)
		} else {
			for _, f := range storedFields[8:] {
				if f == fGroupIdx || set&(1<<f) != 0 {
					out = append(out, f)
				}
			}
		}
	case BlockRemoved:
		out = append(out, removedFields[:3]...)
		if enc == EncodingMap || e.GroupIdx != 0 {
			out = append(out, fGroupIdx)
		}
	default:
		out = append(out, fType)
	}
	return out
}

func appendEvent(dst []byte, e *Event, enc Encoding) []byte {
	var buf [nFields]uint8
	var fields []uint8
	var nilBits uint16
	var flags uint8
	if usableLayout(e, enc) {
		l := &e.Layout
		if enc == EncodingArray {
			fields = kindFields(e.Kind)[:min(int(l.N), len(kindFields(e.Kind)))]
		} else {
			fields = buf[:0]
			for i := 0; i < int(l.N); i++ {
				fields = append(fields, uint8((l.Order>>(4*i))&0xf))
			}
		}
		nilBits, flags = l.Nil, l.Flags
	} else {
		fields = defaultFields(e, enc, &buf)
		// Unset optional values are nil, as msgspec writes None.
		nilBits = 1<<fParent | 1<<fLoraID | 1<<fMedium | 1<<fLoraName |
			1<<fExtraKeys | 1<<fSpecKind | 1<<fSlidingWindow
	}
	if enc == EncodingArray {
		dst = appendArrayHeader(dst, len(fields))
	} else {
		dst = appendMapHeader(dst, len(fields))
	}
	for _, f := range fields {
		if enc == EncodingMap {
			dst = appendStr(dst, fieldNames[f])
		}
		dst = appendField(dst, e, f, nilBits, flags)
	}
	return dst
}

func appendField(dst []byte, e *Event, f uint8, nilBits uint16, flags uint8) []byte {
	isNil := nilBits&(1<<f) != 0
	switch f {
	case fType:
		return appendStr(dst, e.Kind.String())
	case fHashes:
		if len(e.BlockHashes) == 0 && isNil {
			return append(dst, 0xc0)
		}
		dst = appendArrayHeader(dst, len(e.BlockHashes))
		for _, h := range e.BlockHashes {
			dst = appendHash(dst, h, flags)
		}
		return dst
	case fParent:
		if !e.HasParent && isNil {
			return append(dst, 0xc0)
		}
		return appendHash(dst, e.ParentHash, flags)
	case fTokens:
		if len(e.TokenIDs) == 0 && isNil {
			return append(dst, 0xc0)
		}
		dst = appendArrayHeader(dst, len(e.TokenIDs))
		if flags&FlagTokenFixed32 != 0 {
			for _, t := range e.TokenIDs {
				dst = append(dst, 0xce, byte(t>>24), byte(t>>16), byte(t>>8), byte(t))
			}
			return dst
		}
		for _, t := range e.TokenIDs {
			dst = appendUint(dst, uint64(t))
		}
		return dst
	case fBlockSize:
		return appendOptInt(dst, int64(e.BlockSize), isNil)
	case fLoraID:
		if !e.HasLoraID {
			return append(dst, 0xc0)
		}
		return appendInt(dst, e.LoraID)
	case fMedium:
		return appendOptStr(dst, e.Medium, isNil)
	case fLoraName:
		return appendOptStr(dst, e.LoraName, isNil)
	case fExtraKeys:
		if len(e.ExtraKeys) > 0 {
			return append(dst, e.ExtraKeys...)
		}
		if e.CacheSalt != "" {
			return appendExtraKeys(dst, e)
		}
		return append(dst, 0xc0)
	case fGroupIdx:
		return appendOptInt(dst, int64(e.GroupIdx), isNil)
	case fSpecKind:
		return appendOptStr(dst, e.SpecKind, isNil)
	case fSlidingWindow:
		return appendOptInt(dst, int64(e.SlidingWindow), isNil)
	}
	return append(dst, 0xc0)
}

// appendExtraKeys writes extra_keys as vLLM builds them: per block, a tuple
// of the LoRA name and, on the request's block 0, the cache salt; nil for a
// block with neither.
func appendExtraKeys(dst []byte, e *Event) []byte {
	dst = appendArrayHeader(dst, len(e.BlockHashes))
	for i := range e.BlockHashes {
		salt := i == 0 && !e.HasParent && e.CacheSalt != ""
		n := 0
		if e.LoraName != "" {
			n++
		}
		if salt {
			n++
		}
		if n == 0 {
			dst = append(dst, 0xc0)
			continue
		}
		dst = appendArrayHeader(dst, n)
		if e.LoraName != "" {
			dst = appendStr(dst, e.LoraName)
		}
		if salt {
			dst = appendStr(dst, e.CacheSalt)
		}
	}
	return dst
}

func appendHash(dst []byte, h uint64, flags uint8) []byte {
	switch {
	case flags&FlagHashBin != 0:
		dst = append(dst, 0xc4, 8)
		return binary.BigEndian.AppendUint64(dst, h)
	case flags&FlagHashFixed64 != 0:
		dst = append(dst, 0xcf)
		return binary.BigEndian.AppendUint64(dst, h)
	}
	return appendUint(dst, h)
}

func appendOptInt(dst []byte, v int64, isNil bool) []byte {
	if v == 0 && isNil {
		return append(dst, 0xc0)
	}
	return appendInt(dst, v)
}

func appendOptStr(dst []byte, s string, isNil bool) []byte {
	if s == "" && isNil {
		return append(dst, 0xc0)
	}
	return appendStr(dst, s)
}

func appendArrayHeader(dst []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(dst, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(dst, 0xdc, byte(n>>8), byte(n))
	}
	return append(dst, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
}

func appendMapHeader(dst []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(dst, 0x80|byte(n))
	case n <= math.MaxUint16:
		return append(dst, 0xde, byte(n>>8), byte(n))
	}
	return append(dst, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
}

func appendStr(dst []byte, s string) []byte {
	n := len(s)
	switch {
	case n <= 31:
		dst = append(dst, 0xa0|byte(n))
	case n <= math.MaxUint8:
		dst = append(dst, 0xd9, byte(n))
	case n <= math.MaxUint16:
		dst = append(dst, 0xda, byte(n>>8), byte(n))
	default:
		dst = append(dst, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(dst, s...)
}

// appendUint writes v in its smallest msgpack form.
func appendUint(dst []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(dst, byte(v))
	case v <= math.MaxUint8:
		return append(dst, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(dst, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(dst, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	dst = append(dst, 0xcf)
	return binary.BigEndian.AppendUint64(dst, v)
}

// appendInt writes v in its smallest msgpack form (unsigned markers for
// non-negative values, as msgspec does).
func appendInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return appendUint(dst, uint64(v))
	}
	switch {
	case v >= -32:
		return append(dst, byte(v))
	case v >= math.MinInt8:
		return append(dst, 0xd0, byte(v))
	case v >= math.MinInt16:
		return append(dst, 0xd1, byte(v>>8), byte(v))
	case v >= math.MinInt32:
		return append(dst, 0xd2, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	dst = append(dst, 0xd3)
	return binary.BigEndian.AppendUint64(dst, uint64(v))
}
