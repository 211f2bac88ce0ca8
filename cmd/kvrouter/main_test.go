package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/tracing/otlptest"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/bridge"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/httpapi"
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

// field returns the string field key of the router's first JSON log line
// whose msg is msg.
func field(logs *testenv.Logs, msg, key string) string {
	if recs := logs.Lines(msg); len(recs) > 0 {
		v, _ := recs[0][key].(string)
		return v
	}
	return ""
}

// logged waits for the router to log msg with key set (a listener's
// address, the embedded NATS URL) and returns key's value.
func logged(t *testing.T, logs *testenv.Logs, msg, key string) string {
	t.Helper()
	var v string
	testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("the router to log %q with %s", msg, key), func() bool {
		v = field(logs, msg, key)
		return v != ""
	})
	return v
}

// startRun runs the kvrouter command on the config doc (written to a file)
// until the test ends or stop is called, and returns its log, the config
// path and stop, which ends the command and returns what run returned.
func startRun(t *testing.T, doc string, env map[string]string) (logs *testenv.Logs, path string, stop func() error) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "r.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	logs = &testenv.Logs{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--config", path, "--shutdown-timeout", "5s"}, logs, func(k string) string { return env[k] })
	}()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("run: %v", err)
		}
	})
	return logs, path, stop
}

// engine is a vLLM stand-in publishing KV events over ZMQ, with a kvbridge
// forwarding them to the router's NATS, until the test ends.
func engine(t *testing.T, natsURL, pool, model, instance string) *enginezmq.Publisher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t))
	pub, err := enginezmq.NewPublisher(ctx, enginezmq.PublisherConfig{Endpoint: ep, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	nc := testenv.Connect(t, natsURL, nats.MaxReconnects(-1))
	b, err := bridge.New(bridge.Config{Pool: pool, Model: model, BlockSize: 16, Conn: nc, HeartbeatInterval: 200 * time.Millisecond,
		Sources: []bridge.Source{{Instance: instance, Endpoint: ep}}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, ctx, b.Run)
	testenv.WaitFor(t, 30*time.Second, "the bridge subscribed", pub.Subscribed)
	return pub
}

// storeBlocks publishes a GPU BlockStored of len(hashes) 16-token blocks
// over ids.
func storeBlocks(t *testing.T, pub *enginezmq.Publisher, hashes []uint64, ids []uint32) {
	t.Helper()
	payload, err := events.Encode(nil, events.Batch{TS: 1, Events: []events.Event{{Kind: events.BlockStored, BlockHashes: hashes, TokenIDs: ids, BlockSize: 16, Medium: "GPU"}}}, events.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pub.Publish(payload); err != nil {
		t.Fatal(err)
	}
}

func tokenIDs(n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(i + 7)
	}
	return ids
}

// embeddedDoc is a router config whose KV events come from its embedded
// NATS server (stored in a temporary folder), with one kv_aware pool p of
// one instance, vllm-0, and no health checks or discovery. It ends in the
// pools: list, so a test may append pools and then other sections.
func embeddedDoc(t *testing.T) string {
	return fmt.Sprintf(`
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
`, filepath.Join(t.TempDir(), "nats"))
}

// TestRunEmbeddedNATS runs the kvrouter command with no NATS URL: it starts
// its embedded NATS server, a kvbridge publishes an engine's events to it,
// the admin lookup sees the blocks, and a SIGHUP reload keeps the consumer.
func TestRunEmbeddedNATS(t *testing.T) {
	logs, path, _ := startRun(t, embeddedDoc(t), nil)
	natsURL := logged(t, logs, "consuming KV events", "nats_url")
	admin := logged(t, logs, "kvrouter listening", "admin_listen")

	// An engine and its bridge, publishing to the router's embedded NATS.
	pub := engine(t, natsURL, "p", "m", "vllm-0")
	ids := tokenIDs(3 * 16)
	storeBlocks(t, pub, []uint64{11, 12, 13}, ids)
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
	testenv.WaitFor(t, 30*time.Second, "lookup "+want, func() bool { return lookup() == want })

	// SIGHUP reloads the file; the consumer and its index stay.
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the reload", func() bool { return field(logs, "reloaded", "config") == path })
	if got := lookup(); got != want {
		t.Fatalf("after reload: %s", got)
	}
	metric := func(name string) string {
		resp, err := http.Get("http://" + admin + "/metrics")
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, name+" ") {
				return strings.TrimPrefix(l, name+" ")
			}
		}
		return "absent"
	}
	if ok, last := metric(`kvrouter_config_reloads_total{result="ok"}`), metric("kvrouter_config_last_reload_successful"); ok != "1" || last != "1" {
		t.Fatalf("after a reload: reloads ok %s, last successful %s; want 1 and 1", ok, last)
	}
	// A file that no longer parses: the reload fails, the running
	// configuration stays, and an alert can see it.
	if err := os.WriteFile(path, []byte("pools: [\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the failed reload counted", func() bool {
		return metric(`kvrouter_config_reloads_total{result="failed"}`) == "1" && metric("kvrouter_config_last_reload_successful") == "0"
	})
	if got := lookup(); got != want {
		t.Fatalf("after a failed reload: %s", got)
	}
}

// grpcConn dials the router's gRPC listener (creds nil = plaintext).
func grpcConn(t *testing.T, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func bearer(ctx context.Context, tok string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
}

// TestRunGRPC runs the kvrouter command with grpc.listen: health, Pick,
// Lookup and Watch (admin token from the environment, events from the
// router's embedded NATS) and the ext_proc picker (with the file's
// ext_proc settings) answer on it, and shutdown ends an open Watch.
func TestRunGRPC(t *testing.T) {
	doc := embeddedDoc(t) + `  - name: q
    model: m2
    health: {disable: true}
    discovery: {disable: true}
    instances: [{id: vllm-q, url: "http://127.0.0.1:2"}]
grpc:
  listen: "127.0.0.1:0"
  ext_proc: {pool_header: X-Team-Pool, max_body_bytes: 2048}
`
	const tok = "grpc-admin-token"
	logs, _, stop := startRun(t, doc, map[string]string{"KVROUTER_ADMIN_TOKEN": tok})
	natsURL := logged(t, logs, "consuming KV events", "nats_url")
	addr := logged(t, logs, "kvrouter listening", "grpc_listen")
	conn := grpcConn(t, addr, nil)
	ctx := ctxT(t)

	for _, svc := range []string{"", "readiness", "kvrouter.v1.Router", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q: %v %v, want SERVING", svc, resp.GetStatus(), err)
		}
	}

	// A watcher before the engine publishes; the unauthenticated one is refused.
	events := kvrouterv1.NewEventsClient(conn)
	if st, err := events.Watch(ctx, &kvrouterv1.WatchRequest{Pool: "p"}); err == nil {
		if _, err = st.Recv(); status.Code(err) != codes.Unauthenticated {
			t.Errorf("Watch without token: %v, want Unauthenticated", err)
		}
	}
	// Stored blocks only: the bridge starts with a synthetic resync clear.
	watch, err := events.Watch(bearer(ctx, tok), &kvrouterv1.WatchRequest{Pool: "p", Kinds: []kvrouterv1.EventKind{kvrouterv1.EventKind_EVENT_KIND_BLOCK_STORED}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Header(); err != nil { // the subscription is live
		t.Fatal(err)
	}

	pub := engine(t, natsURL, "p", "m", "vllm-0")
	ids := tokenIDs(3 * 16)
	storeBlocks(t, pub, []uint64{11, 12, 13}, ids)
	ev, err := watch.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if ev.GetInstance() != "vllm-0" || ev.GetKind() != kvrouterv1.EventKind_EVENT_KIND_BLOCK_STORED || ev.GetTier() != kvrouterv1.Tier_TIER_GPU || len(ev.GetBlockHashes()) != 3 {
		t.Fatalf("watched %v, want vllm-0's GPU BlockStored of 3 blocks", ev)
	}

	index := kvrouterv1.NewIndexClient(conn)
	if _, err := index.Lookup(ctx, &kvrouterv1.LookupRequest{Pool: "p", TokenIds: ids}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("Lookup without token: %v, want Unauthenticated", err)
	}
	if _, err := index.Lookup(bearer(ctx, "wrong"), &kvrouterv1.LookupRequest{Pool: "p", TokenIds: ids}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("Lookup with a wrong token: %v, want Unauthenticated", err)
	}
	lookup := func() string {
		resp, err := index.Lookup(bearer(ctx, tok), &kvrouterv1.LookupRequest{Pool: "p", TokenIds: ids})
		if err != nil {
			return err.Error()
		}
		var ms []string
		for _, m := range resp.GetMatches() {
			ms = append(ms, fmt.Sprintf("%s gpu=%d", m.GetInstance(), m.GetBlocks().GetGpu()))
		}
		return fmt.Sprintf("%d %v", resp.GetBlockSize(), ms)
	}
	want := "16 [vllm-0 gpu=3]"
	testenv.WaitFor(t, 30*time.Second, "Lookup "+want, func() bool { return lookup() == want })

	// Pick is open (no token_for_pick) and sees the same index, once the
	// router counts the stream healthy: on a loaded machine a consume
	// error or lag at start keeps kv_aware on stream_down for a while
	// (events/consumer Healthy), which the lookup does not check (one CI
	// run picked stream_down with the blocks already visible).
	var pick *kvrouterv1.PickResponse
	testenv.WaitFor(t, 30*time.Second, "Pick with the stream healthy", func() bool {
		var err error
		if pick, err = kvrouterv1.NewRouterClient(conn).Pick(ctx, &kvrouterv1.PickRequest{Model: "m", TokenIds: ids}); err != nil {
			t.Fatal(err)
		}
		return pick.GetReason() != "stream_down"
	})
	if pick.GetPool() != "p" || pick.GetInstance() != "vllm-0" || pick.GetAddress() != "127.0.0.1:1" || pick.GetStrategy() != "kv_aware" || pick.GetMatchedTokens().GetGpu() != 32 {
		// Three blocks held, the last recomputed (vLLM reuses at most (T − 1)/16 blocks).
		t.Errorf("Pick: %v, want vllm-0 by kv_aware with 32 GPU tokens matched", pick)
	}

	tests := []struct {
		name   string
		path   string
		header []string
		body   []byte
		dest   string // routed to, or
		status int32  // the immediate response
	}{
		{"by model", "/v1/completions", nil, completions("m2", "hello"), "127.0.0.1:2", 0},
		{"raw, configured pool header", "/invocations", []string{"x-team-pool", "q"}, []byte("hello"), "127.0.0.1:2", 0},
		{"raw, default header not configured", "/invocations", []string{"x-kvrouter-pool", "q"}, []byte("hello"), "127.0.0.1:1", 0},
		{"configured body limit", "/v1/completions", nil, completions("m", strings.Repeat("x", 4096)), "", 413},
	}
	for _, tc := range tests {
		t.Run("ext_proc "+tc.name, func(t *testing.T) {
			dest, code := extProc(t, conn, tc.path, tc.header, tc.body)
			if dest != tc.dest || code != tc.status {
				t.Errorf("got %q / %d, want %q / %d", dest, code, tc.dest, tc.status)
			}
		})
	}

	// Shutdown ends the open Watch cleanly instead of waiting out the drain.
	t0 := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if d := time.Since(t0); d > 4*time.Second {
		t.Errorf("shutdown with an open Watch took %v", d)
	}
	if _, err := watch.Recv(); err != io.EOF {
		t.Errorf("Watch after shutdown: %v, want a clean end of stream", err)
	}
}

func completions(model, prompt string) []byte {
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt})
	return b
}

// extProc plays Envoy's side of one ext_proc exchange (request headers, then
// the buffered body) and returns the picked endpoint, or the status of the
// immediate response.
func extProc(t *testing.T, conn *grpc.ClientConn, path string, header []string, body []byte) (dest string, code int32) {
	t.Helper()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	defer st.CloseSend()
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte(path)},
		{Key: "content-type", RawValue: []byte("application/json")}}}
	for i := 0; i+1 < len(header); i += 2 {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: header[i], RawValue: []byte(header[i+1])})
	}
	for _, req := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hm}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}},
	} {
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
		resp, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if imm := resp.GetImmediateResponse(); imm != nil {
			return "", int32(imm.GetStatus().GetCode())
		}
		for _, h := range resp.GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
				dest = string(h.GetHeader().GetRawValue())
			}
		}
	}
	return dest, 0
}

// TestRunGRPCTLS: with tls:, the gRPC listener serves the HTTP listeners'
// certificate (their config offers only http/1.1 in ALPN; gRPC needs h2),
// refuses plaintext, and token_for_pick guards Pick.
func TestRunGRPCTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, roots := testenv.SelfSigned(t, dir)
	doc := fmt.Sprintf(`
listen: "127.0.0.1:0"
tls: {cert_file: %q, key_file: %q}
grpc: {listen: "127.0.0.1:0", token_for_pick: true}
events: {enabled: false}
pools:
  - name: p
    model: m
    health: {disable: true}
    discovery: {disable: true}
    instances: [{id: vllm-0, url: "http://127.0.0.1:1"}]
`, certFile, keyFile)
	const tok = "tls-token"
	logs, _, _ := startRun(t, doc, map[string]string{"KVROUTER_ADMIN_TOKEN": tok})
	addr := logged(t, logs, "kvrouter listening", "grpc_listen")
	ctx := ctxT(t)
	tlsConn := grpcConn(t, addr, credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}))
	plainConn := grpcConn(t, addr, nil)
	tests := []struct {
		name string
		conn *grpc.ClientConn
		ctx  context.Context
		want codes.Code
	}{
		{"tls with token", tlsConn, bearer(ctx, tok), codes.OK},
		{"tls without token (token_for_pick)", tlsConn, ctx, codes.Unauthenticated},
		{"plaintext", plainConn, bearer(ctx, tok), codes.Unavailable},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := kvrouterv1.NewRouterClient(tc.conn).Pick(tc.ctx, &kvrouterv1.PickRequest{Model: "m", Prompt: "hello"})
			if status.Code(err) != tc.want {
				t.Fatalf("Pick: %v, want %v", err, tc.want)
			}
			if err == nil && resp.GetInstance() != "vllm-0" {
				t.Errorf("Pick: %v", resp)
			}
		})
	}
	if resp, err := healthpb.NewHealthClient(tlsConn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health over TLS: %v %v", resp.GetStatus(), err)
	}
	// Events are off: Watch has no NATS connection.
	st, err := kvrouterv1.NewEventsClient(tlsConn).Watch(bearer(ctx, tok), &kvrouterv1.WatchRequest{Pool: "p"})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Watch without KV events: %v, want Unavailable", err)
	}
}

// TestGRPCConfig: the grpc: section and --grpc-listen, validated with
// errors naming the field.
func TestGRPCConfig(t *testing.T) {
	const pools = `
pools: [{name: p, model: m, instances: [{id: a, url: "http://127.0.0.1:1"}]}]
`
	tests := []struct {
		name    string
		grpc    string
		args    []string
		token   string
		listen  string // the resulting grpc.listen, or
		wantErr string // a validation error
		extProc config.GRPCExtProcConfig
	}{
		{"absent: off", "", nil, "", "", "", config.GRPCExtProcConfig{}},
		{"file", `grpc: {listen: ":9090", ext_proc: {pool_header: X-Pool, shed: true, max_queued: 8, max_body_bytes: 4096}}`, nil, "", ":9090", "",
			config.GRPCExtProcConfig{PoolHeader: "X-Pool", Shed: true, MaxQueued: 8, MaxBodyBytes: 4096}},
		{"flag wins", `grpc: {listen: ":9090"}`, []string{"--grpc-listen", "127.0.0.1:9191"}, "", "127.0.0.1:9191", "", config.GRPCExtProcConfig{}},
		{"flag alone", "", []string{"--grpc-listen", ":9090"}, "", ":9090", "", config.GRPCExtProcConfig{}},
		{"token_for_pick with token", `grpc: {listen: ":9090", token_for_pick: true}`, nil, "tok", ":9090", "", config.GRPCExtProcConfig{}},
		{"bad listen", "", []string{"--grpc-listen", "9090"}, "", "", "grpc.listen", config.GRPCExtProcConfig{}},
		{"token_for_pick without token", `grpc: {listen: ":9090", token_for_pick: true}`, nil, "", "", "grpc.token_for_pick", config.GRPCExtProcConfig{}},
		{"bad pool header", `grpc: {ext_proc: {pool_header: "x pool"}}`, nil, "", "", "grpc.ext_proc.pool_header", config.GRPCExtProcConfig{}},
		{"pseudo-header", `grpc: {ext_proc: {pool_header: ":path"}}`, nil, "", "", "grpc.ext_proc.pool_header", config.GRPCExtProcConfig{}},
		{"negative max_queued", `grpc: {ext_proc: {max_queued: -1}}`, nil, "", "", "grpc.ext_proc.max_queued", config.GRPCExtProcConfig{}},
		{"tiny body limit", `grpc: {ext_proc: {max_body_bytes: 100}}`, nil, "", "", "grpc.ext_proc.max_body_bytes", config.GRPCExtProcConfig{}},
		{"unknown field", `grpc: {listen: ":9090", tokn_for_pick: true}`, nil, "", "", "tokn_for_pick", config.GRPCExtProcConfig{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "r.yaml")
			if err := os.WriteFile(path, []byte(tc.grpc+pools), 0o600); err != nil {
				t.Fatal(err)
			}
			f, err := parseFlags(append([]string{"--config", path}, tc.args...), io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := loadConfig(f, func(k string) string {
				if k == "KVROUTER_ADMIN_TOKEN" {
					return tc.token
				}
				return ""
			})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.GRPC.Listen != tc.listen || cfg.GRPC.ExtProc != tc.extProc {
				t.Errorf("grpc %+v, want listen %q, ext_proc %+v", cfg.GRPC, tc.listen, tc.extProc)
			}
		})
	}
}

// TestHelp: --help explains the command (what it does, an example, the
// environment and signals), not only the flags, and is not an error.
func TestHelp(t *testing.T) {
	var out strings.Builder
	_, err := parseFlags([]string{"--help"}, &out)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v, want flag.ErrHelp", err)
	}
	for _, want := range []string{"usage: kvrouter --config router.yaml", "--check-config", "-strategy string", "KVROUTER_ADMIN_TOKEN", "SIGHUP", "docs/configuration.md"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help lacks %q:\n%s", want, out.String())
		}
	}
}

// TestRunTelemetry: the admin listener's /metrics has the Go runtime and
// process series, and the pprof endpoints answer only with the admin
// token (the scheme in any case, RFC 7235).
func TestRunTelemetry(t *testing.T) {
	doc := `
listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
pools:
  - name: p
    model: m
    health: {disable: true}
    discovery: {disable: true}
    instances: [{id: vllm-0, url: "http://127.0.0.1:1"}]
`
	logs, _, _ := startRun(t, doc, map[string]string{"KVROUTER_ADMIN_TOKEN": "tok"})
	admin := logged(t, logs, "kvrouter listening", "admin_listen")
	get := func(path, auth string) (int, string) {
		var hdr map[string]string
		if auth != "" {
			hdr = map[string]string{"Authorization": auth}
		}
		r := testenv.Do(t, http.MethodGet, "http://"+admin+path, nil, hdr)
		return r.Status, string(r.Body)
	}
	_, metrics := get("/metrics", "")
	for _, series := range []string{"go_goroutines ", "go_memstats_heap_inuse_bytes ", "process_resident_memory_bytes ", "process_open_fds "} {
		if !strings.Contains(metrics, "\n"+series) {
			t.Errorf("/metrics lacks %s", series)
		}
	}
	if code, _ := get("/debug/pprof/", ""); code != http.StatusUnauthorized {
		t.Errorf("pprof without the token: %d, want 401", code)
	}
	if code, _ := get("/debug/pprof/goroutine?debug=1", "Bearer wrong"); code != http.StatusUnauthorized {
		t.Errorf("pprof with a wrong token: %d, want 401", code)
	}
	for _, auth := range []string{"Bearer tok", "bearer tok", "BEARER  tok"} {
		code, body := get("/debug/pprof/goroutine?debug=1", auth)
		if code != http.StatusOK || !strings.Contains(body, "goroutine profile:") {
			t.Errorf("pprof with %q: %d %.80s", auth, code, body)
		}
	}
	if code, body := get("/debug/pprof/heap?debug=1", "Bearer tok"); code != http.StatusOK || !strings.Contains(body, "heap profile:") {
		t.Errorf("heap profile: %d %.80s", code, body)
	}
}

// TestRunTracing runs the kvrouter command with tracing: on, exporting over
// OTLP/HTTP to a real receiver: a chat request's spans reach it with the
// file's service name, flushed at shutdown (well before the batch
// processor's 5 s schedule), and the engine got the trace's traceparent.
// With OTEL_SDK_DISABLED=true the same file traces nothing.
func TestRunTracing(t *testing.T) {
	for _, disabled := range []bool{false, true} {
		t.Run(fmt.Sprintf("sdk_disabled=%v", disabled), func(t *testing.T) { runTracing(t, disabled) })
	}
}

func runTracing(t *testing.T, disabled bool) {
	coll := &otlptest.Collector{}
	cts := otlptest.StartHTTP(t, coll, false)
	var mu sync.Mutex
	var parents []string
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		parents = append(parents, r.Header.Get("traceparent"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","object":"chat.completion","choices":[]}`)
	}))
	defer eng.Close()
	doc := fmt.Sprintf(`
listen: "127.0.0.1:0"
tracing:
  enabled: true
  service_name: kvrouter-test
  exporter: {protocol: http/protobuf, endpoint: %q}
pools:
  - name: p
    model: m
    health: {disable: true}
    discovery: {disable: true}
    instances: [{id: vllm-0, url: %q}]
`, cts.URL, eng.URL)
	env := map[string]string{}
	if disabled {
		env["OTEL_SDK_DISABLED"] = "true"
	}
	logs, _, stop := startRun(t, doc, env)
	listen := logged(t, logs, "kvrouter listening", "listen")
	resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if disabled {
		if spans := coll.Spans(); len(spans) != 0 || len(parents) != 1 || parents[0] != "" {
			t.Errorf("OTEL_SDK_DISABLED: %d spans exported, engine traceparents %q", len(spans), parents)
		}
		if field(logs, "tracing: enabled in the file but OTEL_SDK_DISABLED=true: off", "level") == "" {
			t.Error("OTEL_SDK_DISABLED not logged")
		}
		return
	}
	byName := map[string]otlptest.Span{}
	for _, s := range coll.Spans() {
		byName[s.Name] = s
	}
	srv, ok := byName["POST /v1/chat/completions"]
	proxy, ok2 := byName[httpapi.SpanProxy]
	if !ok || !ok2 || srv.Service != "kvrouter-test" {
		t.Fatalf("collector got %v, want the request's server and proxy spans of service kvrouter-test", byName)
	}
	want := fmt.Sprintf("00-%x-%x-01", proxy.TraceId, proxy.SpanId)
	if len(parents) != 1 || parents[0] != want {
		t.Errorf("engine traceparent %q, want %q", parents, want)
	}
}
