package test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// orderedPayloads makes n engine batches whose end state depends on their
// order: each stores a chain of fresh blocks and removes some blocks an
// earlier batch stored (removing one before its store leaves it held).
func orderedPayloads(t testing.TB, n, chain int, seed uint64) [][]byte {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 1))
	var held []uint64
	next := uint64(1)
	out := make([][]byte, 0, n)
	for i := 0; i < n; i++ {
		hs := make([]uint64, chain)
		for j := range hs {
			hs[j] = next
			next++
		}
		evs := []events.Event{{Kind: events.BlockStored, BlockHashes: hs, TokenIDs: make([]uint32, 16*chain), BlockSize: 16, Medium: "GPU"}}
		if len(held) > 0 {
			k := rng.IntN(min(len(held), chain) + 1)
			rm := make([]uint64, 0, k)
			for j := 0; j < k; j++ {
				x := rng.IntN(len(held))
				rm = append(rm, held[x])
				held[x] = held[len(held)-1]
				held = held[:len(held)-1]
			}
			if len(rm) > 0 {
				evs = append(evs, events.Event{Kind: events.BlockRemoved, BlockHashes: rm, Medium: "GPU"})
			}
		}
		held = append(held, hs...)
		p, err := events.Encode(nil, events.Batch{TS: 1, Events: evs, HasDPRank: true}, events.EncodingArray)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// streamEngineSeqs reads every message of the rig's instance subject and
// returns the engine seqs of the engine messages in stream order (a
// coalesced message's each), and the number of synthetic resyncs.
func streamEngineSeqs(t *testing.T, r *rig) (seqs []uint64, resyncs int) {
	t.Helper()
	for _, m := range streamMessages(t, r) {
		switch {
		case m.h.Synthetic == kvstream.SyntheticResync:
			if b, err := events.Decode(m.data); err == nil && clearsOnly(b.Events) {
				resyncs++
			}
		case m.h.Synthetic == "" && m.h.HasSeq:
			for i := range max(m.h.Batches, 1) {
				seqs = append(seqs, m.h.Seq+uint64(i))
			}
		}
	}
	return seqs, resyncs
}

// streamMsg is a stream message's parsed headers and payload.
type streamMsg struct {
	h    kvstream.EventHeaders
	data []byte
}

// streamMessages reads every message of the rig's instance subject, in
// stream order; a coalesced one must split into its headers' count of
// payloads.
func streamMessages(t *testing.T, r *rig) []streamMsg {
	t.Helper()
	js, err := jetstream.New(r.conn())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(r.ctx, 30*time.Second)
	defer cancel()
	subj, _ := kvstream.EventsSubject(r.pool, r.instance)
	st, err := js.Stream(ctx, r.stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subj}})
	if err != nil {
		t.Fatal(err)
	}
	var out []streamMsg
	for {
		m, err := c.Next(jetstream.FetchMaxWait(2 * time.Second))
		if errors.Is(err, jetstream.ErrNoMessages) || errors.Is(err, context.DeadlineExceeded) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		h, err := kvstream.ParseEventHeaders(m.Headers())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kvstream.SplitPayload(h, m.Data(), nil); err != nil {
			t.Fatalf("stream message with headers %+v: %v", h, err)
		}
		out = append(out, streamMsg{h: h, data: m.Data()})
		if md, err := m.Metadata(); err == nil && md.NumPending == 0 {
			return out
		}
	}
}

func clearsOnly(evs []events.Event) bool {
	return len(evs) == 1 && evs[0].Kind == events.AllBlocksCleared
}

// Pipelined publishing across a NATS restart with messages in flight:
// NATS stores the bridge's messages but its acks are held back (a reply
// gate between the bridge and NATS), so what the bridge sent is in flight,
// whatever the machine's speed, when NATS goes away, and the engine's
// 3,000 messages wait in the bridge's outage buffer. Nothing is lost (the index ends equal
// to the engine), and the stream holds every engine message once, in the
// engine's order — or, if a failure left it out of order, the bridge said
// so (Reorders) and published a resync after it.
func TestE2EPipelinedPublishNATSRestart(t *testing.T) {
	for _, coalesce := range []int{0, bridge.DefaultCoalesce} {
		t.Run(fmt.Sprintf("coalesce%d", coalesce), func(t *testing.T) { pipelinedPublishNATSRestart(t, coalesce) })
	}
}

// pipelinedPublishNATSRestart is TestE2EPipelinedPublishNATSRestart with
// the bridge's Config.Coalesce (the engine's messages queue behind the
// held window, so with it on they go coalesced).
func pipelinedPublishNATSRestart(t *testing.T, coalesce int) {
	ps := orderedPayloads(t, 3000, 8, 7)
	r := newRig(t, rigOpts{buffer: 1 << 16, gate: true, coalesce: coalesce})
	_, a, _ := r.startConsumer(consumer.Config{})

	// The engine's first message takes the bridge's synchronous start path
	// (fillStart); the rest go through the window.
	r.publish(ps[0])
	r.waitPublished(1)
	r.gate.Hold()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i, p := range ps[1:] {
			if _, err := r.pub.Publish(p); err != nil {
				t.Error(err)
				return
			}
			if i%100 == 99 {
				time.Sleep(time.Millisecond) // stay within the engine's PUB high-water mark
			}
		}
	}()
	// Held, nothing the bridge sends from here on is acknowledged. Wait
	// until NATS has stored some of it (a message still in the client's
	// write buffer would be sent again after the restart and acknowledged
	// then: no failure to repair); their acks are lost with the server.
	<-done
	js, err := jetstream.New(r.conn())
	if err != nil {
		t.Fatal(err)
	}
	subj, _ := kvstream.EventsSubject(r.pool, r.instance)
	testenv.WaitFor(t, 30*time.Second, "NATS storing engine messages whose acks are held", func() bool {
		st, err := js.Stream(r.ctx, r.stream.Name)
		if err != nil {
			return false
		}
		m, err := st.GetLastMsgForSubject(r.ctx, subj)
		if err != nil {
			return false
		}
		h, err := kvstream.ParseEventHeaders(m.Header)
		return err == nil && h.HasSeq && h.Seq > 1
	})
	r.ns.Shutdown()
	r.ns.WaitForShutdown()
	// The replies held die with the server's connections: release the
	// gate only once it has dropped them, or it would deliver them.
	testenv.WaitFor(t, 30*time.Second, "the gate dropping the dead server's connections", func() bool { return r.gate.Conns() == 0 })
	r.gate.Release()
	time.Sleep(200 * time.Millisecond)
	r.ns = r.ns.Restart(t)
	r.waitPublished(uint64(len(ps)))

	waitTable(t, a, r.instance, reference(t, ps...))
	s := r.stats()
	if s.Dropped != 0 {
		t.Fatalf("bridge dropped engine messages with a buffer of 65536: %+v", s)
	}
	if s.Repairs == 0 {
		t.Fatalf("no publish failed: NATS did not go away mid-window (%+v)", s)
	}
	if (s.Coalesced > 0) != (coalesce > 1) || s.MaxCoalesced > uint64(coalesce) {
		t.Fatalf("coalesce %d: %d coalesced messages, the largest of %d engine messages", coalesce, s.Coalesced, s.MaxCoalesced)
	}
	seqs, resyncs := streamEngineSeqs(t, r)
	t.Logf("bridge stats %+v; %d engine messages in the stream, %d resyncs", s, len(seqs), resyncs)
	if s.Reorders != 0 {
		if resyncs < 2 {
			t.Fatalf("%d reorders but %d resyncs in the stream (want the start-up one and one per reorder)", s.Reorders, resyncs)
		}
		return
	}
	if resyncs != 1 {
		t.Fatalf("%d resyncs in the stream, want only the start-up one", resyncs)
	}
	// Every engine message once, in order (gaps the bridge filled from the
	// engine's replay are in place too).
	if len(seqs) != len(ps) {
		t.Fatalf("stream holds %d engine messages, want %d", len(seqs), len(ps))
	}
	for i, q := range seqs {
		if q != uint64(i+1) {
			t.Fatalf("stream message %d has engine seq %d, want %d", i, q, i+1)
		}
	}
}

// Order without failures: a long burst through the window arrives in the
// stream exactly in the engine's order, each message once; the window is
// used (more than one message in flight) and never exceeded.
func TestE2EPipelinedPublishOrder(t *testing.T) {
	ps := orderedPayloads(t, 2000, 4, 11)
	for _, window := range []int{1, 8, bridge.DefaultPublishWindow} {
		t.Run(fmt.Sprintf("window%d", window), func(t *testing.T) {
			// No failure is wanted here: an ack later than the rig's 1s
			// publish timeout (a loaded machine under -race) is not one.
			r := newRig(t, rigOpts{buffer: 1 << 16, window: window, publishTimeout: time.Minute})
			_, a, _ := r.startConsumer(consumer.Config{})
			r.publish(ps...)
			r.waitPublished(uint64(len(ps)))
			waitTable(t, a, r.instance, reference(t, ps...))
			seqs, resyncs := streamEngineSeqs(t, r)
			s := r.stats()
			t.Logf("bridge stats %+v", s)
			if s.Reorders != 0 || s.Repairs != 0 || resyncs != 1 || len(seqs) != len(ps) {
				t.Fatalf("stats %+v, %d resyncs, %d engine messages in the stream: want no failure, one resync, %d messages",
					s, resyncs, len(seqs), len(ps))
			}
			for i, q := range seqs {
				if q != uint64(i+1) {
					t.Fatalf("stream message %d has engine seq %d, want %d", i, q, i+1)
				}
			}
			if s.MaxInFlight > uint64(window) || (window > 1 && s.MaxInFlight < 2) {
				t.Fatalf("at most %d messages in flight at once, want 2..%d", s.MaxInFlight, window)
			}
		})
	}
}

// A message refused while later ones in the window are stored: the stream
// refuses engine message 21 of a burst (larger than its MaxMsgSize) and
// stores 22 and more behind it. The bridge resends 21 until the stream
// takes it (the test raises the limit meanwhile), finds the stream holding
// it after later messages, and publishes a resync. Message 22 removes half
// the blocks 21 stored, so applying 21 late over it would leave blocks the
// engine no longer holds: the router must still end equal to the engine.
func TestE2EPipelinedPublishReorderResynced(t *testing.T) {
	const maxSize = 2048
	small := orderedPayloads(t, 300, 2, 5)
	fresh := make([]uint64, 128)
	for i := range fresh {
		fresh[i] = 1<<40 + uint64(i)
	}
	large, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{{Kind: events.BlockStored,
		BlockHashes: fresh, TokenIDs: make([]uint32, 16*len(fresh)), BlockSize: 16, Medium: "GPU"}}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	removeHalf, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{{Kind: events.BlockRemoved,
		BlockHashes: fresh[:64], Medium: "GPU"}}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	ps := append(append(append([][]byte{}, small[:20]...), large, removeHalf), small[20:]...)
	for i, p := range ps {
		if (len(p) > maxSize/2) != (i == 20) {
			t.Fatalf("payload %d is %d bytes: the test needs only payload 20 over %d", i, len(p), maxSize/2)
		}
	}
	if len(large) <= maxSize {
		t.Fatalf("the large payload is %d bytes, not over the stream's %d", len(large), maxSize)
	}

	r := newRig(t, rigOpts{buffer: 1 << 16})
	_, a, _ := r.startConsumer(consumer.Config{})
	js, err := jetstream.New(r.conn())
	if err != nil {
		t.Fatal(err)
	}
	setMaxSize := func(n int32) {
		t.Helper()
		var st jetstream.Stream
		testenv.WaitFor(t, 10*time.Second, "the bridge's stream", func() bool { st, err = js.Stream(r.ctx, r.stream.Name); return err == nil })
		cfg := st.CachedInfo().Config
		cfg.MaxMsgSize = n
		if _, err := js.UpdateStream(r.ctx, cfg); err != nil {
			t.Fatal(err)
		}
	}
	setMaxSize(maxSize)
	r.publish(ps...)
	testenv.WaitFor(t, 20*time.Second, "the refused message being resent", func() bool { return r.stats().Repairs > 0 })
	time.Sleep(300 * time.Millisecond) // a few refused resends
	setMaxSize(-1)
	r.waitPublished(uint64(len(ps)))

	waitTable(t, a, r.instance, reference(t, ps...))
	s := r.stats()
	seqs, resyncs := streamEngineSeqs(t, r)
	t.Logf("bridge stats %+v; %d engine messages in the stream, %d resyncs", s, len(seqs), resyncs)
	if s.Dropped != 0 || s.Reorders != 1 || resyncs != 2 {
		t.Fatalf("bridge stats %+v, %d resyncs in the stream: want nothing dropped, one reorder, the start-up resync and one after it", s, resyncs)
	}
	if i := slices.Index(seqs, 21); i < 0 || !slices.Contains(seqs[:i], 22) {
		t.Fatalf("engine message 21 not stored after 22: stream order %v", seqs[:min(len(seqs), 40)])
	}
}

// A burst queued behind a held publish window (the gate holds JetStream's
// acks) goes through a coalescing bridge as NATS messages of several
// engine messages each, within both limits (engine messages per NATS
// message, payload bytes); the router's index ends exactly equal to the
// engine's, and the stream holds every engine seq once, in order. With
// coalescing off every engine message is a NATS message of its own, as
// before. A payload that does not decode (engine seq badSeq) is
// published alone, unchanged, and counted.
func TestE2ECoalescedBurst(t *testing.T) {
	good := orderedPayloads(t, 1500, 4, 13)
	largest := 0
	for _, p := range good {
		largest = max(largest, len(p))
	}
	const badSeq = 700
	ps := slices.Concat(good[:badSeq-1], [][]byte{{0xc1, 0x00, 0xff}}, good[badSeq-1:])
	for _, c := range []struct {
		name            string
		coalesce, bytes int
	}{
		{"off", 0, 0},
		{"count-bound", 8, 0},
		{"byte-bound", 64, 3 * largest},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, rigOpts{buffer: 1 << 16, gate: true, window: 4, coalesce: c.coalesce, coalesceMax: c.bytes,
				publishTimeout: time.Minute})
			_, a, _ := r.startConsumer(consumer.Config{})
			evicted := collectEvicted(t, r)
			r.publish(ps[0]) // the start path (synchronous)
			r.waitPublished(1)
			r.gate.Hold()
			for i, p := range ps[1:] {
				if _, err := r.pub.Publish(p); err != nil {
					t.Fatal(err)
				}
				if i%100 == 99 {
					time.Sleep(time.Millisecond) // stay within the engine's PUB high-water mark
				}
			}
			// The engine's messages queue in the bridge behind the four
			// unacknowledged ones meanwhile.
			time.Sleep(300 * time.Millisecond)
			r.gate.Release()
			r.waitPublished(uint64(len(ps)))
			waitTable(t, a, r.instance, reference(t, good...))

			s := r.stats()
			msgs := streamMessages(t, r)
			seqs, resyncs := streamEngineSeqs(t, r)
			t.Logf("bridge stats %+v; %d stream messages carry %d engine messages", s, len(msgs), len(seqs))
			if s.Dropped != 0 || s.Repairs != 0 || s.Reorders != 0 || resyncs != 1 || s.Malformed != 1 {
				t.Fatalf("stats %+v, %d resyncs: want no drop, no failure, the start-up resync only", s, resyncs)
			}
			if len(seqs) != len(ps) {
				t.Fatalf("stream holds %d engine messages, want %d", len(seqs), len(ps))
			}
			for i, q := range seqs {
				if q != uint64(i+1) {
					t.Fatalf("engine message %d in the stream has seq %d, want %d", i, q, i+1)
				}
			}
			coalesced, bad := 0, 0
			for _, m := range msgs {
				if m.h.Seq == badSeq && !m.h.Coalesced() && m.h.Synthetic == "" {
					bad++
				}
				if !m.h.Coalesced() {
					continue
				}
				if m.h.Seq <= badSeq && badSeq <= m.h.LastSeq() {
					t.Fatalf("the malformed payload was coalesced (seqs %d..%d)", m.h.Seq, m.h.LastSeq())
				}
				coalesced++
				if m.h.Batches > c.coalesce {
					t.Fatalf("a NATS message carries %d engine messages, over the bound %d", m.h.Batches, c.coalesce)
				}
				if c.bytes > 0 && len(m.data) > c.bytes {
					t.Fatalf("a coalesced payload of %d bytes, over the bound %d", len(m.data), c.bytes)
				}
			}
			if bad != 1 {
				t.Fatalf("the malformed payload is in %d messages of its own, want 1", bad)
			}
			// Eviction records (one per tier per NATS message when
			// coalesced) name every removed block exactly once.
			var removed []uint64
			for _, p := range good {
				b, err := events.Decode(p)
				if err != nil {
					t.Fatal(err)
				}
				for _, e := range b.Events {
					if e.Kind == events.BlockRemoved {
						removed = append(removed, e.BlockHashes...)
					}
				}
			}
			slices.Sort(removed)
			testenv.WaitFor(t, 10*time.Second, "eviction records of every removed block", func() bool { return len(evicted()) >= len(removed) })
			if got := evicted(); !slices.Equal(got, removed) {
				t.Fatalf("eviction records name %d blocks, want the %d removed, each once", len(got), len(removed))
			}
			if uint64(coalesced) != s.Coalesced {
				t.Fatalf("%d coalesced messages in the stream, the bridge counted %d", coalesced, s.Coalesced)
			}
			if c.coalesce == 0 {
				if coalesced != 0 {
					t.Fatalf("coalescing off, yet %d coalesced messages", coalesced)
				}
				return
			}
			if coalesced == 0 || s.MaxCoalesced < 2 {
				t.Fatalf("a backlog of %d engine messages went uncoalesced: %+v", len(ps), s)
			}
		})
	}
}

// collectEvicted subscribes to the rig instance's eviction records; the
// function returned gives the hashes named by "evicted" records so far,
// sorted.
func collectEvicted(t *testing.T, r *rig) func() []uint64 {
	t.Helper()
	subj, _ := kvstream.EvictionsSubject(r.pool, r.instance)
	var mu sync.Mutex
	var got []uint64
	sub, err := r.conn().Subscribe(subj, func(m *nats.Msg) {
		var rec kvstream.EvictionRecord
		if json.Unmarshal(m.Data, &rec) != nil || rec.Reason != kvstream.ReasonEvicted {
			return
		}
		mu.Lock()
		got = append(got, rec.Hashes...)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := r.conn().Flush(); err != nil {
		t.Fatal(err)
	}
	return func() []uint64 {
		mu.Lock()
		defer mu.Unlock()
		return slices.Sorted(slices.Values(got))
	}
}

// Messages the bridge publishes from the engine's replay after its buffer
// overflowed (catchUp), with the engine quiet afterwards, reach the
// stream with coalescing on as with it off: a step that publishes from
// the replay sends what it joined before waiting for the next signal
// (nothing else may come to send it). The gate holds acks while the
// engine publishes into a two-message buffer, so it overflows.
func TestE2ECoalescedCatchUpAfterDrops(t *testing.T) {
	for _, co := range []int{0, 8} {
		t.Run(fmt.Sprintf("coalesce%d", co), func(t *testing.T) {
			ps := orderedPayloads(t, 30, 2, 7)
			r := newRig(t, rigOpts{buffer: 2, gate: true, window: 1, coalesce: co, publishTimeout: time.Minute})
			_, a, _ := r.startConsumer(consumer.Config{})
			r.publish(ps[0])
			r.waitPublished(1)
			r.gate.Hold()
			for _, p := range ps[1:] {
				r.publish(p)
				time.Sleep(2 * time.Millisecond) // each reaches the bridge: the buffer overflows
			}
			testenv.WaitFor(t, 20*time.Second, "the bridge dropping messages", func() bool { return r.stats().Dropped > 0 })
			r.gate.Release()
			waitTable(t, a, r.instance, reference(t, ps...))
			// The bridge records a message's engine seq when its ack
			// comes back (applyAcked), which can be after the consumer
			// has read the message from the stream: wait for it.
			if !waitUntil(20*time.Second, func() bool { return r.stats().EngineSeq == uint64(len(ps)) }) {
				s := r.stats()
				t.Fatalf("bridge at engine seq %d, want %d: %+v", s.EngineSeq, len(ps), s)
			}
		})
	}
}

// The engine-identity check after coalescing: a gap that follows a run of
// coalesced messages is filled from the engine's replay only if the
// replay's copy of the last message published matches the hash the bridge
// kept, which must be that engine payload's (not the coalesced message's):
// the gap is filled, with no clear.
func TestE2ECoalescedThenGapFilled(t *testing.T) {
	ps := orderedPayloads(t, 400, 4, 17)
	r := newRig(t, rigOpts{buffer: 1 << 16, gate: true, window: 4, coalesce: bridge.DefaultCoalesce, publishTimeout: time.Minute})
	_, a, _ := r.startConsumer(consumer.Config{})
	r.publish(ps[0])
	r.waitPublished(1)
	r.gate.Hold()
	r.publish(ps[1:300]...)
	time.Sleep(300 * time.Millisecond) // queued behind the held window
	r.gate.Release()
	r.waitPublished(300)
	if s := r.stats(); s.Coalesced == 0 {
		t.Fatalf("the burst went uncoalesced: %+v", s)
	}
	// The bridge asks the engine for a replay at its start (resync), when
	// it connects and again half a second later (catchTail): a recheck
	// answered between the skip and the next live message fills the hole
	// before it is seen as a gap. Wait for the three, so that the next
	// live message finds the gap (on a loaded machine the two connect
	// signals can merge into one request: then the fill may come from the
	// recheck, which is right too).
	rechecked := waitUntil(5*time.Second, func() bool { return r.pub.Replays() >= 3 })
	r.pub.Skip(ps[300]) // dropped on the way, still in the replay buffer
	r.publish(ps[301:]...)
	r.waitPublished(uint64(len(ps)))
	waitTable(t, a, r.instance, reference(t, ps...))
	s := r.stats()
	if s.ReplayFailures != 0 || s.Clears != 1 || s.Replays == 0 {
		t.Fatalf("bridge stats %+v: want the hole filled from replay, only the start-up clear", s)
	}
	if rechecked && s.Gaps != 1 {
		t.Fatalf("bridge stats %+v: want the hole found as one gap once the replays after connect were answered", s)
	}
}

// waitUntil polls cond until it holds or d has passed, and reports whether
// it held.
func waitUntil(d time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}
