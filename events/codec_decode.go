package events

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"unsafe"
)

// Decode parses one vLLM EventBatch payload (msgpack). It accepts both event
// encodings, detected per event: tagged positional arrays of any length
// (missing trailing fields take their defaults, extra ones are skipped) and
// tagged maps (missing keys take their defaults, unknown keys are skipped).
// The batch may be [ts, events], [ts, events, rank|nil] or a map with those
// keys. Block hashes may be integers (negative ones, from engines that used
// Python's hash(), are taken as two's complement) or bytes, of which the last
// min(8, len) are read big-endian (an empty bin is an error). A parent hash
// of nil or 0 means no parent.
//
// Events of unknown type are skipped and counted in Batch.Unknown; events of
// non-full-attention groups are kept (see Event.FullAttention). An event
// that is whole msgpack but cannot be read (a field of an unexpected type
// or out of range, no tag) is skipped and counted in Batch.Invalid, and the
// rest of the batch is kept. Anything else that does not fit (truncation,
// an envelope of the wrong shape) returns an error wrapping ErrMalformed;
// no input panics, and no allocation exceeds a small multiple of
// len(payload).
//
// The returned batch does not alias payload.
func Decode(payload []byte) (Batch, error) {
	d := decoder{r: reader{b: payload}}
	b, err := d.batch()
	if err != nil {
		return Batch{}, fmt.Errorf("%w (at byte %d)", err, d.r.off)
	}
	return b, nil
}

// Decoder decodes batches as Decode does, into buffers it keeps from one
// call to the next: once they have grown to a stream's usual batch, a
// batch decodes without allocating (Decode allocates its events, and each
// event's block hashes and token ids). The batch a call returns, its
// events and their BlockHashes and TokenIDs are valid only until the next
// call; ExtraKeys and strings are not reused and stay valid. The zero
// value is ready to use; a Decoder is not safe for concurrent use.
//
// With Retain set, nothing is reused: each batch's events, hashes and
// tokens are carved from chunks of retainChunk bytes shared with the
// batches decoded before and after it, and stay valid for as long as the
// caller keeps them (a chunk lives while any batch carved from it does).
// A stream of small batches then costs an allocation per chunk rather
// than several per batch; a caller that drops batches in the order it
// decoded them (kvbridge, at each ack) frees chunks whole.
type Decoder struct {
	d decoder
	// Retain keeps every batch valid after the next call (see above).
	// Set it before the first Decode and leave it.
	Retain bool
	// JoinRemovals, when above 0, joins a run of consecutive one-block
	// BlockRemoved map events of the form vLLM writes per evicted block
	// (one hash, medium "GPU", the same group_idx; see removal1) into one
	// BlockRemoved event of up to JoinRemovals hashes, in their order. An
	// index applies the joined event as it applies the run (each hash is
	// removed in turn; every other field is alike), and a full cache's
	// step then decodes and applies one event where it had one per
	// evicted block. The joined event keeps the first event's layout, so
	// Encode does not give back the engine's bytes: for a consumer that
	// applies batches, not one that re-publishes them.
	JoinRemovals int
}

// retainChunk is the size of a retaining Decoder's chunks, per kind
// (events, hashes, tokens): many of a stream's usual batches (vLLM's are
// hundreds of bytes to a few KiB decoded) share one allocation, and a
// batch kept alone (its neighbours dropped) holds at most this much
// beside its own data. A batch larger than a chunk gets its own.
const retainChunk = 16 << 10

// Decode parses payload as the package-level Decode does (same results,
// same errors), into the decoder's buffers.
func (dec *Decoder) Decode(payload []byte) (Batch, error) {
	d := &dec.d
	d.r = reader{b: payload}
	d.reuse = true
	d.retain = dec.Retain
	d.join = dec.JoinRemovals
	d.lastR1, d.joined, d.r1 = false, false, false // after a batch that failed
	if !d.retain {
		d.hashUsed, d.tokUsed = 0, 0
		d.trim(len(payload))
	}
	b, err := d.batch()
	off := d.r.off
	d.r = reader{} // the payload is not kept
	if err != nil {
		return Batch{}, fmt.Errorf("%w (at byte %d)", err, off)
	}
	return b, nil
}

// decoderKeep bounds (bytes) a Decoder buffer kept for a batch that can
// use at most a quarter of it: a stream's usual batches (a few dozen
// events of 16 blocks: ~100 KiB of events, 256 tokens and 16 hashes
// each) stay far below it and keep their buffers, and one huge batch
// (a long prompt stored at once) does not pin megabytes per shard for
// the stream's life.
const decoderKeep = 1 << 20

// eventBytes is an Event's size in the event buffer.
const eventBytes = int(unsafe.Sizeof(Event{}))

// trim prepares the reused buffers for a batch of payloadLen bytes. The
// previous batch's events are cleared (its slots left past this batch's
// would otherwise pin their hashes, tokens and strings, old buffers
// included). A buffer over decoderKeep that is more than four times what
// the batch can need (every hash, token and event takes at least one,
// one and minEventBytes bytes of payload) is dropped: a steady stream of
// large batches keeps its buffers, and a Decoder does not allocate
// for batches like the one before.
func (d *decoder) trim(payloadLen int) {
	clear(d.evBuf[:d.evUsed])
	d.evUsed = 0
	if len(d.hashBuf)*8 > decoderKeep && len(d.hashBuf) > 4*payloadLen {
		d.hashBuf = nil
	}
	if len(d.tokBuf)*4 > decoderKeep && len(d.tokBuf) > 4*payloadLen {
		d.tokBuf = nil
	}
	if cap(d.evBuf)*eventBytes > decoderKeep && cap(d.evBuf) > 4*(payloadLen/minEventBytes+1) {
		d.evBuf = nil
	}
}

type decoder struct {
	r reader
	// lastLora caches the previous LoRA name so a batch of events for one
	// adapter allocates it once.
	lastLora string

	// reuse (a Decoder): events, block hashes and token ids are carved
	// out of the buffers below, kept across batches, instead of allocated.
	reuse             bool
	retain            bool // Decoder.Retain: carve, never reuse
	evBuf             []Event
	evUsed            int // events of the last batch in evBuf
	hashBuf           []uint64
	tokBuf            []uint32
	hashUsed, tokUsed int

	// join is Decoder.JoinRemovals. evs is the batch's events while
	// events decodes them; lastR1: the last event kept was decoded by
	// removal1 (so its hashes end at hashUsed); joined: removal1 appended
	// the event it read to that one instead of decoding it into its slot.
	// r1: removal1 decoded the event just read into its slot.
	join               int
	evs                []Event
	lastR1, joined, r1 bool
}

// hashSlice returns n block hashes' room: from the reused buffer with a
// Decoder, else newly allocated. A buffer too small for the rest of the
// batch is replaced by a larger one; events decoded before keep the old
// one (it stays alive through them until the next batch).
func (d *decoder) hashSlice(n int) []uint64 {
	if !d.reuse {
		return make([]uint64, n)
	}
	if n == 0 {
		return []uint64{} // as make: empty, not nil
	}
	if d.hashUsed+n > len(d.hashBuf) {
		size := max(2*len(d.hashBuf), n, 64)
		if d.retain {
			size = max(n, retainChunk/8)
		}
		d.hashBuf, d.hashUsed = make([]uint64, size), 0
	}
	s := d.hashBuf[d.hashUsed : d.hashUsed+n : d.hashUsed+n]
	d.hashUsed += n
	return s
}

// tokSlice is hashSlice for token ids.
func (d *decoder) tokSlice(n int) []uint32 {
	if !d.reuse {
		return make([]uint32, n)
	}
	if n == 0 {
		return []uint32{}
	}
	if d.tokUsed+n > len(d.tokBuf) {
		size := max(2*len(d.tokBuf), n, 1024)
		if d.retain {
			size = max(n, retainChunk/4)
		}
		d.tokBuf, d.tokUsed = make([]uint32, size), 0
	}
	s := d.tokBuf[d.tokUsed : d.tokUsed+n : d.tokUsed+n]
	d.tokUsed += n
	return s
}

func (d *decoder) batch() (Batch, error) {
	var b Batch
	t, err := d.r.peek()
	if err != nil {
		return b, err
	}
	haveTS, haveEvents := false, false
	switch t {
	case mpArray:
		n, err := d.r.arrayHeader(1)
		if err != nil {
			return b, err
		}
		if n < 2 {
			return b, fmt.Errorf("%w: batch has %d elements, want [ts, events(, rank)]", ErrMalformed, n)
		}
		b.Layout.N = clampU8(n)
		for i := 0; i < n; i++ {
			switch i {
			case 0:
				err = d.ts(&b)
			case 1:
				err = d.events(&b)
			case 2:
				err = d.rank(&b)
			default:
				err = d.r.skip()
			}
			if err != nil {
				return b, err
			}
		}
		haveTS, haveEvents = true, true
	case mpMap:
		n, err := d.r.mapHeader()
		if err != nil {
			return b, err
		}
		b.Layout.Map = true
		for i := 0; i < n; i++ {
			key, isStr, err := d.key()
			if err != nil {
				return b, err
			}
			id := -1
			if isStr {
				switch string(key) {
				case "ts":
					id, haveTS, err = 0, true, d.ts(&b)
				case "events":
					id, haveEvents, err = 1, true, d.events(&b)
				case "data_parallel_rank", "attn_dp_rank":
					// attn_dp_rank: SGLang's name for the field (see sglang.go).
					id, err = 2, d.rank(&b)
				}
			}
			if id < 0 {
				err = d.r.skip()
			} else if b.Layout.N < 4 {
				b.Layout.Order |= uint8(id) << (2 * b.Layout.N)
				b.Layout.N++
			}
			if err != nil {
				return b, err
			}
		}
	default:
		return b, fmt.Errorf("%w: batch is a %s, want array or map", ErrMalformed, t)
	}
	if !haveTS || !haveEvents {
		return b, fmt.Errorf("%w: batch lacks ts or events", ErrMalformed)
	}
	if d.r.remaining() != 0 {
		return b, fmt.Errorf("%w: %d trailing bytes after the batch", ErrMalformed, d.r.remaining())
	}
	if b.Encoding == 0 {
		// No event told us: an empty batch reads the same either way.
		b.Encoding = EncodingArray
	}
	return b, nil
}

// key reads a map key; non-string keys are reported so the caller skips them.
func (d *decoder) key() ([]byte, bool, error) {
	t, err := d.r.peek()
	if err != nil {
		return nil, false, err
	}
	if t != mpStr {
		return nil, false, d.r.skip()
	}
	if c := d.r.b[d.r.off]; c >= 0xa0 && c <= 0xbf && d.r.off+1+int(c&0x1f) <= len(d.r.b) {
		// A fixstr, as every key engines write: read in place.
		n := d.r.off + 1 + int(c&0x1f)
		k := d.r.b[d.r.off+1 : n : n]
		d.r.off = n
		return k, true, nil
	}
	k, err := d.r.readStr()
	return k, true, err
}

func (d *decoder) ts(b *Batch) error {
	f, f32, err := d.r.readFloat()
	if err != nil {
		return fmt.Errorf("ts: %w", err)
	}
	b.TS, b.Layout.TSFloat32 = f, f32
	return nil
}

func (d *decoder) rank(b *Batch) error {
	if d.r.readNil() {
		b.Layout.RankNil = true
		return nil
	}
	v, err := d.int("data_parallel_rank", 0, math.MaxInt32)
	if err != nil {
		return fmt.Errorf("data_parallel_rank: %w", err)
	}
	b.DPRank, b.HasDPRank = int(v), true
	return nil
}

// minEventBytes is the smallest encoding of a known event
// (["BlockStored"]: a fixarray header and a 12-byte fixstr); it bounds the
// capacity hint taken from a claimed event count.
const minEventBytes = 13

func (d *decoder) events(b *Batch) error {
	n, err := d.r.arrayHeader(1)
	if err != nil {
		return fmt.Errorf("events: %w", err)
	}
	hint := min(n, d.r.remaining()/minEventBytes, 1024)
	if d.retain {
		// Carved after the batches before; an append past hint (events
		// the payload's size did not promise) moves them out, unshared.
		if d.evBuf == nil || cap(d.evBuf)-d.evUsed < hint {
			d.evBuf, d.evUsed = make([]Event, 0, max(hint, retainChunk/eventBytes)), 0
		}
		b.Events = d.evBuf[d.evUsed : d.evUsed : d.evUsed+hint]
		d.evUsed += hint
	} else if d.reuse {
		if cap(d.evBuf) < hint {
			d.evBuf = make([]Event, 0, hint)
		}
		b.Events = d.evBuf[:0]
		defer func() { d.evBuf, d.evUsed = b.Events[:0], len(b.Events) }()
	} else {
		b.Events = make([]Event, 0, hint)
	}
	for i := 0; i < n; i++ {
		// Decoded in place, into the slot after the batch's events: it is
		// zero (never used, or cleared when a batch or an event before
		// left it), and an event that is not kept leaves it zero again.
		if len(b.Events) == cap(b.Events) {
			b.Events = slices.Grow(b.Events, 1)
		}
		e := &b.Events[:len(b.Events)+1][len(b.Events)]
		start := d.r.off
		d.evs = b.Events // the header, not its address: b would escape
		known, enc, err := d.event(e)
		if d.joined {
			// Appended to the event before: the slot stays free (and
			// zero: removal1 wrote only what mapEvent and event set).
			d.joined = false
			e.Kind, e.Layout = 0, EventLayout{}
			continue
		}
		r1 := d.r1
		d.r1, d.lastR1 = false, false
		if err != nil || !known {
			kind := e.Kind
			*e = Event{}
			if err != nil {
				// An event that cannot be read costs only itself when its
				// extent can still be found: skip it whole and count it.
				if errors.Is(err, errTruncated) {
					return fmt.Errorf("event %d: %w", i, err)
				}
				d.r.off = start
				if d.r.skip() != nil {
					return fmt.Errorf("event %d: %w", i, err)
				}
				if b.Invalid == 0 {
					b.InvalidErr = fmt.Errorf("event %d: %w", i, err)
				}
				b.Invalid++
				if kind == BlockRemoved || kind == AllBlocksCleared {
					b.InvalidRemovals++
				}
				continue
			}
		}
		if b.Encoding == 0 {
			b.Encoding = enc
		}
		if !known {
			b.Unknown++
			continue
		}
		b.Events = b.Events[:len(b.Events)+1]
		d.lastR1 = r1
	}
	d.evs, d.lastR1 = nil, false
	return nil
}

// kindOf maps a tag to a Kind (0 for an unknown tag).
func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return 0
}

// event decodes one event into e. known is false for an unknown tag (the
// event has been skipped).
func (d *decoder) event(e *Event) (known bool, enc Encoding, err error) {
	t, err := d.r.peek()
	if err != nil {
		return false, 0, err
	}
	var st fieldState
	switch t {
	case mpArray:
		enc = EncodingArray
		known, err = d.arrayEvent(e, &st)
	case mpMap:
		enc = EncodingMap
		known, err = d.mapEvent(e, &st)
	default:
		return false, 0, fmt.Errorf("%w: event is a %s, want array or map", ErrMalformed, t)
	}
	if err != nil || !known {
		return known, enc, err
	}
	e.Layout.Encoding = enc
	if len(st.extra) > 0 {
		e.ExtraKeys = bytes.Clone(st.extra)
		e.CacheSalt = cacheSalt(st.extra, e)
	}
	if st.salt != nil && e.CacheSalt == "" && !e.HasParent {
		// SGLang's salt (see sglangMetadata): kept as vLLM would carry it,
		// in extra_keys on block 0, so that Encode writes it back.
		e.CacheSalt = string(st.salt)
		if e.ExtraKeys == nil {
			e.ExtraKeys = appendExtraKeys(nil, e)
		}
	}
	return true, enc, nil
}

// sglangMetadata reads SGLang's BlockStored metadata map
// (sgl-project/sglang#30827, #37482: {"cache_salt": str, "session_id": str}),
// which SGLang writes as the 8th array element, where vLLM has lora_name,
// or under the "metadata" key. Only cache_salt is kept; other keys are
// skipped.
func (d *decoder) sglangMetadata(st *fieldState) error {
	n, err := d.r.mapHeader()
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		key, isStr, err := d.key()
		if err != nil {
			return err
		}
		if isStr && string(key) == "cache_salt" {
			err = d.sglangSalt(st)
		} else {
			err = d.r.skip()
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// sglangSalt reads an SGLang cache_salt value: a string, or nil for none.
func (d *decoder) sglangSalt(st *fieldState) error {
	if d.r.readNil() {
		return nil
	}
	s, err := d.r.readStr()
	if err != nil {
		return fmt.Errorf("cache_salt: %w", err)
	}
	if len(s) > 0 {
		st.salt = s
	}
	return nil
}

func (d *decoder) tag() (Kind, error) {
	tag, err := d.r.readStr()
	if err != nil {
		return 0, fmt.Errorf("event tag: %w", err)
	}
	return kindOf(tag), nil
}

func (d *decoder) arrayEvent(e *Event, st *fieldState) (bool, error) {
	n, err := d.r.arrayHeader(1)
	if err != nil {
		return false, err
	}
	if n == 0 {
		return false, fmt.Errorf("%w: empty event array", ErrMalformed)
	}
	k, err := d.tag()
	if err != nil {
		return false, err
	}
	if k == 0 {
		for i := 1; i < n; i++ {
			if err := d.r.skip(); err != nil {
				return false, err
			}
		}
		return false, nil
	}
	e.Kind = k
	e.Layout.N = clampU8(n)
	fields := kindFields(k)
	for i := 1; i < n; i++ {
		if i >= len(fields) {
			if err := d.r.skip(); err != nil {
				return false, err
			}
			continue
		}
		if err := d.field(e, fields[i], st); err != nil {
			return false, err
		}
	}
	st.finish(e)
	return true, nil
}

func (d *decoder) mapEvent(e *Event, st *fieldState) (bool, error) {
	n, err := d.r.mapHeader()
	if err != nil {
		return false, err
	}
	start := d.r.off
	// The tag normally comes first (msgspec writes it first): then it is
	// read once, and the fields after it follow. Otherwise find it in a
	// first pass, so fields are read knowing the event type.
	first := 0
	k, found := Kind(0), false
	if b := d.r.b[start:]; n > 0 && len(b) > 5 && string(b[:5]) == "\xa4type" {
		d.r.off += 5
		if k, err = d.tag(); err != nil {
			return false, err
		}
		found, first = true, 1
	} else if k, found, err = d.findTag(n); err != nil {
		return false, err
	} else {
		d.r.off = start
	}
	if !found {
		return false, fmt.Errorf("%w: event map has no \"type\"", ErrMalformed)
	}
	if k == 0 {
		for i := 2 * first; i < 2*n; i++ {
			if err := d.r.skip(); err != nil {
				return false, err
			}
		}
		return false, nil
	}
	e.Kind = k
	if first == 1 {
		e.Layout.N = 1 // fType (0) at position 0 of Order
		if k == BlockRemoved && d.removal1(e, n, st) {
			return true, nil
		}
	}
	mask := kindMasks[k]
	for i := first; i < n; i++ {
		key, isStr, err := d.key()
		if err != nil {
			return false, err
		}
		f := -1
		if isStr {
			f = fieldID(key)
			if f < 0 && k == BlockStored {
				// SGLang's salt, in its metadata map or as a key of its own.
				switch string(key) {
				case "metadata":
					if err := d.sglangMetadata(st); err != nil {
						return false, fmt.Errorf("metadata: %w", err)
					}
					continue
				case "cache_salt":
					if err := d.sglangSalt(st); err != nil {
						return false, err
					}
					continue
				}
			}
		}
		if f < 0 || mask&(1<<f) == 0 {
			if err := d.r.skip(); err != nil {
				return false, err
			}
			continue
		}
		if f == fType {
			if _, err := d.r.readStr(); err != nil {
				return false, err
			}
		} else if err := d.field(e, uint8(f), st); err != nil {
			return false, err
		}
		if e.Layout.N < 16 {
			e.Layout.Order |= uint64(f) << (4 * e.Layout.N)
			e.Layout.N++
		}
	}
	st.finish(e)
	return true, nil
}

// The rest of a one-block BlockRemoved map event after its "type", as
// vLLM writes one per evicted block (msgspec, fields in declaration order):
// block_hashes with one hash, medium "GPU", and in the newest vLLM
// group_idx.
const (
	removal1Hashes = "\xacblock_hashes\x91"
	removal1Medium = "\xa6medium\xa3GPU"
	removal1Group  = "\xa9group_idx"
)

// removal1 decodes the rest of a BlockRemoved map event of n keys whose
// "type" came first, when it is exactly that form (n is 3, or 4 with a
// group_idx in 0..127): the event as the general loop would leave it, read
// without a key look-up per field. It reports whether it did; when not,
// nothing was consumed or recorded. With Decoder.JoinRemovals, an event
// like the one before (also read here, same group) is appended to it
// instead (d.joined), its slot left unused.
func (d *decoder) removal1(e *Event, n int, st *fieldState) bool {
	if n != 3 && n != 4 {
		return false
	}
	start := d.r.off
	b := d.r.b[start:]
	if len(b) < len(removal1Hashes) || string(b[:len(removal1Hashes)]) != removal1Hashes {
		return false
	}
	d.r.off += len(removal1Hashes)
	h, err := d.hash(st)
	rest := d.r.b[d.r.off:]
	group := 0
	ok := err == nil && len(rest) >= len(removal1Medium) && string(rest[:len(removal1Medium)]) == removal1Medium
	if ok && n == 4 {
		g := rest[len(removal1Medium):]
		ok = len(g) > len(removal1Group) && string(g[:len(removal1Group)]) == removal1Group && g[len(removal1Group)] < 0x80
		if ok {
			group = int(g[len(removal1Group)])
		}
	}
	if !ok {
		d.r.off, *st = start, fieldState{}
		return false
	}
	d.r.off += len(removal1Medium)
	if n == 4 {
		d.r.off += len(removal1Group) + 1
	}
	if d.join > 0 && d.lastR1 {
		// The event before was read here too: its hashes end at hashUsed
		// (nothing was carved since). Joined when alike and there is
		// room after them.
		p := &d.evs[len(d.evs)-1]
		if l := len(p.BlockHashes); p.GroupIdx == group && l < d.join && d.hashUsed > 0 && d.hashUsed < len(d.hashBuf) &&
			&d.hashBuf[d.hashUsed-1] == &p.BlockHashes[l-1] {
			d.hashBuf[d.hashUsed] = h
			d.hashUsed++
			p.BlockHashes = d.hashBuf[d.hashUsed-l-1 : d.hashUsed : d.hashUsed]
			p.Layout.Flags |= FlagJoined
			d.joined = true
			return true
		}
	}
	d.r1 = true
	e.BlockHashes = d.hashSlice(1)
	e.BlockHashes[0] = h
	e.Medium, e.GroupIdx = "GPU", group
	e.Layout.Order = fType | fHashes<<4 | fMedium<<8
	if n == 4 {
		e.Layout.Order |= fGroupIdx << 12
	}
	e.Layout.N = uint8(n)
	st.finish(e)
	return true
}

// findTag scans n map entries for "type" and returns its kind.
func (d *decoder) findTag(n int) (Kind, bool, error) {
	for i := 0; i < n; i++ {
		key, isStr, err := d.key()
		if err != nil {
			return 0, false, err
		}
		if isStr && string(key) == "type" {
			k, err := d.tag()
			return k, true, err
		}
		if err := d.r.skip(); err != nil {
			return 0, false, err
		}
	}
	return 0, false, nil
}

// fieldID is the id of a map-era key (-1 for none): a switch, which the
// compiler turns into a search by length and content, where a loop over
// fieldNames compared each key with up to 12 names.
func fieldID(key []byte) int {
	switch string(key) {
	case "type":
		return fType
	case "block_hashes":
		return fHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokens
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoraID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoraName
	case "extra_keys":
		return fExtraKeys
	case "group_idx":
		return fGroupIdx
	case "kv_cache_spec_kind":
		return fSpecKind
	case "kv_cache_spec_sliding_window":
		return fSlidingWindow
	}
	return -1
}

// fieldState accumulates per-event facts that span several fields.
type fieldState struct {
	extra []byte // raw extra_keys, aliasing the payload
	salt  []byte // SGLang's cache_salt (sglangMetadata), aliasing the payload
	// Integer-width observations, turned into layout flags by finish.
	hashInts, hashFixed, hashBin int
	tokens, tokenFixed           int
}

func (st *fieldState) finish(e *Event) {
	if st.hashInts > 0 && st.hashFixed == st.hashInts && st.hashBin == 0 {
		e.Layout.Flags |= FlagHashFixed64
	}
	if st.hashBin > 0 {
		e.Layout.Flags |= FlagHashBin
	}
	if st.tokens > 0 && st.tokenFixed == st.tokens {
		e.Layout.Flags |= FlagTokenFixed32
	}
}

func (d *decoder) field(e *Event, f uint8, st *fieldState) error {
	if d.r.readNil() {
		e.Layout.Nil |= 1 << f
		return nil
	}
	var err error
	switch f {
	case fHashes:
		err = d.hashes(e, st)
	case fParent:
		var h uint64
		h, err = d.hash(st)
		e.ParentHash, e.HasParent = h, h != 0
	case fTokens:
		err = d.tokens(e, st)
	case fBlockSize:
		var v int64
		v, err = d.int("block_size", 0, math.MaxInt32)
		e.BlockSize = int(v)
	case fLoraID:
		e.LoraID, err = d.int("lora_id", math.MinInt64, math.MaxInt64)
		e.HasLoraID = err == nil
	case fMedium:
		e.Medium, err = d.str("medium")
	case fLoraName:
		if t, _ := d.r.peek(); t == mpMap {
			// SGLang's metadata sits where vLLM has lora_name.
			err = d.sglangMetadata(st)
			break
		}
		e.LoraName, err = d.str("lora_name")
	case fExtraKeys:
		start := d.r.off
		err = d.r.skip()
		st.extra = d.r.b[start:d.r.off]
	case fGroupIdx:
		var v int64
		v, err = d.int("group_idx", 0, math.MaxInt32)
		e.GroupIdx = int(v)
	case fSpecKind:
		e.SpecKind, err = d.str("kv_cache_spec_kind")
	case fSlidingWindow:
		var v int64
		v, err = d.int("kv_cache_spec_sliding_window", 0, math.MaxInt32)
		e.SlidingWindow = int(v)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", fieldNames[f], err)
	}
	return nil
}

func (d *decoder) hashes(e *Event, st *fieldState) error {
	n, err := d.r.arrayHeader(1)
	if err != nil {
		return err
	}
	e.BlockHashes = d.hashSlice(n)
	// Fast path for the fixed-width form Go encoders write (0xcf, every
	// capture of a Go bridge's output); hash takes any other form.
	b, off, i := d.r.b, d.r.off, 0
	for ; i < n && off+9 <= len(b) && b[off] == 0xcf; i++ {
		e.BlockHashes[i] = binary.BigEndian.Uint64(b[off+1:])
		off += 9
	}
	d.r.off = off
	st.hashInts += i
	st.hashFixed += i
	for ; i < n; i++ {
		if e.BlockHashes[i], err = d.hash(st); err != nil {
			return fmt.Errorf("[%d]: %w", i, err)
		}
	}
	return nil
}

// hash reads one engine block hash: an integer, or digest bytes of which
// the last min(8, len) are read big-endian (vLLM's maybe_convert_block_hash
// keeps int.from_bytes(digest, "big") & (2**64-1)).
func (d *decoder) hash(st *fieldState) (uint64, error) {
	if d.r.off >= len(d.r.b) {
		return 0, errTruncated
	}
	c := d.r.peekByte()
	switch typeOf(c) {
	case mpInt:
		v, _, err := d.r.readInt()
		st.hashInts++
		if c == 0xcf {
			st.hashFixed++
		}
		return v, err
	case mpBin:
		b, err := d.r.readBin()
		if err != nil {
			return 0, err
		}
		if len(b) == 0 {
			return 0, fmt.Errorf("%w: empty hash bytes", ErrMalformed)
		}
		st.hashBin++
		var v uint64
		for _, x := range b[max(0, len(b)-8):] {
			v = v<<8 | uint64(x)
		}
		return v, nil
	}
	return 0, wrongType("int or bin hash", c)
}

func (d *decoder) tokens(e *Event, st *fieldState) error {
	n, err := d.r.arrayHeader(1)
	if err != nil {
		return err
	}
	e.TokenIDs = d.tokSlice(n)
	// Fast path for the forms engines use: 0xce (Go encoders, every
	// capture) and the compact forms msgspec picks for a vocabulary below
	// 2^32, read with the payload and offset in locals; it stops at the
	// first other form, or where fewer than 5 bytes are left, and readInt
	// takes the rest.
	b, off := d.r.b, d.r.off
	fixed, i := 0, 0
	for ; i < n && off+5 <= len(b); i++ {
		switch c := b[off]; {
		case c <= 0x7f:
			e.TokenIDs[i] = uint32(c)
			off++
			continue
		case c == 0xce:
			e.TokenIDs[i] = uint32(b[off+1])<<24 | uint32(b[off+2])<<16 | uint32(b[off+3])<<8 | uint32(b[off+4])
			off += 5
			fixed++
			continue
		case c == 0xcd:
			e.TokenIDs[i] = uint32(b[off+1])<<8 | uint32(b[off+2])
			off += 3
			continue
		}
		break
	}
	d.r.off = off
	st.tokens += i
	st.tokenFixed += fixed
	for ; i < n; i++ {
		v, neg, err := d.r.readInt()
		if err != nil {
			return fmt.Errorf("[%d]: %w", i, err)
		}
		if neg || v > math.MaxUint32 {
			return fmt.Errorf("%w: [%d]: token id %d out of uint32 range", ErrMalformed, i, int64(v))
		}
		e.TokenIDs[i] = uint32(v)
		st.tokens++
	}
	return nil
}

// int reads an integer field and checks it lies in [lo, hi].
func (d *decoder) int(name string, lo, hi int64) (int64, error) {
	v, neg, err := d.r.readInt()
	if err != nil {
		return 0, err
	}
	if !neg && v > math.MaxInt64 {
		return 0, fmt.Errorf("%w: %s %d overflows int64", ErrMalformed, name, v)
	}
	x := int64(v)
	if x < lo || x > hi {
		return 0, fmt.Errorf("%w: %s %d out of range [%d, %d]", ErrMalformed, name, x, lo, hi)
	}
	return x, nil
}

// str reads a string field, interning the values engines repeat in every
// event so that decoding them does not allocate.
func (d *decoder) str(name string) (string, error) {
	b, err := d.r.readStr()
	if err != nil {
		return "", err
	}
	switch string(b) {
	case "GPU":
		return "GPU", nil
	case "CPU":
		return "CPU", nil
	case "full_attention":
		return "full_attention", nil
	case "sliding_window":
		return "sliding_window", nil
	case d.lastLora:
		return d.lastLora, nil
	}
	s := string(b)
	if name == "lora_name" {
		d.lastLora = s
	}
	return s, nil
}

// cacheSalt extracts the request's cache_salt from extra_keys. vLLM builds
// each block's extra keys as lora_name + multimodal keys + [cache_salt]
// (block 0 only) + prompt-embedding hashes
// (vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys), so the
// salt is the last string of the first block's tuple, once the LoRA name is
// set aside, and only when the event starts at block 0 (no parent).
// Engines that sent multimodal hashes as bare strings make this ambiguous;
// anything unexpected yields "".
func cacheSalt(extra []byte, e *Event) string {
	if e.HasParent {
		return ""
	}
	r := reader{b: extra}
	if n, err := r.arrayHeader(1); err != nil || n == 0 {
		return ""
	}
	if r.readNil() {
		return ""
	}
	n, err := r.arrayHeader(1)
	if err != nil {
		return ""
	}
	var salt []byte
	for i := 0; i < n; i++ {
		t, err := r.peek()
		if err != nil {
			return ""
		}
		if t != mpStr {
			if r.skip() != nil {
				return ""
			}
			continue
		}
		s, err := r.readStr()
		if err != nil {
			return ""
		}
		if i == 0 && e.LoraName != "" && string(s) == e.LoraName {
			continue
		}
		salt = s
	}
	return string(salt)
}

func clampU8(n int) uint8 {
	if n > math.MaxUint8 {
		return math.MaxUint8
	}
	return uint8(n)
}
