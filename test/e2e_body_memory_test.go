//go:build linux

package test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// endlessA yields 'a' forever (the uploads' body, cut by io.LimitReader).
type endlessA struct{}

func (endlessA) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'a'
	}
	return len(p), nil
}

// peakRSS is the process's high-water resident set (VmHWM) in bytes: the
// most memory it ever held, not a sample that could miss the peak.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("VmHWM %q: %v", rest, err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}

// TestE2EChunkedUploadsBoundedMemory is the hostile-client load test: the real
// kvrouter binary, loopback only, 64 concurrent 100 MB chunked (no
// Content-Length) uploads beside normal chat traffic. Every upload is
// refused (413 at max_body_bytes, or 503 when the body-memory budget is
// held by the others), every normal request succeeds, and the router's
// peak RSS stays under 256 MB: 2 x the 64 MiB budget (Go's heap may grow
// to twice what is live at GOGC=100) plus the process's own ~30 MB, with
// room. Before the budget, 32 such uploads drove it to 2.6 GB.
func TestE2EChunkedUploadsBoundedMemory(t *testing.T) {
	const (
		uploads    = 64
		uploadSize = 100 << 20
		rssBound   = 256 << 20
	)
	bin := buildRouter(t)
	ups := routerUpstreams(t, 2)
	cfgPath := filepath.Join(t.TempDir(), "router.yaml")
	writeRouterConfig(t, cfgPath, "least_outstanding", ups)
	cfg, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	cfg = []byte(strings.Replace(string(cfg), "max_body_bytes: 1048576\n",
		"max_body_bytes: 16777216\nlimits: {max_body_memory_bytes: 67108864}\n", 1))
	// Health probes off: on a loaded 2-core machine the upload flood can
	// delay a 500 ms probe twice running, and an instance marked down would
	// fail normal requests for a reason this test is not about.
	cfg = []byte(strings.Replace(string(cfg), "    health: {interval: 100ms, timeout: 500ms, unhealthy_threshold: 2, healthy_threshold: 1}\n",
		"    health: {disable: true}\n", 1))
	if !strings.Contains(string(cfg), "health: {disable: true}") {
		t.Fatalf("config not rewritten:\n%s", cfg)
	}
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	p := startRouter(t, bin, nil, "--config", cfgPath)
	chat := p.data + "/v1/chat/completions"

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 0, MaxIdleConnsPerHost: 64}}
	var refused, sendErrs, other atomic.Int64
	statuses := sync.Map{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range uploads {
		wg.Go(func() {
			<-start
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, chat, io.LimitReader(endlessA{}, uploadSize))
			req.ContentLength = -1 // chunked
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			if err != nil {
				// The router answered and closed while the body was still
				// being written: the write fails before the answer is read.
				sendErrs.Add(1)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses.Store(resp.StatusCode, true)
			if resp.StatusCode == http.StatusRequestEntityTooLarge || resp.StatusCode == http.StatusServiceUnavailable {
				refused.Add(1)
			} else {
				other.Add(1)
			}
		})
	}
	// Normal traffic beside the uploads, until they are done.
	uploadsDone := make(chan struct{})
	var normalOK, normalBad atomic.Int64
	var badMsg atomic.Value
	var nwg sync.WaitGroup
	for w := range 4 {
		nwg.Go(func() {
			<-start
			for i := 0; ; i++ {
				select {
				case <-uploadsDone:
					return
				default:
				}
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, chat, strings.NewReader(chatJSON(routerModel, fmt.Sprintf("worker %d request %d", w, i), false)))
				req.Header.Set("Content-Type", "application/json")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					normalBad.Add(1)
					badMsg.Store(err.Error())
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					normalOK.Add(1)
				} else {
					normalBad.Add(1)
					badMsg.Store(fmt.Sprintf("%d %s", resp.StatusCode, b))
				}
			}
		})
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	close(uploadsDone)
	nwg.Wait()
	elapsed := time.Since(t0)
	if ctx.Err() != nil {
		t.Fatalf("uploads did not finish within the deadline (%v)", elapsed)
	}
	hwm := peakRSS(t, p.cmd.Process.Pid)
	var seen []string
	statuses.Range(func(k, _ any) bool { seen = append(seen, strconv.Itoa(k.(int))); return true })
	t.Logf("%d uploads in %v: %d refused (statuses %v), %d cut while sending; normal: %d ok, %d failed; router peak RSS %.1f MB",
		uploads, elapsed.Round(time.Millisecond), refused.Load(), seen, sendErrs.Load(), normalOK.Load(), normalBad.Load(), float64(hwm)/(1<<20))
	if other.Load() != 0 {
		t.Errorf("%d uploads of 100 MB were accepted (statuses %v)", other.Load(), seen)
	}
	if normalBad.Load() != 0 || normalOK.Load() == 0 {
		t.Errorf("normal traffic beside the uploads: %d ok, %d failed (last: %v)", normalOK.Load(), normalBad.Load(), badMsg.Load())
	}
	if hwm > rssBound {
		t.Errorf("router peak RSS %.1f MB exceeds %d MB", float64(hwm)/(1<<20), rssBound>>20)
	}
	// The refusals for want of budget are counted.
	m := httpDo(t, http.MethodGet, p.admin+"/metrics", "", nil).body
	if !strings.Contains(m, "kvrouter_body_budget_rejected_total") || !strings.Contains(m, "kvrouter_body_memory_limit_bytes 6.7108864e+07") {
		t.Errorf("body budget metrics missing:\n%s", grepLines(m, "kvrouter_body"))
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
