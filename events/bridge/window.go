package bridge

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/kvstream"
)

// Pipelined publishing. An engine message is published without waiting
// for JetStream's ack; up to Config.PublishWindow messages per instance
// are in flight, and their acks are taken in publish order. What the
// bridge keeps about a message (its table, the stream sequence its
// snapshots are current to, the engine seq and payload hash that prove
// the engine's identity later) changes only when the message's ack is
// taken, in order, exactly as it did when each publish waited for its
// ack: a snapshot is never ahead of the stream.
//
// Order. One connection delivers the window's messages to the server in
// order and the server stores them in that order, so the stream holds
// them in publish order. A message that fails (an ack timed out, the
// connection dropped, no stream answered) may have been stored or not,
// and a later one may have been stored after it failed; so on the first
// failure the bridge stops sending, settles every message in the window
// (acknowledged, or failed), and resends the failed ones in order with
// their original message ids, retrying until acknowledged (the engine's
// messages wait in the outage buffer meanwhile). JetStream answers a
// resent message it already stored with that message's sequence, so
// afterwards every message of the window has its stream sequence. If
// those sequences are not increasing in publish order, the stream holds
// the instance's messages out of order (a message was refused while a
// later one was stored: a stream leader changing hands): the bridge then
// publishes a resync (a clear, then its whole table), so consumers
// rebuild the instance from what the bridge holds, and counts it
// (kvbridge_publish_reorders_total). Nothing is dropped either way.

// DefaultPublishWindow is the default Config.PublishWindow. A window
// needs to cover one ack round trip at the rate the bridge can publish:
// a message costs the bridge a few microseconds, so at ~100 k messages/s
// a 0.2–1 ms round trip (loopback to another rack) keeps 20–100 in
// flight. 128 covers that with room; memory is bounded by 128 engine
// batches (a few MB at vLLM's batch sizes) — with coalescing (coalesce.go)
// by 128 NATS messages of at most the coalesced byte bound each (32 MiB
// at NATS's default max payload) — and what a failure resends is at most
// that many messages.
const DefaultPublishWindow = 128

// pending is a message published and not yet acknowledged.
type pending struct {
	msg  *nats.Msg
	id   string
	fut  jetstream.PubAckFuture // nil when sending failed at once (err)
	err  error
	sent time.Time
	// batches is the number of engine messages it carries (1, or more
	// when coalesced), and 1 for the bridge's own.
	batches int
	// done runs, in publish order, once the message is acknowledged.
	done func(streamSeq uint64)
}

// window is an instance's messages in flight, oldest first; owned by the
// process goroutine.
type window struct {
	q []pending
	// lastSeq is the stream sequence of the last message acknowledged in
	// order (0: none yet, or the stream was made again).
	lastSeq uint64
	// remade: the stream was made again while resending (sequences
	// restart), so order is judged within the resend only.
	remade bool
}

// msgID is the next message id: JetStream drops a message whose id it
// has seen within its duplicate window, which makes a resend safe.
func (in *instance) msgID() string {
	in.msgCount++
	return fmt.Sprintf("%s.%s.%s.%d", in.b.cfg.Pool, in.src.Instance, in.b.runID, in.msgCount)
}

// publishAsync publishes one message to the instance's subject without
// waiting for its ack; done runs with its stream sequence once it and
// everything published before it are acknowledged. It waits only while
// the window is full, and while a failure is being repaired.
func (in *instance) publishAsync(ctx context.Context, payload []byte, h kvstream.EventHeaders, batches int, done func(uint64)) error {
	p := pending{msg: &nats.Msg{Subject: in.subj, Data: payload, Header: h.Header()}, id: in.msgID(), batches: batches, done: done}
	in.sent.Add(1)
	if !in.b.cfg.Conn.IsConnected() {
		// An outage: one message at a time, retried, until it is over, so
		// that nothing is queued behind a message that may be lost.
		if err := in.flush(ctx); err != nil {
			return err
		}
		seq, err := in.publishSync(ctx, p.msg, p.id)
		if err != nil {
			return err
		}
		in.complete(&p, seq)
		return nil
	}
	for len(in.win.q) >= in.b.cfg.PublishWindow {
		if err := in.takeHead(ctx); err != nil {
			return err
		}
	}
	p.sent = time.Now()
	// No retries inside the client: it would resend a refused message
	// after later ones, out of order. A failure is repaired here.
	p.fut, p.err = in.b.js.PublishMsgAsync(p.msg, jetstream.WithMsgID(p.id), jetstream.WithRetryAttempts(0))
	in.win.q = append(in.win.q, p)
	if n := uint64(len(in.win.q)); n > in.maxInFlight.Load() {
		in.maxInFlight.Store(n) // written only here, by the process goroutine
	}
	if p.err != nil {
		return in.repair(ctx)
	}
	in.takeReady()
	return nil
}

// takeReady completes the acknowledged messages at the head of the window
// without waiting.
func (in *instance) takeReady() {
	n := 0
	for n < len(in.win.q) {
		p := &in.win.q[n]
		select {
		case ack := <-p.fut.Ok():
			in.complete(p, ack.Sequence)
			n++
			continue
		default:
		}
		break
	}
	in.pop(n)
}

// takeHead waits for the oldest message's ack and completes it; a failure
// repairs the whole window.
func (in *instance) takeHead(ctx context.Context) error {
	p := &in.win.q[0]
	seq, err := in.settle(ctx, p)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.err = err
		return in.repair(ctx)
	}
	in.complete(p, seq)
	in.pop(1)
	return nil
}

// flush publishes the engine messages being joined (coalesce.go) and
// waits until every message in flight is acknowledged and completed
// (repairing failures): what reads the table, the last hash or the
// stream position, and every synchronous publish, comes after it.
func (in *instance) flush(ctx context.Context) error {
	if err := in.seal(ctx); err != nil {
		return err
	}
	for len(in.win.q) > 0 {
		if err := in.takeHead(ctx); err != nil {
			return err
		}
	}
	return nil
}

// pop drops the first n messages of the window.
func (in *instance) pop(n int) {
	if n == 0 {
		return
	}
	clear(in.win.q[:n])
	in.win.q = in.win.q[n:]
	if len(in.win.q) == 0 {
		in.win.q = in.win.q[:0:0]
	}
}

// settle waits for p's outcome: its stream sequence, or why it failed.
// The JetStream context's ack timeout (PublishTimeout) bounds the wait.
func (in *instance) settle(ctx context.Context, p *pending) (uint64, error) {
	if p.err != nil {
		return 0, p.err
	}
	select {
	case ack := <-p.fut.Ok():
		return ack.Sequence, nil
	case err := <-p.fut.Err():
		return 0, err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// complete records an acknowledged message, in publish order.
func (in *instance) complete(p *pending, seq uint64) {
	in.win.lastSeq = seq
	if !p.sent.IsZero() {
		in.b.m.publishSecs.Observe(time.Since(p.sent).Seconds())
	}
	n := uint64(max(p.batches, 1))
	in.published.Add(n)
	in.counters.batches.Add(float64(n))
	if p.done != nil {
		p.done(seq)
	}
	in.completed.Add(1)
}

// waitCompleted waits, at most d, until every message handed to the
// window before the call is acknowledged and folded into the table. A
// snapshot served to a consumer waits for it: the consumer asks because
// it is behind the stream, and a snapshot older than what the stream still
// holds (its retention bound passed) could not be completed from it.
func (in *instance) waitCompleted(d time.Duration) {
	target := in.sent.Load()
	deadline := time.Now().Add(d)
	for in.completed.Load() < target && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond) // a snapshot request is rare; its wait may last a publish timeout
	}
}

// repair runs after a message of the window failed: it settles every
// message in flight, resends the failed ones in order under their ids
// until acknowledged, completes all of them in order, and publishes a
// resync if the stream turned out to hold them out of order (see the top
// of this file).
func (in *instance) repair(ctx context.Context) error {
	q := in.win.q
	in.win.q = nil
	seqs := make([]uint64, len(q))
	failed := 0
	for i := range q {
		seq, err := in.settle(ctx, &q[i])
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			if failed == 0 {
				in.log.Warn("publish failed, resending the window in order (engine messages are buffered)",
					"in_flight", len(q), "err", err)
			}
			failed++
			in.b.m.retries.Inc()
			continue
		}
		seqs[i] = seq
	}
	in.repairs.Add(1)
	prev := in.win.lastSeq
	in.win.remade = false
	for i := range q {
		if seqs[i] != 0 {
			continue
		}
		seq, err := in.publishSync(ctx, q[i].msg, q[i].id)
		if err != nil {
			return err
		}
		seqs[i] = seq
	}
	if in.win.remade {
		prev = 0
	}
	ordered := true
	for _, s := range seqs {
		if s <= prev {
			ordered = false
		}
		prev = s
	}
	for i := range q {
		in.complete(&q[i], seqs[i])
	}
	in.log.Info("publish window repaired", "messages", len(q), "resent", failed, "in_order", ordered)
	if ordered {
		return nil
	}
	in.reorders.Add(1)
	in.b.m.reorders.WithLabelValues(in.src.Instance).Inc()
	in.log.Warn("the stream holds the instance's messages out of order after a failure: publishing a resync (clear, then the table)",
		"stream_seqs", seqs)
	return in.publishResync(ctx)
}

// publish sends one message and waits for its ack, after everything in
// flight: for the bridge's own messages (clears, resyncs, removals of aged
// blocks), whose effect on the table the caller applies afterwards.
func (in *instance) publish(ctx context.Context, payload []byte, h kvstream.EventHeaders) (uint64, error) {
	if err := in.flush(ctx); err != nil {
		return 0, err
	}
	p := pending{msg: &nats.Msg{Subject: in.subj, Data: payload, Header: h.Header()}, id: in.msgID(), sent: time.Now()}
	in.sent.Add(1)
	seq, err := in.publishSync(ctx, p.msg, p.id)
	if err != nil {
		return 0, err
	}
	in.complete(&p, seq)
	return seq, nil
}

// publishSync sends msg under id, retrying with the same id (JetStream
// drops duplicates) until it is acknowledged or ctx is done, and returns
// its stream sequence.
func (in *instance) publishSync(ctx context.Context, msg *nats.Msg, id string) (uint64, error) {
	backoff := 50 * time.Millisecond
	remade := false
	for attempt := 0; ; attempt++ {
		pctx, cancel := context.WithTimeout(ctx, in.b.cfg.PublishTimeout)
		ack, err := in.b.js.PublishMsg(pctx, msg, jetstream.WithMsgID(id))
		cancel()
		if err == nil {
			if attempt > 0 {
				in.log.Info("publish recovered", "attempts", attempt+1)
			}
			if remade {
				in.win.remade = true
				select {
				case in.storeNow <- struct{}{}:
				default:
				}
			}
			return ack.Sequence, nil
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		in.b.m.retries.Inc()
		if attempt == 0 {
			in.log.Warn("publish failed, retrying (engine messages are buffered)", "err", err)
		}
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
			// The stream may have been deleted (a wiped JetStream store):
			// make it again, and once publishing works, store a snapshot
			// at once, which makes the bucket again too.
			// One attempt, bounded like a publish: a JetStream API
			// request in flight when its server died is never answered,
			// and nats.go bounds it only for a context without a
			// deadline, so this goroutine (and every later event of the
			// engine) waited for the run's end.
			ectx, cancel := context.WithTimeout(ctx, in.b.cfg.PublishTimeout)
			_, _ = kvstream.EnsureStream(ectx, in.b.js, in.b.cfg.Stream)
			cancel()
			remade = true
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}
