package consumer

import (
	"strings"
	"time"
)

// msgMeta is what the consumer reads of a stream message's JetStream
// metadata; ok is false for a message without it.
type msgMeta struct {
	streamSeq uint64
	stored    time.Time
	pending   uint64
	ok        bool
}

// parseAckReply reads a JetStream message's metadata from its reply
// subject, as jetstream.Msg.Metadata does but without allocating (it runs
// once per stream message): $JS.ACK.<stream>.<consumer>.<delivered>.
// <stream seq>.<consumer seq>.<stored, unix ns>.<pending> (9 tokens), or
// with <domain>.<account hash> after $JS.ACK and any tokens after pending
// (11 or more). Like nats.go, a number field that is not all digits reads
// as 0.
func parseAckReply(s string) msgMeta {
	const prefix = "$JS.ACK."
	n := strings.Count(s, ".") + 1
	if n < 9 || (n > 9 && n < 11) || !strings.HasPrefix(s, prefix) {
		return msgMeta{}
	}
	// Token indexes of the stream sequence; the stored time and pending
	// follow two and three tokens later.
	seqTok := 5
	if n > 9 {
		seqTok = 7
	}
	var m msgMeta
	rest := s[len(prefix):]
	for i := 2; i <= seqTok+3; i++ {
		tok, after, _ := strings.Cut(rest, ".")
		rest = after
		switch i {
		case seqTok:
			m.streamSeq = ackNum(tok)
		case seqTok + 2:
			m.stored = time.Unix(0, int64(ackNum(tok)))
		case seqTok + 3:
			m.pending = ackNum(tok)
		}
	}
	m.ok = true
	return m
}

// ackNum reads a decimal token of an ack subject: 0 unless all digits
// (and not empty), wrapping past 2^64 as nats.go's parser does.
func ackNum(s string) uint64 {
	var n uint64
	for i := 0; i < len(s); i++ {
		d := s[i] - '0'
		if d > 9 {
			return 0
		}
		n = n*10 + uint64(d)
	}
	return n
}
