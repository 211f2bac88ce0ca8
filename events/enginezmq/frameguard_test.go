package enginezmq

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// zmtpStream is a greeting's worth of bytes, then frames of the given
// sizes (SHORT up to 255, LONG above), bodies filled with their index.
func zmtpStream(sizes []uint64) []byte {
	out := bytes.Repeat([]byte{0xff}, zmtpGreeting)
	for i, n := range sizes {
		if n > 255 {
			out = append(out, 0x02)
			out = binary.BigEndian.AppendUint64(out, n)
		} else {
			out = append(out, 0x00, byte(n))
		}
		out = append(out, bytes.Repeat([]byte{byte(i)}, int(n))...)
	}
	return out
}

// FuzzFrameGuard: a stream of frames within the limit passes in any split
// into reads; one over it is refused exactly when its size completes, and
// never after its body has started.
func FuzzFrameGuard(f *testing.F) {
	f.Add([]byte{3, 200, 1, 44, 9}, uint16(300))
	f.Add([]byte{0, 255, 7}, uint16(256))
	f.Fuzz(func(t *testing.T, spec []byte, limit uint16) {
		max := uint64(limit) + 1
		var sizes []uint64
		for i := 0; i+1 < len(spec) && len(sizes) < 32; i += 2 {
			sizes = append(sizes, uint64(spec[i])<<2|uint64(spec[i+1]&3)) // 0..1023
		}
		over := -1
		for i, n := range sizes {
			if n > max {
				over = i
				break
			}
		}
		stream := zmtpStream(sizes)
		// Where the first oversize frame's size field ends.
		refuseAt := -1
		if over >= 0 {
			refuseAt = len(zmtpStream(sizes[:over])) + 1 + 1
			if sizes[over] > 255 {
				refuseAt += 7
			}
		}
		g := newFrameGuard(max)
		pos, step := 0, 1
		for pos < len(stream) {
			n := min(step, len(stream)-pos)
			step = step*3%17 + 1 // reads of 1..17 bytes
			err := g.scan(stream[pos : pos+n])
			end := pos + n
			switch {
			case err != nil && !errors.Is(err, ErrFrameTooLarge):
				t.Fatalf("error %v", err)
			case err != nil && !(refuseAt >= pos+1 && refuseAt <= end):
				t.Fatalf("refused in bytes %d..%d, the oversize size ends at %d (sizes %v, max %d)", pos, end, refuseAt, sizes, max)
			case err == nil && refuseAt >= 0 && refuseAt <= end:
				t.Fatalf("bytes %d..%d passed, the frame of %d bytes ends its size at %d (max %d)", pos, end, sizes[over], refuseAt, max)
			case err != nil:
				return
			}
			pos = end
		}
		if over >= 0 {
			t.Fatalf("the stream passed whole with frame %d over the limit", over)
		}
	})
}

// An engine socket that sends a frame header claiming a terabyte ends the
// session with a counted, logged error, not an allocation of that size
// (go-zeromq sizes a frame's buffer from its header).
func TestSubscriberRefusesHugeFrame(t *testing.T) {
	ctx, cancel, ln := engineListener(t)
	defer cancel()
	var bad error
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + ln.Addr().String(), Topic: "kv",
		OnMalformed: func(err error) { bad = err }})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = sub.Run(ctx, func(Message) {}) }()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := zmq4.Open(c, null.Security(), zmq4.Pub, nil, true, nil); err != nil {
		t.Fatal(err)
	}
	// A LONG frame of 1 TiB: flags, eight size bytes, a little body.
	hdr := binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40)
	if _, err := c.Write(append(hdr, "body"...)); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the session ended and counted", func() bool {
		s := sub.Stats()
		return s.Malformed == 1 && s.Reconnects >= 1
	})
	cancel()
	<-done
	if !errors.Is(bad, ErrFrameTooLarge) {
		t.Fatalf("OnMalformed got %v", bad)
	}
}

// engineListener is a test's context and the TCP listener an engine's PUB
// socket would be, for a subscriber to dial; both end with the test.
func engineListener(t *testing.T) (context.Context, context.CancelFunc, net.Listener) {
	t.Helper()
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ctx, cancel, ln
}

// The replay client reads through the same guard: a reply frame claiming a
// terabyte fails the replay (an error within its timeout), not the process.
func TestReplayRefusesHugeFrame(t *testing.T) {
	ctx, cancel, ln := engineListener(t)
	defer cancel()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		zc, err := zmq4.Open(c, null.Security(), zmq4.Router, nil, true, nil)
		if err != nil {
			return
		}
		if _, err := zc.RecvMsg(); err != nil { // the request
			return
		}
		_, _ = c.Write(binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40))
		<-ctx.Done()
	}()
	err := Replay(ctx, ReplayConfig{Endpoint: "tcp://" + ln.Addr().String(), Timeout: 2 * time.Second}, 0, func(Message) bool { return true })
	if err == nil {
		t.Fatal("replay answered with a 1 TiB frame succeeded")
	}
}
