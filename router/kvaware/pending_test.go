package kvaware

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

func newPendingState(t *testing.T, reg prometheus.Registerer) *KVState {
	t.Helper()
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
	if err != nil {
		t.Fatal(err)
	}
	cfg := KVStateConfig{Pool: "p", Model: kvTestModel, Index: idx, Logger: slog.New(slog.DiscardHandler)}
	if reg != nil {
		if cfg.Metrics, err = NewKVMetrics(reg); err != nil {
			t.Fatal(err)
		}
	}
	st, err := NewKVState(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// waitPending polls inst's pending prefill until it is (tok, n) or the
// deadline passes; it returns the last value seen.
func waitPending(st *KVState, inst string, tok, n int64, within time.Duration) (int64, int64) {
	deadline := time.Now().Add(within)
	for {
		gt, gn := st.PendingPrefill(inst)
		if (gt == tok && gn == n) || time.Now().After(deadline) {
			return gt, gn
		}
		time.Sleep(time.Millisecond)
	}
}

// TestPendingReleaseTimer: a non-streamed request's pending prefill is
// given back at its predicted end, at the first byte or at Finish,
// whichever comes first, exactly once.
func TestPendingReleaseTimer(t *testing.T) {
	tests := []struct {
		name  string
		after time.Duration
		// steps before Finish
		firstByte bool
		wantTimer bool // the timer, not Finish or the first byte, releases
	}{
		{"timer fires before the response", 5 * time.Millisecond, false, true},
		{"zero prediction releases at once", 0, false, true},
		{"first byte before the timer", time.Hour, true, false},
		{"finish before the timer", time.Hour, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := newPendingState(t, nil)
			o, _ := st.newObserver("a", 100, 20)
			other, _ := st.newObserver("a", 7, 0) // another request, still pending throughout
			if tok, n := st.PendingPrefill("a"); tok != 107 || n != 2 {
				t.Fatalf("pending %d/%d, want 107/2", tok, n)
			}
			o.ReleasePrefillAfter(tc.after)
			if tc.wantTimer {
				if tok, n := waitPending(st, "a", 7, 1, 5*time.Second); tok != 7 || n != 1 {
					t.Fatalf("timer did not release: pending %d/%d, want 7/1", tok, n)
				}
			} else if tok, n := st.PendingPrefill("a"); tok != 107 || n != 2 {
				t.Fatalf("released before its time: pending %d/%d", tok, n)
			}
			if tc.firstByte {
				o.FirstByte()
				if tok, n := st.PendingPrefill("a"); tok != 7 || n != 1 {
					t.Fatalf("first byte did not release: pending %d/%d", tok, n)
				}
			}
			o.Done(200, -1)
			o.Done(200, -1)
			if tok, n := st.PendingPrefill("a"); tok != 7 || n != 1 {
				t.Fatalf("after finish: pending %d/%d, want 7/1 (released once)", tok, n)
			}
			o.timerMu.Lock()
			if o.timer != nil && o.timer.Stop() {
				t.Error("timer still armed after Finish")
			}
			o.timerMu.Unlock()
			// Arming after the end is a no-op.
			o.ReleasePrefillAfter(time.Millisecond)
			time.Sleep(5 * time.Millisecond)
			other.Done(200, -1)
			if tok, n := st.PendingPrefill("a"); tok != 0 || n != 0 {
				t.Fatalf("after both finished: pending %d/%d, want 0/0", tok, n)
			}
		})
	}
}

// scrapePending returns kvrouter_kv_pending_prefill_tokens for (pool, inst).
func scrapePending(t *testing.T, g prometheus.Gatherer, pool, inst string) (float64, bool) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	return pendingValue(mfs, pool, inst)
}

func pendingValue(mfs []*dto.MetricFamily, pool, inst string) (float64, bool) {
	for _, mf := range mfs {
		if mf.GetName() != "kvrouter_kv_pending_prefill_tokens" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["pool"] == pool && labels["instance"] == inst {
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// TestPendingGaugeConcurrent: the exported gauge is read from the counters
// at scrape time, so after any interleaving of acquires and releases it is
// exactly what is pending.
func TestPendingGaugeConcurrent(t *testing.T) {
	reg := prometheus.NewRegistry()
	st := newPendingState(t, reg)
	held, _ := st.newObserver("b", 33, 0)
	if v, ok := scrapePending(t, reg, "p", "b"); !ok || v != 33 {
		t.Fatalf("gauge %v (present %v), want 33", v, ok)
	}
	const workers, each = 8, 200
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				inst := []string{"a", "b"}[i%2]
				o, _ := st.newObserver(inst, 1+w+i%13, 0)
				switch i % 3 {
				case 0:
					o.Done(200, -1)
				case 1:
					o.release()
					o.Done(200, -1)
				default:
					o.ReleasePrefillAfter(time.Duration(i%4) * time.Microsecond)
					o.Done(200, -1)
				}
			}
		}()
	}
	// Scrape while they run: a scrape must never fail or go negative.
	done := make(chan struct{})
	var scrapes sync.WaitGroup
	scrapes.Add(1)
	go func() {
		defer scrapes.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			mfs, err := reg.Gather()
			if err != nil {
				t.Errorf("gather while updating: %v", err)
				return
			}
			if v, _ := pendingValue(mfs, "p", "a"); v < 0 {
				t.Errorf("gauge went negative: %v", v)
				return
			}
		}
	}()
	wg.Wait()
	close(done)
	scrapes.Wait()
	if v, ok := scrapePending(t, reg, "p", "a"); !ok || v != 0 {
		t.Errorf("gauge for a after all released: %v (present %v), want 0", v, ok)
	}
	if v, _ := scrapePending(t, reg, "p", "b"); v != 33 {
		t.Errorf("gauge for b: %v, want 33 (one request still pending)", v)
	}
	held.Done(200, -1)
	if v, _ := scrapePending(t, reg, "p", "b"); v != 0 {
		t.Errorf("gauge for b after the last release: %v, want 0", v)
	}
}

// TestPendingNonStreamedReleasedBeforeResponse: through the proxy, a
// non-streamed kv_aware request stops counting as pending prefill once its
// predicted prefill time has passed, while the engine is still generating
// (no response byte yet); a streamed one waits for its first byte.
func TestPendingNonStreamedReleasedBeforeResponse(t *testing.T) {
	tests := []struct {
		stream       bool
		wantReleased bool
	}{
		{false, true},
		{true, false},
	}
	for _, tc := range tests {
		name := "non-streamed"
		if tc.stream {
			name = "streamed"
		}
		t.Run(name, func(t *testing.T) {
			var kv *KVState
			seen := make(chan [2]int64, 1) // pending while the upstream held the answer
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				// The predicted prefill of a few hundred tokens on an idle
				// instance is well under a millisecond: waiting 300ms
				// leaves the timer ample time, and a streamed request
				// must still be pending after it.
				tok, n := waitPending(kv, "a", 0, 0, 300*time.Millisecond)
				seen <- [2]int64{tok, n}
				if tc.stream {
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, "data: {\"choices\":[]}\n\ndata: [DONE]\n\n")
					return
				}
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, `{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":0}}}`)
			}))
			defer up.Close()
			idx, _ := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
			pc := config.PoolConfig{Name: "p", Model: kvTestModel, Routing: config.RoutingConfig{Strategy: config.StrategyKVAware},
				Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
				Instances: []config.InstanceConfig{{ID: "a", URL: up.URL}}}
			srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{
				Logger: slog.New(slog.DiscardHandler),
				KV:     NewSource(func(config.PoolConfig) (kvindex.Index, kvindex.Freshness) { return idx, nil }),
			})
			if err != nil {
				t.Fatal(err)
			}
			p, _ := srv.Pool("p")
			kv = Of(p)
			ts := httptest.NewServer(srv.Handler())
			defer ts.Close()
			prompt := make([]uint32, 20*kvTestBS)
			for i := range prompt {
				prompt[i] = uint32(1000 + i)
			}
			resp := testenv.PostJSON(t, ts.URL+"/v1/completions", map[string]any{"model": kvTestModel, "prompt": prompt, "stream": tc.stream})
			if resp.Status != 200 {
				t.Fatalf("status %d", resp.Status)
			}
			if resp.Header.Get(router.HeaderPredictedTTFT) == "" {
				t.Fatal("no predicted TTFT: the request was not kv-scored")
			}
			got := <-seen
			if released := got == [2]int64{0, 0}; released != tc.wantReleased {
				t.Errorf("pending while the engine held the response: %d tokens / %d requests; released=%v, want %v", got[0], got[1], released, tc.wantReleased)
			}
			if tok, n := kv.PendingPrefill("a"); tok != 0 || n != 0 {
				t.Errorf("pending after the response: %d/%d", tok, n)
			}
		})
	}
}

// TestSpeculativeGaugeAtScrape: kvrouter_kv_speculative_entries is the
// overlay's entries held at the scrape, so it falls to 0 once they expire
// with nothing routed since (a gauge set at each pick kept its last value
// on an idle pool for good).
func TestSpeculativeGaugeAtScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewKVMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS})
	if err != nil {
		t.Fatal(err)
	}
	w := &kvWorld{t: t, idx: idx, clock: newTestClock(), fresh: &testFreshness{}}
	if w.st, err = NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: idx, Freshness: w.fresh, Now: w.clock.Now,
		Logger: slog.New(slog.DiscardHandler), Metrics: m}); err != nil {
		t.Fatal(err)
	}
	w.add("vllm-0")
	w.add("vllm-1")
	s := w.strategy(config.RoutingConfig{})
	d, err := s.Pick(context.Background(), kvRequest("a", promptTokens(1, 8*kvTestBS)), w.insts)
	if err != nil {
		t.Fatal(err)
	}
	d.Observer.Done(200, -1)
	spec := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatalf("gather: %v", err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "kvrouter_kv_speculative_entries" {
				for _, mm := range mf.GetMetric() {
					return mm.GetGauge().GetValue()
				}
			}
		}
		t.Fatal("no kvrouter_kv_speculative_entries series")
		return 0
	}
	if v := spec(); v < 7 {
		t.Fatalf("after routing an 8-block prompt nobody held: %v speculative entries, want its blocks", v)
	}
	w.clock.Advance(DefaultSpeculativeTTL + time.Second)
	if v := spec(); v != 0 {
		t.Fatalf("after the TTL with nothing routed: %v speculative entries, want 0", v)
	}
}
