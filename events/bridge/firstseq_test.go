package bridge

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// An engine's history is whole only from the engine's first seq
// (Source.FirstSeq): 0 for vLLM, whose replay buffer holds seq 0 until
// 10,000 later messages push it out. The bridge took a history starting
// at 0 or 1 as whole, so a vLLM engine's replay that had lost seq 0 was
// vouched for as complete: before the fix the start-up resync took
// [1, 2] with no failure counted and the blocks of seq 0 missing. Now
// it is a hole: the bridge starts empty and counts it. An engine counting
// from 1 (llm-d-inference-sim, kvsim) still has its whole history taken.
func TestResyncHistoryMissingFirstSeq(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	for _, tc := range []struct {
		name        string
		engineFirst uint64 // the engine's first seq
		lost        bool   // its first message gone from its replay buffer
		blocks      int
	}{
		{name: "vllm-seq0-lost", engineFirst: 0, lost: true},
		{name: "vllm-whole", engineFirst: 0, blocks: 9},
		{name: "from1-whole", engineFirst: 1, blocks: 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{FirstSeq: tc.engineFirst})
			for i := range 3 {
				if _, err := pub.Publish(storeBatch(t, uint64(1000+100*i), 3)); err != nil {
					t.Fatal(err)
				}
				if i == 0 && tc.lost {
					pub.ForgetReplay()
				}
			}
			br, _, _ := runBridgeCfg(t, 0, 16, pcfg.Endpoint, nil, func(c *Config) {
				c.Sources[0].ReplayEndpoint = pcfg.ReplayEndpoint
				c.Sources[0].FirstSeq = tc.engineFirst
			})
			testenv.WaitFor(t, 30*time.Second, "bridge ready", br.Ready)
			s := br.insts[0].stats()
			if s.Blocks != tc.blocks || (s.ReplayFailures != 0) != tc.lost {
				t.Fatalf("after the start-up resync: %d blocks, %d replay failures; want %d blocks, failures %v",
					s.Blocks, s.ReplayFailures, tc.blocks, tc.lost)
			}
		})
	}
}

// The same when the bridge hears the engine's first messages live: the
// first it sees is seq 1, and the history before it replays from 1, its
// seq 0 lost. Before the fix enginezmq.ReplayHistory took it as an
// engine counting from 1 with nothing before: no loss counted.
func TestFillStartHistoryMissingSeqZero(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{})
	// The bridge's subscriber reaches no engine: messages are put in its
	// buffer as the subscriber would; the engine's replay answers.
	in := startBridgeCfg(t, func(c *Config) { c.Sources[0].ReplayEndpoint = pcfg.ReplayEndpoint })
	if _, err := pub.Publish(storeBatch(t, 1000, 3)); err != nil { // seq 0, lost to the bridge ...
		t.Fatal(err)
	}
	pub.ForgetReplay() // ... and to the replay
	p := storeBatch(t, 2000, 3)
	seq, err := pub.Publish(p)
	if err != nil {
		t.Fatal(err)
	}
	in.enqueue(enginezmq.Message{Topic: pcfg.Topic, Seq: seq, Payload: p})
	waitEngineSeq(t, in, 1)
	if s := in.stats(); s.ReplayFailures != 1 || s.Blocks != 3 {
		t.Fatalf("first message seq 1, the replay without seq 0: %+v; want the loss counted (1 replay failure) and seq 1's 3 blocks", s)
	}
}
