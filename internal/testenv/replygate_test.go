package testenv

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"
)

// echoServer echoes each line back; stop closes it and every connection.
func echoServer(t *testing.T) (addr string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns <- c
			go func() { _, _ = io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String(), func() {
		_ = ln.Close()
		for {
			select {
			case c := <-conns:
				_ = c.Close()
			default:
				return
			}
		}
	}
}

func readLine(t *testing.T, r *bufio.Reader, c net.Conn, within time.Duration) (string, error) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	return r.ReadString('\n')
}

func TestReplyGate(t *testing.T) {
	addr, stop := echoServer(t)
	g := StartReplyGate(t, addr)
	c, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if _, err := c.Write([]byte("one\n")); err != nil {
		t.Fatal(err)
	}
	if l, err := readLine(t, r, c, 10*time.Second); err != nil || l != "one\n" {
		t.Fatalf("open gate: got %q, %v", l, err)
	}

	// Held: the server gets what the client sends, its replies wait.
	g.Hold()
	if _, err := c.Write([]byte("two\n")); err != nil {
		t.Fatal(err)
	}
	if l, err := readLine(t, r, c, 200*time.Millisecond); err == nil {
		t.Fatalf("held gate delivered %q", l)
	}
	g.Release()
	if l, err := readLine(t, r, c, 10*time.Second); err != nil || l != "two\n" {
		t.Fatalf("released gate: got %q, %v", l, err)
	}

	// The server going away while held closes the client's side at once,
	// dropping the replies held.
	g.Hold()
	if _, err := c.Write([]byte("three\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // let the echo come back into the gate
	stop()
	WaitFor(t, 10*time.Second, "the gate dropping the connection", func() bool { return g.Conns() == 0 })
	if l, err := readLine(t, r, c, 10*time.Second); err == nil || l != "" {
		t.Fatalf("after the server closed: got %q, %v; want the connection closed with nothing", l, err)
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the client's side stayed open after the server closed")
	}

	// A client connecting while the server is down is closed at once.
	g.Release()
	c2, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := readLine(t, bufio.NewReader(c2), c2, 10*time.Second); err == nil {
		t.Fatal("a connection with no server behind it delivered a line")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("a connection with no server behind it stayed open")
	}
}

// A server that sends its last words and closes while the gate is open:
// the client reads them, then the end of the connection.
func TestReplyGateLastWords(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("-ERR bye\n"))
			_ = c.Close()
		}
	}()
	g := StartReplyGate(t, ln.Addr().String())
	for range 20 {
		c, err := net.Dial("tcp", g.Addr())
		if err != nil {
			t.Fatal(err)
		}
		r := bufio.NewReader(c)
		if l, err := readLine(t, r, c, 10*time.Second); err != nil || l != "-ERR bye\n" {
			t.Fatalf("got %q, %v; want the server's last line", l, err)
		}
		if _, err := readLine(t, r, c, 10*time.Second); err == nil {
			t.Fatal("the connection stayed open after the server closed")
		} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatal("the client's side stayed open after the server closed")
		}
		c.Close()
	}
}
