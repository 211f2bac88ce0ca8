// Command requestwalk lists the files of the module that one HTTP chat
// completion runs code in, from the listener's handler to the upstream and
// back (docs/architecture.md, "The request walk"). It serves a plain
// prefix_aware pool of four instances in front of a fake upstream, sends
// one request to warm up, clears the coverage counters, sends a second and
// writes the counters of that one request to dir:
//
//	go build -cover -covermode=atomic -coverpkg=github.com/kvrouter/kvrouter/... -o /tmp/requestwalk ./internal/requestwalk/
//	/tmp/requestwalk /tmp/walk && go tool covdata textfmt -i=/tmp/walk -o /tmp/walk.txt
//	awk -F'[: ]' 'NR>1 && $NF>0 {print $1}' /tmp/walk.txt | grep -v requestwalk | sort | uniq -c
//
// Without -cover it says so and exits 1.
package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime/coverage"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/httpapi"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: requestwalk DIR (a binary built with -cover -covermode=atomic)")
		os.Exit(2)
	}
	if err := walk(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "requestwalk:", err)
		os.Exit(1)
	}
}

func walk(dir string) error {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}`)
	}))
	defer up.Close()
	pc := config.PoolConfig{Name: "p", Model: "m", Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
	for i := range 4 {
		pc.Instances = append(pc.Instances, config.InstanceConfig{ID: fmt.Sprintf("vllm-%d", i), URL: up.URL})
	}
	srv, err := httpapi.NewServer(config.Config{Pools: []config.PoolConfig{pc}}, httpapi.Options{})
	if err != nil {
		return err
	}
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hello there"}]}`)
	chat := func() error {
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("the router answered %s", resp.Status)
		}
		return nil
	}
	if err := chat(); err != nil { // first use: lazy initialisation is not the walk
		return err
	}
	if err := coverage.ClearCounters(); err != nil {
		return err
	}
	if err := chat(); err != nil {
		return err
	}
	if err := coverage.WriteMetaDir(dir); err != nil {
		return err
	}
	return coverage.WriteCountersDir(dir)
}
