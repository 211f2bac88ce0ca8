package bridge

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
)

// The poller against a trtllm-serve stand-in: a failing answer is retried,
// the fixture's events come out as vLLM-shaped batches on the rank's
// loopback publisher (as the bridge subscribes to it), and events of a
// rank beyond those configured are dropped and counted.
func TestTRTLLMPoller(t *testing.T) {
	fixture, err := os.ReadFile(filepath.Join("..", "testdata", "engines", "trtllm-kv_cache_events.json"))
	if err != nil {
		t.Fatal(err)
	}
	dp, err := os.ReadFile(filepath.Join("..", "testdata", "engines", "trtllm-attention-dp.json"))
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/kv_cache_events" {
			http.NotFound(w, r)
			return
		}
		switch calls.Add(1) {
		case 1:
			http.Error(w, "warming up", http.StatusServiceUnavailable)
		case 2:
			_, _ = w.Write(fixture)
		case 3:
			_, _ = w.Write(dp)
		default:
			_, _ = w.Write([]byte("[]"))
		}
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := NewTRTLLMPoller(ctx, TRTLLMConfig{EngineURL: srv.URL + "/", Interval: 10 * time.Millisecond, Logger: quietTestLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	src := p.Source(0, "trt-0", srv.URL)
	got := make(chan enginezmq.Message, 16)
	sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: src.Endpoint, Logger: quietTestLogger()})
	if err != nil {
		t.Fatal(err)
	}
	subDone := make(chan struct{})
	go func() { defer close(subDone); _ = sub.Run(ctx, func(m enginezmq.Message) { got <- m }) }()
	// The subscription must reach the publisher before the first batch:
	// wait for it before polling starts.
	deadline := time.Now().Add(10 * time.Second)
	for !p.pubs[0].Subscribed() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	runDone := make(chan struct{})
	go func() { defer close(runDone); p.Run(ctx) }()
	var m enginezmq.Message
	select {
	case m = <-got:
	case <-ctx.Done():
		t.Fatal("no batch from the poller")
	}
	b, err := events.Decode(m.Payload)
	if err != nil {
		t.Fatal(err)
	}
	if b.Encoding != events.EncodingMap || !b.HasDPRank || b.DPRank != 0 || len(b.Events) != 6 || b.Events[0].Kind != events.AllBlocksCleared {
		t.Fatalf("first batch = %+v", b)
	}
	deadline = time.Now().Add(10 * time.Second)
	for p.Stats().Lost == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	st := p.Stats()
	if st.Failures < 1 || st.Events != 8 || st.Lost != 2 {
		t.Fatalf("stats %+v, want a failure, 8 events, 2 lost (rank 1 beyond one rank)", st)
	}
	cancel()
	<-runDone
	<-subDone
	if _, err := NewTRTLLMPoller(context.Background(), TRTLLMConfig{}); err == nil {
		t.Fatal("a poller without an engine URL was made")
	}
}

func quietTestLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// An answer of drained events that cannot be read (cut off, or not JSON)
// is lost for good: trtllm-serve emptied its buffer into it. Before the
// fix the poller counted a failure and went on; the removals in it were
// never applied, and with the engine quiet after it (no later event id
// to show the gap) every index kept the blocks as fresh. Now every rank
// is cleared at once, and the events after it are a new start (not a
// gap cleared again).
func TestTRTLLMLostAnswerClears(t *testing.T) {
	fixture, err := os.ReadFile(filepath.Join("..", "testdata", "engines", "trtllm-kv_cache_events.json"))
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch calls.Add(1) {
		case 1:
			_, _ = w.Write(fixture)
		case 2:
			_, _ = w.Write(fixture[:len(fixture)/2]) // cut off
		default:
			_, _ = w.Write([]byte("[]"))
		}
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := NewTRTLLMPoller(ctx, TRTLLMConfig{EngineURL: srv.URL, Ranks: 2, Interval: 10 * time.Millisecond, Logger: quietTestLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	got := make([]chan events.Batch, 2)
	var subs []chan struct{}
	for r := range got {
		got[r] = make(chan events.Batch, 16)
		sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: p.Source(r, "trt", srv.URL).Endpoint, Logger: quietTestLogger()})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		subs = append(subs, done)
		go func() {
			defer close(done)
			_ = sub.Run(ctx, func(m enginezmq.Message) {
				b, err := events.Decode(m.Payload)
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
					return
				}
				got[r] <- b
			})
		}()
		deadline := time.Now().Add(10 * time.Second)
		for !p.pubs[r].Subscribed() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	runDone := make(chan struct{})
	go func() { defer close(runDone); p.Run(ctx) }()
	next := func(r int) events.Batch {
		t.Helper()
		select {
		case b := <-got[r]:
			return b
		case <-time.After(10 * time.Second):
			t.Fatalf("rank %d: no batch in 10 s (stats %+v)", r, p.Stats())
		}
		return events.Batch{}
	}
	if b := next(0); len(b.Events) != 6 {
		t.Fatalf("rank 0's first batch has %d events, want the fixture's 6", len(b.Events))
	}
	for r := range got {
		if b := next(r); len(b.Events) != 1 || b.Events[0].Kind != events.AllBlocksCleared || b.DPRank != r {
			t.Fatalf("rank %d after the lost answer: %+v, want a clear", r, b)
		}
	}
	// The clears are published inside the poll, the failure counted when
	// it returns: the stats may trail the clears by a moment.
	deadline := time.Now().Add(10 * time.Second)
	for st := p.Stats(); st.LostAnswers != 1 || st.Failures < 1; st = p.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v, want one lost answer counted as a failure", st)
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-runDone
	for _, d := range subs {
		<-d
	}
}

// signalTransport signals once a round trip has returned its response:
// from then on, the body is what the poller reads.
type signalTransport struct {
	rt   http.RoundTripper
	done chan struct{}
}

func (s signalTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.rt.RoundTrip(r)
	if err == nil {
		close(s.done)
	}
	return resp, err
}

// A bridge shut down while an answer's body is read cancels the read
// (context.Canceled). That answer is not lost to a fault of the engine's
// answer: before the fix it was taken for one, and every rank was
// cleared, so a bridge shutdown wiped the instance in every router.
func TestTRTLLMShutdownMidAnswerDoesNotClear(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("["))
		w.(http.Flusher).Flush()
		select { // the rest of the answer never comes
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer srv.Close()
	defer close(release)
	p, err := NewTRTLLMPoller(context.Background(), TRTLLMConfig{EngineURL: srv.URL, Ranks: 2, Logger: quietTestLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	answered := make(chan struct{})
	p.http.Transport = signalTransport{rt: http.DefaultTransport, done: answered}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	polled := make(chan error, 1)
	go func() { _, err := p.poll(ctx); polled <- err }()
	select {
	case <-answered:
	case <-time.After(30 * time.Second):
		t.Fatal("no answer's headers in 30 s")
	}
	cancel() // the bridge shuts down
	if err := <-polled; err == nil {
		t.Fatal("a poll cut off by its context returned no error")
	}
	if st := p.Stats(); st.LostAnswers != 0 {
		t.Fatalf("stats %+v after a shutdown mid-answer: want no lost answer (no rank cleared)", st)
	}
}

// An answer other than 200 is read to its end (within a bound) before
// its body is closed, so that the connection serves the next poll: an
// engine warming up (503) is polled with backoff, each poll otherwise a
// new connection.
func TestTRTLLMErrorAnswerReusesConnection(t *testing.T) {
	var conns atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "warming up", http.StatusServiceUnavailable)
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	p, err := NewTRTLLMPoller(context.Background(), TRTLLMConfig{EngineURL: srv.URL, Logger: quietTestLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const polls = 3
	for range polls {
		if _, err := p.poll(context.Background()); err == nil {
			t.Fatal("a 503 answer returned no error")
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d polls answered 503 took %d connections; want 1", polls, n)
	}
}
