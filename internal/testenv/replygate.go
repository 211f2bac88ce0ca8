package testenv

import (
	"net"
	"sync"
	"testing"
)

// ReplyGate is a TCP proxy in front of one server that can hold back what
// the server sends to its clients while still passing what they send it.
// Held, a JetStream publisher's acks stop arriving while its messages are
// stored: its window fills deterministically, whatever the machine's
// speed, so a test can make the server go away with messages in flight.
//
// When the server closes a connection (it shut down), the proxy closes
// the client's side at once and drops the replies it held, as a dying
// server would never have sent them. A client that reconnects gets a new
// connection to the server, or a closed one while the server is down.
type ReplyGate struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cond  *sync.Cond
	held  bool
	conns map[*gatedConn]struct{}
	done  bool
}

// gatedConn is one client connection and its server connection; replies
// read from the server wait in buf while the gate is held.
type gatedConn struct {
	client, server net.Conn
	buf            []byte
	closed         bool
	// eof: the server closed while replies were still to deliver and
	// the gate was open; deliver closes the client after writing them.
	eof bool
}

// StartReplyGate starts a gate in front of target (host:port) on a free
// port of 127.0.0.1; it closes at test cleanup.
func StartReplyGate(t testing.TB, target string) *ReplyGate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: reply gate: %v", err)
	}
	g := &ReplyGate{ln: ln, target: target, conns: map[*gatedConn]struct{}{}}
	g.cond = sync.NewCond(&g.mu)
	go g.accept()
	t.Cleanup(g.close)
	return g
}

// Addr is the gate's host:port.
func (g *ReplyGate) Addr() string { return g.ln.Addr().String() }

// Conns is the number of client connections open through the gate.
func (g *ReplyGate) Conns() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.conns)
}

// Hold stops delivering the server's replies to clients (they are kept).
func (g *ReplyGate) Hold() {
	g.mu.Lock()
	g.held = true
	g.mu.Unlock()
}

// Release delivers the replies held and every later one.
func (g *ReplyGate) Release() {
	g.mu.Lock()
	g.held = false
	g.mu.Unlock()
	g.cond.Broadcast()
}

func (g *ReplyGate) close() {
	_ = g.ln.Close()
	g.mu.Lock()
	g.done = true
	for c := range g.conns {
		g.drop(c)
	}
	g.mu.Unlock()
	g.cond.Broadcast()
}

func (g *ReplyGate) accept() {
	for {
		client, err := g.ln.Accept()
		if err != nil {
			return // closed
		}
		server, err := net.Dial("tcp", g.target)
		if err != nil {
			_ = client.Close() // the server is down: so is the connection
			continue
		}
		c := &gatedConn{client: client, server: server}
		g.mu.Lock()
		if g.done {
			g.mu.Unlock()
			_ = client.Close()
			_ = server.Close()
			return
		}
		g.conns[c] = struct{}{}
		g.mu.Unlock()
		go g.forward(c)
		go g.readReplies(c)
		go g.deliver(c)
	}
}

// drop closes both sides of c; g.mu is held.
func (g *ReplyGate) drop(c *gatedConn) {
	if c.closed {
		return
	}
	c.closed = true
	c.buf = nil
	_ = c.client.Close()
	_ = c.server.Close()
	delete(g.conns, c)
}

func (g *ReplyGate) dropLocked(c *gatedConn) {
	g.mu.Lock()
	g.drop(c)
	g.mu.Unlock()
	g.cond.Broadcast()
}

// forward copies what the client sends to the server, never held.
func (g *ReplyGate) forward(c *gatedConn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.client.Read(buf)
		if n > 0 {
			if _, werr := c.server.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			g.dropLocked(c)
			return
		}
	}
}

// readReplies reads the server's replies into c.buf as they come, so a
// server that goes away is seen at once even while the gate is held.
func (g *ReplyGate) readReplies(c *gatedConn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.server.Read(buf)
		g.mu.Lock()
		if n > 0 && !c.closed {
			c.buf = append(c.buf, buf[:n]...)
		}
		if err != nil && !g.held && len(c.buf) > 0 {
			// What the server sent before closing (an -ERR, say) still
			// reaches the client; deliver closes it after.
			c.eof = true
			err = nil
		}
		g.mu.Unlock()
		g.cond.Broadcast()
		if err != nil {
			g.dropLocked(c)
			return
		}
		if c.eofSeen(g) {
			return
		}
	}
}

// eofSeen reports whether the server's side ended with replies left to
// deliver (deliver closes the connection after them).
func (c *gatedConn) eofSeen(g *ReplyGate) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return c.eof
}

// deliver writes the replies read to the client whenever the gate is not
// held.
func (g *ReplyGate) deliver(c *gatedConn) {
	for {
		g.mu.Lock()
		for !c.closed && (g.held || len(c.buf) == 0) {
			if c.eof && (g.held || len(c.buf) == 0) {
				// The server is gone: held replies die with it, and
				// nothing more is coming.
				g.drop(c)
				break
			}
			g.cond.Wait()
		}
		if c.closed {
			g.mu.Unlock()
			return
		}
		out := c.buf
		c.buf = nil
		g.mu.Unlock()
		if _, err := c.client.Write(out); err != nil {
			g.dropLocked(c)
			return
		}
	}
}
