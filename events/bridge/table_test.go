package bridge

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/tiers"
)

// capturedBatches decodes a capture file of events/testdata/captured (real
// llm-d-inference-sim messages; see its DATA.md).
func capturedBatches(t testing.TB, name string) []events.Batch {
	t.Helper()
	var out []events.Batch
	for _, p := range eventstest.CapturedPayloads(t, name) {
		b, err := events.Decode(p)
		if err != nil {
			t.Fatalf("decode capture: %v", err)
		}
		out = append(out, b)
	}
	return out
}

func TestTableSnapshotRebuilds(t *testing.T) {
	cpu := func(hs ...uint64) events.Event {
		return events.Event{Kind: events.BlockStored, BlockHashes: hs, Medium: "CPU"}
	}
	gpuRemove := func(hs ...uint64) events.Event {
		return events.Event{Kind: events.BlockRemoved, BlockHashes: hs, Medium: "GPU"}
	}
	for _, file := range []string{"array.jsonl", "map.jsonl"} {
		t.Run(file, func(t *testing.T) {
			batches := capturedBatches(t, file)
			for cut := 1; cut <= len(batches); cut++ {
				tab := NewTable(0)
				for _, b := range batches[:cut] {
					tab.Apply(b.Events)
				}
				// Offload some blocks to CPU and drop some from GPU, as a
				// CPU offloading connector would.
				dump := tab.Dump()
				if len(dump) < 5 {
					continue // just after the capture's AllBlocksCleared
				}
				var some []uint64
				for h := range dump {
					if len(some) < 5 {
						some = append(some, h)
					}
				}
				tab.Apply([]events.Event{cpu(some...), gpuRemove(some[:2]...)})
				want := tab.Dump()

				// The snapshot survives encoding and rebuilds the table.
				p, err := events.Encode(nil, events.Batch{Events: tab.Events()}, events.EncodingMap)
				if err != nil {
					t.Fatal(err)
				}
				dec, err := events.Decode(p)
				if err != nil {
					t.Fatal(err)
				}
				again := NewTable(0)
				again.Apply(dec.Events)
				if got := again.Dump(); !reflect.DeepEqual(got, want) {
					t.Fatalf("cut %d: rebuilt table differs: %d vs %d blocks", cut, len(got), len(want))
				}
				for _, h := range some[:2] {
					if want[h].Tiers != tiers.CPU.Bit() {
						t.Fatalf("block %x tiers %b, want CPU only", h, want[h].Tiers)
					}
				}
				// Chunked, the same.
				chunked := NewTable(0)
				for _, c := range chunkEvents(tab.Events(), 3) {
					n := 0
					for _, e := range c {
						n += len(e.BlockHashes)
					}
					if n > 3 {
						t.Fatalf("chunk of %d blocks, max 3", n)
					}
					chunked.Apply(c)
				}
				if got := chunked.Dump(); !reflect.DeepEqual(got, want) {
					t.Fatalf("cut %d: chunked rebuild differs", cut)
				}
			}
		})
	}
}

// A parent evicted before its children (the simulator does that) stays as
// a ghost, so a snapshot keys the children as the live stream did.
func TestTableGhostSnapshot(t *testing.T) {
	tab := NewTable(0)
	toks := make([]uint32, 3*4)
	tab.Apply([]events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{1, 2, 3}, TokenIDs: toks, BlockSize: 4, Medium: "GPU"},
		{Kind: events.BlockRemoved, BlockHashes: []uint64{1}, Medium: "GPU"}})
	evs := tab.Events()
	if evs[0].Kind != events.BlockStored || len(evs[0].BlockHashes) != 3 || evs[0].HasParent {
		t.Fatalf("snapshot does not store the chain from its ghost root: %+v", evs[0])
	}
	last := evs[len(evs)-1]
	if last.Kind != events.BlockRemoved || len(last.BlockHashes) != 1 || last.BlockHashes[0] != 1 {
		t.Fatalf("snapshot does not remove the ghost: %+v", last)
	}
	again := NewTable(0)
	again.Apply(evs)
	if !reflect.DeepEqual(again.Dump(), tab.Dump()) || again.Len() != 2 {
		t.Fatalf("rebuilt %v, want %v", again.Dump(), tab.Dump())
	}
	tab.Apply([]events.Event{{Kind: events.BlockRemoved, BlockHashes: []uint64{3, 2}, Medium: "GPU"}})
	if len(tab.index) != 0 || tab.Ghosts() != 0 {
		t.Fatalf("ghost kept after its children went: %d blocks, %d ghosts", len(tab.index), tab.Ghosts())
	}
}

func TestTableApply(t *testing.T) {
	st := func(parent uint64, hasParent bool, medium string, hs ...uint64) events.Event {
		e := events.Event{Kind: events.BlockStored, BlockHashes: hs, ParentHash: parent, HasParent: hasParent, Medium: medium}
		if medium == "GPU" {
			e.BlockSize = 2
			for range hs {
				e.TokenIDs = append(e.TokenIDs, 1, 2)
			}
		}
		return e
	}
	rm := func(medium string, hs ...uint64) events.Event {
		return events.Event{Kind: events.BlockRemoved, BlockHashes: hs, Medium: medium}
	}
	tests := []struct {
		name      string
		max       int
		evs       []events.Event
		wantLen   int
		wantStore int
		unplaced  int
		evicted   int
		skipped   int
		removed   int
	}{
		{"store chain", 0, []events.Event{st(0, false, "GPU", 1, 2, 3)}, 3, 3, 0, 0, 0, 0},
		{"remove", 0, []events.Event{st(0, false, "GPU", 1, 2), rm("GPU", 2, 9)}, 1, 2, 0, 0, 0, 1},
		{"cpu of unknown", 0, []events.Event{st(0, false, "CPU", 7)}, 0, 0, 1, 0, 0, 0},
		{"cpu then gpu removal keeps block", 0, []events.Event{st(0, false, "GPU", 1), st(0, false, "CPU", 1), rm("GPU", 1)}, 1, 2, 0, 0, 0, 1},
		{"clear", 0, []events.Event{st(0, false, "GPU", 1, 2), {Kind: events.AllBlocksCleared}, st(0, false, "GPU", 5)}, 1, 3, 0, 0, 0, 0},
		{"bounded", 2, []events.Event{st(0, false, "GPU", 1, 2, 3)}, 2, 3, 0, 1, 0, 0},
		{"ghost parent", 0, []events.Event{st(0, false, "GPU", 1, 2, 3), rm("GPU", 1)}, 2, 3, 0, 0, 0, 1},
		{"ghost released", 0, []events.Event{st(0, false, "GPU", 1, 2), rm("GPU", 1), rm("GPU", 2)}, 0, 2, 0, 0, 0, 2},
		// Ghosts do not count against the bound: the engine holds 3.
		{"bound ignores ghosts", 3, []events.Event{st(0, false, "GPU", 1, 2, 3), rm("GPU", 1), st(3, true, "GPU", 4)}, 3, 4, 0, 0, 0, 1},
		// Past the bound the oldest held block goes; with children it
		// stays as a ghost, so its descendants still key.
		{"bound keeps chains", 2, []events.Event{st(0, false, "GPU", 1, 2), st(2, true, "GPU", 3)}, 2, 3, 0, 1, 0, 0},
		// Past the ghost bound the oldest ghost goes with its subtree.
		{"ghost bound", 1, []events.Event{st(0, false, "GPU", 1), rm("GPU", 1), st(0, false, "GPU", 2)}, 1, 2, 0, 0, 0, 1},
		{"ghost stored again", 0, []events.Event{st(0, false, "GPU", 1, 2), rm("GPU", 1), st(0, false, "GPU", 1)}, 2, 3, 0, 0, 0, 1},
		{"sliding window skipped", 0, []events.Event{func() events.Event { e := st(0, false, "GPU", 1); e.GroupIdx = 1; return e }()}, 0, 0, 0, 0, 1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tab := NewTable(tc.max)
			r := tab.Apply(tc.evs)
			removed := 0
			for _, x := range r.Removed {
				removed += len(x.Hashes)
			}
			ghosts := 0
			for _, s := range tab.index {
				if tab.at(s).tiers == 0 {
					ghosts++
				}
			}
			if ghosts != tab.Ghosts() || len(tab.Dump()) != tab.Len() || ghosts+tab.Len() != len(tab.index) {
				t.Fatalf("ghost count %d, counted %d", tab.Ghosts(), ghosts)
			}
			if tab.Len() != tc.wantLen || r.Stored != tc.wantStore || r.Unplaced != tc.unplaced || r.Evicted != tc.evicted || r.Skipped != tc.skipped || removed != tc.removed {
				t.Fatalf("len %d result %+v", tab.Len(), r)
			}
		})
	}
}

// BenchmarkTableApply folds the 25 captured batches (144 stores, their
// evictions, a clear) into a table: the bridge's per-batch work after the
// decode.
func BenchmarkTableApply(b *testing.B) {
	batches := capturedBatches(b, "array.jsonl")
	blocks := 0
	for _, bt := range batches {
		for _, e := range bt.Events {
			blocks += len(e.BlockHashes)
		}
	}
	tab := NewTable(1 << 16)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tab.Apply(batches[i%len(batches)].Events)
	}
	b.ReportMetric(float64(b.N)/float64(len(batches))*float64(blocks)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkTableSnapshot renders and encodes a 1,000-block table as a
// snapshot batch.
func BenchmarkTableSnapshot(b *testing.B) {
	tab := NewTable(0)
	toks := make([]uint32, 16*10)
	for c := uint64(0); c < 100; c++ {
		hs := make([]uint64, 10)
		for i := range hs {
			hs[i] = c*1000 + uint64(i) + 1
		}
		tab.Apply([]events.Event{{Kind: events.BlockStored, BlockHashes: hs, TokenIDs: toks, BlockSize: 16, Medium: "GPU"}})
	}
	b.ReportAllocs()
	b.ResetTimer()
	var buf []byte
	for i := 0; i < b.N; i++ {
		var err error
		buf, err = events.Encode(buf[:0], events.Batch{Events: tab.Events()}, events.EncodingMap)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(buf)), "bytes")
}

func TestReplayWindow(t *testing.T) {
	var w replayWindow
	msg := func(seq uint64, p string) enginezmq.Message { return enginezmq.Message{Seq: seq, Payload: []byte(p)} }
	for _, m := range []enginezmq.Message{msg(5, "a"), msg(6, "b"), msg(7, "c")} {
		w.add(m)
	}
	steps := []struct {
		m    enginezmq.Message
		want bool
	}{
		{msg(4, "z"), false}, // before the window
		{msg(5, "a"), true},
		{msg(6, "x"), false}, // same seq, other payload: not a duplicate (a restart)
		{msg(7, "c"), true},
		{msg(7, "c"), false}, // passed
		{msg(8, "d"), false},
	}
	for i, s := range steps {
		if got := w.seen(s.m); got != s.want {
			t.Fatalf("step %d seq %d: got %v", i, s.m.Seq, got)
		}
	}
	w.add(msg(10, "a"))
	w.add(msg(12, "b")) // not consecutive: the window restarts
	if w.seen(msg(10, "a")) || !w.seen(msg(12, "b")) {
		t.Fatal("window did not restart on a non-consecutive add")
	}
}

// The replay window lets a payload go once the live stream passes it.
// seen resliced (or emptied to [:0]) its slice, keeping the backing array
// and every pointer in it: 64 replayed 1 MiB messages, all passed, still
// held 63 MiB. Here the array the window filled is looked at after live
// messages pass part of it, then all of it: its passed entries must be
// nil, and the window must hold no array once passed.
func TestReplayWindowLetsPassedGo(t *testing.T) {
	var w replayWindow
	for seq := range uint64(8) {
		w.add(enginezmq.Message{Seq: 100 + seq, Payload: []byte{byte(seq)}})
	}
	filled := w.payloads[:8] // the backing array as add filled it
	if !w.seen(enginezmq.Message{Seq: 102, Payload: []byte{2}}) {
		t.Fatal("seq 102 not seen as replayed")
	}
	for i, p := range filled[:3] {
		if p != nil {
			t.Errorf("seq %d passed, its payload still held by the window", 100+i)
		}
	}
	if w.seen(enginezmq.Message{Seq: 120, Payload: []byte{20}}) {
		t.Fatal("seq 120, past the window, seen as replayed")
	}
	if w.payloads != nil {
		t.Errorf("window passed: still holds an array of %d payloads", cap(w.payloads))
	}
	for i, p := range filled {
		if p != nil {
			t.Errorf("window passed: seq %d's payload still in its array", 100+i)
		}
	}
}

// A table bounded at exactly the engine's block count holds what an
// unbounded one holds, through churn that leaves ghosts (parents evicted
// before their children, as an engine's LRU may do), and its snapshot
// rebuilds it: the bound never costs a held block.
func TestTableBoundAtEngineSize(t *testing.T) {
	const engineBlocks = 64
	rng := rand.New(rand.NewPCG(1, 2))
	bounded, free := NewTable(engineBlocks), NewTable(0)
	var held []uint64 // what the engine holds, in no particular order
	next := uint64(1)
	parentOf := map[uint64]uint64{}
	maxGhosts := 0
	lastUse := map[uint64]int{}
	apply := func(evs ...events.Event) {
		r := bounded.Apply(evs)
		free.Apply(evs)
		if r.Evicted != 0 {
			t.Fatalf("bounded table evicted %d held blocks (ghosts %d)", r.Evicted, free.Ghosts())
		}
	}
	for step := 0; step < 5000; step++ {
		n := 1 + rng.IntN(6)
		// Make room as an engine does: the least recently used block no
		// held block descends from (vLLM's free queue is LRU and frees a
		// request's blocks tail first), but one time in eight any block,
		// so that parents go before children and leave ghosts.
		var rm []uint64
		for len(held)+n > engineBlocks {
			i := rng.IntN(len(held))
			if rng.IntN(8) > 0 {
				for j, h := range held {
					if !hasChild(held, parentOf, h) && (hasChild(held, parentOf, held[i]) || lastUse[h] < lastUse[held[i]]) {
						i = j
					}
				}
			}
			rm = append(rm, held[i])
			held[i] = held[len(held)-1]
			held = held[:len(held)-1]
		}
		if len(rm) > 0 {
			apply(events.Event{Kind: events.BlockRemoved, BlockHashes: rm, Medium: "GPU"})
		}
		e := events.Event{Kind: events.BlockStored, BlockSize: 2, Medium: "GPU"}
		if len(held) > 0 && rng.IntN(4) > 0 {
			e.ParentHash, e.HasParent = held[rng.IntN(len(held))], true
			// A request reusing a prefix uses all of it.
			for h := e.ParentHash; h != 0; h = parentOf[h] {
				lastUse[h] = step
			}
		}
		parent := e.ParentHash
		for range n {
			e.BlockHashes = append(e.BlockHashes, next)
			e.TokenIDs = append(e.TokenIDs, uint32(next), uint32(step))
			parentOf[next], parent = parent, next
			lastUse[next] = step
			held = append(held, next)
			next++
		}
		apply(e)
		maxGhosts = max(maxGhosts, bounded.Ghosts())
		if step%250 == 0 {
			checkSlots(t, bounded)
		}
		if bounded.Len() != len(held) {
			t.Fatalf("step %d: bounded table holds %d, engine %d", step, bounded.Len(), len(held))
		}
	}
	if maxGhosts == 0 {
		t.Fatal("the churn left no ghosts: it does not test them")
	}
	if !reflect.DeepEqual(bounded.Dump(), free.Dump()) {
		t.Fatal("bounded table differs from the unbounded one")
	}
	again := NewTable(engineBlocks)
	if r := again.Apply(bounded.Events()); r.Evicted != 0 {
		t.Fatalf("rebuilding from the snapshot evicted %d", r.Evicted)
	}
	if !reflect.DeepEqual(again.Dump(), bounded.Dump()) {
		t.Fatal("snapshot does not rebuild the bounded table")
	}
}

func hasChild(held []uint64, parentOf map[uint64]uint64, h uint64) bool {
	for _, x := range held {
		if parentOf[x] == h {
			return true
		}
	}
	return false
}

// BenchmarkBridgePublish is the bridge's own path from its input buffer to
// JetStream's ack, without the engine's ZMQ socket: the captured vLLM
// batches (cycled) are put straight into an instance's buffer, as its
// subscriber does, and the bridge decodes, publishes (window 128) and
// folds each into its table. The NATS server (file store) runs in this
// process, so cpu-µs/batch is the bridge's and the server's together.
// Coalescing off and on (DefaultCoalesce) side by side: the whole burst
// is queued at once, so with it on the bridge joins what is queued.
func BenchmarkBridgePublish(b *testing.B) {
	ps := eventstest.CapturedPayloads(b, "array.jsonl")
	for _, coalesce := range []int{0, DefaultCoalesce} {
		b.Run(fmt.Sprintf("coalesce%d", coalesce), func(b *testing.B) {
			in := startBridge(b, coalesce, b.N+16)
			eventstest.Burst(b, ps, func(seq uint64, p []byte) { in.enqueue(enginezmq.Message{Topic: "kv", Seq: seq, Payload: p}) },
				func(n uint64) bool { s := in.stats(); return s.HasSeq && s.EngineSeq >= n }, func() any { return in.stats() })
			s := in.stats()
			if s.Dropped != 0 || s.Gaps != 0 || s.Malformed != 0 {
				b.Fatalf("bridge dropped messages: %+v", s)
			}
			msgs := float64(b.N) - float64(s.CoalescedBatches) + float64(s.Coalesced)
			b.ReportMetric(float64(b.N)/msgs, "batches/nats-msg")
		})
	}
}

// TestTableRemovedHashes: the hashes a removal reports are exactly the
// held ones it removed, in the event's order, whether they are a prefix
// of the event's (reported without a copy) or not; appending to them (as
// eviction records gathered per tier do) leaves the event unchanged.
func TestTableRemovedHashes(t *testing.T) {
	for _, tc := range []struct{ rm, want []uint64 }{
		{[]uint64{1, 2, 3}, []uint64{1, 2, 3}},
		{[]uint64{1, 2, 9}, []uint64{1, 2}},
		{[]uint64{1, 9, 2, 3}, []uint64{1, 2, 3}},
		{[]uint64{9, 3, 1}, []uint64{3, 1}},
		{[]uint64{9, 8}, nil},
	} {
		tab := NewTable(0)
		tab.Apply([]events.Event{{Kind: events.BlockStored, BlockHashes: []uint64{1, 2, 3}, BlockSize: 1, TokenIDs: []uint32{1, 2, 3}, Medium: "GPU"}})
		ev := events.Event{Kind: events.BlockRemoved, BlockHashes: tc.rm, Medium: "GPU"}
		sent := append([]uint64(nil), tc.rm...)
		r := tab.Apply([]events.Event{ev})
		var got []uint64
		for _, x := range r.Removed {
			got = append(got, x.Hashes...)
			_ = append(x.Hashes, 77)
		}
		if !reflect.DeepEqual(got, tc.want) || !reflect.DeepEqual(ev.BlockHashes, sent) {
			t.Fatalf("removing %v: reported %v, want %v; the event's hashes now %v", sent, got, tc.want, ev.BlockHashes)
		}
	}
}
