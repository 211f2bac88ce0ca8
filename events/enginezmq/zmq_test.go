package enginezmq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

func TestParseLiveFrames(t *testing.T) {
	tests := []struct {
		name    string
		frames  [][]byte
		want    Message
		wantErr bool
	}{
		{"three frames", [][]byte{[]byte("kv@1.2.3.4:8000@m"), SeqBytes(7), {0x93}}, Message{Topic: "kv@1.2.3.4:8000@m", Seq: 7, Payload: []byte{0x93}}, false},
		{"no topic", [][]byte{SeqBytes(1), {1, 2}}, Message{Seq: 1, Payload: []byte{1, 2}}, false},
		{"short seq", [][]byte{[]byte("kv"), {0, 1}, {1}}, Message{}, true},
		{"one frame", [][]byte{{1}}, Message{}, true},
		{"four frames", [][]byte{{}, {}, SeqBytes(1), {}}, Message{}, true},
		{"none", nil, Message{}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseLiveFrames(tc.frames)
			if tc.wantErr {
				if !errors.Is(err, ErrBadFrames) {
					t.Fatalf("err = %v, want ErrBadFrames", err)
				}
				return
			}
			if err != nil || got.Topic != tc.want.Topic || got.Seq != tc.want.Seq || !bytes.Equal(got.Payload, tc.want.Payload) {
				t.Fatalf("got %+v %v, want %+v", got, err, tc.want)
			}
		})
	}
}

// The shapes are the ones in events/testdata/captured/DATA.md (a
// DEALER sees ["", topic, seq, payload], the end marker has topic "") plus
// the older [seq, payload] at a DEALER and at a REQ.
func TestParseReplayFrames(t *testing.T) {
	tests := []struct {
		name    string
		frames  [][]byte
		seq     uint64
		topic   string
		end     bool
		wantErr bool
	}{
		{"dealer new", [][]byte{{}, []byte("kv@h@m"), SeqBytes(3), {0x93}}, 3, "kv@h@m", false, false},
		{"dealer new end", [][]byte{{}, {}, SeqBytes(EndSeq), {}}, EndSeq, "", true, false},
		{"dealer old", [][]byte{{}, SeqBytes(4), {0x93}}, 4, "", false, false},
		{"dealer old end", [][]byte{{}, SeqBytes(EndSeq), {}}, EndSeq, "", true, false},
		{"req new", [][]byte{[]byte("kv"), SeqBytes(5), {0x93}}, 5, "kv", false, false},
		{"req old", [][]byte{SeqBytes(6), {0x93}}, 6, "", false, false},
		{"bad seq", [][]byte{{}, []byte("kv"), {1, 2, 3}, {}}, 0, "", false, true},
		{"too many", [][]byte{{}, {}, {}, SeqBytes(1), {}}, 0, "", false, true},
		{"one", [][]byte{SeqBytes(1)}, 0, "", false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, end, err := ParseReplayFrames(tc.frames)
			if tc.wantErr {
				if !errors.Is(err, ErrBadFrames) {
					t.Fatalf("err = %v, want ErrBadFrames", err)
				}
				return
			}
			if err != nil || m.Seq != tc.seq || m.Topic != tc.topic || end != tc.end {
				t.Fatalf("got %+v end=%v err=%v", m, end, err)
			}
		})
	}
}

func FuzzParseFrames(f *testing.F) {
	f.Add([]byte("kv"), SeqBytes(1), []byte{0x93}, uint8(3))
	f.Add([]byte{}, SeqBytes(EndSeq), []byte{}, uint8(4))
	f.Fuzz(func(t *testing.T, a, b, c []byte, n uint8) {
		frames := [][]byte{a, b, c, {}, a}[:n%6]
		if m, err := ParseLiveFrames(frames); err == nil && len(frames) >= 2 && !bytes.Equal(m.Payload, frames[len(frames)-1]) {
			t.Fatal("live payload is not the last frame")
		}
		if m, end, err := ParseReplayFrames(frames); err == nil {
			if !bytes.Equal(m.Payload, frames[len(frames)-1]) || end != (m.Seq == EndSeq) {
				t.Fatal("replay parse inconsistent")
			}
		}
	})
}

func TestSeqTracker(t *testing.T) {
	type step struct {
		seq  uint64
		want SeqStatus
		from uint64
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"in order from 0", []step{{0, SeqFirst, 0}, {1, SeqNext, 0}, {2, SeqNext, 0}}},
		{"gap", []step{{1, SeqFirst, 0}, {2, SeqNext, 0}, {5, SeqGap, 3}, {6, SeqNext, 0}}},
		{"restart to 0", []step{{10, SeqFirst, 0}, {11, SeqNext, 0}, {0, SeqRestart, 0}, {1, SeqNext, 0}}},
		{"restart to 1", []step{{10, SeqFirst, 0}, {1, SeqRestart, 0}}},
		{"duplicate is restart", []step{{4, SeqFirst, 0}, {4, SeqRestart, 0}}},
		{"first may be anything", []step{{123456, SeqFirst, 0}, {123457, SeqNext, 0}}},
		{"near max", []step{{EndSeq - 2, SeqFirst, 0}, {EndSeq - 1, SeqNext, 0}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var tr SeqTracker
			for i, s := range tc.steps {
				st, from := tr.Observe(s.seq)
				if st != s.want || from != s.from {
					t.Fatalf("step %d seq %d: got %v from %d, want %v from %d", i, s.seq, st, from, s.want, s.from)
				}
			}
		})
	}
}

// collector gathers subscriber output for assertions.
type collector struct {
	mu   sync.Mutex // guards msgs
	msgs []Message
}

func (c *collector) add(m Message) { c.mu.Lock(); c.msgs = append(c.msgs, m); c.mu.Unlock() }
func (c *collector) seqs() []uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]uint64, len(c.msgs))
	for i, m := range c.msgs {
		out[i] = m.Seq
	}
	return out
}

func TestSubscriberLive(t *testing.T) {
	for _, bind := range []bool{false, true} {
		t.Run(fmt.Sprintf("bind=%v", bind), func(t *testing.T) {
			ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
			defer cancel()
			ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
			sub, err := NewSubscriber(SubscriberConfig{Endpoint: ep, Bind: bind, MinBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			var got collector
			done := make(chan error, 1)
			go func() { done <- sub.Run(ctx, got.add) }()
			if bind {
				time.Sleep(100 * time.Millisecond) // let the subscriber bind first
			}
			pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, Dial: bind, Topic: "kv", FirstSeq: 1})
			if err != nil {
				t.Fatal(err)
			}
			testenv.WaitFor(t, 10*time.Second, "subscription", pub.Subscribed)
			for i := 0; i < 5; i++ {
				if _, err := pub.Publish([]byte{byte(i)}); err != nil {
					t.Fatal(err)
				}
			}
			testenv.WaitFor(t, 10*time.Second, "5 messages", func() bool { return len(got.seqs()) == 5 })
			if s := got.seqs(); s[0] != 1 || s[4] != 5 {
				t.Fatalf("seqs %v", s)
			}
			// The engine goes away and comes back: the subscriber reconnects.
			pub.Close()
			pub2, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, Dial: bind, Topic: "kv", FirstSeq: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer pub2.Close()
			testenv.WaitFor(t, 10*time.Second, "resubscription", pub2.Subscribed)
			if _, err := pub2.Publish([]byte("again")); err != nil {
				t.Fatal(err)
			}
			testenv.WaitFor(t, 10*time.Second, "message after reconnect", func() bool { return len(got.seqs()) == 6 })
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("Run returned %v", err)
			}
		})
	}
}

// An engine that dials a subscriber that binds (llm-d-inference-sim's
// layout) and restarts reaches it as a new connection, not as a reconnect of
// the subscriber: OnConnect must still be told, for each engine connection,
// so that the owner checks the engine's replay (a restarted process, a tail
// published before the connection) without waiting for its next message.
// It used to be told only once, when the socket started listening.
func TestSubscriberBindOnConnectPerEngine(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	defer cancel()
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	connects, _ := bindCounting(ctx, t, ep)
	for round := 1; round <= 2; round++ {
		before := connects.Load()
		pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, Dial: true, Topic: "kv", FirstSeq: 1})
		if err != nil {
			t.Fatal(err)
		}
		testenv.WaitFor(t, 10*time.Second, "subscription", pub.Subscribed)
		// No message is published: only the connection can tell.
		testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("OnConnect for engine connection %d", round),
			func() bool { return connects.Load() > before })
		pub.Close()
	}
}

// bindCounting runs a subscriber bound at ep until ctx ends, counting its
// OnConnect calls (the first: listening, waited for) and collecting what
// it receives.
func bindCounting(ctx context.Context, t *testing.T, ep string) (*atomic.Int64, *collector) {
	t.Helper()
	connects, got := &atomic.Int64{}, &collector{}
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: ep, Bind: true, OnConnect: func() { connects.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = sub.Run(ctx, got.add) }()
	testenv.WaitFor(t, 10*time.Second, "listening", func() bool { return connects.Load() >= 1 })
	return connects, got
}

// A subscriber that binds must not be held by a peer that connects and
// sends nothing (a half-open connection, a stray client): go-zeromq
// handshakes each accepted connection inline in its accept loop, so
// before the handshake bound no engine could connect after such a peer.
// The silent connection is closed after handshakeTimeout, the engine that
// dials next is heard, and only the engine's connection is counted as one.
func TestSubscriberBindSilentPeer(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 60*time.Second))
	defer cancel()
	port := testenv.FreePort(t)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", port)
	connects, got := bindCounting(ctx, t, ep)
	silent, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	time.Sleep(100 * time.Millisecond) // the accept loop is in its handshake
	if n := connects.Load(); n != 1 {
		t.Fatalf("a silent TCP connection counted as an engine connection (%d)", n-1)
	}
	pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, Dial: true, Topic: "kv", FirstSeq: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	testenv.WaitFor(t, 3*handshakeTimeout, "the engine's subscription behind a silent peer", pub.Subscribed)
	for i := 0; i < 3; i++ {
		if _, err := pub.Publish([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "the engine's messages", func() bool { return len(got.seqs()) == 3 })
	if n := connects.Load(); n != 2 {
		t.Fatalf("engine connections counted %d, want 1", n-1)
	}
	// The silent peer's connection was closed by the bound (after the
	// subscriber's own greeting, which it reads first).
	_ = silent.SetReadDeadline(time.Now().Add(2 * handshakeTimeout))
	for buf := make([]byte, 256); ; {
		if _, err := silent.Read(buf); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("the silent peer's connection still open after the handshake bound")
			}
			break
		}
	}
}

func TestReplay(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			ctx := testenv.Context(t, 30*time.Second)
			ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
			rep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
			pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, ReplayEndpoint: rep, Topic: "kv", BufferSteps: 5, LegacyReplay: legacy})
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			for i := 0; i < 8; i++ { // seq 0..7; the buffer keeps 3..7
				if _, err := pub.Publish([]byte{byte(i)}); err != nil {
					t.Fatal(err)
				}
			}
			cfg := ReplayConfig{Endpoint: rep, Timeout: 5 * time.Second}
			tests := []struct {
				from, to uint64
				want     []uint64
				wantErr  bool
			}{
				{4, 7, []uint64{4, 5, 6}, false},
				{3, 8, []uint64{3, 4, 5, 6, 7}, false},
				{2, 5, nil, true},  // 2 is no longer buffered
				{6, 10, nil, true}, // 8, 9 do not exist yet
				{5, 5, nil, false},
			}
			for _, tc := range tests {
				ms, err := ReplayRange(ctx, cfg, tc.from, tc.to)
				if tc.wantErr {
					if !errors.Is(err, ErrReplayIncomplete) {
						t.Fatalf("[%d,%d): err = %v, want ErrReplayIncomplete", tc.from, tc.to, err)
					}
					continue
				}
				if err != nil {
					t.Fatalf("[%d,%d): %v", tc.from, tc.to, err)
				}
				if len(ms) != len(tc.want) {
					t.Fatalf("[%d,%d): got %d messages", tc.from, tc.to, len(ms))
				}
				for i, m := range ms {
					if m.Seq != tc.want[i] || len(m.Payload) != 1 || m.Payload[0] != byte(m.Seq) {
						t.Fatalf("[%d,%d): message %d = %+v", tc.from, tc.to, i, m)
					}
					if !legacy && m.Topic != "kv" {
						t.Fatalf("topic %q", m.Topic)
					}
				}
			}
		})
	}
}

func TestReplayUnavailable(t *testing.T) {
	ctx := testenv.Context(t, 30*time.Second)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	start := time.Now()
	_, err := ReplayRange(ctx, ReplayConfig{Endpoint: ep, Timeout: time.Second}, 1, 3)
	if !errors.Is(err, ErrReplayIncomplete) {
		t.Fatalf("err = %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v, timeout is 1s", d)
	}
}

// Bad frames are dropped and counted; the subscriber keeps reading.
func TestSubscriberMalformedFrames(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	defer cancel()
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(quietZMQLogger()))
	defer pub.Close()
	if err := pub.Listen(ep); err != nil {
		t.Fatal(err)
	}
	var bad atomic.Int32
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: ep, OnMalformed: func(error) { bad.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	var got collector
	go func() { _ = sub.Run(ctx, got.add) }()
	testenv.WaitFor(t, 10*time.Second, "subscription", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })
	for _, m := range []zmq4.Msg{
		zmq4.NewMsgFrom([]byte("kv")),                            // one frame
		zmq4.NewMsgFrom([]byte("kv"), []byte{1, 2}, []byte{3}),   // 2-byte seq
		zmq4.NewMsgFrom([]byte("kv"), SeqBytes(9), []byte{0x93}), // good
	} {
		if err := pub.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "the good message", func() bool { return len(got.seqs()) == 1 })
	if s := sub.Stats(); s.Malformed != 2 || bad.Load() != 2 || s.Messages != 1 || got.seqs()[0] != 9 {
		t.Fatalf("stats %+v, hook %d", s, bad.Load())
	}
}

func TestNewSubscriberValidates(t *testing.T) {
	for _, cfg := range []SubscriberConfig{{}, {Endpoint: "http://x:1"}, {Endpoint: "tcp://x:1", MinBackoff: time.Second, MaxBackoff: time.Millisecond}} {
		if _, err := NewSubscriber(cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
}

// An engine's whole history before a seq is ReplayRange from its first
// seq, whether the engine counts from 0 (vLLM) or 1: it refuses a buffer
// that no longer reaches back to the first message, and a history of an
// engine counting from 0 that begins at 1 (its seq 0 lost). It replaced
// ReplayHistory, which took either 0 or 1 as the first seq, so that a
// history missing seq 0 read as complete.
func TestReplayHistory(t *testing.T) {
	ctx := testenv.Context(t, 30*time.Second)
	for _, first := range []uint64{0, 1} {
		pub, rep := startPublisher(t, ctx, PublisherConfig{BufferSteps: 6, FirstSeq: first})
		cfg := ReplayConfig{Endpoint: rep, Timeout: 5 * time.Second}
		for i := 0; i < 4; i++ {
			if _, err := pub.Publish([]byte{byte(i)}); err != nil {
				t.Fatal(err)
			}
		}
		for to := uint64(0); to <= first+4; to++ {
			ms, err := ReplayRange(ctx, cfg, first, to)
			if err != nil {
				t.Fatalf("first %d, to %d: %v", first, to, err)
			}
			want := 0
			if to > first {
				want = int(to - first)
			}
			if len(ms) != want || (want > 0 && (ms[0].Seq != first || ms[want-1].Seq != to-1)) {
				t.Fatalf("first %d, to %d: got %d messages %+v", first, to, len(ms), ms)
			}
		}
		if _, err := ReplayRange(ctx, cfg, first, first+6); !errors.Is(err, ErrReplayIncomplete) {
			t.Fatalf("first %d: replay past the newest message: err = %v", first, err)
		}
		if first == 1 {
			// An engine counting from 0 whose buffer begins at 1.
			// The error says where the replay began (a bridge's
			// --first-seq 0 before an engine numbering from 1).
			var later *ReplayBeganLater
			if _, err := ReplayRange(ctx, cfg, 0, 3); !errors.Is(err, ErrReplayIncomplete) || !errors.As(err, &later) || later.Began != 1 || later.From != 0 {
				t.Fatalf("a history from 0 answered from 1: err = %v", err)
			}
		}
		for i := 0; i < 4; i++ { // the buffer (6) no longer holds the first message
			if _, err := pub.Publish([]byte{byte(i)}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := ReplayRange(ctx, cfg, first, first+8); !errors.Is(err, ErrReplayIncomplete) {
			t.Fatalf("first %d: buffer passed the first message: err = %v", first, err)
		}
	}
}

// startPublisher starts a publisher for cfg on free local ports (its PUB
// and replay sockets) with topic "kv", closed when the test ends, and
// returns it and its replay endpoint.
func startPublisher(t *testing.T, ctx context.Context, cfg PublisherConfig) (*Publisher, string) {
	t.Helper()
	cfg.Endpoint = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	cfg.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	cfg.Topic = "kv"
	pub, err := NewPublisher(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub, cfg.ReplayEndpoint
}

// A replay is bounded in bytes as in messages: a caller holds every reply
// until the end marker, and each may be up to MaxFrame, so 100,000 of
// them (MaxMessages) bounded nothing in practice. Past MaxBytes the
// replay fails as past MaxMessages; a first reply larger than the bound
// alone is still read. Before the bound, all five replies were read.
//
// The first reply is not counted: a caller that asks from the message
// before a hole to compare it (the bridge) needs the second, and a
// message that fits the bound alone is replayable after it. Counting the
// first, a bound of 1,000 bytes failed at the second 1,000-byte reply
// (the 1,000 case read 1 reply, 2,500 read 2, 4,000 failed at the 5th).
func TestReplayMaxBytes(t *testing.T) {
	ctx := testenv.Context(t, 30*time.Second)
	pub, rep := startPublisher(t, ctx, PublisherConfig{})
	for i := range 5 {
		if _, err := pub.Publish(bytes.Repeat([]byte{byte(i)}, 1000)); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		max, read int
		fails     bool
	}{
		{max: 5000, read: 5},
		{max: 4000, read: 5},
		{max: 2500, read: 3, fails: true},
		{max: 1000, read: 2, fails: true},
		{max: 10, read: 1, fails: true},
	} {
		read := 0
		err := Replay(ctx, ReplayConfig{Endpoint: rep, Timeout: 5 * time.Second, MaxBytes: tc.max}, 0, func(Message) bool {
			read++
			return true
		})
		if (err != nil) != tc.fails || read != tc.read {
			t.Errorf("max %d bytes: %d replies handed on, err %v; want %d, failing %v", tc.max, read, err, tc.read, tc.fails)
		}
	}
}

// Kick ends a reconnect wait at once: a subscriber whose backoff has grown
// connects as soon as it is kicked, not at the end of the wait.
func TestSubscriberKick(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	defer cancel()
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	var logs testenv.Logs
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: ep, MinBackoff: time.Hour, MaxBackoff: time.Hour, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var got collector
	go func() { _ = sub.Run(ctx, got.add) }()
	// Nobody listens: the first dial fails and the next waits an hour.
	testenv.WaitFor(t, 20*time.Second, "a failed dial", func() bool { return sub.Stats().Reconnects >= 1 })
	pub, err := NewPublisher(ctx, PublisherConfig{Endpoint: ep, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	sub.Kick()
	testenv.WaitFor(t, 10*time.Second, "subscribed after the kick", pub.Subscribed)
	// The log says the outage ended, not only that it began.
	testenv.WaitFor(t, 10*time.Second, "the reconnection logged", func() bool {
		return strings.Contains(logs.String(), "zmq subscriber: connected again")
	})
}

// TestParseLiveFramesLastTopic: the topic returned is the frame's, whether
// or not it spells the last one.
func TestParseLiveFramesLastTopic(t *testing.T) {
	for _, last := range []string{"", "kv", "kv@a", "kv@b"} {
		m, err := parseLiveFrames([][]byte{[]byte("kv@a"), SeqBytes(7), []byte("p")}, last)
		if err != nil || m.Topic != "kv@a" || m.Seq != 7 || string(m.Payload) != "p" {
			t.Fatalf("last %q: %+v, %v", last, m, err)
		}
	}
}

// TestSubscriberAnswersHeartbeat: a PUB that sends ZMTP 3.1 heartbeats
// (libzmq with ZMQ_HEARTBEAT_IVL set) between messages: the dialing
// subscriber answers the PING with a PONG and goes on reading messages.
func TestSubscriberAnswersHeartbeat(t *testing.T) {
	ctx, cancel, ln := engineListener(t)
	defer cancel()
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + ln.Addr().String(), Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	var got collector
	go func() { _ = sub.Run(ctx, got.add) }()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	pub, err := zmq4.Open(c, null.Security(), zmq4.Pub, nil, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	if m, err := pub.RecvMsg(); err != nil || len(m.Frames) != 1 || string(m.Frames[0]) != "\x01kv" {
		t.Fatalf("subscription %q, %v", m.Frames, err)
	}
	send := func(seq uint64) {
		if err := pub.SendMsg(zmq4.NewMsgFrom([]byte("kv"), SeqBytes(seq), []byte{0x93})); err != nil {
			t.Fatal(err)
		}
	}
	send(1)
	if err := pub.SendCmd(zmq4.CmdPing, []byte{0, 10}); err != nil { // TTL 1 s, no context
		t.Fatal(err)
	}
	send(2)
	if cmd, err := pub.RecvCmd(); err != nil || cmd.Name != zmq4.CmdPong {
		t.Fatalf("answer to the ping: %+v, %v", cmd, err)
	}
	testenv.WaitFor(t, 10*time.Second, "both messages", func() bool { return len(got.seqs()) == 2 })
	if s := sub.Stats(); s.Messages != 2 || s.Malformed != 0 {
		t.Fatalf("stats %+v", s)
	}
}
