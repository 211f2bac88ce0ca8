package eventstest_test

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// TestStreamPUBWritesGoZeromqBytes: the bytes go-zeromq's PUB socket (the
// one enginezmq.Publisher uses) writes after the handshake for the captured
// vLLM batches and for bodies at the short/long frame boundary are the
// bytes ZMTPFrames makes, and a subscriber reads StreamPUB's stream as the
// same messages.
func TestStreamPUBWritesGoZeromqBytes(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	ps := eventstest.CapturedPayloads(t, "array.jsonl")
	ps = append(ps, []byte{}, bytes.Repeat([]byte{7}, 255), bytes.Repeat([]byte{8}, 256))
	const topic = "kv@127.0.0.1:8000@m"

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type opened struct {
		c   net.Conn
		zc  *zmq4.Conn
		err error
	}
	acc := make(chan opened, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			acc <- opened{err: err}
			return
		}
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		zc, err := zmq4.Open(c, null.Security(), zmq4.Sub, nil, true, nil)
		acc <- opened{c, zc, err}
	}()
	// The PUB dials: its handshake completes with the one above.
	pub, err := enginezmq.NewPublisher(ctx, enginezmq.PublisherConfig{Endpoint: "tcp://" + ln.Addr().String(), Dial: true, Topic: topic, FirstSeq: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	o := <-acc
	if o.err != nil {
		t.Fatal(o.err)
	}
	c, zc := o.c, o.zc
	defer c.Close()
	if err := zc.SendMsg(zmq4.NewMsg(append([]byte{1}, topic...))); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "subscribed", pub.Subscribed)
	var want []byte
	for i, p := range ps {
		if _, err := pub.Publish(p); err != nil {
			t.Fatal(err)
		}
		want = eventstest.ZMTPFrames(want, []byte(topic), enginezmq.SeqBytes(uint64(5+i)), p)
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("go-zeromq wrote %d bytes unlike ZMTPFrames' %d", len(got), len(want))
	}

	// The stream read back by a go-zeromq subscriber.
	s := eventstest.NewStreamPUB(t, topic, ps)
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- s.Accept(10 * time.Second) }()
	if err := sub.Dial(s.Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	n := uint64(3*len(ps) + 1)
	go func() { errc <- s.Send(100, n) }()
	for i := range n {
		m := eventstest.Recv(t, sub)
		if m.Topic != topic || m.Seq != 100+i || !bytes.Equal(m.Payload, ps[int(i)%len(ps)]) {
			t.Fatalf("message %d: got topic %q seq %d payload of %d bytes", i, m.Topic, m.Seq, len(m.Payload))
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}
