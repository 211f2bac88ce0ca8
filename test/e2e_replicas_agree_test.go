package test

import (
	"bytes"
	"context"
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

// previewAll asks every router, at one instant, which instance it would
// pick for the same completion and why (reason, predicted TTFT, matched
// tokens), dry (kvaware.Preview: nothing committed, so no replica's answer
// is a peer's state). Copies of one request sent to all three at once
// would not compare like with like: a replica that decides first sends its
// in-flight request to its peers a millisecond later (early sends,
// docs/replicas.md), and one that decides after that sees it, as it
// should. The request is resolved as the HTTP edge resolves it.
func previewAll(t *testing.T, routers []*clusterRouter, pool string, prompt []uint32) (picks, why []string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": prompt, "max_tokens": 1})
	picks = make([]string, len(routers))
	why = make([]string, len(routers))
	errs := make([]error, len(routers))
	var wg sync.WaitGroup
	for i, r := range routers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, p, err := r.srv.Resolve(router.Inbound{Endpoint: router.EndpointCompletions, Body: body, Forwards: true})
			if err != nil {
				errs[i] = err
				return
			}
			if p.Name() != pool {
				errs[i] = fmt.Errorf("resolved to pool %s, want %s", p.Name(), pool)
				return
			}
			_, strat := p.Routing()
			cands, _ := p.Candidates(nil, req.Adapter, nil)
			req.Warmable = req.ProxyCanWarm() // as the data plane routes it
			d, _, err := kvaware.Preview(context.Background(), strat, req, cands)
			if err != nil {
				errs[i] = err
				return
			}
			picks[i] = d.Instance.ID()
			why[i] = string(d.Reason)
			if e := d.Explain; e != nil {
				why[i] += fmt.Sprintf(" ttft=%v matched=%v", e.PredictedTTFT, e.MatchedTokens)
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("preview on r%d: %v", i, err)
		}
	}
	return picks, why
}

// sendProbe routes the probe for real through one router, so that it
// leaves what a request leaves (speculative and stored blocks, load) for
// the probes after it.
func sendProbe(t *testing.T, r *clusterRouter, prompt []uint32) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": prompt, "max_tokens": 1})
	resp, err := http.Post(r.http.URL+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("probe: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("probe: status %d", resp.StatusCode)
	}
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
	probes, agreed int
	splits         map[string]int // disagreeing pick sets, for the log
}

// add counts one probe; false for a split.
func (a *agreeCount) add(picks []string) bool {
	a.probes++
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
// cluster, replica sync on. Each replica, asked at one instant which
// instance it would pick for the same request (previewAll: dry, nothing
// committed), names the same one:
//
//   - once state has settled (traffic stopped, sync and events delivered):
//     in at least 97% of probes — the test's assertion; the target
//     is 99%. Each split is logged with every replica's reason and the
//     engine-load samples it held. Each probe is then routed for real
//     through one replica in turn, so the next probes meet its blocks and
//     load. 100 of 100 in three runs (docs/BENCHMARKS.md §11); 97% leaves
//     a split or two for a loaded machine.
//     Until stop 27 the probe was sent live to all three at once: with
//     early sends (1 ms) the replicas that decided later saw the first
//     one's request in flight and, rightly, avoided it — 95 of 100 in one
//     CI run, every split two-against-one, all kv_match at the same
//     predicted TTFT;
//   - under steady load through all three (round robin, as an L4 balancer):
//     measured and logged (KV_AGREE_SECONDS, default 5 s), not asserted:
//     each replica learns a peer's decisions a millisecond or more later,
//     scrapes the engines at its own moments, and follows utilisation and
//     the prefill-cost weight from its own decisions (docs/replicas.md,
//     "What can still differ").
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
		picks, _ := previewAll(t, routers, f.pool, probePrompt(1000+i))
		busy.add(picks)
		time.Sleep(20 * time.Millisecond)
	}
	l.finish()
	if l.failed.Load() > 0 {
		t.Fatalf("load: %s", l.summary())
	}
	rate := float64(l.sent.Load()) / secs
	t.Logf("under load (%.0f requests/s through 3 replicas): %d of %d probes agreed (%.1f%%); splits %v",
		rate, busy.agreed, busy.probes, 100*busy.frac(), busy.splits)

	// Settled: wait until no replica counts anything in flight, its own
	// or its peers', then probe one request at a time: ask all three,
	// then route it for real through one of them (in turn), and wait for
	// its state to go round before the next.
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
		picks, why := previewAll(t, routers, f.pool, probePrompt(i))
		if !settled.add(picks) {
			t.Logf("settled split %d: picks %v; why %q; scraped waiting/running before it %q", i, picks, why, loads)
		}
		sendProbe(t, routers[i%len(routers)], probePrompt(i))
		time.Sleep(150 * time.Millisecond)
	}
	t.Logf("settled: %d of %d probes agreed (%.1f%%); splits %v",
		settled.agreed, settled.probes, 100*settled.frac(), settled.splits)
	if settled.frac() < 0.97 {
		t.Fatalf("settled agreement %.1f%%, want >= 97%%", 100*settled.frac())
	}
}
