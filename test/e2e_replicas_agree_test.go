package test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/kvaware"
)

// probePrompt is one of the load's 16 shared prefixes (startLoad's: 3
// blocks of 16 tokens) with a tail no other request has, so that what the
// probe's copies leave behind (speculative blocks, stored blocks) can
// never lure another request.
func probePrompt(i int) []uint32 {
	p := make([]uint32, 0, 4*16)
	for k := 0; k < 3*16; k++ {
		p = append(p, uint32(50000+(i%16)*100+k))
	}
	for k := 0; k < 16; k++ {
		p = append(p, uint32(900000+i*16+k))
	}
	return p
}

// probeAll sends the same completion to every router at once and returns
// the instance each one picked ("" for a failed request) and how each
// explained it (reason, predicted TTFT, matched tokens).
func probeAll(routers []*clusterRouter, prompt []uint32) (picks, why []string) {
	body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": prompt, "max_tokens": 1})
	picks = make([]string, len(routers))
	why = make([]string, len(routers))
	var wg sync.WaitGroup
	for i, r := range routers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(r.http.URL+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				picks[i] = resp.Header.Get(router.HeaderInstance)
				why[i] = resp.Header.Get(router.HeaderReason) + " ttft=" + resp.Header.Get(router.HeaderPredictedTTFT) +
					"ms matched=" + resp.Header.Get(router.HeaderMatchedTokens)
			}
		}()
	}
	wg.Wait()
	return picks, why
}

// engineLoads is what each router last scraped from the engines
// (waiting/running per instance, "-" when it holds no fresh sample): the
// input a settled split is explained by.
func engineLoads(routers []*clusterRouter, pool string) []string {
	out := make([]string, len(routers))
	for i, r := range routers {
		p, _ := r.srv.Pool(pool)
		st := kvaware.Of(p)
		var b strings.Builder
		for _, l := range st.Compare("", false, p.Instances(), 0).Instances {
			if l.Waiting == nil {
				fmt.Fprintf(&b, " %s=-", l.ID)
				continue
			}
			fmt.Fprintf(&b, " %s=%g/%g", l.ID, *l.Waiting, *l.Running)
		}
		out[i] = b.String()
	}
	return out
}

// agreeCount tallies probes: all replicas picked the same instance, or not.
type agreeCount struct {
	probes, agreed, failed int
	splits                 map[string]int // disagreeing pick sets, for the log
}

// add counts one probe; false for a split.
func (a *agreeCount) add(picks []string) bool {
	a.probes++
	for _, p := range picks {
		if p == "" {
			a.failed++
			return true
		}
	}
	for _, p := range picks[1:] {
		if p != picks[0] {
			if a.splits == nil {
				a.splits = map[string]int{}
			}
			a.splits[fmt.Sprint(picks)]++
			return false
		}
	}
	a.agreed++
	return true
}

func (a *agreeCount) frac() float64 { return float64(a.agreed) / float64(max(a.probes, 1)) }

// Decision agreement between three router replicas (issue 14): each with
// its own memory index fed from the same JetStream stream on a 3-node
// cluster, replica sync on. The same request sent to all three at once
// picks the same instance:
//
//   - once state has settled (traffic stopped, sync and events delivered):
//     in at least 97% of probes — the test's assertion; the target
//     is 99%. Each split is logged with every replica's reason and the
//     engine-load samples it held. Before the samples left out the
//     requests any replica saw end since they were taken (loadended.go,
//     sync version 3), 93–98 of 100 agreed on a loaded 2-core machine
//     (94–97 in the runs beside the change: three of four under 97) and
//     every split was a kv_match tie broken by a sample that one replica's
//     scrape had taken while an earlier probe (or the load) ran; after,
//     98–100 in eleven runs (docs/BENCHMARKS.md §11), so 97% catches the
//     old behaviour and leaves a split or two for a loaded machine;
//   - under steady load through all three (round robin, as an L4 balancer):
//     measured and logged (KV_AGREE_SECONDS, default 5 s), not asserted:
//     each replica learns a peer's decisions an interval later, scrapes
//     the engines at its own moments, and follows utilisation and the
//     prefill-cost weight from its own decisions (docs/replicas.md, "What
//     can still differ").
func TestE2EReplicaDecisionAgreement(t *testing.T) {
	f := newClusterFleet(t, 4, 512, 20)
	routers := []*clusterRouter{
		f.startRouter(f.replicaConfig("r0")),
		f.startRouter(f.replicaConfig("r1")),
		f.startRouter(f.replicaConfig("r2")),
	}
	secs := testenv.Value(t, "KV_AGREE_SECONDS", 5.0)
	// Warm every shared prefix into the fleet, through all three.
	l := f.startLoad(routers, 6, 11)
	time.Sleep(2 * time.Second)
	l.finish()
	if l.failed.Load() > 0 {
		t.Fatalf("warm-up: %s", l.summary())
	}

	// Under steady load.
	l = f.startLoad(routers, 6, 12)
	var busy agreeCount
	start := time.Now()
	for i := 0; time.Since(start) < time.Duration(secs*float64(time.Second)); i++ {
		picks, _ := probeAll(routers, probePrompt(1000+i))
		busy.add(picks)
		time.Sleep(20 * time.Millisecond)
	}
	l.finish()
	if l.failed.Load() > 0 {
		t.Fatalf("load: %s", l.summary())
	}
	rate := float64(l.sent.Load()) / secs
	t.Logf("under load (%.0f requests/s through 3 replicas): %d of %d probes agreed (%.1f%%), %d failed; splits %v",
		rate, busy.agreed, busy.probes, 100*busy.frac(), busy.failed, busy.splits)
	if busy.failed > 0 {
		t.Fatalf("%d probes failed under load", busy.failed)
	}

	// Settled: wait until no replica counts anything in flight, its own
	// or its peers', then probe one request at a time, each after the
	// previous one's state has gone round (two sync intervals).
	for i, r := range routers {
		testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("r%d idle", i), func() bool {
			for _, v := range r.view(t, f.pool) {
				if v.inflight != 0 || v.reqs != 0 {
					return false
				}
			}
			return true
		})
	}
	var settled agreeCount
	for i := 0; i < 100; i++ {
		loads := engineLoads(routers, f.pool)
		picks, why := probeAll(routers, probePrompt(i))
		if !settled.add(picks) {
			t.Logf("settled split %d: picks %v; why %q; scraped waiting/running before it %q", i, picks, why, loads)
		}
		time.Sleep(150 * time.Millisecond)
	}
	t.Logf("settled: %d of %d probes agreed (%.1f%%), %d failed; splits %v",
		settled.agreed, settled.probes, 100*settled.frac(), settled.failed, settled.splits)
	if settled.failed > 0 || settled.frac() < 0.97 {
		t.Fatalf("settled agreement %.1f%% (%d failed), want >= 97%%", 100*settled.frac(), settled.failed)
	}
}
