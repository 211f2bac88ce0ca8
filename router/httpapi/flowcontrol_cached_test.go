package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// TestFlowControlFreedSlotPrefersCached: with kv_aware, a request carries
// from its arrival the tokens each instance holds, and when the pool's one
// slot frees, the waiting request whose prompt the instance holds goes
// first, ahead of one that arrived earlier from another tenant (both due
// together under fair queuing).
func TestFlowControlFreedSlotPrefersCached(t *testing.T) {
	const bs = 16
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: "m", BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	// One engine: it records the first token id of each prompt in arrival
	// order and holds the first request until release.
	var mu sync.Mutex
	var order []uint32
	release, started := make(chan struct{}), make(chan struct{}, 8)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Prompt []uint32 `json:"prompt"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		mu.Lock()
		order = append(order, body.Prompt[0])
		first := len(order) == 1
		mu.Unlock()
		started <- struct{}{}
		if first {
			<-release
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}))
	t.Cleanup(up.Close)
	srv, ts := servertest.Serve(t, config.Config{Pools: []config.PoolConfig{{
		Name: "p", Model: "m",
		Routing:     config.RoutingConfig{Strategy: config.StrategyKVAware, ConcurrencyThreshold: 1},
		Health:      config.HealthConfig{Disable: true},
		Discovery:   config.DiscoveryConfig{Disable: true},
		FlowControl: &config.FlowControlConfig{Enabled: true, PrefillTokensPerInstance: 1 << 20},
		Instances:   []config.InstanceConfig{{ID: "e0", URL: up.URL}},
	}}}, httpapi.Options{Logger: slog.New(slog.DiscardHandler), Admin: admin.Routes(nil),
		KV: kvaware.NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil })})

	// e0 holds hot's prompt, 8 blocks of it.
	first, cold, hot := routertest.Prompt(1, 8*bs), routertest.Prompt(2, 8*bs), routertest.Prompt(3, 8*bs)
	first[0], cold[0], hot[0] = 1, 2, 3
	ev := events.Event{Kind: events.BlockStored, BlockSize: bs, Medium: "GPU", TokenIDs: hot}
	for i := range len(hot) / bs {
		ev.BlockHashes = append(ev.BlockHashes, uint64(100+i))
	}
	if _, err := idx.Apply(context.Background(), "e0", []events.Event{ev}); err != nil {
		t.Fatal(err)
	}

	post := func(prompt []uint32, tenant, extra string) flowReply {
		ids, _ := json.Marshal(prompt)
		return postCompletionBody(context.Background(), ts.URL, `{"model":"m","prompt":`+string(ids)+`,"max_tokens":1`+extra+`}`,
			map[string]string{"X-Amzn-SageMaker-Prefix-Aware-Id": tenant})
	}
	t.Cleanup(func() { // a failure before the release must not leave the engine holding
		select {
		case <-release:
		default:
			close(release)
		}
	})
	replies := make(chan flowReply, 3)
	// Streamed, so that its prompt stays pending until its first byte (a
	// non-streamed one's is released at its predicted first token).
	go func() { replies <- post(first, "t-first", `,"stream":true`) }()
	<-started
	go func() { replies <- post(cold, "t-cold", "") }()
	waitQueue(t, srv, 1)
	go func() { replies <- post(hot, "t-hot", "") }()
	waitQueue(t, srv, 2)

	p, _ := srv.Pool("p")
	for _, l := range p.QueueStatus().Queue.Instances {
		if l.Instance == "e0" && l.PendingPrefill != int64(len(first)) {
			t.Fatalf("e0 pending prefill %d, want the first prompt's %d tokens", l.PendingPrefill, len(first))
		}
	}
	close(release)
	for range 3 {
		if r := <-replies; r.err != nil || r.status != http.StatusOK {
			t.Fatalf("reply %d, %v", r.status, r.err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []uint32{1, 3, 2}; fmt.Sprint(order) != fmt.Sprint(want) {
		t.Fatalf("engine saw prompts %v, want %v (the cached request before the earlier cold one)", order, want)
	}
}
