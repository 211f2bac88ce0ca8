package testenv

import (
	"net"
	"testing"

	"github.com/nats-io/nats.go"
)

func TestRedisAnswersPing(t *testing.T) {
	addr := Redis(t)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	n, err := c.Read(buf)
	if err != nil || string(buf[:n]) != "+PONG\r\n" {
		t.Fatalf("PING: got %q, %v", buf[:n], err)
	}
}

func TestNATSRestartKeepsJetStream(t *testing.T) {
	s := StartNATS(t)
	nc, err := nats.Connect(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	js, _ := nc.JetStream()
	name := UniqueName(t)
	if _, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name + ".>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(name+".a", []byte("x")); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	s = s.Restart(t)
	nc, err = nats.Connect(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ = nc.JetStream()
	info, err := js.StreamInfo(name)
	if err != nil || info.State.Msgs != 1 {
		t.Fatalf("after restart: %+v %v", info, err)
	}
}
