package eventstest

import (
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// ZMTPFrames appends the wire form of one message's frames to dst as a
// ZMTP 3 peer writes it after the handshake on a NULL-security connection
// (RFC 23/ZMTP, "Framing"): per frame a flags byte (MORE on every frame but
// the last; LONG when the body is over 255 bytes) and the body's size (one
// byte, or eight big-endian with LONG), then the body. libzmq (vLLM's
// pyzmq) and go-zeromq write the same bytes (TestStreamPUBWritesGoZeromqBytes
// compares with go-zeromq's PUB).
func ZMTPFrames(dst []byte, frames ...[]byte) []byte {
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags |= 0x01
		}
		if len(f) > 255 {
			dst = append(dst, flags|0x02)
			dst = binary.BigEndian.AppendUint64(dst, uint64(len(f)))
		} else {
			dst = append(dst, flags, byte(len(f)))
		}
		dst = append(dst, f...)
	}
	return dst
}

// StreamPUB is an engine's PUB socket reduced to its wire, for measuring
// a subscriber alone. It accepts one subscriber, does the ZMTP handshake
// with go-zeromq (as a PUB), reads the subscription, then writes vLLM's
// KV-event messages ([topic, seq, payload], the payloads given cycled)
// pre-encoded by ZMTPFrames in large writes, as fast as the connection
// takes them. go-zeromq's own PUB makes two write system calls per frame
// (six per engine message), which made a benchmark of the bridge measure
// its engine stand-in; a real engine's libzmq batches its writes, and its
// CPU is not the bridge's. Every message goes to the subscriber whatever
// its subscription (a benchmark subscribes to all).
type StreamPUB struct {
	ln    net.Listener
	conn  net.Conn
	topic []byte
	ps    [][]byte
}

// NewStreamPUB listens on a free loopback port; it is closed at cleanup.
func NewStreamPUB(tb testing.TB, topic string, ps [][]byte) *StreamPUB {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	s := &StreamPUB{ln: ln, topic: []byte(topic), ps: ps}
	tb.Cleanup(func() {
		_ = ln.Close()
		if s.conn != nil {
			_ = s.conn.Close()
		}
	})
	return s
}

// Endpoint is the ZMQ endpoint a subscriber dials.
func (s *StreamPUB) Endpoint() string { return "tcp://" + s.ln.Addr().String() }

// Accept waits for a subscriber, does the handshake and reads its
// subscription.
func (s *StreamPUB) Accept(timeout time.Duration) error {
	if tl, ok := s.ln.(*net.TCPListener); ok {
		_ = tl.SetDeadline(time.Now().Add(timeout))
	}
	c, err := s.ln.Accept()
	if err != nil {
		return fmt.Errorf("stream pub: accept: %w", err)
	}
	_ = c.SetDeadline(time.Now().Add(timeout))
	// go-zeromq reads the handshake and the subscription unbuffered, so
	// the connection holds nothing of the peer's afterwards.
	zc, err := zmq4.Open(c, null.Security(), zmq4.Pub, nil, true, nil)
	if err != nil {
		c.Close()
		return fmt.Errorf("stream pub: handshake: %w", err)
	}
	msg, err := zc.RecvMsg()
	if err != nil || len(msg.Frames) != 1 || len(msg.Frames[0]) == 0 || msg.Frames[0][0] != 1 {
		c.Close()
		return fmt.Errorf("stream pub: want a subscription, got %v (%v)", msg.Frames, err)
	}
	_ = c.SetDeadline(time.Time{})
	s.conn = c
	return nil
}

// Send writes n messages numbered first, first+1, …; payload i is
// ps[i % len(ps)]. It returns when the last byte is written.
func (s *StreamPUB) Send(first, n uint64) error {
	if len(s.ps) == 0 {
		return fmt.Errorf("stream pub: no payloads to send")
	}
	// One chunk of whole cycles of the payloads, at least 256 KiB (a few
	// socket buffers: large writes, few system calls); only the seq
	// frames change from one chunk to the next.
	var chunk []byte
	var seqAt, end []int
	var zero [8]byte
	seqOff := len(ZMTPFrames(nil, s.topic)) + 2 // the topic frame, then the seq's header
	for len(chunk) < 256<<10 || len(end)%len(s.ps) != 0 {
		seqAt = append(seqAt, len(chunk)+seqOff)
		chunk = ZMTPFrames(chunk, s.topic, zero[:], s.ps[len(end)%len(s.ps)])
		end = append(end, len(chunk))
	}
	for sent := uint64(0); sent < n; {
		m := min(uint64(len(end)), n-sent)
		for i := range m {
			binary.BigEndian.PutUint64(chunk[seqAt[i]:], first+sent+i)
		}
		if _, err := s.conn.Write(chunk[:end[m-1]]); err != nil {
			return fmt.Errorf("stream pub: after %d messages: %w", sent, err)
		}
		sent += m
	}
	return nil
}
