package test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"gopkg.in/yaml.v3"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkRouterTier measures the router tier's throughput with 1, 2 and
// 3 active-active kvrouter replicas side by side in one run (issue 14):
// each replica is its own process (the built binary), kv_aware from token
// ids (completions with a token-id prompt), replica sync on over one NATS
// server, 16 fast upstreams that answer at once, requests spread round
// robin over the replicas by 32 client workers (a plain L4 balancer).
//
// The figure is router CPU per request, read from each replica's own
// process_cpu_seconds_total, so that the client and the upstreams (in this
// process) and the machine's other load do not count: requests per router
// core = 1 / (router CPU per request). A tier of R replicas on R cores
// serves R × that; the sync's cost shows as the growth of CPU per request
// with R. Wall requests/s is reported beside it but, on a shared 2-core
// machine that also runs the client, says little.
//
//	go test -run XXX -bench RouterTier -benchtime 20000x ./test/
func BenchmarkRouterTier(b *testing.B) {
	bin := buildRouter(b)
	ns := testenv.StartNATS(b)
	name := testenv.UniqueName(b)
	pool := "tier_" + name

	// Fast upstreams: a completion answered at once, no body read beyond
	// what the server needs.
	const instances = 16
	var insts []config.InstanceConfig
	for i := 0; i < instances; i++ {
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"cmpl-1","object":"text_completion","model":"`+simModel+`","choices":[{"index":0,"text":"a","finish_reason":"length"}],"usage":{"prompt_tokens":2112,"completion_tokens":1,"total_tokens":2113}}`)
		}))
		b.Cleanup(up.Close)
		insts = append(insts, config.InstanceConfig{ID: fmt.Sprintf("up-%d", i), URL: up.URL})
	}

	// Heartbeats for every instance, as their bridges would send them, so
	// that kv_aware counts them as live and scores them from the index.
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(nc.Close)
	hbCtx, hbStop := context.WithCancel(context.Background())
	var hbDone sync.WaitGroup
	hbDone.Add(1)
	go func() {
		defer hbDone.Done()
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, in := range insts {
				subj, err := kvstream.InstancesSubject(pool, in.ID)
				if err != nil {
					b.Error(err)
					return
				}
				data, _ := json.Marshal(kvstream.Heartbeat{Pool: pool, Instance: in.ID, Model: simModel, Time: time.Now(), IntervalMS: 500})
				_ = nc.Publish(subj, data)
			}
			select {
			case <-hbCtx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	b.Cleanup(func() { hbStop(); hbDone.Wait() })

	// Block size 16 as configured (no event has taught it). Prompts: 64 shared 2,048-token prefixes, each request with its own
	// 64-token tail, so kv_aware keys 2,112 tokens and follows its own
	// speculative entries (and its peers') to the prefix's instance.
	prompt := func(i int) []byte {
		p := make([]uint32, 0, 2112)
		fam := i % 64
		for k := 0; k < 2048; k++ {
			p = append(p, uint32(1000+fam*4096+k))
		}
		for k := 0; k < 64; k++ {
			p = append(p, uint32(300000+(i*64+k)%500000))
		}
		body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": p, "max_tokens": 1})
		return body
	}

	// One stream and bucket for every case: a stream takes the pool's
	// kv.events subjects, which two streams cannot share, and a NATS
	// stream name cannot hold the case's "/" (with it no consumer ran and
	// every decision fell back as stream_down). The cases run one at a
	// time, so their routers consume it in turn.
	stream, bucket := "EV_"+name, "SN_"+name

	// With sync, early sends (events.replica_sync.min_gap) on and off side
	// by side: their cost in router CPU and in sync messages.
	for _, c := range []struct {
		replicas    int
		sync, early bool
	}{{1, true, true}, {2, false, false}, {2, true, false}, {2, true, true}, {3, false, false}, {3, true, false}, {3, true, true}} {
		replicas := c.replicas
		sub := fmt.Sprintf("replicas=%d/sync=%v", replicas, c.sync)
		if c.sync {
			sub += fmt.Sprintf("/early=%v", c.early)
		}
		b.Run(sub, func(b *testing.B) {
			var rs []*tierReplica
			for r := 0; r < replicas; r++ {
				cfg := config.Config{AdminToken: "adm",
					Listen:      fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(b)),
					AdminListen: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(b)),
					Log:         config.LogConfig{Level: "warn", Format: "json"},
					Events: &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: stream}, Bucket: bucket,
						ReplicaSync: &config.ReplicaSyncConfig{Enabled: c.sync, Replica: fmt.Sprintf("r%d-of-%d", r, replicas), DisableEarlySend: !c.early}},
					Pools: []config.PoolConfig{{Name: pool, Model: simModel,
						Routing: config.RoutingConfig{Strategy: config.StrategyKVAware, KV: &config.KVScoringConfig{BlockSize: 16}},
						Health:  config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
						Instances: insts}},
				}
				rs = append(rs, startTierReplica(b, bin, cfg))
			}
			// Every replica hears the others before the clock starts.
			for _, r := range rs {
				if !c.sync {
					break
				}
				testenv.WaitFor(b, 30*time.Second, "replica sync peers", func() bool {
					return r.metric(b, "kvrouter_replica_sync_peers{pool=\""+pool+"\"}") == float64(replicas-1)
				})
			}
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 30 * time.Second}
			var reasons sync.Map
			send := func(n int, count bool) {
				var next atomic.Int64
				var wg sync.WaitGroup
				for w := 0; w < 32; w++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for {
							i := int(next.Add(1)) - 1
							if i >= n {
								return
							}
							r := rs[i%len(rs)]
							resp, err := client.Post(r.url+"/v1/completions", "application/json", bytes.NewReader(prompt(i)))
							if err != nil {
								b.Error(err)
								return
							}
							_, _ = io.Copy(io.Discard, resp.Body)
							resp.Body.Close()
							if resp.StatusCode != http.StatusOK {
								b.Errorf("status %d", resp.StatusCode)
								return
							}
							if count {
								v, _ := reasons.LoadOrStore(resp.Header.Get("X-Kvrouter-Reason"), new(atomic.Int64))
								v.(*atomic.Int64).Add(1)
							}
						}
					}()
				}
				wg.Wait()
			}
			send(2000, false) // warm: connections, speculative entries
			msgs := func(r *tierReplica) float64 {
				return r.metric(b, "kvrouter_replica_sync_messages_total{direction=\"sent\",kind=\"load\",pool=\""+pool+"\"}") +
					r.metric(b, "kvrouter_replica_sync_messages_total{direction=\"sent\",kind=\"spec\",pool=\""+pool+"\"}")
			}
			cpu0, sync0, msgs0 := 0.0, 0.0, 0.0
			for _, r := range rs {
				cpu0 += r.metric(b, "process_cpu_seconds_total")
				sync0 += r.metric(b, "kvrouter_replica_sync_bytes_total{direction=\"sent\",pool=\""+pool+"\"}")
				msgs0 += msgs(r)
			}
			start := time.Now()
			b.ResetTimer()
			send(b.N, true)
			b.StopTimer()
			wall := time.Since(start)
			cpu1, sync1, msgs1 := 0.0, 0.0, 0.0
			for _, r := range rs {
				cpu1 += r.metric(b, "process_cpu_seconds_total")
				sync1 += r.metric(b, "kvrouter_replica_sync_bytes_total{direction=\"sent\",pool=\""+pool+"\"}")
				msgs1 += msgs(r)
			}
			cpu := cpu1 - cpu0
			b.ReportMetric(cpu/float64(b.N)*1e6, "router-CPU-µs/req")
			b.ReportMetric(float64(b.N)/cpu, "req/router-CPU-s")
			b.ReportMetric(float64(b.N)/wall.Seconds(), "req/s")
			b.ReportMetric((sync1-sync0)/float64(b.N), "sync-B/req")
			b.ReportMetric((msgs1-msgs0)/wall.Seconds()/float64(replicas), "sync-msgs/s/replica")
			b.ReportMetric((sync1-sync0)/wall.Seconds()/float64(replicas), "sync-B/s/replica")
			var rsn []string
			reasons.Range(func(k, v any) bool {
				rsn = append(rsn, fmt.Sprintf("%s=%d", k, v.(*atomic.Int64).Load()))
				return true
			})
			b.Logf("replicas=%d reasons: %s", replicas, strings.Join(rsn, " "))
			if v, ok := reasons.Load(string(router.ReasonStreamDown)); ok && v.(*atomic.Int64).Load() > 0 {
				// The figure would be the heuristic fallback's, not kv_aware's.
				b.Fatalf("%d decisions fell back as stream_down: the replicas consume no stream", v.(*atomic.Int64).Load())
			}
			for _, r := range rs {
				r.stop()
			}
		})
	}
}

// tierReplica is one kvrouter process of BenchmarkRouterTier.
type tierReplica struct {
	url, admin string
	pid        int
	stop       func()
}

func startTierReplica(b *testing.B, bin string, cfg config.Config) *tierReplica {
	b.Helper()
	data, err := yaml.Marshal(cfg)
	if err != nil {
		b.Fatal(err)
	}
	path := filepath.Join(b.TempDir(), "router.yaml")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		b.Fatal(err)
	}
	var logs testenv.Logs
	cmd := exec.Command(bin, "--config", path)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	b.Cleanup(func() {
		if b.Failed() || os.Getenv("KV_TEST_LOG") != "" {
			b.Logf("kvrouter %s logs:\n%s", cfg.Listen, logs.String())
		}
	})
	cmd.Env = append(os.Environ(), "KVROUTER_ADMIN_TOKEN=adm")
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	var once sync.Once
	r := &tierReplica{url: "http://" + cfg.Listen, admin: "http://" + cfg.AdminListen, pid: cmd.Process.Pid}
	r.stop = func() {
		once.Do(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
	}
	b.Cleanup(r.stop)
	testenv.WaitFor(b, 60*time.Second, "kvrouter ready", func() bool {
		resp, err := http.Get(r.url + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return r
}

// metric reads one sample of the replica's /metrics by its name and
// labels as the exposition writes them (0 when absent).
func (r *tierReplica) metric(b *testing.B, series string) float64 {
	b.Helper()
	out := 0.0
	scrape(b, r.admin, func(line string) {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatalf("%s: %v", series, err)
			}
			out = f
		}
	})
	return out
}

// scrape calls fn with each line of a router's /metrics (admin token adm).
func scrape(b *testing.B, admin string, fn func(line string)) {
	b.Helper()
	req, _ := http.NewRequest("GET", admin+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer adm")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		fn(sc.Text())
	}
}
