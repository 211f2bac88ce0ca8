package bridge

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
)

// HeaderError is set on a snapshot reply that carries no snapshot (the
// bridge is still starting); its value says why.
const HeaderError = "Kv-Error"

// resync runs once at start: recover the table from the bucket's snapshot
// if the engine is provably the process it was taken from, catch up from
// the engine's replay (or give up what cannot be vouched for), then
// publish a clear followed by the whole table, so consumers hold exactly
// the bridge's table whatever a previous bridge published.
//
// A snapshot is for one engine process. The engine behind the endpoint
// may have restarted while the bridge was away (a pod restart restarts
// both), and a new process's seq may well have passed the snapshot's, so
// neither "replay has nothing newer" nor "the seq follows on" proves
// anything. What does: the replay socket returning the snapshot's last
// message byte for byte (its hash is in the snapshot), or the engine's
// process start time equal to the snapshot's. Without proof the bridge
// starts empty and rebuilds from the engine's replay buffer.
func (in *instance) resync(ctx context.Context) error {
	var start float64
	if in.probing() {
		r := in.probeOnce(ctx)
		start = r.start
		in.mu.Lock()
		in.engineStart = r.start
		in.mu.Unlock()
	}
	snap := in.loadSnapshot(ctx)
	if snap != nil && snap.EngineStart != 0 && start != 0 && snap.EngineStart != start {
		in.log.Info("snapshot is of an earlier engine process (start time differs): starting empty",
			"snapshot_start", snap.EngineStart, "engine_start", start)
		snap = nil
	}
	startProven := snap != nil && snap.EngineStart != 0 && snap.EngineStart == start
	if in.src.ReplayEndpoint != "" {
		from := in.src.FirstSeq // no snapshot: the engine's whole history
		hashProof := snap != nil && snap.LastHash != 0
		switch {
		case hashProof:
			from = snap.EngineSeq // replayed again, to be compared
		case startProven:
			from = snap.EngineSeq + 1
		case snap != nil:
			in.log.Info("snapshot cannot be tied to the engine process (no hash, no start time): starting empty")
			snap = nil
		}
		msgs, err := in.replayAll(ctx, from)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err == nil && hashProof {
			if len(msgs) == 0 || msgs[0].Seq != from || xxhash.Sum64(msgs[0].Payload) != snap.LastHash {
				err = errNotSameEngine
			} else {
				msgs, from = msgs[1:], from+1
			}
		}
		if err == nil && contiguous(msgs, from) {
			if snap != nil {
				in.applySnapshot(*snap)
			}
			for _, m := range msgs {
				b, err := events.Decode(m.Payload)
				if err != nil {
					in.malformed.Add(1)
					continue
				}
				in.mu.Lock()
				in.table.Apply(b.Events)
				if b.InvalidRemovals > 0 {
					// The engine dropped blocks nobody can be told of:
					// cleared after the message, as live (publishEngine).
					in.table.Clear()
				}
				in.lastHash = xxhash.Sum64(m.Payload)
				in.mu.Unlock()
				if b.InvalidRemovals > 0 {
					in.log.Warn("unreadable removal in the replay: clearing instance", "seq", m.Seq, "events", b.InvalidRemovals)
				}
				in.tracker.Set(m.Seq)
			}
			for _, m := range msgs {
				in.replayed.add(m)
			}
			in.countReplay(true)
			in.log.Info("caught up from replay", "from", from, "messages", len(msgs), "snapshot", snap != nil)
		} else {
			in.countReplay(false)
			if snap != nil {
				in.log.Warn("snapshot not provably of this engine process, or replay cannot close the gap since it: starting empty", "from", from, "err", err)
			} else {
				if err == nil && len(msgs) > 0 {
					in.warnFirstSeq("start-up", msgs[0].Seq)
				}
				in.log.Info("no usable snapshot and no full replay: starting empty; the first message asks again", "first_seq", from, "err", err)
			}
		}
	} else if snap != nil {
		if startProven {
			in.applySnapshot(*snap)
			in.log.Info("no replay endpoint: the engine's start time proves the snapshot's process; the first live message decides whether it still holds")
		} else {
			in.log.Info("no replay endpoint and no engine start time to tie the snapshot to the engine process: starting empty")
		}
	}
	if last, ok := in.tracker.Last(); ok {
		in.mu.Lock()
		in.engineSeq, in.hasSeq = last, true
		in.mu.Unlock()
	}
	if err := in.publishResync(ctx); err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(ctx, in.storeBudget())
	defer cancel()
	in.storeSnapshot(sctx)
	return nil
}

// loadSnapshot reads the instance's snapshot from the bucket (nil: none or
// unusable); nothing is applied yet.
func (in *instance) loadSnapshot(ctx context.Context) *kvstream.Snapshot {
	// Bounded like a store: a JetStream request in flight when its server
	// died is never answered, and nats.go bounds it only for a context
	// without a deadline.
	ctx, cancel := context.WithTimeout(ctx, in.storeBudget())
	defer cancel()
	kv, obs := in.b.stores()
	e, err := kv.Get(ctx, in.key)
	if err != nil {
		return nil
	}
	s, err := kvstream.UnmarshalSnapshot(e.Value())
	if err == nil {
		s, err = kvstream.ResolveSnapshot(ctx, obs, s)
	}
	if err == nil && s.Instance == in.src.Instance && !s.HasSeq {
		// The previous run had heard no engine message yet (an idle
		// engine): nothing to resume from, and nothing wrong.
		in.log.Info("the snapshot in the bucket holds no engine seq (the previous run heard no engine message): starting from the engine's replay", "key", in.key)
		return nil
	}
	if err == nil && s.Instance != in.src.Instance {
		err = fmt.Errorf("snapshot of instance %q, not %q", s.Instance, in.src.Instance)
	}
	if err == nil {
		_, err = events.Decode(s.Batch)
	}
	if err != nil {
		in.log.Warn("ignoring unusable snapshot in bucket", "key", in.key, "err", err)
		return nil
	}
	return &s
}

// applySnapshot folds a proven snapshot into the (empty) table.
func (in *instance) applySnapshot(s kvstream.Snapshot) {
	b, _ := events.Decode(s.Batch) // checked by loadSnapshot
	in.mu.Lock()
	in.table.Apply(b.Events)
	in.lastHash = s.LastHash
	in.mu.Unlock()
	if b.Encoding != 0 {
		in.enc.Store(uint32(b.Encoding))
	}
	in.tracker.Set(s.EngineSeq)
	in.log.Info("recovered block table from snapshot", "blocks", s.Blocks, "engine_seq", s.EngineSeq)
}

// contiguous reports whether msgs are consecutive from `from`: for an
// engine's whole history, from its first seq (Source.FirstSeq). A history
// of an engine counting from 0 that starts at 1 is not: it accepted
// either, so an engine whose seq 0 was lost read as complete.
func contiguous(msgs []enginezmq.Message, from uint64) bool {
	if len(msgs) == 0 {
		return true
	}
	if msgs[0].Seq != from {
		return false
	}
	for i := 1; i < len(msgs); i++ {
		if msgs[i].Seq != msgs[i-1].Seq+1 {
			return false
		}
	}
	return true
}

// publishResync publishes a clear and then the table, in chunks.
func (in *instance) publishResync(ctx context.Context) error {
	in.mu.Lock()
	evs := in.table.Events()
	in.mu.Unlock()
	h := kvstream.EventHeaders{Rank: in.src.Rank, Encoding: in.encoding().String(), Pool: in.b.cfg.Pool,
		Instance: in.src.Instance, Model: in.b.cfg.Model, Synthetic: kvstream.SyntheticResync}
	// The clear goes through clear() so it is counted, but the table must
	// survive it: publish it, then the table.
	payload, err := events.Encode(nil, events.Batch{TS: now(), Events: []events.Event{{Kind: events.AllBlocksCleared}},
		DPRank: in.src.Rank, HasDPRank: true}, in.encoding())
	if err != nil {
		return fmt.Errorf("bridge: encode clear: %w", err)
	}
	seq, err := in.publish(ctx, payload, h)
	if err != nil {
		return err
	}
	in.clears.Add(1)
	in.b.m.clears.WithLabelValues(in.src.Instance, kvstream.SyntheticResync).Inc()
	for _, chunk := range chunkEvents(evs, in.b.cfg.MaxBlocksPerMessage) {
		if seq, err = in.publishChunk(ctx, chunk, h, seq); err != nil {
			return err
		}
	}
	in.mu.Lock()
	in.streamSeq = seq
	n := in.table.Len()
	in.mu.Unlock()
	in.b.m.tableBlocks.WithLabelValues(in.src.Instance).Set(float64(n))
	in.log.Info("published resync", "blocks", n, "stream_seq", seq)
	return nil
}

// publishChunk publishes one chunk of a resync, and returns the stream
// sequence of the last message published (seq when none). A chunk over
// the server's max payload (blocks of many tokens: 4,096 blocks of 256
// tokens are 3–5 MB) is split in halves until each part fits; it
// would be refused at every attempt, as an oversize engine message was.
// A single block that does not fit is left out, and logged: consumers
// then hold fewer blocks than the table, never more.
func (in *instance) publishChunk(ctx context.Context, chunk []events.Event, h kvstream.EventHeaders, seq uint64) (uint64, error) {
	payload, err := events.Encode(nil, events.Batch{TS: now(), Events: chunk, DPRank: in.src.Rank, HasDPRank: true}, in.encoding())
	if err != nil {
		return seq, fmt.Errorf("bridge: encode resync: %w", err)
	}
	if !in.oversize(len(payload), h) {
		return in.publish(ctx, payload, h)
	}
	n := 0
	for i := range chunk {
		n += len(chunk[i].BlockHashes)
	}
	if n <= 1 {
		in.log.Warn("a block of the table is larger than the NATS server's max payload by itself: left out of the resync",
			"bytes", len(payload), "max_payload", in.b.cfg.Conn.MaxPayload())
		return seq, nil
	}
	for _, part := range chunkEvents(chunk, (n+1)/2) {
		if seq, err = in.publishChunk(ctx, part, h, seq); err != nil {
			return seq, err
		}
	}
	return seq, nil
}

func now() float64 { return float64(time.Now().UnixNano()) / 1e9 }

// chunkEvents splits evs into groups of at most max blocks, splitting a
// long store (its tail continues from the last block of its head).
func chunkEvents(evs []events.Event, max int) [][]events.Event {
	var out [][]events.Event
	var cur []events.Event
	n := 0
	flush := func() {
		if len(cur) > 0 {
			out = append(out, cur)
			cur, n = nil, 0
		}
	}
	for _, e := range evs {
		for len(e.BlockHashes) > 0 {
			room := max - n
			if room <= 0 {
				flush()
				room = max
			}
			if len(e.BlockHashes) <= room {
				cur = append(cur, e)
				n += len(e.BlockHashes)
				break
			}
			head := e
			head.BlockHashes = e.BlockHashes[:room]
			tail := e
			tail.BlockHashes = e.BlockHashes[room:]
			if e.Kind == events.BlockStored && len(e.TokenIDs) > 0 && e.BlockSize > 0 {
				head.TokenIDs = e.TokenIDs[:room*e.BlockSize]
				tail.TokenIDs = e.TokenIDs[room*e.BlockSize:]
				tail.ParentHash, tail.HasParent = head.BlockHashes[room-1], true
				tail.CacheSalt = ""
			}
			cur = append(cur, head)
			n += room
			e = tail
		}
		if len(e.BlockHashes) == 0 && e.Kind == events.AllBlocksCleared {
			cur = append(cur, e)
		}
	}
	flush()
	return out
}

// snapshot renders the table and the seqs it is current to.
func (in *instance) snapshot() (kvstream.Snapshot, error) {
	in.mu.Lock()
	evs := in.table.Events()
	s := kvstream.Snapshot{Pool: in.b.cfg.Pool, Instance: in.src.Instance, Model: in.b.cfg.Model,
		BlockSize: in.table.BlockSize(), Blocks: in.table.Len(), EngineSeq: in.engineSeq, HasSeq: in.hasSeq,
		StreamSeq: in.streamSeq, Taken: time.Now().UTC(), EngineStart: in.engineStart, LastHash: in.lastHash}
	in.mu.Unlock()
	b, err := events.Encode(nil, events.Batch{TS: now(), Events: evs, DPRank: in.src.Rank, HasDPRank: true}, in.encoding())
	if err != nil {
		return kvstream.Snapshot{}, fmt.Errorf("bridge: encode snapshot: %w", err)
	}
	s.Batch = b
	return s, nil
}

// serveSnapshot answers kv.snapshot.<pool>.<instance> requests.
func (in *instance) serveSnapshot(msg *nats.Msg) {
	reply := nats.NewMsg(msg.Reply)
	if !in.started.Load() {
		reply.Header.Set(HeaderError, "starting")
		_ = msg.RespondMsg(reply)
		in.b.m.snapshots.WithLabelValues("request", "error").Inc()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), in.b.cfg.PublishTimeout)
	defer cancel()
	in.waitCompleted(in.b.cfg.PublishTimeout)
	s, err := in.snapshot()
	if err == nil {
		reply.Data, err = in.marshalServed(ctx, s)
	}
	if err != nil {
		reply.Header.Set(HeaderError, err.Error())
		in.b.m.snapshots.WithLabelValues("request", "error").Inc()
	} else {
		in.b.m.snapshots.WithLabelValues("request", "ok").Inc()
	}
	_ = msg.RespondMsg(reply)
}

// requestObject ends the name of the object a snapshot served to a
// request is put under (<pool>.<instance>.request); the bucket's is
// <pool>.<instance>. Under one name, a request's snapshot taken before a
// store and written after it replaced the newer object the bucket's
// pointer names: the pointer then named an object older than itself,
// which kvstream.ResolveSnapshot refuses, and nothing rewrote it while
// the engine stayed quiet (a store with nothing new only checks that
// the bucket has its key) — a bridge restarted meanwhile started empty,
// routers could not load the instance from the bucket. Each name has one
// writer at a time (stores are one at a time, and requests are served
// one at a time by their subscription), each writing snapshots in the
// order taken.
const requestObject = ".request"

// inlineMax is the largest snapshot sent inline: InlineSnapshotMax, at
// most half the server's max payload (the default's ratio to NATS's
// default 1 MiB), which leaves room for a reply's headers and for a
// server configured lower since connecting, as coalesceBytes does.
func (in *instance) inlineMax() int {
	if mp := in.b.cfg.Conn.MaxPayload(); mp > 0 {
		return int(min(int64(in.b.cfg.InlineSnapshotMax), mp/2))
	}
	return in.b.cfg.InlineSnapshotMax
}

// objectChunk is the chunk size of a snapshot object: each chunk is one
// message, so nats.go's default (128 KiB) is cut to half the server's max
// payload, as inlineMax is, which leaves room for a chunk's headers and
// for a server configured lower since connecting.
func (in *instance) objectChunk() uint32 {
	const dflt = 128 << 10 // nats.go's default
	if mp := in.b.cfg.Conn.MaxPayload(); mp > 0 {
		return uint32(min(dflt, mp/2))
	}
	return dflt
}

// marshalServed renders a snapshot served to a request (serveSnapshot).
func (in *instance) marshalServed(ctx context.Context, s kvstream.Snapshot) ([]byte, error) {
	return in.marshalSnapshot(ctx, s, in.key+requestObject)
}

// marshalSnapshot renders s for one message: inline when it fits in
// InlineSnapshotMax, else put in the object store under name with a
// pointer returned.
func (in *instance) marshalSnapshot(ctx context.Context, s kvstream.Snapshot, name string) ([]byte, error) {
	data, err := s.MarshalBinary()
	if err != nil || len(data) <= in.inlineMax() {
		return data, err
	}
	_, obs := in.b.stores()
	meta := jetstream.ObjectMeta{Name: name, Opts: &jetstream.ObjectMetaOptions{ChunkSize: in.objectChunk()}}
	if _, err := obs.Put(ctx, meta, bytes.NewReader(data)); err != nil {
		return nil, fmt.Errorf("bridge: snapshot object: %w", err)
	}
	ptr := s
	ptr.Object, ptr.Batch = name, nil
	return ptr.MarshalBinary()
}

// storeBudget bounds one snapshot store: the snapshot interval (the next
// store supersedes this one, so finishing later is worth nothing), and at
// least one publish timeout. Without a deadline on its context nats.go
// gives every chunk of an object its own 5 s ack timeout (the JetStream
// default), so a snapshot of many chunks written while the server is
// busy failed every time; see docs/operations.md "snapshot store".
func (in *instance) storeBudget() time.Duration {
	return max(in.b.cfg.SnapshotInterval, in.b.cfg.PublishTimeout)
}

// storeSnapshot puts the current snapshot in the bucket unless the bucket
// already has this stream position. ctx bounds the whole store.
func (in *instance) storeSnapshot(ctx context.Context) {
	in.mu.Lock()
	cur, stored := in.streamSeq, in.storedSeq
	in.mu.Unlock()
	if cur == stored && cur != 0 {
		// Nothing new; but a wiped JetStream loses the bucket while the
		// engine is idle too, so check that the snapshot is still there.
		kv, _ := in.b.stores()
		if _, err := kv.Get(ctx, in.key); err == nil || ctx.Err() != nil {
			return
		}
	}
	start := time.Now()
	s, err := in.snapshot()
	put := func() error {
		data, err := in.marshalSnapshot(ctx, s, in.key)
		if err == nil {
			kv, _ := in.b.stores()
			_, err = kv.Put(ctx, in.key, data)
		}
		return err
	}
	if err == nil {
		if err = put(); err != nil && ctx.Err() == nil {
			if rerr := in.b.remakeStores(ctx); rerr == nil {
				in.log.Info("snapshot store failed; bucket and object store looked up or made again", "err", err)
				err = put()
			}
		}
	}
	took := time.Since(start)
	if err != nil {
		in.b.m.snapshots.WithLabelValues("store", "error").Inc()
		// One line per failed store, and stores are one per interval.
		in.log.Warn("snapshot store failed", "err", err, "blocks", s.Blocks, "took", took.Round(time.Millisecond),
			"budget", in.storeBudget())
		return
	}
	in.b.m.snapshots.WithLabelValues("store", "ok").Inc()
	in.b.m.storeSecs.Observe(took.Seconds())
	in.b.m.storeBytes.WithLabelValues(in.src.Instance).Set(float64(len(s.Batch)))
	in.mu.Lock()
	in.storedSeq = s.StreamSeq
	in.mu.Unlock()
}

// periodic publishes heartbeats and refreshes the bucket's snapshot. A
// store runs beside the heartbeats, never in their way (a store may take
// up to storeBudget, longer than routers wait for a heartbeat), one at a
// time (a store asked for while one runs follows it); the first periodic one waits a random part of the interval so that
// bridges started together do not all write at the same instant.
func (in *instance) periodic(ctx context.Context) {
	hb := time.NewTicker(in.b.cfg.HeartbeatInterval)
	defer hb.Stop()
	snap := time.NewTimer(time.Duration(rand.Int64N(int64(in.b.cfg.SnapshotInterval)) + 1))
	defer snap.Stop()
	var storing sync.WaitGroup
	defer storing.Wait()
	busy, again := false, false
	done := make(chan struct{}, 1)
	store := func() {
		if !in.started.Load() {
			return
		}
		if busy { // run once more when this one ends, with the table as it is then
			again = true
			return
		}
		busy = true
		storing.Add(1)
		go func() {
			defer storing.Done()
			sctx, cancel := context.WithTimeout(ctx, in.storeBudget())
			defer cancel()
			in.storeSnapshot(sctx)
			done <- struct{}{}
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-hb.C:
			// Not before the start-up resync is done: until its clear
			// reaches the routers they may hold what a previous bridge
			// published for an engine that has since restarted, and a
			// heartbeat would make that live again.
			if in.started.Load() {
				in.heartbeat()
			}
		case <-done:
			busy = false
			if again {
				again = false
				store()
			}
		case <-snap.C:
			snap.Reset(in.b.cfg.SnapshotInterval)
			store()
		case <-in.storeNow:
			store()
		}
	}
}

func (in *instance) heartbeat() {
	in.mu.Lock()
	h := kvstream.Heartbeat{Pool: in.b.cfg.Pool, Instance: in.src.Instance, URL: in.src.URL, Model: in.b.cfg.Model,
		BlockSize: in.table.BlockSize(), Adapters: in.b.cfg.Adapters, Role: in.b.cfg.Role, Rank: in.src.Rank, Blocks: in.table.Len(),
		EngineSeq: in.engineSeq, StreamSeq: in.streamSeq, Time: time.Now().UTC(),
		IntervalMS: in.b.cfg.HeartbeatInterval.Milliseconds(), EngineDown: in.engineDown.Load(), EngineStart: in.engineStart}
	in.mu.Unlock()
	if h.BlockSize == 0 {
		h.BlockSize = in.b.cfg.BlockSize
	}
	data, err := json.Marshal(h)
	if err != nil {
		return
	}
	msg := &nats.Msg{Subject: in.hbSubj, Data: data}
	if key := in.b.cfg.HeartbeatKey; key != nil {
		msg.Header = nats.Header{kvstream.HeaderSignature: []string{kvstream.SignHeartbeat(key, in.hbSubj, data)}}
	}
	_ = in.b.cfg.Conn.PublishMsg(msg)
}

// duplicate reports whether a live message repeats one a replay already
// folded in (the subscriber kept receiving during the replay), and forgets
// replayed messages the live stream has passed.
func (in *instance) duplicate(m enginezmq.Message) bool { return in.replayed.seen(m) }

// replayWindow holds the payloads of consecutive replayed seqs
// [from, from+len(payloads)). A payload the live stream has passed is let
// go at once, its pointer cleared and the backing array dropped with the
// last: resliced only, the array kept every payload of the replay alive
// (64 replayed 1 MiB messages, all passed, still held 63 MiB).
type replayWindow struct {
	from     uint64
	payloads [][]byte
}

func (w *replayWindow) add(m enginezmq.Message) {
	if len(w.payloads) == 0 || m.Seq != w.from+uint64(len(w.payloads)) {
		clear(w.payloads)
		w.from, w.payloads = m.Seq, w.payloads[:0]
	}
	w.payloads = append(w.payloads, m.Payload)
}

func (w *replayWindow) seen(m enginezmq.Message) bool {
	if len(w.payloads) == 0 || m.Seq < w.from {
		return false
	}
	i := m.Seq - w.from
	if i >= uint64(len(w.payloads)) {
		clear(w.payloads)
		w.payloads = nil
		return false
	}
	dup := bytes.Equal(w.payloads[i], m.Payload)
	clear(w.payloads[:i+1])
	w.payloads, w.from = w.payloads[i+1:], m.Seq+1
	if len(w.payloads) == 0 {
		w.payloads = nil
	}
	return dup
}
