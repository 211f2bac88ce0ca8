package bridge

import (
	"context"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
)

// Coalescing (Config.Coalesce). A NATS message costs the bridge and the
// server far more than the engine batch in it (a JetStream publish, its
// store and its ack: tens of microseconds per message on loopback, the
// same for a 2 KB batch as for 200 KB), so when engine messages queue up
// behind the publish window the bridge joins consecutive ones of an
// instance into one NATS message: their payloads concatenated unchanged
// (msgpack values are self-delimiting, so each batch is still the
// engine's bytes), headers saying the engine seqs first..last and their
// count (kvstream.HeaderBatches). Consumers apply the batches in order,
// each checked against the engine seq like a message of its own.
//
// Only what is already queued is joined: a message joins the group, and
// the group is published as soon as the input buffer is empty (the
// process loop's flush), the group is full (Coalesce messages, or
// coalesceBytes), or anything else is to be published (a malformed
// payload, a clear, a resync, a removal of aged blocks: they go alone,
// after the group). A quiet engine's message is therefore published at
// once, alone, with the headers it always had; the added latency of a
// joined one is the decoding of the messages queued behind it.
//
// Everything the bridge keeps about its messages is unchanged: a
// coalesced message is one pending message of the window, one message id
// (a resend after a failure repeats it whole, and JetStream drops it if
// it stored it), and its ack folds its batches into the table in order,
// the last one setting engineSeq and lastHash (the hash of the last
// engine payload published, which the restart check compares with the
// engine's replay of that seq).
//
// Rollout: a router from before coalescing reads a coalesced message as
// one malformed payload (its decoder refuses the bytes after the first
// batch) with the first seq, so it applies nothing of it and reloads the
// instance's snapshot at the next message (a seq gap); it never applies
// part of one. Routers are upgraded first, then bridges turn it on.

// DefaultCoalesce is the advised Config.Coalesce (kvbridge --coalesce).
// The per-message cost is shared by the messages joined: at 64 it is
// below 2 % of what it was per batch, less than the bridge's own per-batch
// work (decoding, the table), so joining more buys little, while the
// group and each resend stay small (with the byte bound).
const DefaultCoalesce = 64

// group is the engine messages being joined, in seq order.
type group struct {
	msgs  []enginezmq.Message
	evs   [][]events.Event
	bytes int
	enc   string
}

// coalesceBytes bounds a coalesced payload: Config.CoalesceBytes, at
// most a quarter of the server's max payload (256 KiB at NATS's default
// 1 MiB), far enough under it for the headers and for a server
// configured lower since connecting; it also bounds what a window of
// coalesced messages holds in memory and what a failure resends.
func (in *instance) coalesceBytes() int {
	limit := 256 << 10
	if mp := in.b.cfg.Conn.MaxPayload(); mp > 0 {
		limit = int(mp / 4)
	}
	if n := in.b.cfg.CoalesceBytes; n > 0 && n < limit {
		return n
	}
	return limit
}

// join adds an engine message that decoded (its events evs, its
// encoding enc) to the group, publishing the group first when the
// message cannot follow it, and after when the group is full.
func (in *instance) join(ctx context.Context, m enginezmq.Message, evs []events.Event, enc string) error {
	g := &in.group
	// A group's seqs increase (kvstream.ParseEventHeaders refuses a last
	// seq below the first): one ends where the engine's seq wraps to 0.
	if n := len(g.msgs); n > 0 && (m.Seq != g.msgs[n-1].Seq+1 || m.Seq == 0 || enc != g.enc || g.bytes+len(m.Payload) > in.coalesceBytes()) {
		if err := in.seal(ctx); err != nil {
			return err
		}
	}
	if g.msgs == nil {
		// Room for a full group at once: the group's slices are the
		// message's until its ack (not reused), so they are made once
		// per group rather than grown by doubling.
		g.msgs = make([]enginezmq.Message, 0, in.b.cfg.Coalesce)
		g.evs = make([][]events.Event, 0, in.b.cfg.Coalesce)
	}
	g.msgs = append(g.msgs, m)
	g.evs = append(g.evs, evs)
	g.bytes += len(m.Payload)
	g.enc = enc
	if len(g.msgs) >= in.b.cfg.Coalesce {
		return in.seal(ctx)
	}
	return nil
}

// seal publishes the group, if any: one engine message as it always was,
// several as one coalesced message.
func (in *instance) seal(ctx context.Context) error {
	g := in.group
	if len(g.msgs) == 0 {
		return nil
	}
	in.group = group{}
	first := g.msgs[0]
	h := kvstream.EventHeaders{Seq: first.Seq, HasSeq: true, Rank: in.src.Rank, Pool: in.b.cfg.Pool, Instance: in.src.Instance,
		Model: in.b.cfg.Model, Encoding: g.enc}
	payload := first.Payload
	if n := len(g.msgs); n > 1 {
		h.Batches = n
		// Without a copy when the payloads lie back to back as the
		// subscriber read them (enginezmq.JoinPayloads).
		payload, _ = enginezmq.JoinPayloads(g.msgs)
		in.coalesced.Add(1)
		in.coalescedBatches.Add(uint64(n))
		if uint64(n) > in.maxCoalesced.Load() {
			in.maxCoalesced.Store(uint64(n)) // written only here, by the process goroutine
		}
	}
	return in.publishAsync(ctx, payload, h, len(g.msgs), func(seq uint64) { in.applyAcked(g.msgs, g.evs, seq) })
}
