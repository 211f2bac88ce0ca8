package eventstest

import (
	"context"
	"encoding/binary"
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

// UnreadableRemoval is an engine message [ts, [["BlockRemoved", [h], 7]],
// 0] (array encoding) whose one removal cannot be read (its medium is an
// integer, where a string belongs): the engine dropped block h, and no
// index can be told of it (events.Batch.InvalidRemovals is 1).
func UnreadableRemoval(t testing.TB, h uint64) []byte {
	t.Helper()
	bad := []byte{0x93, 0x01, 0x91, 0x93, 0xac}
	bad = append(bad, "BlockRemoved"...)
	bad = append(bad, 0x91, 0xcf)
	bad = binary.BigEndian.AppendUint64(bad, h)
	bad = append(bad, 0x07, 0x00)
	if b, err := events.Decode(bad); err != nil || b.InvalidRemovals != 1 {
		t.Fatalf("the test's batch: %+v, %v; want one unreadable removal", b, err)
	}
	return bad
}
