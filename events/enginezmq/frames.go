package enginezmq

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"

	"github.com/go-zeromq/zmq4"
)

// ZMTP 3 frame flags (RFC 23/ZMTP).
const (
	zmtpMore    = 0x01
	zmtpLong    = 0x02
	zmtpCommand = 0x04
)

// maxMessageFrames bounds the frames of one message (vLLM sends three):
// zero-size frames cost a peer two bytes each and the reader eight to
// remember (go-zeromq's, 24), so an endless message of them is refused,
// as is one whose frames before the last add up to more than MaxFrame:
// here and, for every connection of the buffered transport, by the frame
// guard.
const maxMessageFrames = 64

// keepScratch is the most scratch a zmtpReader keeps between messages:
// the frames before a message's last are a topic and an 8-byte seq, so
// anything larger was an odd message and is not held on to.
const keepScratch = 4 << 10

// zmtpReader reads the messages of an established ZMTP 3 connection (after
// go-zeromq's handshake) from the subscriber's buffered connection, for a
// dialing subscriber. go-zeromq's (*Conn).RecvMsg allocates every frame's
// body and grows the frame list per message (six allocations for vLLM's
// [topic, seq, payload]); here the frames before the last (the topic and
// the seq, which the subscriber parses and does not keep) are read into a
// buffer reused by the next message, and only the last frame (the payload,
// which the bridge keeps) is allocated. Frame sizes are those the frame
// guard passed (bufConn); a size over MaxFrame is refused here as well.
//
// Payloads are carved one after another from chunks of payloadChunk bytes
// (payloads.go), so the payloads of consecutive messages lie back to back
// and a coalesced NATS message can be their bytes as they are, without a
// copy (JoinPayloads).
type zmtpReader struct {
	r       *bufio.Reader
	scratch []byte
	ends    []int    // where each frame before the last ends in scratch
	frames  [][]byte // reused by the next message
	pay     payloads
	// span is the last message's payload with the rest of its chunk
	// after it (nil when it was allocated alone): Message.span.
	span []byte
}

// next reads one message. frames are valid until the next call, but the
// last one is the caller's to keep. cmd reports a command (frames holds
// its one frame, name and data as RFC 23 encodes them).
func (z *zmtpReader) next() (frames [][]byte, cmd bool, err error) {
	if cap(z.scratch) > keepScratch {
		z.scratch = nil
	}
	z.scratch, z.ends = z.scratch[:0], z.ends[:0]
	for {
		fl, err := z.r.ReadByte()
		if err != nil {
			return nil, false, err
		}
		var size uint64
		if fl&zmtpLong != 0 {
			var b [8]byte
			if _, err := io.ReadFull(z.r, b[:]); err != nil {
				return nil, false, err
			}
			size = binary.BigEndian.Uint64(b[:])
		} else {
			s, err := z.r.ReadByte()
			if err != nil {
				return nil, false, err
			}
			size = uint64(s)
		}
		if size > MaxFrame {
			return nil, false, &frameError{size: size, max: MaxFrame}
		}
		cmd = fl&zmtpCommand != 0
		if cmd && len(z.ends) > 0 {
			return nil, false, fmt.Errorf("%w: a command frame inside a message", ErrBadFrames)
		}
		if fl&zmtpMore != 0 && !cmd {
			n := len(z.scratch)
			if len(z.ends) == maxMessageFrames-1 {
				return nil, false, &messageError{}
			}
			if uint64(n)+size > MaxFrame {
				return nil, false, &frameError{size: uint64(n) + size, max: MaxFrame}
			}
			if cap(z.scratch)-n < int(size) {
				z.scratch = append(z.scratch, make([]byte, size)...)
			}
			z.scratch = z.scratch[:n+int(size)]
			if _, err := io.ReadFull(z.r, z.scratch[n:]); err != nil {
				return nil, false, err
			}
			z.ends = append(z.ends, len(z.scratch))
			continue
		}
		var body []byte
		if cmd {
			body, z.span = make([]byte, size), nil
		} else {
			body, z.span = z.pay.carve(int(size))
		}
		if _, err := io.ReadFull(z.r, body); err != nil {
			return nil, false, err
		}
		z.frames = z.frames[:0]
		start := 0
		for _, end := range z.ends {
			z.frames = append(z.frames, z.scratch[start:end:end])
			start = end
		}
		z.frames = append(z.frames, body)
		return z.frames, cmd, nil
	}
}

// answer handles a command read by next as (*zmq4.Conn).RecvMsg does: a
// heartbeat PING is answered with a PONG (without the PING's context, as
// go-zeromq answers), other commands are ignored; a command that cannot
// be read is an error.
func answer(zc *zmq4.Conn, body []byte) error {
	if len(body) == 0 || 1+int(body[0]) > len(body) {
		return fmt.Errorf("%w: unreadable ZMTP command", ErrBadFrames)
	}
	if string(body[1:1+int(body[0])]) == zmq4.CmdPing {
		return zc.SendCmd(zmq4.CmdPong, nil)
	}
	return nil
}
