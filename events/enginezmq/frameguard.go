package enginezmq

import (
	"errors"
	"fmt"
)

// MaxFrame is the largest ZMTP frame a subscriber accepts from an engine:
// NATS's largest message payload (64 MiB, the server's max_payload
// ceiling), so no frame a bridge could forward is refused. go-zeromq
// allocates a frame's whole body from the size in its header before
// reading it, so a header claiming terabytes (a corrupt stream, or
// something other than an engine on the port) would make it ask the
// runtime for that much at once: a fatal out-of-memory error, not an
// error a caller can handle.
const MaxFrame = 64 << 20

// ErrFrameTooLarge is the read error of a connection that sent a frame
// over MaxFrame.
var ErrFrameTooLarge = errors.New("zmq frame over the size limit")

// frameError is a refused frame. It is a net.Error that is no timeout, so
// that go-zeromq's reader marks the connection closed (and a listening
// socket drops it) rather than keeping it as a live peer; it matches
// ErrFrameTooLarge.
type frameError struct{ size, max uint64 }

func (e *frameError) Error() string {
	return fmt.Sprintf("%v: %d bytes, over %d (not an engine's KV events)", ErrFrameTooLarge, e.size, e.max)
}
func (e *frameError) Is(target error) bool { return target == ErrFrameTooLarge }
func (e *frameError) Timeout() bool        { return false }
func (e *frameError) Temporary() bool      { return false }

// messageError is a refused message of more than maxMessageFrames frames:
// a net.Error that is no timeout, as frameError is, matching ErrBadFrames.
type messageError struct{ frameError }

func (e *messageError) Error() string {
	return fmt.Sprintf("%v: a message of more than %d frames", ErrBadFrames, maxMessageFrames)
}
func (e *messageError) Is(target error) bool { return target == ErrBadFrames }

// zmtpGreeting is the length of a ZMTP 3 greeting (RFC 23/ZMTP), which
// precedes the frames.
const zmtpGreeting = 64

// frameGuard follows the ZMTP framing of the bytes a connection reads
// (the greeting, then per frame a flags byte, its size in one byte or,
// with the LONG flag, eight big-endian, and the body) and refuses a frame
// whose size is over max before the bytes that complete its size reach
// the reader. It only looks: the bytes are passed on unchanged.
//
// It refuses as well, in the same place, a message (frames up to one
// without the MORE flag, commands among them: go-zeromq reads a command
// with MORE as a message too) of more than maxMessageFrames frames, or
// whose frames before the last add up to more than max, as the dialing
// subscriber's reader does (zmtpReader): go-zeromq's reader, under a bound
// subscriber, ipc:// and the replay client, appends frames for as long as
// MORE is set, so empty MORE frames (two bytes each) would grow its frame
// list without end.
type frameGuard struct {
	max  uint64
	skip uint64 // greeting or body bytes still to pass
	head int    // size bytes still to read (0: at a flags byte)
	size uint64 // the size read so far
	// body: skip counts a frame's body (not the greeting); frames: the
	// frames passed whole (the first is the peer's READY: its handshake).
	body   bool
	frames uint64
	// more: the current frame has the MORE flag; inMsg and inMsgSize: the
	// frames with it before the current one, and their bytes.
	more             bool
	inMsg, inMsgSize uint64
}

func newFrameGuard(max uint64) frameGuard {
	return frameGuard{max: max, skip: zmtpGreeting}
}

// scan follows p, bytes the connection has just read. At the first frame
// over the limit it returns an error and how many of p's bytes come before
// that frame's header (those may still be read: a handshake ahead of it in
// the same read completes, and the refusal reaches the reader as an error
// of its own); otherwise len(p).
func (g *frameGuard) scan(p []byte) (int, error) {
	hdr := 0 // where in p the current frame's header began (0: before p)
	for i := 0; i < len(p); {
		switch {
		case g.skip > 0:
			n := int(min(g.skip, uint64(len(p)-i)))
			g.skip -= uint64(n)
			i += n
			if g.skip == 0 && g.body {
				g.body = false
				g.frames++
			}
		case g.head > 0:
			g.size = g.size<<8 | uint64(p[i])
			g.head--
			i++
			if g.head == 0 {
				if err := g.message(); err != nil {
					return hdr, err
				}
				g.skip = g.size
				if g.body = g.size > 0; !g.body {
					g.frames++
				}
			}
		default: // a flags byte
			hdr = i
			g.head, g.size, g.more = 1, 0, p[i]&zmtpMore != 0
			if p[i]&zmtpLong != 0 { // an eight-byte size
				g.head = 8
			}
			i++
		}
	}
	return len(p), nil
}

// message checks the frame whose size has just been read against max and
// the frames of its message before it, and counts it in its message.
func (g *frameGuard) message() error {
	if g.size > g.max {
		return &frameError{size: g.size, max: g.max}
	}
	if !g.more {
		g.inMsg, g.inMsgSize = 0, 0
		return nil
	}
	if g.inMsg == maxMessageFrames-1 {
		return &messageError{}
	}
	if g.inMsgSize+g.size > g.max {
		return &frameError{size: g.inMsgSize + g.size, max: g.max}
	}
	g.inMsg++
	g.inMsgSize += g.size
	return nil
}
