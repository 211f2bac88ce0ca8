package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

func TestFlagsOverrideFileAndEnvSetsSecrets(t *testing.T) {
	path := filepath.Join(t.TempDir(), "r.yaml")
	doc := `
listen: ":9000"
max_body_bytes: 2048
index: {backend: redis, redis: {addrs: ["127.0.0.1:6379"]}}
pools:
  - name: a
    model: m1
    routing: {strategy: random, prefix_length: 2048}
    instances: [{id: x, url: "http://127.0.0.1:1"}]
  - name: b
    model: m2
    instances: [{id: y, url: "http://127.0.0.1:2"}]
`
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"KVROUTER_ADMIN_TOKEN": "tok", "KVROUTER_REDIS_PASSWORD": "pw"}
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, f flags)
	}{
		{"file only", nil, nil},
		{"flags win", []string{"--listen", "127.0.0.1:7000", "--max-body-bytes", "4096", "--strategy", "least_outstanding", "--concurrency-threshold", "9"}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := parseFlags(append([]string{"--config", path}, tc.args...), io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := loadConfig(f, func(k string) string { return env[k] })
			if err != nil {
				t.Fatal(err)
			}
			if cfg.AdminToken != "tok" || cfg.Index.Redis.Password != "pw" {
				t.Fatalf("secrets not taken from the environment: %q %q", cfg.AdminToken, cfg.Index.Redis.Password)
			}
			if tc.args == nil {
				if cfg.Listen != ":9000" || cfg.MaxBodyBytes != 2048 || cfg.Pools[0].Routing.Strategy != "random" || cfg.Pools[1].Routing.Strategy != "prefix_aware" {
					t.Fatalf("file values: %+v", cfg)
				}
				return
			}
			if cfg.Listen != "127.0.0.1:7000" || cfg.MaxBodyBytes != 4096 {
				t.Fatalf("flags did not override: %+v", cfg)
			}
			for _, p := range cfg.Pools {
				if p.Routing.Strategy != "least_outstanding" || p.Routing.ConcurrencyThreshold != 9 {
					t.Fatalf("pool %s routing %+v", p.Name, p.Routing)
				}
			}
			if cfg.Pools[0].Routing.PrefixLength != 2048 || cfg.Pools[1].Routing.PrefixLength != 8192 {
				t.Fatal("a flag not given changed prefix_length")
			}
		})
	}
}

func TestFlagErrors(t *testing.T) {
	for _, args := range [][]string{{}, {"--config", "x", "extra"}, {"--nope"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	f, _ := parseFlags([]string{"--config", "/nonexistent.yaml"}, io.Discard)
	if _, err := loadConfig(f, func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), "nonexistent") {
		t.Errorf("missing file: %v", err)
	}
}

// syncBuffer collects the router's log lines for the test to read.
type syncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// field returns the string field of the first JSON log line whose msg is msg.
func (s *syncBuffer) field(msg, key string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, line := range strings.Split(s.b.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == msg {
			v, _ := m[key].(string)
			return v
		}
	}
	return ""
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// TestRunEmbeddedNATS runs the kvrouter command with no NATS URL: it starts
// its embedded NATS server, a kvbridge publishes an engine's events to it,
// the admin lookup sees the blocks, and a SIGHUP reload keeps the consumer.
func TestRunEmbeddedNATS(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "r.yaml")
	doc := fmt.Sprintf(`
listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
events:
  nats: {listen: "127.0.0.1:0", store_dir: %q}
pools:
  - name: p
    model: m
    routing: {strategy: kv_aware}
    health: {disable: true}
    discovery: {disable: true}
    instances: [{id: vllm-0, url: "http://127.0.0.1:1"}]
`, filepath.Join(dir, "nats"))
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--config", path, "--shutdown-timeout", "5s"}, logs, func(string) string { return "" })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	var natsURL, admin string
	waitFor(t, "the router to listen", func() bool {
		natsURL, admin = logs.field("consuming KV events", "nats_url"), logs.field("kvrouter listening", "admin_listen")
		return natsURL != "" && admin != ""
	})

	// An engine and its bridge, publishing to the router's embedded NATS.
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	pub, err := events.NewZMQPublisher(ctx, events.ZMQPublisherConfig{Endpoint: ep, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	b, err := bridge.New(bridge.Config{Pool: "p", Model: "m", BlockSize: 16, Conn: nc, HeartbeatInterval: 200 * time.Millisecond,
		Sources: []bridge.Source{{Instance: "vllm-0", Endpoint: ep}}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	bctx, stopBridge := context.WithCancel(ctx)
	bdone := make(chan struct{})
	go func() { defer close(bdone); _ = b.Run(bctx) }()
	t.Cleanup(func() { stopBridge(); <-bdone })
	waitFor(t, "the bridge subscribed", pub.Subscribed)

	ids := make([]uint32, 3*16)
	for i := range ids {
		ids[i] = uint32(i + 7)
	}
	hashes := []uint64{11, 12, 13}
	payload, err := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{{Kind: events.BlockStored, BlockHashes: hashes, TokenIDs: ids, BlockSize: 16, Medium: "GPU"}}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pub.Publish(payload); err != nil {
		t.Fatal(err)
	}
	lookup := func() string {
		body, _ := json.Marshal(map[string]any{"token_ids": ids})
		resp, err := http.Post("http://"+admin+"/admin/pools/p/lookup", "application/json", bytes.NewReader(body))
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		var out struct {
			BlockSize int `json:"block_size"`
			Matches   []struct {
				Instance  string `json:"instance"`
				GPUBlocks int    `json:"gpu_blocks"`
				CPUBlocks int    `json:"cpu_blocks"`
			} `json:"matches"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
			return err.Error()
		}
		return fmt.Sprintf("%d %+v", out.BlockSize, out.Matches)
	}
	want := "16 [{Instance:vllm-0 GPUBlocks:3 CPUBlocks:0}]"
	waitFor(t, "lookup "+want, func() bool { return lookup() == want })

	// SIGHUP reloads the file; the consumer and its index stay.
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the reload", func() bool { return logs.field("reloaded", "config") == path })
	if got := lookup(); got != want {
		t.Fatalf("after reload: %s", got)
	}
}
