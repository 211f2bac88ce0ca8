package kvaware

import (
	"context"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// vllmMetrics is shaped like a vLLM /metrics page: HELP/TYPE comments,
// model_name and engine labels, histograms, one gauge series per DP rank.
const vllmMetrics = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 12.0
`

func TestParseVLLMLoad(t *testing.T) {
	tests := []struct {
		name             string
		text             string
		waiting, running float64
		found            bool
	}{
		{"vllm page", vllmMetrics, 8, 5, true},
		{"no labels, timestamp", "vllm:num_requests_waiting 4 1700000000000\nvllm:num_requests_running 2\n", 4, 2, true},
		{"underscore names", "vllm_num_requests_waiting 1\nvllm_num_requests_running 1\n", 1, 1, true},
		{"crlf and tabs", "vllm:num_requests_waiting{a=\"b\"}\t6\r\n", 6, 0, true},
		{"label value with brace and quote", `vllm:num_requests_waiting{model_name="we}ird \"m\"",x="\\"} 9` + "\n", 9, 0, true},
		{"nan, inf and negative ignored", "vllm:num_requests_waiting NaN\nvllm:num_requests_waiting +Inf\nvllm:num_requests_waiting -3\nvllm:num_requests_waiting 2\n", 2, 0, true},
		{"prefix of another name", "vllm:num_requests_waiting_total 5\nvllm:num_requests_running_x 5\n", 0, 0, false},
		{"unterminated labels", `vllm:num_requests_waiting{a="b 5` + "\n", 0, 0, false},
		{"no value", "vllm:num_requests_waiting\n", 0, 0, false},
		{"garbage value", "vllm:num_requests_waiting abc\n", 0, 0, false},
		{"comments only", "# vllm:num_requests_waiting 5\n", 0, 0, false},
		{"empty", "", 0, 0, false},
		{"not metrics at all", "<html>hello</html>", 0, 0, false},
	}
	for _, tc := range tests {
		w, r, found := ParseVLLMLoad([]byte(tc.text))
		if w != tc.waiting || r != tc.running || found != tc.found {
			t.Errorf("%s: got (%v, %v, %v), want (%v, %v, %v)", tc.name, w, r, found, tc.waiting, tc.running, tc.found)
		}
	}
}

func FuzzParseVLLMLoad(f *testing.F) {
	f.Add([]byte(vllmMetrics))
	f.Add([]byte(`vllm:num_requests_waiting{a="\\\"}"} 1e3 123`))
	f.Add([]byte("vllm:num_requests_running{"))
	f.Fuzz(func(t *testing.T, b []byte) {
		w, r, found := ParseVLLMLoad(b)
		if w < 0 || r < 0 || w != w || r != r {
			t.Fatalf("negative or NaN load (%v, %v)", w, r)
		}
		if !found && (w != 0 || r != 0) {
			t.Fatalf("load without a found series (%v, %v)", w, r)
		}
	})
}

// TestLoadScraper scrapes real HTTP endpoints: a vLLM-like page, one that
// fails, one that is not metrics; only the first yields a sample, and the
// samples steer kv_aware.
func TestLoadScraper(t *testing.T) {
	var hits atomic.Int64
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		hits.Add(1)
		_, _ = w.Write([]byte(vllmMetrics))
	}))
	defer good.Close()
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "boom", http.StatusInternalServerError)
	}))
	defer bad.Close()
	html := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("<html></html>"))
	}))
	defer html.Close()

	w := newKVWorld(t, 0)
	w.st.log = slog.New(slog.DiscardHandler)
	w.st.now = time.Now
	for _, s := range []struct{ id, url string }{{"good", good.URL}, {"bad", bad.URL}, {"html", html.URL}} {
		in, err := router.NewInstance(s.id, s.url)
		if err != nil {
			t.Fatal(err)
		}
		w.insts = append(w.insts, in)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.st.runScraper(ctx, good.Client(), func() []*router.Instance { return w.insts }, 20*time.Millisecond, time.Second, "/metrics")
	}()
	deadline := time.Now().Add(5 * time.Second)
	for hits.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done // the scraper stops with its context
	if hits.Load() < 3 {
		t.Fatalf("scraped %d times in 5s, want repeated scrapes", hits.Load())
	}
	if ls, ok := w.st.loads.get("good", time.Now(), time.Minute); !ok || ls.waiting != 8 || ls.running != 5 {
		t.Fatalf("good instance load %+v %v, want waiting 8 running 5", ls, ok)
	}
	for _, id := range []string{"bad", "html"} {
		if _, ok := w.st.loads.get(id, time.Now(), time.Minute); ok {
			t.Errorf("%s: a sample from a failing endpoint", id)
		}
		if got := counterValue(t, w.st.m.scrapes.WithLabelValues("p", id, "error")); got < 1 {
			t.Errorf("%s: %v scrape errors counted", id, got)
		}
	}
}

// An engine load that is not a finite count (NaN, ±Inf, negative: a
// simulation's or a scraper's bad value, or finite samples summing past
// the largest float) is not a load: kv_aware ignored none of it, and with
// one instance a NaN made the bounded-load rule look for another
// instance that does not exist and panic (index -1). It is dropped, and
// the decision goes on without it.
func TestNonFiniteLoadIgnored(t *testing.T) {
	for _, bad := range [][2]float64{{math.NaN(), 0}, {0, math.NaN()}, {math.Inf(1), 0}, {0, math.Inf(-1)}, {-1, 0}} {
		w := newKVWorld(t, 1)
		s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
		w.st.SetLoad(w.insts[0].ID(), bad[0], bad[1])
		d := kvPick(t, s, kvRequest("a cold prompt", promptTokens(7, 64)), w.insts)
		if d.Instance != w.insts[0] {
			t.Fatalf("load %v: picked %v", bad, d.Instance)
		}
		if _, ok := w.st.loads.get(w.insts[0].ID(), w.clock.Now(), time.Hour); ok {
			t.Fatalf("load %v kept as a sample", bad)
		}
	}
	wt, r, found := ParseVLLMLoad([]byte("vllm:num_requests_waiting 1e308\nvllm:num_requests_waiting 1e308\nvllm:num_requests_running 3\n"))
	if math.IsInf(wt, 0) || math.IsNaN(wt) || r != 3 || !found {
		t.Fatalf("two samples summing past the largest float: (%v, %v, %v)", wt, r, found)
	}
}

// The bounded-load rule with a load that is not a number (however it got
// there) keeps the home instead of looking for another under the
// threshold that does not exist (it indexed candidate -1 and panicked).
func TestBoundedNaNLoadKeepsHome(t *testing.T) {
	w := newKVWorld(t, 1)
	s := w.strategy(config.RoutingConfig{Strategy: config.StrategyKVAware})
	ev := &kvEval{cands: []candEval{{inst: w.insts[0], load: math.NaN(), queue: math.NaN()}}}
	if pick, _ := s.bounded(ev); pick != 0 {
		t.Fatalf("picked %d, want the home (0)", pick)
	}
}
