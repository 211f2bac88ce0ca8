package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/tick"
)

// The stream consumer and its watchdog.
//
// nats.go's ordered consumer recovers by itself from a lost pull (two
// missed idle heartbeats) and from a reconnect: it re-creates its server
// side consumer. But that re-create is one JetStream API request with a
// fixed 10s timeout, retried 1s after a failure, and its errors are never
// reported to the consume error handler. A consumer create is answered
// only by the meta leader; when the NATS node that was the meta leader
// dies, the surviving servers drop the request without a word until they
// have elected a new one, so the ordered consumer waits out the full 10s
// and delivers nothing, while Healthy still says yes (no consume error,
// and the lag is only measured on a delivery). That is the 11–13s tail of
// the node-kill recoveries.
//
// The watchdog bounds it: when nothing has been delivered for one
// heartbeat, it asks the stream for the pool's newest message (one
// bounded request); a message that was already in the stream
// stallHeartbeats heartbeats ago and is still not delivered, with no
// delivery in between and none in progress, means the consumer is
// stalled. It then counts a consume error (Healthy says no until a
// delivery) and replaces the ordered consumer with a new one that starts
// right after the last message delivered, created with a bounded request
// and retried at the next heartbeat, not after 10s.
//
// Its cost: while a pool's stream is quiet, one last-message request a
// second per pool and router to the stream's leader, the same rate as the
// idle heartbeats the server already sends; nothing while messages flow.

// heartbeat is the idle heartbeat asked of the server for each pull; a
// pull consumer lost with its server is noticed by nats.go after 2 missed
// ones. Every second, not nats.go's default of 5s: the cost is one small
// message a second per pool while the stream is idle.
const heartbeat = time.Second

// stallHeartbeats is how long, in heartbeats, a message may sit in the
// stream undelivered, with nothing delivered meanwhile, before the
// consumer is called stalled. A working consumer delivers a stored message
// within milliseconds; one whose pull was lost notices after 2 missed
// heartbeats and re-creates itself in one API round trip (milliseconds on
// a healthy cluster). The third heartbeat is the slack for that round trip
// and for a loaded machine: the watchdog acts only once nats.go's own
// recovery has had its chance and not delivered.
const stallHeartbeats = 3

// createTimeout bounds the watchdog's requests (the stream's last message,
// a consumer create): a healthy cluster answers in milliseconds, tens of
// them on a loaded machine, one without a meta leader never does. Two
// heartbeats is an order of magnitude above the first and a fifth of
// nats.go's 10s; a failed create is retried at the next check.
const createTimeout = 2 * heartbeat

// streamCons is the current ordered consumer with its position: the
// stream sequence of the last message it delivered (or where it started),
// and what the watchdog has seen.
type streamCons struct {
	// mu serializes deliveries with a replacement: held by the message
	// handler while it checks and dispatches a message, and by replace
	// while it swaps the consumer, so a message of the old consumer can
	// neither be dispatched twice nor overtake the new consumer's.
	mu   sync.Mutex
	gen  atomic.Uint64            // the current consumer's generation; written under mu
	seq  uint64                   // stream sequence of the last message dispatched; guarded by mu
	cons jetstream.Consumer       // guarded by mu
	cc   jetstream.ConsumeContext // guarded by mu
	// stored is the JetStream store time of message seq (zero: unknown);
	// guarded by mu.
	stored time.Time
	// check is the last message dispatched before the connection was
	// lost, to be found again in the stream once it is back (rewound);
	// guarded by mu.
	check streamMark

	// done is seq once the message is dispatched (queued on its
	// shard), read without mu (heartbeats: a delivery may hold mu while
	// its shard is full).
	done atomic.Uint64
	at   atomic.Int64 // unix nanos of the last delivery
	busy atomic.Bool  // a message is being dispatched (may wait on a full shard)

	// The watchdog's own (its goroutine only): the newest message seen
	// undelivered and when; recreated: the stream's sequences started
	// over (stalled found it), so replace consumes it from its start.
	pending      uint64
	pendingSince time.Time
	recreated    bool
	silent       bool // the stream's last check went unanswered
	// created is when the stream being consumed was created (JetStream
	// keeps it across server restarts and leader changes): another time
	// is another stream under the same name.
	created   time.Time
	renewedAt time.Time // the re-created stream's creation time, until restream takes it
}

// current is the consumer in use (for Info).
func (s *streamCons) current() jetstream.Consumer {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cons
}

// startConsumer creates the ordered consumer of generation gen starting
// at start (0: by policy deliver) and consumes it, with ctx bounding the
// create.
func (c *Consumer) startConsumer(ctx, runCtx context.Context, gen uint64, deliver jetstream.DeliverPolicy, start uint64) (jetstream.Consumer, jetstream.ConsumeContext, error) {
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{c.evSubj}, DeliverPolicy: deliver}
	if start > 0 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, start
	}
	cons, err := c.js.OrderedConsumer(ctx, c.streamName, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("ordered consumer on %s: %w", c.streamName, err)
	}
	s := &c.sc
	cc, err := cons.Consume(func(m jetstream.Msg) { c.deliver(runCtx, gen, m) },
		jetstream.PullHeartbeat(heartbeat),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if gen != s.gen.Load() {
				return // a replaced consumer's
			}
			c.lastErr.Store(time.Now().UnixNano())
			c.m.consumeErrors.Inc()
			c.cfg.Logger.Debug("consumer: consume error", "err", err)
		}))
	if err != nil {
		return nil, nil, fmt.Errorf("consume %s: %w", c.streamName, err)
	}
	return cons, cc, nil
}

// deliver takes a message from the consumer of generation gen: a message
// of a replaced consumer, or one already dispatched, is dropped.
func (c *Consumer) deliver(ctx context.Context, gen uint64, m jetstream.Msg) {
	s := &c.sc
	s.busy.Store(true)
	defer s.busy.Store(false)
	s.mu.Lock()
	defer s.mu.Unlock()
	md := parseAckReply(m.Reply())
	if gen != s.gen.Load() || (md.ok && md.streamSeq <= s.seq) {
		return
	}
	if md.ok {
		s.seq, s.stored = md.streamSeq, md.stored
	}
	// One clock read per message: the delivery time and the lag.
	now := time.Now()
	s.at.Store(now.UnixNano())
	c.dispatch(ctx, m, md, now)
	if md.ok {
		s.done.Store(md.streamSeq)
	}
}

// watch runs the watchdog until ctx is done.
func (c *Consumer) watch(ctx context.Context, deliver jetstream.DeliverPolicy) {
	_ = tick.Every(ctx, heartbeat, func() {
		info := streamInfoOnce{c: c, ctx: ctx}
		// recreated still set: a restream that failed (its consumer not
		// made), tried again here; nothing else would find it again once
		// the stream has passed the position.
		if c.sc.recreated || c.renewed(&info) || c.rewound(ctx, &info) || c.stalled(ctx, &info, time.Now()) {
			c.replace(ctx, deliver)
		}
	})
}

// streamInfoOnce asks for the stream's info at most once per heartbeat,
// however many checks read it (renewed at every heartbeat, stalled when
// the newest message is below the last delivered): one request, not two.
type streamInfoOnce struct {
	c    *Consumer
	ctx  context.Context
	done bool
	info *jetstream.StreamInfo
}

// get returns the stream's info, nil when it could not be had.
func (o *streamInfoOnce) get() *jetstream.StreamInfo {
	if !o.done {
		o.done = true
		rctx, cancel := context.WithTimeout(o.ctx, createTimeout)
		info, err := o.c.stream.Info(rctx)
		cancel()
		if err == nil {
			o.info = info
		}
	}
	return o.info
}

// stalled reports whether a message the stream held stallHeartbeats ago
// is still undelivered with no delivery since.
func (c *Consumer) stalled(ctx context.Context, info *streamInfoOnce, now time.Time) bool {
	s := &c.sc
	last := time.Unix(0, s.at.Load())
	if s.busy.Load() || now.Sub(last) < heartbeat {
		s.pending = 0
		c.streamAnswers() // it delivers
		return false
	}
	if quorumLost(info.get()) {
		// Its leader still answers reads for a few seconds (seen: 5 to
		// more than 20) after losing its replicas, and stores nothing.
		c.unanswered(errNoQuorum)
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, createTimeout)
	msg, err := c.stream.GetLastMsgForSubject(rctx, c.evSubj)
	cancel()
	if err != nil {
		// No message (nothing to deliver) or no answer (the stream is
		// down, nothing a new consumer would get either): not stalled;
		// but a stream that does not answer stores nothing, and the
		// index falls behind the engines meanwhile (unanswered).
		if !errors.Is(err, jetstream.ErrMsgNotFound) {
			c.unanswered(err)
		} else {
			c.streamAnswers()
		}
		return false
	}
	c.streamAnswers()
	s.mu.Lock()
	seq := s.seq
	s.mu.Unlock()
	switch {
	case msg.Sequence < seq && c.streamRecreated(info, seq):
		s.recreated = true
		return true
	case msg.Sequence <= seq:
		s.pending = 0
		return false
	case s.pending == 0 || last.After(s.pendingSince):
		s.pending, s.pendingSince = msg.Sequence, now
		return false
	}
	return now.Sub(s.pendingSince) >= stallHeartbeats*heartbeat
}

// streamMark is a message the consumer dispatched: its stream sequence
// and store time (seq 0: none).
type streamMark struct {
	seq    uint64
	stored time.Time
}

// markOnDisconnect takes, each time the connection is lost, the last
// message dispatched as the one rewound looks for once it is back, until
// ctx is done. A JetStream server restarted on a store that lost its
// newest messages (written but not yet synced to disk when its host
// failed: JetStream syncs every 2 minutes by default; or a store restored
// from a backup) keeps the stream's creation time and numbers the next
// messages from its last stored sequence again, below the position the
// consumer resumes after: those messages are never delivered, and once
// the stream has passed that position (the bridges publish their backlog
// at once) nothing else shows it. The mark is taken as the connection
// drops, before any message of the server restarted can be delivered.
func (c *Consumer) markOnDisconnect(ctx context.Context) {
	ch := c.cfg.Conn.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING)
	defer c.cfg.Conn.RemoveStatusListener(ch)
	s := &c.sc
	for {
		select {
		case <-ctx.Done():
			return
		case <-ch:
			s.mu.Lock()
			if s.seq > 0 && !s.stored.IsZero() {
				s.check = streamMark{seq: s.seq, stored: s.stored}
			}
			s.mu.Unlock()
		}
	}
}

// rewound reports whether the stream no longer holds, at its sequence,
// the last message dispatched before the connection was lost (another
// store time, or none while the stream ends below it): its sequences were
// reused, and what it stored in the place of the lost messages was never
// delivered. Followed as a re-created stream (replace: consumed from its
// start, every instance reloaded). One message request per reconnection.
func (c *Consumer) rewound(ctx context.Context, o *streamInfoOnce) bool {
	s := &c.sc
	s.mu.Lock()
	mark := s.check
	s.mu.Unlock()
	if mark.seq == 0 || !c.cfg.Conn.IsConnected() {
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, createTimeout)
	msg, err := c.stream.GetMsg(rctx, mark.seq)
	cancel()
	lost := false
	switch {
	case err == nil:
		lost = !msg.Time.Equal(mark.stored)
	case errors.Is(err, jetstream.ErrMsgNotFound):
		info := o.get()
		if info == nil {
			return false // asked again at the next heartbeat
		}
		// Gone with the stream ending below it: rewound. Gone below its
		// first sequence: removed by its limits, nothing to compare.
		lost = info.State.LastSeq < mark.seq
	default:
		return false // no answer: asked again at the next heartbeat
	}
	var created time.Time
	if lost {
		// The stream's creation time, taken as restream's (as
		// streamRecreated does): a store wiped across the disconnect has
		// a new one, which renewed would otherwise find at the next
		// heartbeat and reload everything a second time.
		info := o.get()
		if info == nil {
			return false // asked again at the next heartbeat
		}
		created = info.Created
	}
	s.mu.Lock()
	if s.check == mark {
		s.check = streamMark{}
	}
	s.mu.Unlock()
	if !lost {
		return false
	}
	s.renewedAt = created
	c.cfg.Logger.Warn("consumer: the stream no longer holds the last message delivered before the connection was lost (its server came back on a store missing its newest messages): consuming it from its start",
		"stream", c.streamName, "seq", mark.seq)
	s.recreated = true
	return true
}

// unanswered records that the stream did not answer the watchdog: no
// leader (its quorum lost), deleted, or its servers gone. Nothing can be
// stored meanwhile, so the engines' changes wait in their bridges and the
// index falls behind them, while the consumer may look fine (its pull on a
// surviving node goes on answering idle heartbeats, so nats.go reports no
// error). It counts as a consume error, renewed at every unanswered check:
// Healthy says no until a delivery or until 10 s after the stream answers.
func (c *Consumer) unanswered(err error) {
	c.lastErr.Store(time.Now().UnixNano())
	c.m.consumeErrors.Inc()
	if !c.sc.silent {
		c.sc.silent = true
		c.cfg.Logger.Warn("consumer: the stream does not answer (no leader, deleted, or its servers down); exact routing is off until it does",
			"stream", c.streamName, "err", err)
	}
}

// errNoQuorum: the stream's info shows no leader, or a leader without a
// majority of its replicas current.
var errNoQuorum = errors.New("the stream has no leader with a quorum of current replicas")

// quorumLost reports whether a clustered stream's info shows it unable to
// store: no leader, or a leader that hears fewer than a majority of its
// replicas (itself included) as current. A stream of one replica, or info
// that could not be had, says nothing.
func quorumLost(info *jetstream.StreamInfo) bool {
	if info == nil || info.Cluster == nil || len(info.Cluster.Replicas) == 0 {
		return false
	}
	if info.Cluster.Leader == "" {
		return true
	}
	current := 1 // the leader
	for _, r := range info.Cluster.Replicas {
		if r != nil && r.Current && !r.Offline {
			current++
		}
	}
	return 2*current <= len(info.Cluster.Replicas)+1
}

// streamAnswers notes that the stream answers the watchdog again.
func (c *Consumer) streamAnswers() {
	if c.sc.silent {
		c.sc.silent = false
		c.cfg.Logger.Info("consumer: the stream answers again", "stream", c.streamName)
	}
}

// renewed reports whether the stream was created again since it was
// consumed (its creation time changed: a JetStream store wiped and the
// stream made again by a bridge), busy or idle: a new stream that has
// already passed the old one's last sequence is not seen by stalled, and
// the consumer would go on from the old position, never applying the new
// stream's first messages. One stream info request per heartbeat, shared
// with stalled's check.
func (c *Consumer) renewed(o *streamInfoOnce) bool {
	s := &c.sc
	if s.created.IsZero() {
		return false
	}
	info := o.get()
	if info == nil || info.Created.IsZero() || info.Created.Equal(s.created) {
		return false
	}
	s.recreated, s.renewedAt = true, info.Created
	return true
}

// streamRecreated reports whether the stream's last sequence is below seq,
// the last one this consumer delivered: its sequences started over (a
// JetStream store wiped, the stream deleted and created again). The pool's
// newest message being older than the last one delivered is otherwise
// seen only while a consumer started at the end of a stream other pools
// also write (DeliverNew) has delivered nothing yet; one stream info
// request tells them apart.
func (c *Consumer) streamRecreated(o *streamInfoOnce, seq uint64) bool {
	info := o.get()
	if info == nil || info.State.LastSeq >= seq {
		return false
	}
	c.sc.renewedAt = info.Created
	return true
}

// replace swaps the stalled consumer for a new one starting after the
// last message delivered, or, when the stream was re-created, at the new
// stream's start (with every instance reloaded); on failure the next check
// tries again.
func (c *Consumer) replace(ctx context.Context, deliver jetstream.DeliverPolicy) {
	s := &c.sc
	s.mu.Lock()
	defer s.mu.Unlock()
	c.lastErr.Store(time.Now().UnixNano())
	c.m.consumeErrors.Inc()
	if s.recreated {
		c.restream(ctx, deliver)
		return
	}
	c.m.stalls.Inc()
	silent := time.Since(time.Unix(0, s.at.Load()))
	rctx, cancel := context.WithTimeout(ctx, createTimeout)
	defer cancel()
	cons, cc, err := c.startConsumer(rctx, ctx, s.gen.Load()+1, deliver, s.seq+1)
	if err != nil {
		c.cfg.Logger.Warn("consumer: stalled, nothing delivered; re-creating failed, retrying",
			"pending", s.pending, "delivered", s.seq, "silent", silent.Round(time.Millisecond), "err", err)
		return
	}
	old := s.cc
	s.gen.Add(1)
	s.cons, s.cc = cons, cc
	s.pendingSince = time.Now()
	c.cfg.Logger.Warn("consumer: stalled, nothing delivered; re-created the consumer",
		"pending", s.pending, "delivered", s.seq, "silent", silent.Round(time.Millisecond))
	// Stopping an ordered consumer waits while it is re-creating itself
	// (up to its 10s request timeout): not on the watchdog.
	go old.Stop()
}

// restream follows a re-created stream (s.mu held): every instance's
// stream positions (snapshot coverage, the stream seq it is at) point into
// the old stream, so each is reset and its snapshot reloaded on its shard,
// queued before the new consumer's first message; the new consumer then
// delivers the new stream from its start. A shared index keeps positions of
// the old stream in Redis: it is not repaired here (docs/transport.md,
// "JetStream store wiped").
func (c *Consumer) restream(ctx context.Context, deliver jetstream.DeliverPolicy) {
	s := &c.sc
	// A mark taken before the connection dropped numbers the old stream
	// too: looked for in the new one it would read as rewound again.
	s.check = streamMark{}
	if c.cfg.SharedIndex {
		c.m.streamRecreated.Inc()
		// Its messages would fall below the positions and be taken as
		// applied: unhealthy, kv_aware falls back rather than trust it.
		c.renumbered.Store(true)
		c.cfg.Logger.Error("consumer: the stream was re-created (its sequences started over); the shared index's positions point into the old one, so exact routing is off: restart the routers with the pool's index keys flushed",
			"stream", c.streamName, "delivered", s.seq)
		s.recreated = false
		s.seq = 0
		s.done.Store(0)
		s.created = cmp.Or(s.renewedAt, s.created)
		return
	}
	rctx, cancel := context.WithTimeout(ctx, createTimeout)
	defer cancel()
	cons, cc, err := c.startConsumer(rctx, ctx, s.gen.Load()+1, jetstream.DeliverAllPolicy, 0)
	if err != nil {
		c.cfg.Logger.Warn("consumer: the stream was re-created; consuming it from its start failed, retrying", "err", err)
		return
	}
	// Its deliveries wait for s.mu, held here: the reloads are queued
	// before its first message is dispatched.
	c.mu.Lock()
	names := make([]string, 0, len(c.insts))
	for name := range c.insts {
		names = append(names, name)
	}
	c.mu.Unlock()
	for _, name := range names {
		c.enqueue(ctx, work{kind: workRestream, instance: name})
	}
	old := s.cc
	s.gen.Add(1)
	s.cons, s.cc = cons, cc
	c.m.streamRecreated.Inc()
	c.cfg.Logger.Warn("consumer: the stream was re-created (its sequences started over): consuming it from its start and reloading every instance",
		"stream", c.streamName, "delivered", s.seq, "instances", len(names))
	s.seq, s.recreated, s.pending = 0, false, 0
	s.done.Store(0)
	s.created = cmp.Or(s.renewedAt, s.created)
	go old.Stop()
}

// dispatched is the stream seq of the last message handed to the shards
// (or where the consumer started).
func (c *Consumer) dispatched() uint64 { return c.sc.done.Load() }
