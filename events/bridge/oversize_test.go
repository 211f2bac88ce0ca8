package bridge

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
)

// storeBatch encodes one engine message storing n blocks of 16 tokens,
// hashes from first.
func storeBatch(t *testing.T, first uint64, n int) []byte {
	t.Helper()
	e := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU"}
	for i := 0; i < n; i++ {
		e.BlockHashes = append(e.BlockHashes, first+uint64(i))
		for k := 0; k < 16; k++ {
			e.TokenIDs = append(e.TokenIDs, uint32(i*16+k)%30000+1)
		}
	}
	p, err := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{e}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// An engine message larger than the NATS server's max payload (a step
// storing 25,000 blocks: about 1.3 MB against the default 1 MiB) can
// never be published. Seen on the real binaries: the bridge retried it
// forever, every later message of the engine waited behind it, and the
// router, still getting heartbeats, showed the instance live on an index
// that stopped at the message before. It must be dropped, counted, and
// the instance cleared (the router then holds fewer blocks than the
// engine, never blocks it does not hold), and the messages after it
// published.
func TestOversizeEngineMessage(t *testing.T) {
	in := startBridge(t, 0, 16)
	big := storeBatch(t, 1000, 25000)
	if mp := in.b.cfg.Conn.MaxPayload(); int64(len(big)) <= mp {
		t.Fatalf("message of %d bytes is within the max payload %d", len(big), mp)
	}
	in.enqueue(enginezmq.Message{Topic: "kv", Seq: 1, Payload: storeBatch(t, 1, 3)})
	in.enqueue(enginezmq.Message{Topic: "kv", Seq: 2, Payload: big})
	in.enqueue(enginezmq.Message{Topic: "kv", Seq: 3, Payload: storeBatch(t, 500000, 2)})
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := in.stats()
		if s.HasSeq && s.EngineSeq == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the message after an oversize one was not published in 30s: %+v", s)
		}
		time.Sleep(20 * time.Millisecond)
	}
	in.mu.Lock()
	n := in.table.Len()
	in.mu.Unlock()
	if n != 2 {
		t.Fatalf("table holds %d blocks, want the 2 stored after the clear", n)
	}
	if s := in.stats(); s.Dropped != 1 {
		t.Fatalf("dropped %d, want the oversize message counted: %+v", s.Dropped, s)
	}
}
