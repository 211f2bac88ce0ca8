package bridge

import (
	"bytes"
	"log/slog"
	"reflect"
	"strings"
	"sync"
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

// lockedBuffer is a bytes.Buffer a logger may write from any goroutine.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A bridge left at --first-seq 0 before an engine numbering from 1 (kvsim,
// llm-d-inference-sim) refuses every history the engine replays. Before,
// its logs said only "starting empty ... first_seq=0 err=<nil>" (INFO)
// and "engine replayed up to seq 0 of [0, 4)": neither named seq 1. Now
// a warning names where the replay began and the flag to set, once per
// kind of replay (here the start-up resync, and the first message heard,
// twice: the second, after the engine's topic changed, says nothing more),
// and the replay's error names it too.
func TestFirstSeqMismatchWarned(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{FirstSeq: 1})
	n := 0
	publish := func() enginezmq.Message {
		t.Helper()
		n++
		p := storeBatch(t, uint64(1000+100*n), 3)
		seq, err := pub.Publish(p)
		if err != nil {
			t.Fatal(err)
		}
		return enginezmq.Message{Topic: pcfg.Topic, Seq: seq, Payload: p}
	}
	for range 3 {
		publish()
	}
	var logs lockedBuffer
	in := startBridgeCfg(t, func(c *Config) {
		c.Sources[0].ReplayEndpoint = pcfg.ReplayEndpoint
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	m := publish()
	in.enqueue(m)
	waitEngineSeq(t, in, m.Seq)
	m = publish()
	m.Topic = "kv@another-process"
	in.enqueue(m)
	waitEngineSeq(t, in, m.Seq)
	if s := in.stats(); s.ReplayFailures != 3 {
		t.Fatalf("%d replay failures; want 3 (the start-up resync, each first message)", s.ReplayFailures)
	}
	out := logs.String()
	const warn = "the engine's replay begins at seq 1, not --first-seq 0: if this engine numbers its messages from 1 (kvsim, llm-d-inference-sim), run kvbridge with --first-seq 1"
	kinds := map[string]int{}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, warn) {
			kinds[strings.Split(strings.SplitAfter(line, " replay=")[1], " began=")[0]]++
		}
	}
	if !reflect.DeepEqual(kinds, map[string]int{"start-up": 1, `"first message"`: 1}) {
		t.Errorf("want the warning once for the start-up resync and once for the first messages:\n%s", out)
	}
	if !strings.Contains(out, "engine's replay begins at seq 1, not 0") {
		t.Errorf("the first message's replay error does not say where the replay began:\n%s", out)
	}
}

// A replay that does not begin where asked is of no use to any caller, so
// replayAll stops at its first reply: a history refused for a later first
// seq (or a buffer no longer reaching back) costs one reply, not the
// engine's whole buffer at every retry (before: all 50 read, up to
// 10,000 messages or ReplayBytes). One that begins where asked is read
// whole.
func TestReplayAllStopsAtFirstBreak(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	pub, pcfg := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{FirstSeq: 1})
	for i := range 50 {
		if _, err := pub.Publish(storeBatch(t, uint64(1000+100*i), 1)); err != nil {
			t.Fatal(err)
		}
	}
	in := startBridgeCfg(t, func(c *Config) { c.Sources[0].ReplayEndpoint = pcfg.ReplayEndpoint })
	for _, tc := range []struct {
		from uint64
		n    int
		last uint64
	}{
		{from: 0, n: 1, last: 1},   // the engine counts from 1: its first reply only
		{from: 1, n: 50, last: 50}, // its whole history
		{from: 20, n: 31, last: 50},
	} {
		msgs, err := in.replayAll(ctx, tc.from)
		var last uint64
		if len(msgs) > 0 {
			last = msgs[len(msgs)-1].Seq
		}
		if err != nil || len(msgs) != tc.n || last != tc.last {
			t.Fatalf("replay from %d: %d messages, the last seq %d, err %v; want %d, the last %d", tc.from, len(msgs), last, err, tc.n, tc.last)
		}
	}
}
