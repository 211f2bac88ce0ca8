package enginezmq

// Engine payloads carved from shared chunks. The dialing subscriber's
// frame reader (zmtpReader) used to allocate each payload alone, and the
// bridge then copied the payloads of a coalesced NATS message into one
// more allocation (events/bridge, seal): every engine byte was written to
// fresh memory twice, and on a bridge behind its engine (a backlog in its
// buffer, which grows the heap) both copies landed on new pages, their
// page faults a large share of its CPU (docs/BENCHMARKS.md §3, "Session
// 18"). Carved one after another from a chunk, the payloads of
// consecutive messages lie back to back, so the coalesced message is a
// slice over them (JoinPayloads): written once, read by the NATS client
// from where the reader put them.

// payloadChunk is the size of a chunk. A coalesced message is at most
// Coalesce (64) engine messages and the byte bound (256 KiB at NATS's
// default max payload); vLLM's batches are hundreds of bytes to a few
// KiB, so a usual group is tens to ~200 KiB and a chunk holds several to
// dozens of them: only a group that straddles two chunks is copied. A
// chunk lives while any message carved from it does (the bridge keeps a
// message until its NATS ack, and drops them in order), so a connection
// holds at most one chunk beyond the messages it has queued.
const payloadChunk = 1 << 20

// payloadAlone is the largest payload carved from a chunk; a larger one
// gets its own allocation, so a chunk's unused tail (when the next
// payload does not fit) is at most this, 1/16 of the chunk.
const payloadAlone = payloadChunk / 16

// payloads carves payloads from chunks; the zero value is ready.
type payloads struct {
	rest []byte // the current chunk's room not yet carved
}

// carve returns room for an n-byte payload and its span: the payload's
// room with the rest of its chunk after it (nil for a payload allocated
// alone). The payload's capacity is n, so an append to it copies.
func (p *payloads) carve(n int) (payload, span []byte) {
	if n == 0 || n > payloadAlone {
		return make([]byte, n), nil
	}
	if len(p.rest) < n {
		p.rest = make([]byte, payloadChunk)
	}
	span = p.rest
	p.rest = p.rest[n:]
	return span[:n:n], span
}

// Detached returns m with a payload of its own when it was carved from a
// shared chunk: a copy, and no reference to the chunk, so that keeping m
// no longer keeps the chunk, and every message carved beside it, alive.
// A caller that keeps a message while dropping those read around it (the
// bridge's full buffer) detaches it: otherwise each kept message could
// hold a 1 MiB chunk of dropped bytes. A payload allocated alone is
// returned as it is.
func (m Message) Detached() Message {
	if m.span == nil {
		return m
	}
	m.Payload = append([]byte(nil), m.Payload...)
	m.span = nil
	return m
}

// JoinPayloads returns the payloads of ms concatenated, without a copy
// when they were read one after another from one chunk (the dialing
// subscriber's messages of one connection, none between them dropped):
// then the result is a slice over them, capacity its length, and ok is
// true. Otherwise it is a new allocation holding a copy. Either way the
// result must not be written to.
func JoinPayloads(ms []Message) (joined []byte, ok bool) {
	if joined, ok := adjacent(ms); ok {
		return joined, true
	}
	n := 0
	for i := range ms {
		n += len(ms[i].Payload)
	}
	joined = make([]byte, 0, n)
	for i := range ms {
		joined = append(joined, ms[i].Payload...)
	}
	return joined, false
}

// adjacent returns ms's payloads as one slice if each was carved right
// after the one before, from the same chunk, and is unchanged since.
func adjacent(ms []Message) ([]byte, bool) {
	if len(ms) == 0 {
		return nil, false
	}
	total := 0
	for i := range ms {
		m := &ms[i]
		if len(m.Payload) == 0 || len(m.span) < len(m.Payload) || &m.span[0] != &m.Payload[0] {
			return nil, false
		}
		if i > 0 {
			prev := &ms[i-1]
			// The previous payload's chunk continues right here: the same
			// allocation (one slice reaches both), so the joined slice
			// keeps every payload in it alive.
			if len(prev.span) <= len(prev.Payload) || &prev.span[len(prev.Payload)] != &m.span[0] {
				return nil, false
			}
		}
		total += len(m.Payload)
	}
	return ms[0].span[:total:total], true
}
