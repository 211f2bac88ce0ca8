package enginezmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// PublisherConfig configures a Publisher. Zero values mean defaults.
type PublisherConfig struct {
	// Endpoint is where the PUB socket binds (or dials, with Dial).
	Endpoint string
	// Dial makes the PUB socket connect to Endpoint (the engine side of
	// llm-d-inference-sim's layout) instead of binding (vLLM's).
	Dial bool
	// ReplayEndpoint, when set, is where the replay ROUTER socket binds.
	ReplayEndpoint string
	// Topic is the first frame of every message (vLLM's default: "kv").
	Topic string
	// BufferSteps is how many recent messages replay can return (vLLM's
	// default buffer_steps: 10000).
	BufferSteps int
	// LegacyReplay makes replay replies [seq, payload] (older vLLM)
	// instead of [topic, seq, payload].
	LegacyReplay bool
	// FirstSeq is the first sequence number (vLLM starts at 0, the
	// simulator at 1).
	FirstSeq uint64
	// ReplayDelay binds the replay socket that long after the PUB socket,
	// as an engine that sets its replay up only once its publisher is
	// connected (llm-d-inference-sim); 0: at once.
	ReplayDelay time.Duration
}

// Publisher emits KV-event messages exactly as a vLLM engine does: a PUB
// socket sending [topic, seq, payload] and a ROUTER socket answering replay
// requests. It stands in for an engine in tests, benchmarks and the
// simulated fleet; it is not used on the production path.
type Publisher struct {
	cfg    PublisherConfig
	pub    zmq4.Socket
	router zmq4.Socket
	cancel context.CancelFunc
	wg     sync.WaitGroup

	rmu  sync.Mutex // orders a delayed replay bind (ReplayDelay) and Close
	mu   sync.Mutex // guards next, ring and sending on pub
	next uint64
	ring []Message // the last BufferSteps messages, oldest first

	replays atomic.Uint64 // replay requests answered
}

// NewPublisher binds (or dials) the sockets; Close releases them.
func NewPublisher(ctx context.Context, cfg PublisherConfig) (*Publisher, error) {
	if err := validEndpoint(cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = 10000
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &Publisher{cfg: cfg, cancel: cancel, next: cfg.FirstSeq}
	p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quietZMQLogger()), zmq4.WithDialerMaxRetries(-1))
	var err error
	// Peers' frames (subscriptions, replay requests) are read through the
	// frame guard, as the subscriber's are: anything may dial a simulated
	// engine's ports.
	if cfg.Dial {
		err = p.pub.Dial(bufEndpoint(cfg.Endpoint))
	} else {
		err = p.pub.Listen(bufEndpoint(cfg.Endpoint))
	}
	if err != nil {
		cancel()
		p.pub.Close()
		return nil, fmt.Errorf("enginezmq: publisher %s: %w", cfg.Endpoint, err)
	}
	if cfg.ReplayEndpoint != "" {
		p.router = zmq4.NewRouter(ctx, zmq4.WithLogger(quietZMQLogger()))
		if cfg.ReplayDelay <= 0 {
			if err := p.router.Listen(bufEndpoint(cfg.ReplayEndpoint)); err != nil {
				cancel()
				p.pub.Close()
				p.router.Close()
				return nil, fmt.Errorf("enginezmq: publisher replay %s: %w", cfg.ReplayEndpoint, err)
			}
			p.wg.Add(1)
			go p.serveReplay(ctx)
		} else {
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				select {
				case <-ctx.Done():
					return
				case <-time.After(cfg.ReplayDelay):
				}
				p.rmu.Lock()
				ok := ctx.Err() == nil && p.router.Listen(bufEndpoint(cfg.ReplayEndpoint)) == nil
				p.rmu.Unlock()
				if ok {
					p.wg.Add(1)
					p.serveReplay(ctx)
				}
			}()
		}
	}
	return p, nil
}

// Subscribed reports whether at least one subscriber's subscription has
// reached the PUB socket (messages sent before that are lost, as in ZMQ).
func (p *Publisher) Subscribed() bool {
	if t, ok := p.pub.(zmq4.Topics); ok {
		return len(t.Topics()) > 0
	}
	return true
}

// Publish sends payload with the next sequence number and returns it.
func (p *Publisher) Publish(payload []byte) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.next++
	return seq, p.sendLocked(seq, payload, true)
}

// Skip consumes the next sequence number with a message that goes to the
// replay buffer but not to subscribers: what a PUB socket dropping a
// message at its high-water mark looks like downstream.
func (p *Publisher) Skip(payload []byte) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.next++
	_ = p.sendLocked(seq, payload, false)
	return seq
}

// ForgetReplay empties the replay buffer (an engine whose buffer no longer
// reaches back far enough).
func (p *Publisher) ForgetReplay() {
	p.mu.Lock()
	p.ring = p.ring[:0]
	p.mu.Unlock()
}

func (p *Publisher) sendLocked(seq uint64, payload []byte, send bool) error {
	buf := append([]byte(nil), payload...)
	if len(p.ring) == p.cfg.BufferSteps {
		copy(p.ring, p.ring[1:])
		p.ring = p.ring[:len(p.ring)-1]
	}
	p.ring = append(p.ring, Message{Topic: p.cfg.Topic, Seq: seq, Payload: buf})
	if !send {
		return nil
	}
	if err := p.pub.Send(zmq4.NewMsgFrom([]byte(p.cfg.Topic), SeqBytes(seq), buf)); err != nil {
		return fmt.Errorf("enginezmq: publish seq %d: %w", seq, err)
	}
	return nil
}

// serveReplay answers [id, "", start_seq] with every buffered message from
// start_seq on, then the end marker, as vLLM's _service_replay does.
func (p *Publisher) serveReplay(ctx context.Context) {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		if len(msg.Frames) < 2 {
			continue
		}
		id := msg.Frames[0]
		req := msg.Frames[len(msg.Frames)-1]
		if len(req) != 8 {
			continue
		}
		start := binary.BigEndian.Uint64(req)
		p.mu.Lock()
		var out []Message
		for _, m := range p.ring {
			if m.Seq >= start {
				out = append(out, m)
			}
		}
		p.mu.Unlock()
		for _, m := range out {
			frames := [][]byte{id, {}}
			if !p.cfg.LegacyReplay {
				frames = append(frames, []byte(m.Topic))
			}
			frames = append(frames, SeqBytes(m.Seq), m.Payload)
			if err := p.router.Send(zmq4.NewMsgFrom(frames...)); err != nil {
				break
			}
		}
		end := [][]byte{id, {}}
		if !p.cfg.LegacyReplay {
			end = append(end, []byte{})
		}
		end = append(end, SeqBytes(EndSeq), []byte{})
		_ = p.router.Send(zmq4.NewMsgFrom(end...))
		p.replays.Add(1)
	}
}

// Replays is how many replay requests the publisher has answered (the end
// marker sent).
func (p *Publisher) Replays() uint64 { return p.replays.Load() }

// Close stops the sockets.
func (p *Publisher) Close() error {
	p.cancel()
	err := p.pub.Close()
	if p.router != nil {
		p.rmu.Lock() // not while a delayed replay socket binds
		err = errors.Join(err, p.router.Close())
		p.rmu.Unlock()
	}
	p.wg.Wait()
	return err
}
