package enginezmq

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// zmtpStream is a greeting's worth of bytes, then frames of the given
// sizes, bodies filled with their index: flags[i]'s MORE and COMMAND bits
// kept, LONG set when the size is over 255 or flags[i] asks for it (a
// small size in the long form is legal ZMTP).
func zmtpStream(sizes []uint64, flags []byte) []byte {
	out := bytes.Repeat([]byte{0xff}, zmtpGreeting)
	for i, n := range sizes {
		fl := flags[i] & 0x05
		if n > 255 || flags[i]&0x02 != 0 {
			out = append(out, fl|0x02)
			out = binary.BigEndian.AppendUint64(out, n)
		} else {
			out = append(out, fl, byte(n))
		}
		if n <= 1<<12 { // an over-limit frame's body is never reached
			out = append(out, bytes.Repeat([]byte{byte(i)}, int(n))...)
		}
	}
	return out
}

// FuzzFrameGuard: a stream of frames within the limits passes in any split
// into reads; a frame over the size limit, or that makes its message more
// than maxMessageFrames frames or its frames before the last more than the
// size limit, is refused exactly in the read that completes its size, and
// never after its body has started.
func FuzzFrameGuard(f *testing.F) {
	f.Add([]byte{3, 200, 1, 0, 44, 9, 2, 0}, uint16(300), uint8(1))
	f.Add([]byte{0, 255, 7, 1}, uint16(256), uint8(5))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff}, uint16(0), uint8(3))
	// An endless message of empty frames; one of maxMessageFrames frames
	// and the next message; frames before the last over the limit.
	f.Add(bytes.Repeat([]byte{0, 0, 0, 1}, maxMessageFrames+1), uint16(300), uint8(2))
	f.Add(append(bytes.Repeat([]byte{0, 0, 0, 3}, maxMessageFrames-1), 0, 1, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0), uint16(300), uint8(4))
	f.Add([]byte{16, 0, 0, 1, 16, 0, 0, 1, 0, 5, 0, 0}, uint16(400), uint8(6))
	f.Fuzz(func(t *testing.T, spec []byte, limit uint16, split uint8) {
		max := uint64(limit) + 1
		var sizes []uint64
		var flags []byte
		for i := 0; i+3 < len(spec) && len(sizes) < 2*maxMessageFrames; i += 4 {
			n := uint64(spec[i])<<4 | uint64(spec[i+1]&15) // 0..4095
			if spec[i+2]&0x80 != 0 {
				n |= uint64(spec[i+2]) << 40 // a size with high bytes: always over the limit
			}
			sizes = append(sizes, n)
			flags = append(flags, spec[i+3])
		}
		over, why := -1, error(nil) // the first refused frame, and why
		var inMsg, inMsgSize uint64 // its message's MORE frames before it
	frames:
		for i, n := range sizes {
			more := flags[i]&zmtpMore != 0
			switch {
			case n > max:
				why = ErrFrameTooLarge
			case more && inMsg == maxMessageFrames-1:
				why = ErrBadFrames
			case more && inMsgSize+n > max:
				why = ErrFrameTooLarge
			case more:
				inMsg, inMsgSize = inMsg+1, inMsgSize+n
				continue
			default:
				inMsg, inMsgSize = 0, 0
				continue
			}
			over = i
			break frames
		}
		if over >= 0 {
			sizes, flags = sizes[:over+1], flags[:over+1] // the stream ends in its size
		}
		stream := zmtpStream(sizes, flags)
		refuseAt, hdrAt := -1, -1 // where the first refused frame's size field ends, and its header begins
		if over >= 0 {
			hdrAt = len(zmtpStream(sizes[:over], flags[:over]))
			refuseAt = hdrAt + 2
			if sizes[over] > 255 || flags[over]&0x02 != 0 {
				refuseAt += 7
			}
			stream = stream[:refuseAt]
		}
		g := newFrameGuard(max)
		pos, step := 0, int(split)%17+1
		for pos < len(stream) {
			n := min(step, len(stream)-pos)
			step = (step*7+int(split))%23 + 1 // reads of 1..23 bytes, from the input
			ok, err := g.scan(stream[pos : pos+n])
			end := pos + n
			switch {
			case err != nil && !errors.Is(err, why):
				t.Fatalf("error %v, want %v", err, why)
			case err != nil && !(refuseAt > pos && refuseAt <= end):
				t.Fatalf("refused in bytes %d..%d, the refused size ends at %d (sizes %v, max %d)", pos, end, refuseAt, sizes, max)
			case err == nil && refuseAt > 0 && refuseAt <= end:
				t.Fatalf("bytes %d..%d passed, the frame of %d bytes ends its size at %d (max %d)", pos, end, sizes[over], refuseAt, max)
			case err == nil && ok != n:
				t.Fatalf("bytes %d..%d passed, %d of them readable", pos, end, ok)
			case err != nil:
				// What may still be read is what comes before the frame's
				// header, in this read.
				want := hdrAt - pos
				if want < 0 {
					want = 0
				}
				if ok != want {
					t.Fatalf("refused with %d bytes readable, want %d (the header starts at %d, the read at %d)", ok, want, hdrAt, pos)
				}
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
// (go-zeromq sizes a frame's buffer from its header): over TCP (the
// subscriber reads its one connection itself) and over a Unix socket
// (ipc://, through a go-zeromq SUB socket).
func TestSubscriberRefusesHugeFrame(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			// A LONG frame of 1 TiB: flags, eight size bytes, a little body.
			hdr := binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40)
			sendRefused(t, network, append(hdr, "body"...), ErrFrameTooLarge)
		})
	}
}

// sendRefused has an engine socket on network (see engineListenerOn),
// dialed by a subscriber, send b after the handshake, and checks that the
// subscriber ends the session and counts and reports it malformed with
// error want.
func sendRefused(t *testing.T, network string, b []byte, want error) {
	t.Helper()
	ctx, cancel, ln := engineListenerOn(t, network)
	defer cancel()
	ep := "tcp://" + ln.Addr().String()
	if network == "unix" {
		ep = "ipc://" + ln.Addr().String()
	}
	var bad lastError
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: ep, Topic: "kv", OnMalformed: bad.set})
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
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the session ended and counted", func() bool {
		s := sub.Stats()
		return s.Malformed == 1 && s.Reconnects >= 1
	})
	cancel()
	<-done
	bad.mustBe(t, want)
}

// engineListener is a test's context and the TCP listener an engine's PUB
// socket would be, for a subscriber to dial; both end with the test.
func engineListener(t *testing.T) (context.Context, context.CancelFunc, net.Listener) {
	return engineListenerOn(t, "tcp")
}

// engineListenerOn is engineListener on a network: "tcp" (a loopback
// port) or "unix" (a socket file in the test's directory).
func engineListenerOn(t *testing.T, network string) (context.Context, context.CancelFunc, net.Listener) {
	t.Helper()
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "engine.sock")
	}
	ln, err := net.Listen(network, addr)
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
	start := time.Now()
	err := Replay(ctx, ReplayConfig{Endpoint: "tcp://" + ln.Addr().String(), Timeout: 10 * time.Second}, 0, func(Message) bool { return true })
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("replay answered with a 1 TiB frame: %v, want ErrFrameTooLarge", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("refused after %v: the guard, not the replay's timeout, must end it", el)
	}
}

// A listening subscriber (engines that dial, --zmq-bind) refuses the frame
// too, counts it, drops that peer, and takes the next one.
func TestBoundSubscriberRefusesHugeFrame(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	defer cancel()
	var got collector
	b := startBound(t, ctx, got.add)
	if _, err := b.peer.Write(binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40)); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the refusal counted", func() bool { return b.sub.Stats().Malformed == 1 })
	// The next engine to dial in is read as before.
	pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: b.ep, Dial: true, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	testenv.WaitFor(t, 15*time.Second, "a message from the next engine", func() bool {
		_, _ = pub.Publish([]byte{0x90})
		return len(got.seqs()) > 0
	})
	cancel()
	<-b.done
	b.bad.mustBe(t, ErrFrameTooLarge)
}

// bound is a subscriber that binds a free loopback port, and a peer
// connected to it as an engine that dials.
type bound struct {
	ep   string
	sub  *Subscriber
	bad  lastError     // what its OnMalformed reported
	done chan struct{} // closed when its Run returns (ctx done)
	peer net.Conn      // handshaken as a PUB; closed with the test
}

// startBound runs a bound subscriber until ctx is done, handing its
// messages to handle, and connects a peer to it.
func startBound(t *testing.T, ctx context.Context, handle func(Message)) *bound {
	t.Helper()
	b := &bound{ep: fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)), done: make(chan struct{})}
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: b.ep, Bind: true, Topic: "kv", OnMalformed: b.bad.set})
	if err != nil {
		t.Fatal(err)
	}
	b.sub = sub
	go func() { defer close(b.done); _ = sub.Run(ctx, handle) }()
	testenv.WaitFor(t, 10*time.Second, "the subscriber listens", func() bool {
		b.peer, err = net.Dial("tcp", strings.TrimPrefix(b.ep, "tcp://"))
		return err == nil
	})
	t.Cleanup(func() { _ = b.peer.Close() })
	_ = b.peer.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := zmq4.Open(b.peer, null.Security(), zmq4.Pub, nil, false, nil); err != nil {
		t.Fatal(err)
	}
	return b
}

// lastError keeps the last error a subscriber's OnMalformed reported.
type lastError struct {
	mu  sync.Mutex
	err error
}

func (l *lastError) set(err error) { l.mu.Lock(); l.err = err; l.mu.Unlock() }

func (l *lastError) mustBe(t *testing.T, want error) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if !errors.Is(l.err, want) {
		t.Fatalf("OnMalformed got %v, want %v", l.err, want)
	}
}

// A simulated engine (the Publisher kvsim runs) reads its peers' frames
// through the guard too: a replay request, or a subscriber's message,
// claiming a terabyte closes that peer's connection, and the engine goes
// on publishing and answering replays.
func TestPublisherRefusesHugeFrame(t *testing.T) {
	ctx := testenv.Context(t, 30*time.Second)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	rep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, ReplayEndpoint: rep, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	for _, c := range []struct {
		addr string
		typ  zmq4.SocketType
	}{{ep, zmq4.Sub}, {rep, zmq4.Dealer}} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(c.addr, "tcp://"))
		if err != nil {
			t.Fatal(err)
		}
		_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err := zmq4.Open(conn, null.Security(), c.typ, nil, false, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write(binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40)); err != nil {
			t.Fatal(err)
		}
		// The engine closes that connection: the read ends.
		if _, err := io.Copy(io.Discard, conn); err != nil {
			t.Fatalf("%s: the connection with the huge frame was not closed: %v", c.addr, err)
		}
		_ = conn.Close()
	}
	if _, err := pub.Publish([]byte{0x90}); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := Replay(ctx, ReplayConfig{Endpoint: rep, Timeout: 10 * time.Second}, 0, func(Message) bool { n++; return true }); err != nil {
		t.Fatalf("replay after the refusals: %v", err)
	}
	if n != 1 {
		t.Fatalf("replay after the refusals returned %d messages, want 1", n)
	}
}

// A peer whose handshake fails (a PUB dialing a simulated engine's PUB
// socket) and whose huge frame came in the same read is closed all the
// same: go-zeromq drops a failed handshake without closing or reading
// its connection, so the refusal the guard holds back for the bytes
// before it would never be returned.
func TestRefusedFrameBehindFailedHandshakeCloses(t *testing.T) {
	ctx := testenv.Context(t, 30*time.Second)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	conn, err := net.Dial("tcp", strings.TrimPrefix(ep, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// ZMTP 3.0's greeting (signature, version 3.0, NULL, not as server),
	// READY with Socket-Type PUB (a PUB socket takes SUB peers only), and
	// a 1 TiB frame header, in one write.
	b := append([]byte{0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0}, "NULL"...)
	b = append(b, make([]byte, 16+1+31)...)
	ready := append([]byte{5}, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, 3)
	ready = append(ready, "PUB"...)
	b = append(append(b, 0x04, byte(len(ready))), ready...)
	b = binary.BigEndian.AppendUint64(append(b, 0x02), 1<<40)
	if _, err := conn.Write(b); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.Copy(io.Discard, conn); err != nil {
		t.Fatalf("the connection was not closed: %v", err)
	}
}

// floodSize is how much of an endless message of empty MORE frames
// (two bytes each) a test peer sends: 8 Mi frames, which go-zeromq's
// reader, unguarded, held as 24-byte slice headers and their list's growth
// copies (561 MB of heap for this much, in the review that found it).
const floodSize = 16 << 20

// heapGrowthLimit is the heap growth the flood may cause: well above a
// guarded connection's (64 frames) and the test's own buffers, far below
// an unguarded reader's.
const heapGrowthLimit = 64 << 20

// floodEmptyFrames writes floodSize bytes of empty MORE frames to c, or
// until a write fails (the reader refused the message and closed the
// connection), and returns how much the heap grew meanwhile, after a GC.
func floodEmptyFrames(t *testing.T, c net.Conn) int64 {
	t.Helper()
	chunk := bytes.Repeat([]byte{zmtpMore, 0}, 1<<19)
	before := heapAfterGC()
	for sent := 0; sent < floodSize; sent += len(chunk) {
		if _, err := c.Write(chunk); err != nil {
			break
		}
	}
	grew := int64(heapAfterGC()) - int64(before)
	t.Logf("heap grew %.1f MB while %d MB of empty MORE frames were sent", float64(grew)/1e6, floodSize>>20)
	if grew > heapGrowthLimit {
		t.Fatalf("heap grew %d MB for an endless message of empty frames, want under %d MB", grew>>20, heapGrowthLimit>>20)
	}
	return grew
}

func heapAfterGC() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// A listening subscriber (--zmq-bind: any TCP peer may connect) reads its
// peers through go-zeromq, which appends a message's frames for as long as
// they have the MORE flag: an endless message of empty frames is refused
// by the frame guard at maxMessageFrames, counted and reported as
// malformed, and its connection dropped, with the heap growing by no more
// than a few buffers.
func TestBoundSubscriberRefusesEndlessMessage(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	defer cancel()
	b := startBound(t, ctx, func(Message) {})
	floodEmptyFrames(t, b.peer)
	testenv.WaitFor(t, 10*time.Second, "the refusal counted", func() bool { return b.sub.Stats().Malformed == 1 })
	if _, err := io.Copy(io.Discard, b.peer); err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("the connection was not closed: %v", err)
	}
	cancel()
	<-b.done
	b.bad.mustBe(t, ErrBadFrames)
}

// The replay client (a go-zeromq DEALER) reads through the same guard: a
// reply that never ends fails the replay with ErrBadFrames.
func TestReplayRefusesEndlessMessage(t *testing.T) {
	ctx, cancel, ln := engineListener(t)
	defer cancel()
	res := make(chan error, 1)
	go func() {
		res <- Replay(ctx, ReplayConfig{Endpoint: "tcp://" + ln.Addr().String(), Timeout: 20 * time.Second}, 0, func(Message) bool { return true })
	}()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	zc, err := zmq4.Open(c, null.Security(), zmq4.Router, nil, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := zc.RecvMsg(); err != nil { // the request
		t.Fatal(err)
	}
	floodEmptyFrames(t, c)
	if err := <-res; !errors.Is(err, ErrBadFrames) {
		t.Fatalf("replay answered with an endless message: %v, want ErrBadFrames", err)
	}
}
