package consumer

import (
	"testing"

	"github.com/nats-io/nats.go"
)

// natsMeta is nats.go's reading of a reply subject (its legacy API runs
// the same parser as jetstream.Msg.Metadata).
func natsMeta(reply string) (*nats.MsgMetadata, error) {
	return (&nats.Msg{Reply: reply, Sub: &nats.Subscription{}}).Metadata()
}

// ackCase is a reply subject and what parseAckReply should read of it.
type ackCase struct {
	reply        string
	ok           bool
	seq, pending uint64
	stored       int64
}

func TestParseAckReply(t *testing.T) {
	tests := []ackCase{
		{"$JS.ACK.S.C.1.42.7.1764882000123456789.3", true, 42, 3, 1764882000123456789},
		{"$JS.ACK._.ACCHASH.S.C.2.43.8.1764882000123456789.0.tok", true, 43, 0, 1764882000123456789},
		{"$JS.ACK.dom.ACCHASH.S.C.2.44.8.17.5", true, 44, 5, 17},          // 11 tokens: no trailing token
		{"$JS.ACK.dom.ACCHASH.S.C.2.45.8.17.5.tok.more", true, 45, 5, 17}, // more tokens after
		{"$JS.ACK.S.C.1.x.7.1.3", true, 0, 3, 1},                          // not a number: 0
		{"$JS.ACK.S.C.1.42.7.1.3.x", false, 0, 0, 0},                      // 10 tokens
		{"$JS.ACK.S.C.1.42.7.1", false, 0, 0, 0},                          // 8 tokens
		{"$JS.NAK.S.C.1.42.7.1.3", false, 0, 0, 0},                        // not an ack subject
		{"", false, 0, 0, 0}, // no reply
	}
	for _, tt := range tests {
		got := parseAckReply(tt.reply)
		if got.ok != tt.ok || got.streamSeq != tt.seq || got.pending != tt.pending || (tt.ok && got.stored.UnixNano() != tt.stored) {
			t.Errorf("%q: got %+v, want ok %v seq %d pending %d stored %d", tt.reply, got, tt.ok, tt.seq, tt.pending, tt.stored)
		}
		checkAgainstNATS(t, tt.reply)
	}
	if n := testing.AllocsPerRun(100, func() { parseAckReply(tests[1].reply) }); n != 0 {
		t.Errorf("parseAckReply allocates %v times", n)
	}
}

// checkAgainstNATS fails t unless parseAckReply and nats.go read reply
// alike: both refuse it, or both read the same stream sequence, store
// time and pending count.
func checkAgainstNATS(t *testing.T, reply string) {
	t.Helper()
	got := parseAckReply(reply)
	want, err := natsMeta(reply)
	if got.ok != (err == nil) {
		t.Fatalf("%q: ok %v, nats.go's error %v", reply, got.ok, err)
	}
	if err == nil && (got.streamSeq != want.Sequence.Stream || got.pending != want.NumPending || !got.stored.Equal(want.Timestamp)) {
		t.Fatalf("%q: seq %d pending %d stored %v, nats.go %d %d %v", reply, got.streamSeq, got.pending, got.stored,
			want.Sequence.Stream, want.NumPending, want.Timestamp)
	}
}

func FuzzParseAckReply(f *testing.F) {
	f.Add("$JS.ACK.S.C.1.42.7.1764882000123456789.3")
	f.Add("$JS.ACK._.ACCHASH.S.C.2.43.8.1764882000123456789.0.tok")
	f.Add("$JS.ACK.a.b.c.d.e.99999999999999999999999.g.h.i.j")
	f.Add("$JS.ACK........")
	f.Fuzz(func(t *testing.T, reply string) { checkAgainstNATS(t, reply) })
}
