package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/events/eventstest"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/admin"
	"github.com/kvrouter/kvrouter/router/admin/adminapi"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/kvstate"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/tokenizer"
)

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// engine is one simulated vLLM engine's KV-event side: a vLLM-format ZMQ
// publisher and the real kvbridge forwarding it to NATS.
type engine struct {
	pub *enginezmq.Publisher
}

func startEngine(t *testing.T, ctx context.Context, natsURL, pool, instance, url, stream, bucket string) *engine {
	t.Helper()
	pub, pc := eventstest.Publisher(t, ctx, enginezmq.PublisherConfig{})
	b, err := bridge.New(bridge.Config{Pool: pool, Model: testModel, BlockSize: 16, Conn: testenv.Connect(t, natsURL),
		Sources: []bridge.Source{{Instance: instance, Endpoint: pc.Endpoint, ReplayEndpoint: pc.ReplayEndpoint, URL: url}},
		Stream:  kvstream.StreamConfig{Name: stream}, Bucket: kvstream.BucketConfig{Name: bucket},
		HeartbeatInterval: 200 * time.Millisecond, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, ctx, b.Run)
	testenv.WaitFor(t, 10*time.Second, "the bridge subscribed to the engine", pub.Subscribed)
	return &engine{pub: pub}
}

func (e *engine) publish(t *testing.T, evs ...events.Event) {
	t.Helper()
	eventstest.Publish(t, e.pub, events.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Events: evs})
}

// TestKVCommandsEndToEnd runs kvctl lookup, instances and tail evictions
// against a real in-process kvrouter fed by a real kvbridge through an
// embedded NATS JetStream: blocks stored, seen, evicted, gone.
func TestKVCommandsEndToEnd(t *testing.T) {
	ctx := testenv.Context(t, 2*time.Minute)
	name := testenv.UniqueName(t)
	pool := "p_" + name
	stream, bucket := "EV_"+name, "SN_"+name
	ns := testenv.StartNATS(t)
	u0 := routertest.New(t, "vllm-0", testModel)
	u1 := routertest.New(t, "vllm-1", testModel)
	cfg := config.Config{
		AdminListen: "127.0.0.1:0",
		AdminToken:  "adm",
		Events:      &config.EventsConfig{NATS: config.NATSConfig{URL: ns.URL(), Stream: stream}, Bucket: bucket},
		Pools: []config.PoolConfig{{Name: pool, Model: testModel,
			Routing:   config.RoutingConfig{Strategy: config.StrategyKVAware},
			Tokenizer: &config.TokenizerConfig{Source: kvaware.TokenSourceSimple},
			Health:    config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true},
			Instances: []config.InstanceConfig{{ID: "vllm-0", URL: u0.URL()}, {ID: "vllm-1", URL: u1.URL()}}}},
	}
	kve, err := kvstate.Start(ctx, cfg, kvstate.Options{Logger: quiet(), SnapshotTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kve.Close)
	srv, err := httpapi.NewServer(cfg, httpapi.Options{Logger: quiet(), KV: kvaware.NewSource(kve.KV), KVEvents: kve, Admin: admin.Routes(kve)})
	if err != nil {
		t.Fatal(err)
	}
	admin := httptest.NewServer(srv.AdminHandler())
	t.Cleanup(admin.Close)
	if err := kve.WaitReady(testenv.Context(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KVROUTER_ADMIN_URL", admin.URL)
	t.Setenv("KVROUTER_ADMIN_TOKEN", "adm")

	eng := startEngine(t, ctx, ns.URL(), pool, "vllm-1", u1.URL(), stream, bucket)

	// Token ids in a file, whitespace-separated: 4 full blocks and a tail.
	ids := make([]string, 4*16+5)
	for i := range ids {
		ids[i] = fmt.Sprint(1000 + i*7)
	}
	tokFile := filepath.Join(t.TempDir(), "ids.txt")
	if err := os.WriteFile(tokFile, []byte(strings.Join(ids, " ")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	toks := make([]uint32, len(ids))
	for i := range toks {
		toks[i] = uint32(1000 + i*7)
	}

	lookup := func() lookupAnswer {
		t.Helper()
		code, out, errOut := runCLI(t, "lookup", "--pool", pool, "--tokens", tokFile, "--json")
		if code != 0 {
			t.Fatalf("lookup: exit %d: %s", code, errOut)
		}
		var ans lookupAnswer
		if err := json.Unmarshal([]byte(out), &ans); err != nil {
			t.Fatalf("lookup --json: %v\n%s", err, out)
		}
		return ans
	}
	if a := lookup(); len(a.Matches) != 0 || a.PromptTokens != len(ids) {
		t.Fatalf("lookup before any event: %+v", a)
	}

	// Follow evictions twice: through the router's SSE stream and on NATS.
	sse := startTail(t, "--pool", pool, "--tier", "gpu", "--count", "1", "--json")
	direct := startTail(t, "--pool", pool, "--instance", "vllm-1", "--nats", ns.URL(), "--count", "1", "--each")
	sse.ready(t)
	direct.ready(t)

	// Four blocks stored on GPU; the last two offloaded to CPU and evicted
	// from GPU: vllm-1 holds 2 blocks on GPU, then 2 more on CPU.
	eng.publish(t, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{11, 12, 13, 14}, TokenIDs: toks[:64], BlockSize: 16, Medium: "GPU"})
	eng.publish(t,
		events.Event{Kind: events.BlockStored, BlockHashes: []uint64{13, 14}, Medium: "CPU"},
		events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{13, 14}, Medium: "GPU"})
	testenv.WaitFor(t, 10*time.Second, "lookup sees GPU and CPU blocks", func() bool {
		a := lookup()
		return a.BlockSize == 16 && a.Blocks == 4 && len(a.Matches) == 1 &&
			a.Matches[0] == lookupMatch{Instance: "vllm-1", GPUBlocks: 2, CPUBlocks: 2, Live: true}
	})

	// The table says the same to a human.
	code, out, errOut := runCLI(t, "lookup", "--pool", pool, "--tokens", tokFile)
	if code != 0 {
		t.Fatalf("lookup: %d %s", code, errOut)
	}
	for _, s := range []string{fmt.Sprintf("pool %s: prompt 69 tokens, block size 16, 4 full blocks", pool), "vllm-1    yes   2    2    0     0       4      64      100%"} {
		if !strings.Contains(out, s) {
			t.Errorf("lookup table lacks %q:\n%s", s, out)
		}
	}

	// decide: kv_aware would send the prompt to vllm-1 for what it holds
	// there (2 blocks on GPU, 2 more on CPU); asking commits nothing.
	for range 2 {
		code, out, errOut = runCLI(t, "decide", "--pool", pool, "--tokens", tokFile, "--json")
		if code != 0 {
			t.Fatalf("decide: exit %d: %s", code, errOut)
		}
		var d adminapi.DecideResponse
		if err := json.Unmarshal([]byte(out), &d); err != nil {
			t.Fatalf("decide --json: %v\n%s", err, out)
		}
		if k := d.KVAware; d.Pool != pool || d.Endpoint != "completions" || k.Instance != "vllm-1" || k.Reason != "kv_match" ||
			k.GPUTokens != 32 || k.CPUTokens != 32 || k.PromptTokens != len(ids) || k.PredictedTTFTMs == nil || d.PrefixAware.Instance == "" {
			t.Fatalf("decide: %s", out)
		}
	}
	code, out, errOut = runCLI(t, "decide", "--pool", pool, "--tokens", tokFile)
	if code != 0 || !strings.Contains(out, "kv_aware      vllm-1") || !strings.Contains(out, "kv_match") {
		t.Errorf("decide table (exit %d, %s):\n%s", code, errOut, out)
	}
	notJSON := filepath.Join(t.TempDir(), "req.json")
	if err := os.WriteFile(notJSON, []byte(`{"prompt":`), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut = runCLI(t, "decide", "--pool", pool, "--request", notJSON); code != 2 || !strings.Contains(errOut, "not JSON") {
		t.Errorf("decide --request with a broken body: exit %d: %s", code, errOut)
	}

	// The GPU eviction reached both tails.
	if err := sse.wait(t); err != nil {
		t.Fatalf("sse tail: %v", err)
	}
	var rec kvstream.EvictionRecord
	if err := json.Unmarshal([]byte(sse.out.String()), &rec); err != nil {
		t.Fatalf("sse tail output %q: %v", sse.out, err)
	}
	if rec.Pool != pool || rec.Instance != "vllm-1" || rec.Tier != "gpu" || rec.Blocks != 2 || rec.Reason != kvstream.ReasonEvicted || len(rec.Hashes) != 2 {
		t.Errorf("sse tail record %+v", rec)
	}
	if err := direct.wait(t); err != nil {
		t.Fatalf("nats tail: %v", err)
	}
	if o := direct.out.String(); !strings.Contains(o, "vllm-1") || !strings.Contains(o, "000000000000000d,000000000000000e") || !strings.Contains(o, "evicted") {
		t.Errorf("nats tail output:\n%s", o)
	}

	// instances: the configured pair, vllm-1 live with its blocks per tier.
	code, out, errOut = runCLI(t, "instances", "--json")
	if code != 0 {
		t.Fatalf("instances: %d %s", code, errOut)
	}
	var rows []instanceRow
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("instances --json: %v\n%s", err, out)
	}
	if len(rows) != 2 || rows[0].Instance != "vllm-0" || rows[1].Instance != "vllm-1" {
		t.Fatalf("instances rows: %s", out)
	}
	r0, r1 := rows[0], rows[1]
	if r0.KV == nil || r0.KV.State != "unknown" || r0.Healthy == nil || !*r0.Healthy || r0.URL != u0.URL() {
		t.Errorf("vllm-0 row %+v", r0)
	}
	if k := r1.KV; k == nil || k.State != "live" || k.Blocks["gpu"] != 2 || k.Blocks["cpu"] != 2 || k.LastEvent.IsZero() || k.StreamSeq == 0 || !k.Configured {
		t.Errorf("vllm-1 row %+v kv %+v", r1, r1.KV)
	}
	code, out, _ = runCLI(t, "instances", "--pool", pool)
	if code != 0 || !strings.Contains(out, "live") || !strings.Contains(out, "pool "+pool+": event stream healthy, block size 16") {
		t.Errorf("instances table (exit %d):\n%s", code, out)
	}

	// A prompt file: the router tokenizes it with the pool's tokenizer;
	// blocks stored for those tokens on vllm-0 are found from the text.
	prompt := strings.Repeat("the quick brown fox jumps over the lazy dog ", 12)
	promptFile := filepath.Join(t.TempDir(), "prompt.txt")
	if err := os.WriteFile(promptFile, []byte(prompt), 0o600); err != nil {
		t.Fatal(err)
	}
	pids, err := tokenizer.Simple{}.Encode(prompt)
	if err != nil || len(pids) < 32 {
		t.Fatalf("simple tokenizer: %d ids, %v", len(pids), err)
	}
	eng0 := startEngine(t, ctx, ns.URL(), pool, "vllm-0", u0.URL(), stream, bucket)
	eng0.publish(t, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{21, 22}, TokenIDs: pids[:32], BlockSize: 16, Medium: "GPU"})
	testenv.WaitFor(t, 10*time.Second, "prompt lookup sees vllm-0", func() bool {
		code, out, _ := runCLI(t, "lookup", "--pool", pool, "--prompt-file", promptFile, "--json")
		var a lookupAnswer
		return code == 0 && json.Unmarshal([]byte(out), &a) == nil && a.PromptTokens == len(pids) &&
			len(a.Matches) == 1 && a.Matches[0] == lookupMatch{Instance: "vllm-0", GPUBlocks: 2, Live: true}
	})

	// A chat file: the router renders the messages with the pool's
	// template, then tokenizes; blocks stored for those tokens are found.
	msgs := []tokenizer.Message{{Role: "system", Content: prompt}, {Role: "user", Content: "hello"}}
	rendered, err := tokenizer.Simple{}.Render(msgs, tokenizer.RenderOptions{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	cids, err := tokenizer.Simple{}.Encode(rendered)
	if err != nil || len(cids) < 48 {
		t.Fatalf("chat: %d ids, %v", len(cids), err)
	}
	chatReq, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	chatFile := filepath.Join(t.TempDir(), "chat.json")
	if err := os.WriteFile(chatFile, chatReq, 0o600); err != nil {
		t.Fatal(err)
	}
	eng0.publish(t, events.Event{Kind: events.BlockStored, BlockHashes: []uint64{31, 32, 33}, TokenIDs: cids[:48], BlockSize: 16, Medium: "GPU"})
	testenv.WaitFor(t, 10*time.Second, "chat lookup sees vllm-0", func() bool {
		code, out, _ := runCLI(t, "lookup", "--pool", pool, "--chat-file", chatFile, "--json")
		var a lookupAnswer
		return code == 0 && json.Unmarshal([]byte(out), &a) == nil && a.PromptTokens == len(cids) &&
			len(a.Matches) == 1 && a.Matches[0] == lookupMatch{Instance: "vllm-0", GPUBlocks: 3, Live: true}
	})

	// Removal: nothing left.
	eng.publish(t,
		events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{11, 12}, Medium: "GPU"},
		events.Event{Kind: events.BlockRemoved, BlockHashes: []uint64{13, 14}, Medium: "CPU"})
	testenv.WaitFor(t, 10*time.Second, "lookup sees the removal", func() bool { return len(lookup().Matches) == 0 })
	code, out, _ = runCLI(t, "lookup", "--pool", pool, "--tokens", tokFile)
	if code != 0 || !strings.Contains(out, "no instance holds the prompt's first block") {
		t.Errorf("lookup after removal (exit %d):\n%s", code, out)
	}

	// Without the token the KV endpoints refuse, and kvctl says how to fix it.
	t.Setenv("KVROUTER_ADMIN_TOKEN", "")
	code, _, errOut = runCLI(t, "lookup", "--pool", pool, "--tokens", tokFile)
	if code != 1 || !strings.Contains(errOut, "401 Unauthorized") || !strings.Contains(errOut, "set --token") {
		t.Errorf("lookup without token: exit %d, %s", code, errOut)
	}
	code, _, errOut = runCLI(t, "tail", "evictions", "--pool", pool)
	if code != 1 || !strings.Contains(errOut, "401 Unauthorized") {
		t.Errorf("tail without token: exit %d, %s", code, errOut)
	}
}

// TestKVCommandsWithoutIndex: a pool without a KV index still lists its
// instances; lookup explains the 409.
func TestKVCommandsWithoutIndex(t *testing.T) {
	tr := newTestRouter(t, 2, false, nil)
	code, out, errOut := tr.kvctl(t, "instances")
	if code != 0 {
		t.Fatalf("instances: %d %s", code, errOut)
	}
	for _, s := range []string{"llama  llama-0", "yes", "pool llama: no KV index"} {
		if !strings.Contains(out, s) {
			t.Errorf("instances lacks %q:\n%s", s, out)
		}
	}
	tokFile := filepath.Join(t.TempDir(), "ids.json")
	if err := os.WriteFile(tokFile, []byte("[1,2,3]"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, _, errOut = tr.kvctl(t, "lookup", "--pool", "llama", "--tokens", tokFile)
	if code != 1 || !strings.Contains(errOut, `409 Conflict: pool "llama" has no KV index`) {
		t.Errorf("lookup: exit %d, %s", code, errOut)
	}
	code, _, errOut = tr.kvctl(t, "tail", "evictions", "--pool", "llama")
	if code != 1 || !strings.Contains(errOut, "503 Service Unavailable: eviction stream: the router consumes no KV events") {
		t.Errorf("tail: exit %d, %s", code, errOut)
	}
}
