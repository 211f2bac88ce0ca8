package consumer

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// storePayload is an engine batch storing one block, hash seq*10.
func storePayload(t *testing.T, seq uint64) []byte {
	t.Helper()
	p, err := events.Encode(nil, events.Batch{TS: 1, HasDPRank: true, Events: []events.Event{{Kind: events.BlockStored,
		BlockHashes: []uint64{seq * 10}, TokenIDs: make([]uint32, 16), BlockSize: 16, Medium: "GPU"}}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// coalesced publishes engine seqs first..last as one coalesced message
// (one payload when first == last); extra payloads beyond the headers'
// count make it malformed.
func (e *env) coalesced(instance string, first, last uint64, extra int) {
	e.t.Helper()
	var data []byte
	for s := first; s <= last; s++ {
		data = append(data, storePayload(e.t, s)...)
	}
	for range extra {
		data = append(data, storePayload(e.t, last)...)
	}
	h := kvstream.EventHeaders{Seq: first, HasSeq: true, Pool: e.pool, Instance: instance}
	if last > first {
		h.Batches = int(last - first + 1)
	}
	subj, _ := kvstream.EventsSubject(e.pool, instance)
	if _, err := e.js.PublishMsg(e.ctx, &nats.Msg{Subject: subj, Data: data, Header: h.Header()}); err != nil {
		e.t.Fatal(err)
	}
}

// A coalesced message is applied payload by payload in order, each engine
// seq once: payloads of a range that overlaps what was applied (a bridge
// that restarted, a message stored twice) are skipped, the new ones
// applied. A coalesced message whose payload does not split into its
// headers' count is unreadable as a whole: counted malformed, nothing of
// it applied.
func TestCoalescedMessages(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.coalesced("i0", 1, 1, 0)
	e.coalesced("i0", 2, 4, 0)
	e.coalesced("i0", 3, 6, 0) // 3, 4 seen: 5, 6 new
	e.coalesced("i0", 5, 6, 0) // all seen
	e.coalesced("i0", 7, 7, 0)
	e.coalesced("i0", 8, 9, 1) // three payloads under a count of two
	want := []uint64{10, 20, 30, 40, 50, 60, 70}
	testenv.WaitFor(t, 10*time.Second, "malformed coalesced message counted", func() bool {
		st := c.Instances()
		return len(st) == 1 && st[0].Malformed == 1
	})
	e.coalesced("i0", 8, 9, 0) // the same seqs, well formed
	want = append(want, 80, 90)
	testenv.WaitFor(t, 10*time.Second, "payloads applied", func() bool {
		got, _ := a.get("i0")
		return len(got) >= len(want)
	})
	time.Sleep(100 * time.Millisecond) // anything applied twice would show by now
	got, _ := a.get("i0")
	if !slices.Equal(got, want) {
		t.Fatalf("applied %v, want %v", got, want)
	}
	if st := c.Instances()[0]; st.LastSeq != 9 {
		t.Fatalf("last seq %d, want 9", st.LastSeq)
	}
	if n := counterValue(c.m.messages.WithLabelValues("duplicate_seq")); n != 4 {
		t.Fatalf("%v duplicate payloads skipped, want 4 (3, 4, 5, 6)", n)
	}
}

// Every payload of a coalesced message is applied while the instance
// waits for a snapshot it cannot get (an unreadable one in the bucket, no
// bridge to ask) and in the shared-index mode over a plain applier (which
// never loads one): only a refused apply stops a message part way.
func TestCoalescedAppliedWhileSnapshotPending(t *testing.T) {
	for _, mode := range []string{"unreadable snapshot", "shared index, plain applier"} {
		t.Run(mode, func(t *testing.T) {
			e := newEnv(t)
			var a *recorder
			if mode == "unreadable snapshot" {
				e.putSnapshotBytes("i0", []byte("not a snapshot"))
				_, a = e.startRecording()
			} else {
				a = newRecorder()
				cfg := e.cfg
				cfg.Applier, cfg.SharedIndex = a, true
				e.start(cfg)
			}
			e.coalesced("i0", 1, 3, 0)
			e.coalesced("i0", 4, 6, 0)
			want := []uint64{10, 20, 30, 40, 50, 60}
			testenv.WaitFor(t, 10*time.Second, "six payloads applied", func() bool {
				got, _ := a.get("i0")
				return len(got) >= len(want)
			})
			if got, _ := a.get("i0"); !slices.Equal(got, want) {
				t.Fatalf("applied %v, want %v", got, want)
			}
		})
	}
}

// The replay after a snapshot load skips a coalesced message that does
// not split into its headers' count, as the live path does, instead of
// applying the payloads it could split: live, the malformed message sets
// up a reload at the next message, whose replay from the bucket's
// snapshot (stream seq 1) meets it again.
func TestCoalescedMalformedSkippedInReplay(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	e.coalesced("i0", 1, 1, 0)
	testenv.WaitFor(t, 10*time.Second, "seq 1 applied", func() bool { return c.status("i0").LastSeq == 1 })
	e.putSnapshot("i0", 1, 1, 10)
	e.coalesced("i0", 2, 3, 1) // three payloads under a count of two
	e.coalesced("i0", 4, 4, 0)
	testenv.WaitFor(t, 10*time.Second, "the last message applied", func() bool {
		got, _ := a.get("i0")
		return slices.Contains(got, 40)
	})
	if got, _ := a.get("i0"); slices.Contains(got, 20) || slices.Contains(got, 30) {
		t.Fatalf("applied %v: payloads of the malformed message among them", got)
	}
	if n := counterValue(c.m.messages.WithLabelValues("malformed")); n < 2 {
		t.Fatalf("%v malformed messages counted, want the live one and the replayed one", n)
	}
	if st := c.status("i0"); st.ReplayLost != 0 {
		t.Fatalf("the malformed message counted as lost from the stream: %+v", st)
	}
}
