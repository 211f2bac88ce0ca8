package enginezmq

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"
)

// readMessages reads every message of in with a zmtpReader as the dialing
// subscriber does (the span of each payload attached).
func readMessages(t *testing.T, in []byte) []Message {
	t.Helper()
	z := zmtpReader{r: bufio.NewReaderSize(bytes.NewReader(in), 4096)}
	var ms []Message
	for {
		fs, cmd, err := z.next()
		if errors.Is(err, io.EOF) {
			return ms
		}
		if err != nil {
			t.Fatal(err)
		}
		if cmd {
			continue
		}
		m, err := parseLiveFrames(fs, "")
		if err != nil {
			t.Fatal(err)
		}
		m.span = z.span
		ms = append(ms, m)
	}
}

func concat(ms []Message) []byte {
	var b []byte
	for _, m := range ms {
		b = append(b, m.Payload...)
	}
	return b
}

// TestJoinPayloads: consecutive payloads read from one connection join
// without a copy or an allocation (a command between them does not
// interrupt them), capacity equal to length; across a chunk's end, with a
// message left out, after a payload was replaced, or for messages that
// were not carved (replay, go-zeromq's reader), the join is a copy; the
// bytes are the concatenation every time, and the payloads are unchanged
// by the reads that followed them.
func TestJoinPayloads(t *testing.T) {
	var in []byte
	var want [][]byte
	for i := range 200 {
		p := bytes.Repeat([]byte{byte(i)}, 100+i*37%2000) // 100 B to 2 KB
		want = append(want, p)
		in = append(in, zmtpFrame(zmtpMore, []byte("kv@a"), false)...)
		in = append(in, zmtpFrame(zmtpMore, SeqBytes(uint64(i)), false)...)
		in = append(in, zmtpFrame(0, p, false)...)
		if i == 7 {
			in = append(in, zmtpFrame(zmtpCommand, []byte("\x04PING\x00\x0a"), false)...)
		}
	}
	// One payload over payloadAlone, allocated alone.
	big := bytes.Repeat([]byte{0xee}, payloadAlone+1)
	in = append(in, zmtpFrame(zmtpMore, SeqBytes(200), false)...)
	in = append(in, zmtpFrame(0, big, false)...)
	want = append(want, big)
	ms := readMessages(t, in)
	if len(ms) != len(want) {
		t.Fatalf("%d messages, want %d", len(ms), len(want))
	}
	for i := range ms {
		if !bytes.Equal(ms[i].Payload, want[i]) || cap(ms[i].Payload) != len(ms[i].Payload) {
			t.Fatalf("payload %d changed or capacity %d open", i, cap(ms[i].Payload))
		}
	}
	group := ms[:64]
	j, ok := JoinPayloads(group)
	if !ok || !bytes.Equal(j, concat(group)) || cap(j) != len(j) {
		t.Fatalf("consecutive payloads: joined in place %v, cap %d len %d", ok, cap(j), len(j))
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = JoinPayloads(group) }); n != 0 {
		t.Fatalf("a join in place allocates %v times", n)
	}
	for _, c := range []struct {
		name string
		ms   []Message
	}{
		{"a message left out", append(append([]Message(nil), ms[10:20]...), ms[21:30]...)},
		{"out of order", []Message{ms[3], ms[2]}},
		{"a payload replaced", func() []Message {
			g := append([]Message(nil), ms[30:40]...)
			g[5].Payload = bytes.Clone(g[5].Payload)
			return g
		}()},
		{"not carved", func() []Message {
			g := append([]Message(nil), ms[40:50]...)
			for i := range g {
				g[i].span = nil
			}
			return g
		}()},
		{"allocated alone", ms[199:201]},
	} {
		j, ok := JoinPayloads(c.ms)
		if ok || !bytes.Equal(j, concat(c.ms)) {
			t.Fatalf("%s: joined in place %v, or bytes differ", c.name, ok)
		}
	}
	// A chunk's end: more payloads than one chunk holds.
	in = in[:0]
	p := bytes.Repeat([]byte{0x5a}, 3000)
	n := 2*payloadChunk/len(p) + 1
	for i := range n {
		in = append(in, zmtpFrame(zmtpMore, SeqBytes(uint64(i)), false)...)
		in = append(in, zmtpFrame(0, p, false)...)
	}
	ms = readMessages(t, in)
	joined, copied := 0, 0
	for i := 0; i+64 <= len(ms); i += 64 {
		j, ok := JoinPayloads(ms[i : i+64])
		if !bytes.Equal(j, concat(ms[i:i+64])) {
			t.Fatalf("group at %d: bytes differ", i)
		}
		if ok {
			joined++
		} else {
			copied++
		}
	}
	if copied == 0 || copied > 2 || joined == 0 {
		t.Fatalf("%d groups joined in place, %d copied across a chunk's end, want 1 or 2 copied", joined, copied)
	}
}
