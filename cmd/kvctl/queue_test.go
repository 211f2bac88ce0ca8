package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/flowcontrol"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

// TestQueue shows a pool whose one instance is held busy, with requests of
// two tenants waiting at two priorities, beside a pool without flow control.
func TestQueue(t *testing.T) {
	tr := newTestRouter(t, 1, true, func(c *config.Config) {
		c.Pools[0].Routing.ConcurrencyThreshold = 1
		c.Pools[0].FlowControl = &config.FlowControlConfig{Enabled: true, MaxQueue: 16}
	})
	data := httptest.NewServer(tr.srv.Handler())
	defer data.Close()
	release := tr.ups[0].Hold()
	defer release() // before data.Close: the held requests must end
	send := func(tenant, prio string) {
		body := `{"model":"` + testModel + `","prompt":"hello there, a prompt of some length","max_tokens":8,"prompt_cache_key":"` + tenant + `"}`
		req, _ := http.NewRequest("POST", data.URL+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(httpapi.HeaderPriority, prio)
		go func() {
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	send("first", "0")
	<-tr.ups[0].Started
	send("alice", "0")
	send("bob", "3")
	send("bob", "3")
	p, _ := tr.srv.Pool("llama")
	for deadline := time.Now().Add(20 * time.Second); p.QueueStatus().Queue.Queued < 3; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("requests never queued")
		}
	}

	code, out, errOut := tr.kvctl(t, "queue")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"POOL", "llama", "on", "3/16", "1/1", "qwen", "off"} {
		if !strings.Contains(out, want) {
			t.Errorf("queue lacks %q:\n%s", want, out)
		}
	}
	code, out, errOut = tr.kvctl(t, "queue", "--pool", "llama")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"PRIORITY", "TENANT", "bob", "alice"} {
		if !strings.Contains(out, want) {
			t.Errorf("queue --pool lacks %q:\n%s", want, out)
		}
	}
	if strings.Index(out, "bob") > strings.Index(out, "alice") {
		t.Errorf("tenants not by queued tokens (bob has two requests):\n%s", out)
	}
	code, out, _ = tr.kvctl(t, "queue", "--pool", "llama", "--json")
	var qs queueStatus
	if code != 0 || json.Unmarshal([]byte(out), &qs) != nil || !qs.Enabled || qs.Queue.Queued != 3 || len(qs.Queue.Bands) != 2 {
		t.Fatalf("--json: %d %s", code, out)
	}
	if code, _, errOut := tr.kvctl(t, "queue", "--pool", "nope"); code != 1 || !strings.Contains(errOut, "404") {
		t.Fatalf("unknown pool: %d %s", code, errOut)
	}
}

// The pending-prefill cell names the bound that applies: the pool's, or
// the per-instance one when only that is set (it read "none" then).
func TestPendingCell(t *testing.T) {
	tests := []struct {
		q    flowcontrol.Stats
		want string
	}{
		{flowcontrol.Stats{PendingPrefill: 100}, "100/none"},
		{flowcontrol.Stats{PendingPrefill: 100, MaxPendingPrefill: 4096}, "100/4096"},
		{flowcontrol.Stats{PendingPrefill: 100, InstancePrefill: 8192}, "100/8192 per instance"},
		{flowcontrol.Stats{PendingPrefill: 100, MaxPendingPrefill: 4096, InstancePrefill: 8192}, "100/4096"},
	}
	for _, tc := range tests {
		if got := pendingCell(&tc.q); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.q, got, tc.want)
		}
	}
}
