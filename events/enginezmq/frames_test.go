package enginezmq

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"
)

// zmtpFrame encodes one ZMTP 3 frame: short or long size as the spec
// says, the LONG flag only when the size needs it unless long is set.
func zmtpFrame(flags byte, body []byte, long bool) []byte {
	if long || len(body) > 255 {
		var b [9]byte
		b[0] = flags | zmtpLong
		binary.BigEndian.PutUint64(b[1:], uint64(len(body)))
		return append(b[:], body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// TestZMTPReader: messages of one, two and three frames, short and long
// sizes, a command between them; the last frame of a message stays as it
// was after later messages are read (the bridge keeps the payload while
// the frames before it are reused), and the frames before it are the
// message's.
func TestZMTPReader(t *testing.T) {
	big := bytes.Repeat([]byte{0xab}, 300)
	var in []byte
	in = append(in, zmtpFrame(zmtpMore, []byte("kv@a"), false)...)
	in = append(in, zmtpFrame(zmtpMore, SeqBytes(7), true)...)
	in = append(in, zmtpFrame(0, []byte("payload-1"), false)...)
	in = append(in, zmtpFrame(zmtpCommand, []byte("\x04PING\x00\x0a"), false)...)
	in = append(in, zmtpFrame(zmtpMore, SeqBytes(8), false)...)
	in = append(in, zmtpFrame(0, big, false)...)
	in = append(in, zmtpFrame(zmtpMore, []byte("kv@b"), false)...)
	in = append(in, zmtpFrame(zmtpMore, SeqBytes(9), false)...)
	in = append(in, zmtpFrame(0, nil, true)...)
	z := zmtpReader{r: bufio.NewReaderSize(bytes.NewReader(in), 16)}
	type msg struct {
		frames [][]byte
		cmd    bool
	}
	var got []msg
	var kept [][]byte
	for {
		fs, cmd, err := z.next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		var cp [][]byte
		for _, f := range fs {
			cp = append(cp, bytes.Clone(f))
		}
		got = append(got, msg{cp, cmd})
		kept = append(kept, fs[len(fs)-1])
	}
	want := []msg{
		{[][]byte{[]byte("kv@a"), SeqBytes(7), []byte("payload-1")}, false},
		{[][]byte{[]byte("\x04PING\x00\x0a")}, true},
		{[][]byte{SeqBytes(8), big}, false},
		{[][]byte{[]byte("kv@b"), SeqBytes(9), {}}, false},
	}
	if len(got) != len(want) {
		t.Fatalf("%d messages, want %d: %v", len(got), len(want), got)
	}
	for i := range want {
		if got[i].cmd != want[i].cmd || len(got[i].frames) != len(want[i].frames) {
			t.Fatalf("message %d: %q (cmd %v), want %q", i, got[i].frames, got[i].cmd, want[i].frames)
		}
		for j := range want[i].frames {
			if !bytes.Equal(got[i].frames[j], want[i].frames[j]) {
				t.Fatalf("message %d frame %d: %q, want %q", i, j, got[i].frames[j], want[i].frames[j])
			}
		}
		if last := want[i].frames[len(want[i].frames)-1]; !bytes.Equal(kept[i], last) {
			t.Fatalf("message %d: its last frame changed to %q after later reads, want %q", i, kept[i], last)
		}
	}
}

// TestZMTPReaderRefuses: a frame over MaxFrame (whatever the guard under
// the buffer did), a command inside a multi-frame message, a truncated
// frame and a command that cannot be read are errors, not messages.
func TestZMTPReaderRefuses(t *testing.T) {
	var huge [9]byte
	huge[0] = zmtpLong
	binary.BigEndian.PutUint64(huge[1:], MaxFrame+1)
	read := func(b []byte) error {
		z := zmtpReader{r: bufio.NewReader(bytes.NewReader(b))}
		_, _, err := z.next()
		return err
	}
	if err := read(huge[:]); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("oversize frame: %v", err)
	}
	inside := append(zmtpFrame(zmtpMore, []byte("kv"), false), zmtpFrame(zmtpCommand, []byte("\x04PING"), false)...)
	if err := read(inside); !errors.Is(err, ErrBadFrames) {
		t.Fatalf("command inside a message: %v", err)
	}
	if err := read(zmtpFrame(0, []byte("abc"), false)[:4]); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("truncated frame: %v", err)
	}
	var many []byte
	for range maxMessageFrames - 1 {
		many = append(many, zmtpFrame(zmtpMore, nil, false)...)
	}
	if fs, _, err := (&zmtpReader{r: bufio.NewReader(bytes.NewReader(append(many, zmtpFrame(0, []byte("p"), false)...)))}).next(); err != nil || len(fs) != maxMessageFrames {
		t.Fatalf("a message of %d frames: %d frames, %v", maxMessageFrames, len(fs), err)
	}
	if err := read(append(many, zmtpFrame(zmtpMore, nil, false)...)); !errors.Is(err, ErrBadFrames) {
		t.Fatalf("a message of more than %d frames: %v", maxMessageFrames, err)
	}
	for _, body := range [][]byte{nil, []byte("\x05PING")} {
		if err := answer(nil, body); !errors.Is(err, ErrBadFrames) {
			t.Fatalf("command %q: %v", body, err)
		}
	}
}

// FuzzZMTPReader: whatever a peer sends after the handshake, the reader
// returns messages of at most maxMessageFrames frames, a command as one
// frame, or an error; it never panics, and a message's last frame is not
// overwritten by reading the next.
func FuzzZMTPReader(f *testing.F) {
	f.Add(append(zmtpFrame(zmtpMore, []byte("kv@a"), false), append(zmtpFrame(zmtpMore, SeqBytes(7), true), zmtpFrame(0, []byte("payload"), false)...)...))
	f.Add(zmtpFrame(zmtpCommand, []byte("\x04PING\x00\x0a"), false))
	f.Add([]byte{zmtpLong | zmtpMore, 0, 0, 0, 0, 0, 0, 0, 3, 'a', 'b', 'c', 0, 0})
	f.Fuzz(func(t *testing.T, in []byte) {
		z := zmtpReader{r: bufio.NewReaderSize(bytes.NewReader(in), 16)}
		var kept, want [][]byte
		for {
			fs, cmd, err := z.next()
			if err != nil {
				break
			}
			if len(fs) == 0 || len(fs) > maxMessageFrames || (cmd && len(fs) != 1) {
				t.Fatalf("%d frames, command %v", len(fs), cmd)
			}
			kept, want = append(kept, fs[len(fs)-1]), append(want, bytes.Clone(fs[len(fs)-1]))
		}
		for i := range kept {
			if !bytes.Equal(kept[i], want[i]) {
				t.Fatalf("message %d's last frame changed after later reads", i)
			}
		}
	})
}

// A message of more frames than maxMessageFrames ends the session, counted
// and reported as malformed as every other refused message is (it used to
// be delivered and dropped as malformed), not as a silent reconnect: over
// TCP (zmtpReader) and over a Unix socket (go-zeromq's reader, which the
// frame guard under it stops).
func TestSubscriberCountsTooManyFrames(t *testing.T) {
	var many []byte
	for range maxMessageFrames {
		many = append(many, zmtpFrame(zmtpMore, nil, false)...)
	}
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) { sendRefused(t, network, many, ErrBadFrames) })
	}
}
