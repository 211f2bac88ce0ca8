package test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/consumer"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// Two data-parallel ranks, each its own publisher with its own seq (the
// captured dp run: both start at 1), bridged as two instances.
func TestE2EDataParallelRanks(t *testing.T) {
	ps := eventstest.CapturedPayloads(t, "dp.array.jsonl")
	if len(ps) != 2 {
		t.Fatalf("dp capture has %d messages, want one per rank", len(ps))
	}
	r := &rig{streamRig: streamRig{t: t, ctx: testenv.Context(t, time.Minute), ns: testenv.StartNATS(t)}}
	name := testenv.UniqueName(t)
	r.pool = "pool_" + name
	r.stream = kvstream.StreamConfig{Name: "EV_" + name}
	r.bucket = kvstream.BucketConfig{Name: "SN_" + name}
	var pubs []*enginezmq.Publisher
	var srcs []bridge.Source
	for rank := 0; rank < 2; rank++ {
		pub, pc := eventstest.Publisher(t, r.ctx, enginezmq.PublisherConfig{
			Topic: fmt.Sprintf("kv@127.0.0.1:%d@fake-model", 18000+rank), FirstSeq: 1})
		pubs = append(pubs, pub)
		srcs = append(srcs, bridge.Source{Instance: fmt.Sprintf("vllm-0-dp%d", rank), Rank: rank, Endpoint: pc.Endpoint, ReplayEndpoint: pc.ReplayEndpoint, FirstSeq: 1})
	}
	r.runBridge(bridge.Config{Model: "fake-model", Sources: srcs})
	testenv.WaitFor(t, 20*time.Second, "bridge ready", r.br.Ready)
	for _, p := range pubs {
		testenv.WaitFor(t, 20*time.Second, "subscribed", p.Subscribed)
	}
	c, a, _ := r.startConsumer(consumer.Config{})
	for rank, p := range pubs {
		if _, err := p.Publish(ps[rank]); err != nil {
			t.Fatal(err)
		}
	}
	for rank := range pubs {
		waitTable(t, a, fmt.Sprintf("vllm-0-dp%d", rank), reference(t, ps[rank]))
	}
	st := c.Instances()
	if len(st) != 2 || st[0].LastSeq != 1 || st[1].LastSeq != 1 || st[0].Gaps+st[1].Gaps != 0 {
		t.Fatalf("instances %+v", st)
	}
	for _, s := range r.br.Stats() {
		if s.Gaps != 0 || s.Clears != 1 {
			t.Fatalf("rank stats %+v: each rank has its own seq, no gaps", s)
		}
	}
}
