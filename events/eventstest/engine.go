package eventstest

import (
	"context"
	"fmt"
	"testing"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// Publisher starts a vLLM-format ZMQ publisher for cfg, closed when the
// test ends (after the cleanups registered later, such as a bridge
// reading it). Empty endpoints get free local ports (the replay socket
// too) and an empty topic is "kv"; the config returned is the one used,
// whose endpoints a bridge source subscribes to.
func Publisher(t testing.TB, ctx context.Context, cfg enginezmq.PublisherConfig) (*enginezmq.Publisher, enginezmq.PublisherConfig) {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	}
	if cfg.ReplayEndpoint == "" {
		cfg.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	}
	if cfg.Topic == "" {
		cfg.Topic = "kv"
	}
	pub, err := enginezmq.NewPublisher(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub, cfg
}

// Publish sends b on pub as vLLM does (array encoding).
func Publish(t testing.TB, pub *enginezmq.Publisher, b events.Batch) {
	t.Helper()
	payload, err := events.Encode(nil, b, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pub.Publish(payload); err != nil {
		t.Fatal(err)
	}
}

// Recv reads the next message from a subscriber of a vLLM-format publisher
// and splits its frames (topic, sequence, payload), failing the test when
// either step fails.
func Recv(t testing.TB, sub zmq4.Socket) enginezmq.Message {
	t.Helper()
	msg, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	m, err := enginezmq.ParseLiveFrames(msg.Frames)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
