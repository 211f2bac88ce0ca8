package enginezmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// EndSeq is the sequence number of the replay end marker (sent with an
// empty payload), as vLLM's ZmqEventPublisher defines it.
const EndSeq = ^uint64(0)

// ErrBadFrames is returned for a ZMQ message whose frames are not a vLLM
// KV-event message.
var ErrBadFrames = errors.New("enginezmq: malformed zmq frames")

// Message is one KV-event message as published by an engine: the topic (may
// be empty), the publisher's sequence number and the msgpack EventBatch.
type Message struct {
	Topic   string
	Seq     uint64
	Payload []byte
	// span is Payload with the rest of the chunk it was carved from after
	// it (payloads.go), nil when it was not: what JoinPayloads reads.
	span []byte
}

// ParseLiveFrames parses a PUB message [topic, seq, payload]. A two-frame
// [seq, payload] is accepted too (no topic configured).
func ParseLiveFrames(frames [][]byte) (Message, error) { return parseLiveFrames(frames, "") }

// parseLiveFrames is ParseLiveFrames returning last as the topic when the
// topic frame spells it: an engine's topic never changes, and this way
// its string is not made again for every message.
func parseLiveFrames(frames [][]byte, last string) (Message, error) {
	switch len(frames) {
	case 3:
		if len(frames[1]) != 8 {
			return Message{}, fmt.Errorf("%w: seq frame is %d bytes, want 8", ErrBadFrames, len(frames[1]))
		}
		topic := last
		if string(frames[0]) != last {
			topic = string(frames[0])
		}
		return Message{Topic: topic, Seq: binary.BigEndian.Uint64(frames[1]), Payload: frames[2]}, nil
	case 2:
		if len(frames[0]) != 8 {
			return Message{}, fmt.Errorf("%w: seq frame is %d bytes, want 8", ErrBadFrames, len(frames[0]))
		}
		return Message{Seq: binary.BigEndian.Uint64(frames[0]), Payload: frames[1]}, nil
	}
	return Message{}, fmt.Errorf("%w: %d frames, want [topic, seq, payload]", ErrBadFrames, len(frames))
}

// ParseReplayFrames parses one reply of an engine's replay (ROUTER) socket
// as seen by a DEALER or REQ. The shapes differ by engine version and by
// socket: newer engines send [topic, seq, payload], older [seq, payload],
// and a DEALER sees an empty delimiter frame first. In every shape the seq
// is the second-to-last frame and the payload the last, so that is how it
// is read; a leading frame, if any, that is not the delimiter is the topic.
// end is true for the end marker (seq EndSeq).
func ParseReplayFrames(frames [][]byte) (m Message, end bool, err error) {
	n := len(frames)
	if n < 2 || n > 4 {
		return Message{}, false, fmt.Errorf("%w: replay reply has %d frames", ErrBadFrames, n)
	}
	seq := frames[n-2]
	if len(seq) != 8 {
		return Message{}, false, fmt.Errorf("%w: replay seq frame is %d bytes, want 8", ErrBadFrames, len(seq))
	}
	m.Seq = binary.BigEndian.Uint64(seq)
	m.Payload = frames[n-1]
	if n >= 3 {
		m.Topic = string(frames[n-3])
	}
	return m, m.Seq == EndSeq, nil
}

// SeqBytes is seq as the 8-byte big-endian frame vLLM uses.
func SeqBytes(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// SeqStatus classifies a sequence number against the previous one of the
// same publisher.
type SeqStatus uint8

const (
	// SeqFirst: nothing seen before from this publisher.
	SeqFirst SeqStatus = iota
	// SeqNext: exactly one after the previous.
	SeqNext
	// SeqGap: messages were lost between the previous and this one.
	SeqGap
	// SeqRestart: the sequence went back (to 0/1, or to any value not
	// above the previous): the publisher restarted and its cache is new.
	SeqRestart
)

func (s SeqStatus) String() string {
	switch s {
	case SeqFirst:
		return "first"
	case SeqNext:
		return "next"
	case SeqGap:
		return "gap"
	case SeqRestart:
		return "restart"
	}
	return "unknown"
}

// SeqTracker follows one publisher's sequence numbers. The zero value has
// seen nothing. It is not safe for concurrent use.
type SeqTracker struct {
	last uint64
	seen bool
}

// Observe classifies seq and records it as the latest. For SeqGap the
// missing range is [from, seq).
func (t *SeqTracker) Observe(seq uint64) (st SeqStatus, from uint64) {
	prev, seen := t.last, t.seen
	t.last, t.seen = seq, true
	switch {
	case !seen:
		return SeqFirst, 0
	case seq == prev+1:
		return SeqNext, 0
	case seq > prev+1:
		return SeqGap, prev + 1
	default:
		return SeqRestart, 0
	}
}

// Last returns the latest sequence number, if any.
func (t *SeqTracker) Last() (uint64, bool) { return t.last, t.seen }

// Set records seq as the latest without classifying it (after a replay).
func (t *SeqTracker) Set(seq uint64) { t.last, t.seen = seq, true }

// Reset forgets the publisher.
func (t *SeqTracker) Reset() { t.last, t.seen = 0, false }

// SubscriberConfig configures a Subscriber. The zero value of every field
// but Endpoint means the documented default.
type SubscriberConfig struct {
	// Endpoint is the engine's PUB endpoint, e.g. tcp://10.0.0.5:5557.
	Endpoint string
	// Bind makes the subscriber listen on Endpoint instead of dialing it,
	// for engines configured to dial (llm-d-inference-sim does).
	Bind bool
	// Topic is the subscription prefix; "" subscribes to everything.
	Topic string
	// MinBackoff and MaxBackoff bound the reconnect delay, doubled per
	// failure (defaults 100ms and 5s: quick recovery when an engine
	// restarts, without spinning when it is gone).
	MinBackoff, MaxBackoff time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnMalformed, when set, is called (on the Run goroutine) for each
	// message dropped for bad frames, so the owner can count it.
	OnMalformed func(error)
	// OnConnect, when set, is called each time the socket is connected
	// (or listening) again, on the Run goroutine, and, with Bind, each
	// time an engine connects to it and completes its handshake (a TCP
	// connection that sends no ZMTP greeting and READY is none), on
	// go-zeromq's accept goroutine.
	// Messages the engine published while it was not connected, and a
	// tail no later message reveals as a gap, are only in the engine's
	// replay buffer: the owner asks for them. An engine that dials comes
	// back from a restart as a new connection to a socket that never
	// stopped listening: that connection is the only sign of it before
	// the engine's next message. It must not block (the accept loop
	// waits for it).
	OnConnect func()
}

// SubscriberStats are a Subscriber's counters since it was made.
type SubscriberStats struct {
	Messages   uint64 // well-formed messages handed on
	Malformed  uint64 // messages dropped for bad frames
	Reconnects uint64 // connection attempts after the first
}

// Subscriber reads KV-event messages from one engine PUB socket,
// reconnecting with backoff, and never stops on bad input.
type Subscriber struct {
	cfg                             SubscriberConfig
	messages, malformed, reconnects atomic.Uint64
	accepted                        atomic.Uint64 // engine connections handshaken (Bind)
	kick                            chan struct{}
	topic                           string // of the last message (owned by Run)
}

// NewSubscriber validates cfg and fills its defaults.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	if err := validEndpoint(cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 100 * time.Millisecond
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 5 * time.Second
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		return nil, fmt.Errorf("enginezmq: subscriber max backoff %v is below min backoff %v", cfg.MaxBackoff, cfg.MinBackoff)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Subscriber{cfg: cfg, kick: make(chan struct{}, 1)}, nil
}

// Kick cuts the current reconnect wait short and resets the backoff: the
// owner learnt by other means (the engine's HTTP health) that the engine is
// back, so waiting up to MaxBackoff more would only delay its events.
func (s *Subscriber) Kick() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func validEndpoint(ep string) error {
	if ep == "" {
		return errors.New("enginezmq: zmq endpoint is empty")
	}
	if !strings.HasPrefix(ep, "tcp://") && !strings.HasPrefix(ep, "ipc://") && !strings.HasPrefix(ep, "inproc://") {
		return fmt.Errorf("enginezmq: zmq endpoint %q: want tcp://host:port, ipc:// or inproc://", ep)
	}
	return nil
}

// Stats returns the subscriber's counters.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{Messages: s.messages.Load(), Malformed: s.malformed.Load(), Reconnects: s.reconnects.Load()}
}

// quietZMQLogger keeps zmq4's internal log lines out of stderr; the
// subscriber logs what matters through slog.
func quietZMQLogger() *log.Logger { return log.New(io.Discard, "", 0) }

// Run reads messages until ctx is done and calls handle for each, in
// order, from this goroutine. It returns ctx.Err().
func (s *Subscriber) Run(ctx context.Context, handle func(Message)) error {
	backoff := s.cfg.MinBackoff
	first := true
	for ctx.Err() == nil {
		if !first {
			s.reconnects.Add(1)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(backoff):
				backoff = min(2*backoff, s.cfg.MaxBackoff)
			case <-s.kick:
				backoff = s.cfg.MinBackoff
			}
		}
		first = false
		got, err := s.session(ctx, handle)
		if got {
			backoff = s.cfg.MinBackoff
		}
		if err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("zmq subscriber: reconnecting", "endpoint", s.cfg.Endpoint, "bind", s.cfg.Bind, "err", err, "backoff", backoff)
		}
	}
	return ctx.Err()
}

// session runs one socket until it fails; got reports whether any message
// arrived (which resets the backoff).
func (s *Subscriber) session(ctx context.Context, handle func(Message)) (got bool, err error) {
	if addr, ok := strings.CutPrefix(s.cfg.Endpoint, "tcp://"); ok && !s.cfg.Bind {
		return s.dialSession(ctx, addr, handle)
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if s.cfg.Bind {
		sctx = context.WithValue(sctx, acceptHookKey{}, s.engineConnected)
	}
	sock := zmq4.NewSub(sctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(quietZMQLogger()), zmq4.WithDialerTimeout(handshakeTimeout))
	defer sock.Close()
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return false, fmt.Errorf("subscribe: %w", err)
	}
	if s.cfg.Bind {
		if err := sock.Listen(bufEndpoint(s.cfg.Endpoint)); err != nil {
			return false, fmt.Errorf("listen: %w", err)
		}
	} else if err := sock.Dial(bufEndpoint(s.cfg.Endpoint)); err != nil {
		return false, fmt.Errorf("dial: %w", err)
	}
	s.connected()
	for {
		msg, err := sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return got, ctx.Err()
			}
			s.refused(err)
			if s.cfg.Bind {
				// One peer went away; the listener still accepts others
				// (and the same engine when it comes back).
				s.cfg.Logger.Debug("zmq subscriber: peer error", "endpoint", s.cfg.Endpoint, "err", err)
				continue
			}
			return got, fmt.Errorf("recv: %w", err)
		}
		got = s.deliver(msg.Frames, nil, handle) || got
	}
}

// dialSession is session for a TCP endpoint the subscriber dials (vLLM's
// layout): the one connection is read on this goroutine. A go-zeromq SUB
// socket reads each connection on a goroutine of its own and hands every
// message to Recv through a channel: a goroutine switch per engine
// message, about a fifth of a loaded bridge's CPU with the ZMQ read
// (docs/BENCHMARKS.md §3, "Session 13"). Here go-zeromq still does the
// ZMTP handshake (zmq4.Open); the frames are read by zmtpReader, which
// allocates only each message's payload and answers a heartbeat PING as
// (*zmq4.Conn).RecvMsg did (docs/BENCHMARKS.md §3, "Session 16"); the
// subscription is the message a go-zeromq SUB socket sends, [0x01 topic].
func (s *Subscriber) dialSession(ctx context.Context, addr string, handle func(Message)) (got bool, err error) {
	d := net.Dialer{Timeout: handshakeTimeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return false, fmt.Errorf("dial: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer c.Close()
	// The handshake has the dial's time bound; a silent engine afterwards
	// is normal.
	_ = c.SetDeadline(time.Now().Add(d.Timeout))
	bc := newBufConn(c)
	zc, err := zmq4.Open(bc, null.Security(), zmq4.Sub, nil, false, nil)
	if err != nil {
		return false, fmt.Errorf("dial: %w", err)
	}
	if err := zc.SendMsg(zmq4.NewMsg(append([]byte{1}, s.cfg.Topic...))); err != nil {
		return false, fmt.Errorf("subscribe: %w", err)
	}
	_ = c.SetDeadline(time.Time{})
	s.connected()
	zr := zmtpReader{r: bc.r}
	for {
		frames, cmd, err := zr.next()
		if err == nil && cmd {
			err = answer(zc, frames[0])
			if err == nil {
				continue // a heartbeat (answered) or other command
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return got, ctx.Err()
			}
			s.refused(err)
			return got, fmt.Errorf("recv: %w", err)
		}
		got = s.deliver(frames, zr.span, handle) || got
	}
}

// refused counts, logs and reports a receive error that was a frame over
// MaxFrame or a message the frame reader refused (the connection that
// sent it is closed); other errors are the caller's.
func (s *Subscriber) refused(err error) {
	// ErrBadFrames: the frame reader's refusals (a message of too many
	// frames, a command inside a message or unreadable), counted as the
	// malformed messages they are.
	if !errors.Is(err, ErrFrameTooLarge) && !errors.Is(err, ErrBadFrames) {
		return
	}
	s.malformed.Add(1)
	s.cfg.Logger.Warn("zmq subscriber: refused an oversize frame or malformed message; connection closed", "endpoint", s.cfg.Endpoint, "err", err)
	if s.cfg.OnMalformed != nil {
		s.cfg.OnMalformed(err)
	}
}

// connected logs a reconnection and tells the owner.
func (s *Subscriber) connected() {
	if n := s.reconnects.Load(); n > 0 {
		// Said once per (re)connection, so an operator reading the log
		// sees the outage end, not only begin.
		s.cfg.Logger.Info("zmq subscriber: connected again", "endpoint", s.cfg.Endpoint, "bind", s.cfg.Bind, "reconnects", n)
	}
	if s.cfg.OnConnect != nil {
		s.cfg.OnConnect()
	}
}

// engineConnected is the accept hook of a subscriber that binds: an engine
// connected (its first connection, or again after a restart or a network
// break); it is logged and the owner told, as for a reconnect.
func (s *Subscriber) engineConnected() {
	n := s.accepted.Add(1)
	if n > 1 {
		s.cfg.Logger.Info("zmq subscriber: engine connected again", "endpoint", s.cfg.Endpoint, "connections", n)
	}
	if s.cfg.OnConnect != nil {
		s.cfg.OnConnect()
	}
}

// deliver hands one message's frames on, or counts them malformed; it
// reports whether they were a message. span is the payload's (the last
// frame's) span when it was carved from a chunk (payloads.go), else nil.
func (s *Subscriber) deliver(frames [][]byte, span []byte, handle func(Message)) bool {
	m, err := parseLiveFrames(frames, s.topic)
	if err != nil {
		s.malformed.Add(1)
		s.cfg.Logger.Warn("zmq subscriber: dropped malformed message", "endpoint", s.cfg.Endpoint, "err", err)
		if s.cfg.OnMalformed != nil {
			s.cfg.OnMalformed(err)
		}
		return false
	}
	s.topic = m.Topic
	m.span = span
	s.messages.Add(1)
	handle(m)
	return true
}

// ErrReplayIncomplete is returned by Replay when the engine's replay buffer
// does not reach back to the requested sequence number, or the reply
// stream ended or timed out before it closed the requested range.
var ErrReplayIncomplete = errors.New("enginezmq: replay cannot fill the gap")

// ReplayConfig configures a replay request. Zero values mean defaults.
type ReplayConfig struct {
	// Endpoint is the engine's replay (ROUTER) endpoint, e.g. tcp://10.0.0.5:5558.
	Endpoint string
	// Timeout bounds the whole request, from dial to end marker (default
	// 5s: vLLM answers from memory, so seconds mean it is not answering).
	Timeout time.Duration
	// MaxMessages bounds the replies read (default 100000, above vLLM's
	// default buffer_steps of 10000).
	MaxMessages int
	// MaxBytes bounds the payload bytes of the replies read after the
	// first, as MaxMessages bounds their number (default
	// DefaultReplayBytes): a caller keeps what it is given until the
	// replay ends, and each reply may be up to MaxFrame. The first reply
	// is not counted: it is the message at from, which a caller that
	// knows the message before a hole asks for again to compare it (the
	// bridge does), so the first it needs is the second. Counted, a
	// message that fits MaxBytes alone could not be replayed after one
	// before it; not counted, every such message can, and a first one
	// larger than the bound is still read. A replay holds at most its
	// first reply and MaxBytes.
	MaxBytes int
}

// DefaultReplayBytes is ReplayConfig.MaxBytes's default. A replay
// returns at most the engine's replay buffer, vLLM's buffer_steps (10,000)
// messages. vLLM's messages are hundreds of bytes to a few KiB (the
// captured engine's: 0.6 KB on average, 3.3 KB at most); a scheduler step
// at vLLM's default max_num_batched_tokens (8,192) stores at most 512
// 16-token blocks, some 50 KB. 128 MiB is the whole buffer at ~13 KiB a
// message, four times the largest captured: only a buffer of nothing but
// large prefill steps passes it, and a replay of it then fails as one
// past MaxMessages does (the caller repairs the hole another way).
const DefaultReplayBytes = 128 << 20

// Replay asks the engine's replay socket for every buffered message with
// seq >= from, through a DEALER socket, and calls fn for each in order until
// the end marker. fn returns false to stop early (then Replay returns nil).
// Bad frames count as an error: a replay with holes cannot be trusted.
func Replay(ctx context.Context, cfg ReplayConfig, from uint64, fn func(Message) bool) error {
	if err := validEndpoint(cfg.Endpoint); err != nil {
		return err
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.MaxMessages <= 0 {
		cfg.MaxMessages = 100000
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultReplayBytes
	}
	rctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	sock := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(quietZMQLogger()), zmq4.WithDialerTimeout(cfg.Timeout), zmq4.WithTimeout(cfg.Timeout))
	defer sock.Close()
	// Through the buffered transport: its frame guard refuses a reply
	// frame over MaxFrame before go-zeromq sizes a buffer from it.
	if err := sock.Dial(bufEndpoint(cfg.Endpoint)); err != nil {
		return fmt.Errorf("enginezmq: replay dial %s: %w", cfg.Endpoint, err)
	}
	// A DEALER talking to a ROUTER that expects REQ framing sends the
	// empty delimiter itself.
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, SeqBytes(from))); err != nil {
		return fmt.Errorf("enginezmq: replay request to %s: %w", cfg.Endpoint, err)
	}
	read := 0 // payload bytes after the first reply (MaxBytes)
	for i := 0; i < cfg.MaxMessages; i++ {
		msg, err := sock.Recv()
		if err != nil {
			return fmt.Errorf("enginezmq: replay from %s after %d replies: %w", cfg.Endpoint, i, err)
		}
		m, end, err := ParseReplayFrames(msg.Frames)
		if err != nil {
			return fmt.Errorf("enginezmq: replay from %s: %w", cfg.Endpoint, err)
		}
		if end {
			return nil
		}
		if i > 0 {
			if read += len(m.Payload); read > cfg.MaxBytes {
				return fmt.Errorf("enginezmq: replay from %s: more than %d bytes in the %d replies after the first", cfg.Endpoint, cfg.MaxBytes, i)
			}
		}
		if !fn(m) {
			return nil
		}
	}
	return fmt.Errorf("enginezmq: replay from %s: more than %d replies", cfg.Endpoint, cfg.MaxMessages)
}

// ReplayBeganLater is ReplayRange's error when the engine's replay began
// past the seq asked from: its buffer no longer reaches back, or, asked
// from an engine's first seq, the engine numbers its messages from a
// later one. It is ErrReplayIncomplete (errors.Is).
type ReplayBeganLater struct {
	From  uint64 // the seq asked from
	Began uint64 // the seq of the engine's first reply
}

func (e *ReplayBeganLater) Error() string {
	return fmt.Sprintf("%v: engine's replay begins at seq %d, not %d", ErrReplayIncomplete, e.Began, e.From)
}

func (e *ReplayBeganLater) Unwrap() error { return ErrReplayIncomplete }

// ReplayRange replays [from, to) and returns exactly those messages, or
// ErrReplayIncomplete when the engine cannot provide all of them in order
// (a *ReplayBeganLater when its replay began past from).
func ReplayRange(ctx context.Context, cfg ReplayConfig, from, to uint64) ([]Message, error) {
	if to <= from {
		return nil, nil
	}
	want := from
	var out []Message
	var began *ReplayBeganLater
	err := Replay(ctx, cfg, from, func(m Message) bool {
		if len(out) == 0 && m.Seq > want {
			began = &ReplayBeganLater{From: from, Began: m.Seq}
			return false
		}
		if m.Seq < want {
			return true // already have it
		}
		if m.Seq != want {
			return false // hole in the engine's buffer
		}
		out = append(out, m)
		want++
		return want < to
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrReplayIncomplete, err)
	}
	if began != nil {
		return nil, began
	}
	if want < to {
		return nil, fmt.Errorf("%w: engine replayed up to seq %d of [%d, %d)", ErrReplayIncomplete, want, from, to)
	}
	return out, nil
}
