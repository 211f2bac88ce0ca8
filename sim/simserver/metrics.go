package simserver

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/sim"
)

// metrics exposes vLLM's metric names (labels model_name and engine, the
// data-parallel rank) read from the engines at scrape time, plus latency
// histograms fed by the drivers and kvsim_* event-publishing counters.
type metrics struct {
	ttft *prometheus.HistogramVec
	e2e  *prometheus.HistogramVec
	itl  *prometheus.HistogramVec
}

// vLLM's TTFT buckets (vllm/v1/metrics/loggers.py), in seconds.
var ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}

func newMetrics(reg prometheus.Registerer, model string, ranks []*driver, maxLoRA int) *metrics {
	m := &metrics{
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:time_to_first_token_seconds", Help: "Histogram of time to first token in seconds.",
			Buckets: ttftBuckets,
		}, []string{"model_name", "engine"}),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:e2e_request_latency_seconds", Help: "Histogram of e2e request latency in seconds.",
			Buckets: []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0},
		}, []string{"model_name", "engine"}),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:inter_token_latency_seconds", Help: "Histogram of inter-token latency in seconds.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0},
		}, []string{"model_name", "engine"}),
	}
	reg.MustRegister(m.ttft, m.e2e, m.itl)
	for _, d := range ranks {
		labels := prometheus.Labels{"model_name": model, "engine": strconv.Itoa(d.rank)}
		stat := func(f func(s sim.Stats) float64) func() float64 {
			return func() float64 {
				d.mu.Lock()
				defer d.mu.Unlock()
				return f(d.eng.Stats())
			}
		}
		gauge := func(name, help string, f func(s sim.Stats) float64) {
			reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, stat(f)))
		}
		counter := func(name, help string, f func(s sim.Stats) float64) {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, stat(f)))
		}
		gauge("vllm:num_requests_running", "Number of requests in model execution batches.", func(s sim.Stats) float64 { return float64(s.Running) })
		gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", func(s sim.Stats) float64 { return float64(s.Waiting + s.Loading) })
		gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", func(s sim.Stats) float64 { return s.KVUsage })
		counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", func(s sim.Stats) float64 { return float64(s.PrefixQueries) })
		counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", func(s sim.Stats) float64 { return float64(s.PrefixHits) })
		counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", func(s sim.Stats) float64 { return float64(s.PromptTokens) })
		counter("vllm:generation_tokens_total", "Number of generation tokens processed.", func(s sim.Stats) float64 { return float64(s.GenerationTokens) })
		counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", func(s sim.Stats) float64 { return float64(s.Preemptions) })
		counter("kvsim_cpu_hit_tokens_total", "Prompt tokens promoted from the CPU offload tier.", func(s sim.Stats) float64 { return float64(s.CPUHitTokens) })
		counter("kvsim_gpu_evicted_blocks_total", "Blocks evicted from GPU memory.", func(s sim.Stats) float64 { return float64(s.GPUEvicted) })
		counter("kvsim_cpu_evicted_blocks_total", "Blocks evicted from the CPU offload tier.", func(s sim.Stats) float64 { return float64(s.CPUEvicted) })
		gauge("kvsim_gpu_cached_blocks", "Hashed blocks resident in GPU memory.", func(s sim.Stats) float64 { return float64(s.GPUBlocks) })
		gauge("kvsim_cpu_cached_blocks", "Hashed blocks resident in the CPU offload tier.", func(s sim.Stats) float64 { return float64(s.CPUBlocks) })
		pub := func(name, help string, f func(p *pubStats) uint64) {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, func() float64 {
				d.stats.mu.Lock()
				defer d.stats.mu.Unlock()
				return float64(f(&d.stats))
			}))
		}
		pub("kvsim_event_batches_published_total", "KV-event batches sent on the PUB socket.", func(p *pubStats) uint64 { return p.batches })
		pub("kvsim_event_batches_dropped_total", "KV-event batches dropped at the high-water mark (replayable).", func(p *pubStats) uint64 { return p.dropped })
		pub("kvsim_event_publish_errors_total", "KV-event batches the socket failed to send.", func(p *pubStats) uint64 { return p.errors })
		pub("kvsim_event_encode_errors_total", "KV-event batches that failed to encode.", func(p *pubStats) uint64 { return p.enc })

		cfg := d.eng.Config()
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig",
			ConstLabels: prometheus.Labels{
				"engine": labels["engine"], "block_size": strconv.Itoa(cfg.BlockSize),
				"num_gpu_blocks": strconv.Itoa(cfg.GPUBlocks), "num_cpu_blocks": strconv.Itoa(cfg.CPUBlocks),
				"enable_prefix_caching": "True", "cache_dtype": "auto",
			},
		}, func() float64 { return 1 }))

		ttft, e2e, itl := m.ttft.With(labels), m.e2e.With(labels), m.itl.With(labels)
		last := map[uint64]float64{} // request → time of its previous token (guarded by d.mu)
		d.obs = func(u sim.Update) {
			at := u.At.Seconds() / d.clock.Scale
			switch u.Kind {
			case sim.FirstToken:
				ttft.Observe((u.At - u.Arrival).Seconds() / d.clock.Scale)
				last[u.ID] = at
			case sim.Token:
				itl.Observe(at - last[u.ID])
				last[u.ID] = at
			case sim.Finished:
				e2e.Observe((u.At - u.Arrival).Seconds() / d.clock.Scale)
				delete(last, u.ID)
			case sim.Aborted:
				delete(last, u.ID)
			}
		}
	}
	reg.MustRegister(&loraInfo{ranks: ranks, maxLoRA: maxLoRA})
	return m
}

// loraInfo is vLLM's vllm:lora_requests_info: one sample whose labels list
// the adapters of running and waiting requests (comma-separated) and whose
// value is the Unix time of the scrape; LoRA-aware schedulers read it.
type loraInfo struct {
	ranks   []*driver
	maxLoRA int
}

var loraInfoDesc = prometheus.NewDesc("vllm:lora_requests_info", "Running stats on lora requests.",
	[]string{"max_lora", "waiting_lora_adapters", "running_lora_adapters"}, nil)

func (l *loraInfo) Describe(ch chan<- *prometheus.Desc) { ch <- loraInfoDesc }

func (l *loraInfo) Collect(ch chan<- prometheus.Metric) {
	var running, waiting []string
	for _, d := range l.ranks {
		d.mu.Lock()
		r, w := d.eng.ActiveLoRAs()
		d.mu.Unlock()
		running, waiting = union(running, r), union(waiting, w)
	}
	ch <- prometheus.MustNewConstMetric(loraInfoDesc, prometheus.GaugeValue, float64(time.Now().UnixNano())/1e9,
		strconv.Itoa(l.maxLoRA), strings.Join(waiting, ","), strings.Join(running, ","))
}

func union(a, b []string) []string {
	for _, x := range b {
		if !slices.Contains(a, x) {
			a = append(a, x)
		}
	}
	slices.Sort(a)
	return a
}

func sortPairs(p [][2]string) {
	slices.SortFunc(p, func(a, b [2]string) int {
		switch {
		case a[0] < b[0]:
			return -1
		case a[0] > b[0]:
			return 1
		}
		return 0
	})
}
