package bridge

import (
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// encodeBatch encodes one engine message of evs (vLLM's array encoding).
func encodeBatch(t *testing.T, evs ...events.Event) []byte {
	t.Helper()
	p, err := events.Encode(nil, events.Batch{TS: 1, Events: evs}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// storeBatch encodes one engine message storing n blocks of 16 tokens,
// hashes from first.
func storeBatch(t *testing.T, first uint64, n int) []byte {
	t.Helper()
	return encodeBatch(t, chain(first, n, 16, 0, "", ""))
}

// engineTable is what the engine holds after payloads: they applied to an
// unbounded table.
func engineTable(t *testing.T, payloads ...[]byte) map[uint64]Placement {
	t.Helper()
	return applyAll(t, NewTable(0), payloads).Dump()
}

// applyAll applies each payload to tab in order, and returns tab.
func applyAll(t *testing.T, tab *Table, payloads [][]byte) *Table {
	t.Helper()
	for i, p := range payloads {
		b, err := events.Decode(p)
		if err != nil {
			t.Fatalf("payload %d of %d: %v", i, len(payloads), err)
		}
		tab.Apply(b.Events)
	}
	return tab
}

// streamMsg is one message of an instance's stream, as a consumer reads it.
type streamMsg struct {
	seq       uint64 // engine seq (0: none)
	last      uint64 // last engine seq it carries (coalesced)
	synthetic string
	bytes     int
}

// readStream applies every message of the bridge's stream in order to an
// empty table, as a router's consumer does (a coalesced message's
// payloads one by one; a synthetic clear is an AllBlocksCleared in its
// payload), and returns the table and the messages read.
func readStream(t *testing.T, in *instance) (*Table, []streamMsg) {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	js, err := jetstream.New(in.b.cfg.Conn)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, in.b.cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	tab := NewTable(0)
	var out []streamMsg
	for done := uint64(0); done < info.State.LastSeq; {
		m, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
		if err != nil {
			t.Fatalf("after stream seq %d of %d: %v", done, info.State.LastSeq, err)
		}
		meta, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		done = meta.Sequence.Stream
		h, err := kvstream.ParseEventHeaders(m.Headers())
		if err != nil {
			t.Fatal(err)
		}
		sm := streamMsg{synthetic: h.Synthetic, bytes: len(m.Data())}
		if h.HasSeq {
			sm.seq, sm.last = h.Seq, h.LastSeq()
		}
		out = append(out, sm)
		parts, err := kvstream.SplitPayload(h, m.Data(), nil)
		if err != nil {
			t.Fatal(err)
		}
		applyAll(t, tab, parts)
	}
	return tab, out
}

// waitEngineSeq waits until the bridge has published engine seq seq.
func waitEngineSeq(t *testing.T, in *instance, seq uint64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := in.stats()
		if s.HasSeq && s.EngineSeq == seq {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("engine seq %d not published in 30s: %+v", seq, s)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An engine message larger than the NATS server's max payload (a step
// storing 25,000 blocks: about 2 MB against the default 1 MiB) can never
// be published. Seen on the real binaries: the bridge retried it forever,
// every later message of the engine waited behind it, and the router,
// still getting heartbeats, showed the instance live on an index that
// stopped at the message before. Then (session 18) it was dropped and the
// instance cleared: the router held 0 blocks of the engine's 25,005. Now
// the bridge folds it into its table and publishes a resync (a clear,
// then the table in chunks under the max payload): a router reading the
// stream ends with exactly the engine's blocks, and the messages after
// it follow the resync in order. Both shapes of message: one store of
// 25,000 blocks, and 2,500 events of 10 blocks with a removal among them
// (which the router must not keep), each with coalescing off and on.
func TestOversizeEngineMessage(t *testing.T) {
	one := encodeBatch(t, chain(1000, 25000, 16, 3, "", ""))
	var evs []events.Event
	for i := range 2500 {
		evs = append(evs, chain(100000+uint64(i)*10, 10, 16, 0, "", ""))
		if i == 1000 {
			evs = append(evs, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{2, 3}, Medium: "GPU"})
		}
	}
	many := encodeBatch(t, evs...)
	for _, tc := range []struct {
		name string
		big  []byte
		last uint64 // a block the big message stores, which the next message chains onto
	}{{"one event", one, 25999}, {"many events", many, 124999}} {
		for _, coalesce := range []int{0, DefaultCoalesce} {
			t.Run(fmt.Sprintf("%s/coalesce=%d", tc.name, coalesce), func(t *testing.T) {
				in := startBridge(t, coalesce, 16)
				if mp := in.b.cfg.Conn.MaxPayload(); int64(len(tc.big)) <= mp {
					t.Fatalf("message of %d bytes is within the max payload %d", len(tc.big), mp)
				}
				ps := [][]byte{
					storeBatch(t, 1, 3),
					tc.big,
					encodeBatch(t, chain(500000, 2, 16, tc.last, "", "")),
					encodeBatch(t, events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{500001, 1}, Medium: "GPU"}),
				}
				for i, p := range ps {
					in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: p})
				}
				waitEngineSeq(t, in, uint64(len(ps)))
				want := engineTable(t, ps...)
				in.mu.Lock()
				got := in.table.Dump()
				in.mu.Unlock()
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("bridge table holds %d blocks, the engine %d", len(got), len(want))
				}
				routed, msgs := readStream(t, in)
				if r := routed.Dump(); !reflect.DeepEqual(r, want) {
					t.Fatalf("the stream read in order builds %d blocks, the engine holds %d", len(r), len(want))
				}
				// Order: seq 1, the resync (clear, then the table), seq 3, seq 4;
				// seq 2 itself never reaches the stream.
				var order []string
				for _, m := range msgs {
					switch {
					case m.synthetic != "":
						if n := len(order); n == 0 || order[n-1] != m.synthetic {
							order = append(order, m.synthetic)
						}
					default:
						for s := m.seq; s <= m.last; s++ {
							order = append(order, fmt.Sprint(s))
						}
					}
				}
				wantOrder := []string{kvstream.SyntheticResync, "1", kvstream.SyntheticResync, "3", "4"}
				if !reflect.DeepEqual(order, wantOrder) {
					t.Fatalf("stream order %v, want %v (the start-up resync first)", order, wantOrder)
				}
				for _, m := range msgs {
					if int64(m.bytes) > in.b.cfg.Conn.MaxPayload() {
						t.Fatalf("a message of %d bytes in the stream", m.bytes)
					}
				}
				s := in.stats()
				if s.Dropped != 0 || s.OversizeResyncs != 1 {
					t.Fatalf("dropped %d, oversize resyncs %d; want 0 and 1: %+v", s.Dropped, s.OversizeResyncs, s)
				}
				t.Logf("message of %d bytes; engine %d blocks, bridge table %d, stream %d; %d messages in the stream", len(tc.big), len(want), len(got), routed.Len(), len(msgs))
			})
		}
	}
}

// startBridgeCfg is startBridge with cfg changed by set first.
func startBridgeCfg(t *testing.T, set func(*Config)) *instance {
	t.Helper()
	br, _, _ := runBridgeCfg(t, 0, 16, fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)), nil, set)
	testenv.WaitFor(t, 20*time.Second, "bridge ready", br.Ready)
	return br.insts[0]
}

// A table bounded below what the oversize message stores (--max-blocks
// set under the engine's block count) keeps what its bound lets it; the
// resync publishes what it kept: the router then holds fewer blocks than
// the engine, every one of them held by the engine, and the messages
// after it are applied. At 20,000 the table keeps the newest 20,000 of
// the 25,000-block chain; at 10,000 the chain's evicted head passes the
// ghost bound too (Table), which takes the whole chain with it: nothing
// of the message is kept, still never a block the engine does not hold.
func TestOversizeEngineMessageBoundedTable(t *testing.T) {
	for _, tc := range []struct{ bound, want int }{{20000, 20000 + 2}, {10000, 2}} {
		t.Run(fmt.Sprint(tc.bound), func(t *testing.T) {
			in := startBridgeCfg(t, func(c *Config) { c.MaxBlocks = tc.bound })
			ps := [][]byte{
				storeBatch(t, 1, 3),
				encodeBatch(t, chain(1000, 25000, 16, 0, "", "")),
				encodeBatch(t, chain(500000, 2, 16, 25999, "", "")),
			}
			for i, p := range ps {
				in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: p})
			}
			waitEngineSeq(t, in, uint64(len(ps)))
			engine := engineTable(t, ps...)
			routed, _ := readStream(t, in)
			r := routed.Dump()
			for h, p := range r {
				if e, ok := engine[h]; !ok || e != p {
					t.Fatalf("the router holds block %d (%+v), the engine %+v, %v", h, p, e, ok)
				}
			}
			if len(r) != tc.want {
				t.Fatalf("the router holds %d blocks, want %d", len(r), tc.want)
			}
			if s := in.stats(); s.Dropped != 0 || s.OversizeResyncs != 1 {
				t.Fatalf("dropped %d, oversize resyncs %d: %+v", s.Dropped, s.OversizeResyncs, s)
			}
			t.Logf("engine %d blocks, router %d (table bound %d)", len(engine), len(r), tc.bound)
		})
	}
}

// Long blocks (256 tokens each): the table's resync chunks of 4,096
// blocks would be over the max payload themselves (retried forever, as
// the engine message was); they are split until they fit.
func TestOversizeResyncLongBlocks(t *testing.T) {
	in := startBridge(t, 0, 16)
	ps := [][]byte{
		encodeBatch(t, chain(1, 3, 256, 0, "", "")),
		encodeBatch(t, chain(1000, 1500, 256, 3, "", "")),
		encodeBatch(t, chain(500000, 2, 256, 2499, "", "")),
	}
	if mp := in.b.cfg.Conn.MaxPayload(); int64(len(ps[1])) <= mp {
		t.Fatalf("message of %d bytes is within the max payload %d", len(ps[1]), mp)
	}
	for i, p := range ps {
		in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: p})
	}
	waitEngineSeq(t, in, uint64(len(ps)))
	routed, msgs := readStream(t, in)
	if want := engineTable(t, ps...); !reflect.DeepEqual(routed.Dump(), want) {
		t.Fatalf("the stream builds %d blocks, the engine holds %d", routed.Len(), len(want))
	}
	t.Logf("message of %d bytes; %d messages in the stream", len(ps[1]), len(msgs))
}

// A message over the max payload that does not decode cannot be folded
// into the table: it is dropped, counted, and the instance cleared.
func TestOversizeMalformedDropped(t *testing.T) {
	in := startBridge(t, 0, 16)
	bad := make([]byte, 2<<20)
	bad[0] = 0xc1 // never used in msgpack
	ps := [][]byte{storeBatch(t, 1, 3), bad, storeBatch(t, 500000, 2)}
	for i, p := range ps {
		in.enqueue(enginezmq.Message{Topic: "kv", Seq: uint64(i + 1), Payload: p})
	}
	waitEngineSeq(t, in, 3)
	routed, _ := readStream(t, in)
	if want := engineTable(t, ps[2]); !reflect.DeepEqual(routed.Dump(), want) {
		t.Fatalf("the stream builds %d blocks, want the 2 stored after the clear", routed.Len())
	}
	if s := in.stats(); s.Dropped != 1 || s.OversizeResyncs != 0 {
		t.Fatalf("dropped %d, oversize resyncs %d: %+v", s.Dropped, s.OversizeResyncs, s)
	}
}
