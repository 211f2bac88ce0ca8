package enginezmq

import (
	"bufio"
	"context"
	"errors"
	"net"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// bufTCP and bufIPC are the transport schemes of the subscriber's and the
// replay client's connections: "tcp" and "ipc" (a Unix socket, where an
// engine outside the process writes as over TCP) whose reads go through a
// buffer and the frame guard. go-zeromq reads every frame's header and
// then its body with an io.ReadFull each on the connection, so an engine
// message (three frames) cost six read system calls, which were a quarter
// of a loaded bridge's CPU (docs/BENCHMARKS.md §3, "Session 12"); through
// a buffer one read takes whatever the kernel holds. Writes are not
// buffered (a subscriber writes only its handshake and subscription).
// inproc:// stays go-zeromq's own: its peer is in this process.
const (
	bufTCP = "kvbuftcp"
	bufIPC = "kvbufipc"
)

// bufConnSize is the read buffer: a few engine messages (vLLM's batches
// are ~1–10 KB), and the most one read system call usually returns on
// loopback.
const bufConnSize = 64 << 10

func init() {
	for scheme, network := range map[string]string{bufTCP: "tcp", bufIPC: "unix"} {
		if err := zmq4.RegisterTransport(scheme, bufTransport{transport.New(network)}); err != nil {
			panic(err)
		}
	}
}

// bufEndpoint is the endpoint the subscriber dials or binds: a tcp:// or
// ipc:// endpoint under its buffered, guarded scheme; others unchanged.
func bufEndpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return bufTCP + "://" + rest
	}
	if rest, ok := strings.CutPrefix(ep, "ipc://"); ok {
		return bufIPC + "://" + rest
	}
	return ep
}

type bufTransport struct{ transport.Transport }

func (t bufTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newBufConn(c), nil
}

func (t bufTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.Transport.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	onAccept, _ := ctx.Value(acceptHookKey{}).(func())
	return bufListener{l, onAccept}, nil
}

// acceptHookKey keys a func() in the context a socket is made with: its
// listener calls it for every connection accepted. go-zeromq accepts on a
// goroutine of its own and tells its owner nothing, yet a subscriber that
// binds must know when an engine (re)connects (Subscriber.session).
type acceptHookKey struct{}

type bufListener struct {
	net.Listener
	onAccept func() // nil: none
}

// Accept returns the next connection with a bound on its handshake:
// go-zeromq runs each accepted connection's handshake inline in its accept
// loop, with no deadline, so one peer that connects and sends nothing (a
// half-open connection, a stray client) would keep every engine from
// connecting after it. The peer's greeting and READY must arrive within
// handshakeTimeout, or the connection is closed and the loop goes on; the
// accept hook runs once they have (a port scan or a TCP probe is no engine
// connection).
func (l bufListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if err := c.SetReadDeadline(time.Now().Add(handshakeTimeout)); err != nil {
		_ = c.Close()
		return nil, err
	}
	bc := newBufConn(c)
	g := bc.guarded
	g.handshaking, g.onHandshake = true, l.onAccept
	return bc, nil
}

// handshakeTimeout bounds a connection's handshake, either side: an
// accepted connection's greeting and READY here, a dialing subscriber's
// connect and ZMTP handshake (Subscriber.session, dialSession).
const handshakeTimeout = 5 * time.Second

// bufConn is a connection whose reads go through a buffer, each frame's
// size checked against MaxFrame (frameGuard) as the buffer fills, before
// go-zeromq reads it: one scan per fill (up to bufConnSize bytes, many
// frames), not one per go-zeromq read (two or three per frame).
type bufConn struct {
	net.Conn
	r       *bufio.Reader
	guarded *guardedReader
}

func newBufConn(c net.Conn) *bufConn {
	g := &guardedReader{c: c, guard: newFrameGuard(MaxFrame)}
	return &bufConn{Conn: c, r: bufio.NewReaderSize(g, bufConnSize), guarded: g}
}

func (c *bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// guardedReader is the connection under the buffer: every byte read from
// it passes the frame guard once.
type guardedReader struct {
	c     net.Conn
	guard frameGuard
	err   error // the guard's refusal: every later read returns it
	// handshaking: an accepted connection whose peer has not yet sent its
	// greeting and READY; its reads have a deadline (bufListener.Accept)
	// lifted once they have come, when onHandshake (if any) is called.
	handshaking bool
	onHandshake func()
}

func (g *guardedReader) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.refuse()
	}
	n, err := g.c.Read(p)
	if g.handshaking {
		defer g.handshakeRead(err)
	}
	ok, gerr := g.guard.scan(p[:n])
	if gerr != nil {
		// The bytes before the refused frame's header go on, and the
		// connection stays open until the refusal is returned: a
		// handshake in the same read completes and the subscription that
		// follows it is written, so the reader that meets the refusal is
		// the one that counts it.
		// go-zeromq leaves a connection whose handshake fails unclosed
		// and unread, so a refusal deferred behind a handshake that then
		// fails would never be returned: the connection is closed after
		// refusedLinger whatever happens.
		g.err = gerr
		if ok > 0 {
			time.AfterFunc(refusedLinger, func() { _ = g.c.Close() })
			return ok, nil
		}
		return 0, g.refuse()
	}
	return n, err
}

// handshakeRead ends an accepted connection's handshake bound after a
// read: lifted once the peer's READY has passed, or, when the read timed
// out before it, the connection is closed (go-zeromq would leave it open).
func (g *guardedReader) handshakeRead(err error) {
	if g.guard.frames > 0 {
		g.handshaking = false
		_ = g.c.SetReadDeadline(time.Time{})
		if g.onHandshake != nil {
			g.onHandshake()
		}
		return
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		_ = g.c.Close()
	}
}

// refusedLinger bounds how long a connection whose frame was refused stays
// open for the bytes before that frame: the handshake's own time bound.
const refusedLinger = handshakeTimeout

// refuse closes the connection (nothing after a refused header can be
// read as frames) and returns the refusal.
func (g *guardedReader) refuse() error {
	_ = g.c.Close()
	return g.err
}
