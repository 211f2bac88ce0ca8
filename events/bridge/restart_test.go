package bridge

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// trtllmServe stands in for trtllm-serve: /health, /metrics (JSON, as
// trtllm-serve's, unless a start time is set) and POST /kv_cache_events,
// which drains the answers queued, then answers "[]". Down, it answers
// 503 to everything.
type trtllmServe struct {
	mu      sync.Mutex
	down    bool
	start   float64 // process_start_time_seconds; 0: /metrics is JSON
	answers [][]byte
}

func (s *trtllmServe) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.down:
		http.Error(w, "engine dead", http.StatusServiceUnavailable)
	case r.URL.Path == "/metrics" && s.start != 0:
		fmt.Fprintf(w, "process_start_time_seconds %v\n", s.start)
	case r.URL.Path == "/metrics":
		_, _ = w.Write([]byte("[]"))
	case r.URL.Path == "/kv_cache_events" && len(s.answers) > 0:
		_, _ = w.Write(s.answers[0])
		s.answers = s.answers[1:]
	case r.URL.Path == "/kv_cache_events":
		_, _ = w.Write([]byte("[]"))
	}
}

// set changes the stand-in under its lock.
func (s *trtllmServe) set(f func(s *trtllmServe)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

// trtllmNewProcess is what a restarted TensorRT-LLM engine's first drain
// holds: its KV cache manager's "created", then a store of n blocks.
func trtllmNewProcess(n int) []byte {
	var blocks []string
	for i := range n {
		blocks = append(blocks, fmt.Sprintf(`{"type":"stored_block","block_hash":%d,"tokens":[`+
			`{"type":"unique_token","token_id":%d,"token_extra_id":0},{"type":"unique_token","token_id":7,"token_extra_id":0},`+
			`{"type":"unique_token","token_id":8,"token_extra_id":0},{"type":"unique_token","token_id":9,"token_extra_id":0}],`+
			`"cache_level":0,"priority":35}`, 9000+i, 500+i))
	}
	return []byte(`[{"event_id":0,"data":{"type":"created","num_blocks_per_cache_level":[2048,8192]},"window_size":4096},` +
		`{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[` + strings.Join(blocks, ",") + `]},"window_size":4096}]`)
}

// TensorRT-LLM (--format trtllm-json): the bridge's replay socket is the
// poller's loopback publisher, which outlives the engine and returns the
// last message byte for byte whatever process is behind it. Before the
// fix an engine back from down was "proven" the same process by it (no
// start time: trtllm-serve's /metrics is JSON) and heartbeated live with
// the dead process's 2 blocks until the poller, backed off while the
// engine was down (up to 5 s), drained the new process's "created" (here
// 19-20 of ~52 heartbeats since the engine went down); with a start time
// that changed, the restart clear was followed by the loopback's whole
// history, the dead process's message 0 again. Now no heartbeat after
// the engine went down says it is live with the old blocks, none of the
// old messages is published again, and the stream ends with the new
// process's blocks.
func TestTRTLLMRestartedEngineNotLiveWithOldBlocks(t *testing.T) {
	fixture, err := os.ReadFile(filepath.Join("..", "testdata", "engines", "trtllm-kv_cache_events.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		start float64
	}{{"no start time", 0}, {"start time", 1.7e9}} {
		t.Run(tc.name, func(t *testing.T) {
			const oldBlocks, newBlocks = 2, 3 // the fixture leaves 2
			eng := &trtllmServe{start: tc.start, answers: [][]byte{fixture}}
			srv := httptest.NewServer(eng)
			t.Cleanup(srv.Close)
			ctx := testenv.Context(t, 3*time.Minute)
			p, err := NewTRTLLMPoller(ctx, TRTLLMConfig{EngineURL: srv.URL, Interval: 20 * time.Millisecond, Logger: quietTestLogger()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Close) // after the poller has stopped
			testenv.Go(t, ctx, func(ctx context.Context) error { p.Run(ctx); return nil })
			src := p.Source(0, "i0", srv.URL)
			br, nc, _ := runBridgeCfg(t, 0, 16, src.Endpoint, nil, func(c *Config) {
				c.Sources = []Source{src}
				c.EngineProbeInterval = 100 * time.Millisecond
				c.HeartbeatInterval = 200 * time.Millisecond
			})
			in := br.insts[0]
			var hbMu sync.Mutex
			var hbs []kvstream.Heartbeat
			if _, err := nc.Subscribe(in.hbSubj, func(m *nats.Msg) {
				var h kvstream.Heartbeat
				if json.Unmarshal(m.Data, &h) == nil {
					hbMu.Lock()
					hbs = append(hbs, h)
					hbMu.Unlock()
				}
			}); err != nil {
				t.Fatal(err)
			}
			testenv.WaitFor(t, time.Minute, "the first process's blocks", func() bool {
				s := in.stats()
				return br.Ready() && s.Blocks == oldBlocks && !s.EngineDown
			})
			before := in.stats() // the dead process's last message, and its place in the stream
			eng.set(func(s *trtllmServe) { s.down = true })
			downAt := -1
			testenv.WaitFor(t, time.Minute, "a heartbeat saying the engine is down", func() bool {
				hbMu.Lock()
				defer hbMu.Unlock()
				for i, h := range hbs {
					if h.EngineDown {
						downAt = i
						return true
					}
				}
				return false
			})
			// Down long enough for the poller to back off to seconds.
			time.Sleep(6 * time.Second)
			eng.set(func(s *trtllmServe) {
				s.down = false
				if s.start != 0 {
					s.start++
				}
				s.answers = [][]byte{trtllmNewProcess(newBlocks)}
			})
			testenv.WaitFor(t, time.Minute, "a live heartbeat with the new process's blocks", func() bool {
				hbMu.Lock()
				defer hbMu.Unlock()
				h := hbs[len(hbs)-1]
				return !h.EngineDown && h.Blocks == newBlocks
			})
			hbMu.Lock()
			after := append([]kvstream.Heartbeat(nil), hbs[downAt:]...)
			hbMu.Unlock()
			stale := 0
			for _, h := range after {
				if !h.EngineDown && h.Blocks != 0 && h.Blocks != newBlocks {
					stale++
				}
			}
			if stale > 0 {
				t.Errorf("%d of %d heartbeats since the engine went down say it is live with %d blocks (the dead process's)", stale, len(after), oldBlocks)
			}
			routed, msgs := readStream(t, in)
			for _, m := range msgs[before.StreamSeq:] {
				if m.synthetic == "" && m.seq <= before.EngineSeq {
					t.Errorf("the dead process's message %d published again after it went down: the stream is %+v", m.seq, msgs)
				}
			}
			in.mu.Lock()
			want := in.table.Dump()
			in.mu.Unlock()
			if got := routed.Dump(); len(got) != newBlocks || !reflect.DeepEqual(got, want) {
				t.Errorf("the stream builds %d blocks, the bridge's table %d; want the new process's %d", len(got), len(want), newBlocks)
			}
		})
	}
}

// kvbridge after messages were dropped (its buffer full through a NATS
// outage) replays what the engine published after the last one handled
// (catchUp). The engine may have restarted meanwhile and counted past
// that seq: fillGap and catchTail ask for the last message again and
// compare it, catchUp did not. Here the old process's messages 0-6 are
// handled (4-6 buffered while NATS held its acks), the new process's
// 0-8 all dropped; before the fix the new process's 7 and 8 were
// published as the old one's continuation, with no clear: the stream held
// the old process's 14 blocks beside the new one's 2. Now the restart is
// found, the instance cleared and the new process's history replayed.
func TestCatchUpEngineRestartedBehindDrops(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	ns := testenv.StartNATS(t)
	gate := testenv.StartReplyGate(t, fmt.Sprintf("127.0.0.1:%d", ns.Port))
	replayEP := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	old, _ := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{ReplayEndpoint: replayEP})
	// The bridge's subscriber reaches no engine: messages are put in its
	// buffer as the subscriber would, and no reconnection asks catchTail.
	in := startBridgeCfg(t, func(c *Config) {
		c.Conn = testenv.Connect(t, "nats://"+gate.Addr(), nats.MaxReconnects(-1))
		c.Buffer, c.PublishWindow, c.PublishTimeout = 2, 1, time.Minute
		c.Sources[0].ReplayEndpoint = replayEP
	})
	send := func(pub *enginezmq.Publisher, p []byte) enginezmq.Message {
		t.Helper()
		seq, err := pub.Publish(p)
		if err != nil {
			t.Fatal(err)
		}
		return enginezmq.Message{Topic: "kv", Seq: seq, Payload: p}
	}
	for i := range 4 {
		in.enqueue(send(old, storeBatch(t, uint64(1+10*i), 2)))
		waitEngineSeq(t, in, uint64(i))
	}
	gate.Hold() // NATS stops answering: seq 4 waits for its ack ...
	base := in.sent.Load()
	in.enqueue(send(old, storeBatch(t, 41, 2)))
	testenv.WaitFor(t, 30*time.Second, "seq 4 published, its ack held", func() bool { return in.sent.Load() == base+1 && len(in.in) == 0 })
	time.Sleep(100 * time.Millisecond)
	in.enqueue(send(old, storeBatch(t, 51, 2))) // ... 5 and 6 fill the buffer
	in.enqueue(send(old, storeBatch(t, 61, 2)))
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	neu, _ := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{ReplayEndpoint: replayEP})
	var fresh [][]byte
	for i := range 9 {
		p := storeBatch(t, uint64(1001+10*i), 1)
		fresh = append(fresh, p)
		in.enqueue(send(neu, p)) // dropped
	}
	if s := in.stats(); s.Dropped != 9 || in.sent.Load() != base+1 {
		t.Fatalf("set-up: %d dropped, %d sent since the hold; want the new process's 9 dropped and only seq 4 sent", s.Dropped, in.sent.Load()-base)
	}
	gate.Release()
	waitEngineSeq(t, in, 8)
	routed, msgs := readStream(t, in)
	if got, want := routed.Dump(), engineTable(t, fresh...); !reflect.DeepEqual(got, want) {
		t.Fatalf("the stream builds %d blocks; want the new process's %d (stream %+v)", len(got), len(want), msgs)
	}
}
