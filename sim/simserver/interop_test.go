package simserver

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/sim"
)

// TestInteropWithProjectSubscriber runs the instance the way the captured
// simulator runs (PUB dials a binding SUB, legacy [seq, payload] replay) and
// reads it with the project's own enginezmq.Subscriber and enginezmq.ReplayRange,
// the code kvbridge uses against real engines.
func TestInteropWithProjectSubscriber(t *testing.T) {
	subPort, replayPort := testenv.FreePort(t), testenv.FreePort(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub, err := enginezmq.NewSubscriber(enginezmq.SubscriberConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", subPort), Bind: true})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex // guards got
	var got []enginezmq.Message
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = sub.Run(ctx, func(m enginezmq.Message) {
			mu.Lock()
			got = append(got, m)
			mu.Unlock()
		})
	}()
	in := startInstance(t, Config{
		Engine:    sim.Config{Model: "fake-model", GPUBlocks: 64},
		TimeScale: 20,
		Events: EventsConfig{
			Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", subPort), Dial: true,
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort), LegacyReplay: true,
		},
	})
	testenv.WaitFor(t, 10*time.Second, "subscription", in.EventsSubscribed)
	for i := range 3 {
		code, body := post(t, in.URL()+"/v1/completions", map[string]any{"prompt": strings.Repeat(fmt.Sprintf("prompt %d words ", i), 30), "max_tokens": 2})
		if code != 200 {
			t.Fatalf("completion %d: %s", code, body)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "3 batches", func() bool { mu.Lock(); defer mu.Unlock(); return len(got) >= 3 })
	mu.Lock()
	live := append([]enginezmq.Message(nil), got...)
	mu.Unlock()
	replayed, err := enginezmq.ReplayRange(ctx, enginezmq.ReplayConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort)}, 1, live[len(live)-1].Seq+1)
	if err != nil {
		t.Fatal(err)
	}
	if len(replayed) != len(live) {
		t.Fatalf("replayed %d messages, live %d", len(replayed), len(live))
	}
	for i := range live {
		if live[i].Seq != uint64(i+1) || replayed[i].Seq != live[i].Seq || string(replayed[i].Payload) != string(live[i].Payload) {
			t.Fatalf("message %d: live seq %d, replayed seq %d (payload equal %v)", i, live[i].Seq, replayed[i].Seq,
				string(replayed[i].Payload) == string(live[i].Payload))
		}
		if replayed[i].Topic != "" {
			t.Fatalf("legacy replay carried a topic %q", replayed[i].Topic)
		}
	}
	cancel()
	<-done
}
