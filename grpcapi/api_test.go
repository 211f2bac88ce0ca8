package grpcapi_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tokenizer"
)

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestPick asks Router.Pick for decisions: the kv_aware pool follows the
// index (instance, address, matched tokens, reason), and bad requests get
// the right status codes.
func TestPick(t *testing.T) {
	h := newHarness(t)
	p := prompt(1, 10*bs+5)
	h.store("kv-2", p[:6*bs])

	tests := []struct {
		name       string
		req        *kvrouterv1.PickRequest
		code       codes.Code
		instance   string
		reason     string
		matchedGPU int64
	}{
		{name: "kv match by token ids", req: &kvrouterv1.PickRequest{Pool: "kv", TokenIds: p},
			instance: "kv-2", reason: string(router.ReasonKVMatch), matchedGPU: 6 * bs},
		// The pick above left speculative holds (kv-2 is about to compute
		// blocks 6..9): the same prompt now matches all ten full blocks.
		{name: "pool by model, speculative holds", req: &kvrouterv1.PickRequest{Model: kvModel, TokenIds: p},
			instance: "kv-2", reason: string(router.ReasonKVMatch), matchedGPU: 10 * bs},
		{name: "unknown prefix routes heuristically", req: &kvrouterv1.PickRequest{Pool: "kv", TokenIds: prompt(99, 4*bs)},
			reason: string(router.ReasonHeuristic)},
		{name: "prompt text on a hash pool", req: &kvrouterv1.PickRequest{Pool: "hash", Prompt: "hello world"},
			reason: string(router.ReasonHash)},
		{name: "unknown pool", req: &kvrouterv1.PickRequest{Pool: "nope", Prompt: "x"}, code: codes.NotFound},
		{name: "unknown model", req: &kvrouterv1.PickRequest{Model: "nope", Prompt: "x"}, code: codes.NotFound},
		{name: "unknown adapter", req: &kvrouterv1.PickRequest{Pool: "kv", Adapter: "nope", Prompt: "x"}, code: codes.NotFound},
		{name: "no prompt", req: &kvrouterv1.PickRequest{Pool: "kv"}, code: codes.InvalidArgument},
		{name: "prompt and tokens", req: &kvrouterv1.PickRequest{Pool: "kv", Prompt: "x", TokenIds: p}, code: codes.InvalidArgument},
		// Over limits.max_tokenize_bytes: not tokenized, routed by the
		// heuristic, as the HTTP data plane routes the same body.
		{name: "prompt over the tokenize limit", req: &kvrouterv1.PickRequest{Pool: "kv", Prompt: strings.Repeat("x", config.MaxTokenizeBytes+1)}, reason: "heuristic"},
		{name: "bad tenant", req: &kvrouterv1.PickRequest{Pool: "kv", Prompt: "x", Tenant: "\x01bad"}, code: codes.InvalidArgument},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := h.router().Pick(ctxT(t), tc.req)
			if status.Code(err) != tc.code {
				t.Fatalf("code %v (%v), want %v", status.Code(err), err, tc.code)
			}
			if tc.code != codes.OK {
				return
			}
			if tc.instance != "" && got.Instance != tc.instance {
				t.Errorf("instance %q, want %q", got.Instance, tc.instance)
			}
			if got.Reason != tc.reason {
				t.Errorf("reason %q, want %q", got.Reason, tc.reason)
			}
			if want := h.upAddr(got.Instance); got.Address != want {
				t.Errorf("address %q, want %q", got.Address, want)
			}
			if got.Url != h.ups[got.Instance].URL() {
				t.Errorf("url %q, want %q", got.Url, h.ups[got.Instance].URL())
			}
			if tc.matchedGPU > 0 {
				if !got.HasExplanation || got.MatchedTokens.GetGpu() != tc.matchedGPU || got.PromptTokens != int64(len(p)) {
					t.Errorf("explanation %v matched %v prompt %d, want gpu %d of %d", got.HasExplanation, got.MatchedTokens, got.PromptTokens, tc.matchedGPU, len(p))
				}
				if got.PredictedTtftMs <= 0 {
					t.Errorf("predicted ttft %v, want > 0", got.PredictedTtftMs)
				}
			}
		})
	}
	// Pick is advisory: it leaves no request in flight.
	for id := range h.ups {
		pool := id[:len(id)-2]
		if n := h.instance(pool, id).InFlight(); n != 0 {
			t.Errorf("%s: %d in flight after picks", id, n)
		}
	}
}

// TestPickNoCandidates: a pool with no healthy instance answers Unavailable.
func TestPickNoCandidates(t *testing.T) {
	h := newHarness(t)
	p, _ := h.srv.Pool("hash")
	for _, in := range p.Instances() {
		in.SetHealthy(false)
	}
	_, err := h.router().Pick(ctxT(t), &kvrouterv1.PickRequest{Pool: "hash", Prompt: "x"})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("got %v, want Unavailable", err)
	}
}

// TestPickAgreesWithHTTP: for the same completions request, Router.Pick
// names the instance the HTTP data plane routes to (prefix_aware), with
// and without a tenant.
func TestPickAgreesWithHTTP(t *testing.T) {
	h := newHarness(t)
	ts := httptest.NewServer(h.srv.Handler())
	t.Cleanup(ts.Close)
	spread := map[string]bool{}
	for i := range 24 {
		text := fmt.Sprintf("system prompt %d: you are a helpful assistant. %s", i, bytes.Repeat([]byte("x"), i))
		tenant := ""
		if i%3 == 0 {
			tenant = fmt.Sprintf("tenant-%d", i)
		}
		got, err := h.router().Pick(ctxT(t), &kvrouterv1.PickRequest{Model: hashModel, Prompt: text, Tenant: tenant})
		if err != nil {
			t.Fatal(err)
		}
		body, _ := json.Marshal(map[string]any{"model": hashModel, "prompt": text})
		req, _ := http.NewRequest(http.MethodPost, ts.URL+"/v1/completions", bytes.NewReader(body))
		if tenant != "" {
			req.Header.Set(router.TenantHeader, tenant)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("HTTP status %d", resp.StatusCode)
		}
		if want := resp.Header.Get(router.HeaderInstance); got.Instance != want {
			t.Errorf("prompt %d: gRPC picked %s, HTTP routed to %s", i, got.Instance, want)
		}
		spread[got.Instance] = true
	}
	if len(spread) < 2 {
		t.Errorf("24 prompts all went to %v: the test cannot tell instances apart", spread)
	}
}

// TestLookup reads the index through Index.Lookup: per instance, per tier,
// from token ids or from prompt text tokenized by the pool's tokenizer.
func TestLookup(t *testing.T) {
	h := newHarness(t)
	p := prompt(7, 8*bs+3)
	h.store("kv-0", p[:8*bs])
	keys := h.store("kv-1", p[:4*bs])
	// kv-1 offloads its 4 blocks to CPU, then loses the last 2 from GPU.
	cpu := events.Event{Kind: events.BlockStored, Medium: "CPU"}
	for _, k := range keys {
		cpu.BlockHashes = append(cpu.BlockHashes, engineHash("kv-1", k))
	}
	gone := events.Event{Kind: events.BlockRemoved, Medium: "GPU", BlockHashes: cpu.BlockHashes[2:]}
	h.apply("kv-1", cpu, gone)

	text := "the quick brown fox jumps over the lazy dog, again and again, " + string(bytes.Repeat([]byte("and again "), 20))
	textIDs, err := tokenizer.Simple{}.Encode(text)
	if err != nil {
		t.Fatal(err)
	}
	h.store("kv-2", textIDs)

	tc := func(g, c, d, s int64) *kvrouterv1.TierCounts {
		return &kvrouterv1.TierCounts{Gpu: g, Cpu: c, Disk: d, Shared: s}
	}
	type match struct {
		inst           string
		blocks, tokens *kvrouterv1.TierCounts
	}
	tests := []struct {
		name   string
		req    *kvrouterv1.LookupRequest
		code   codes.Code
		blocks int64
		want   []match
	}{
		{name: "token ids", req: &kvrouterv1.LookupRequest{Pool: "kv", TokenIds: p}, blocks: 8, want: []match{
			{"kv-0", tc(8, 0, 0, 0), tc(8*bs, 0, 0, 0)},
			{"kv-1", tc(2, 2, 0, 0), tc(2*bs, 2*bs, 0, 0)},
		}},
		{name: "prompt text", req: &kvrouterv1.LookupRequest{Pool: "kv", Prompt: text}, blocks: int64(len(textIDs) / bs), want: []match{
			{"kv-2", tc(int64(len(textIDs)/bs), 0, 0, 0), tc(int64(len(textIDs)/bs*bs), 0, 0, 0)},
		}},
		{name: "other adapter holds nothing", req: &kvrouterv1.LookupRequest{Pool: "kv", TokenIds: p, Adapter: "kv-lora"}, blocks: 8},
		{name: "adapter the pool does not serve", req: &kvrouterv1.LookupRequest{Pool: "kv", TokenIds: p, Adapter: "lora-x"}, code: codes.NotFound},
		{name: "other cache salt holds nothing", req: &kvrouterv1.LookupRequest{Pool: "kv", TokenIds: p, CacheSalt: "s"}, blocks: 8},
		{name: "pool without index", req: &kvrouterv1.LookupRequest{Pool: "hash", TokenIds: p}, code: codes.FailedPrecondition},
		{name: "unknown pool", req: &kvrouterv1.LookupRequest{Pool: "nope", TokenIds: p}, code: codes.NotFound},
		{name: "no prompt", req: &kvrouterv1.LookupRequest{Pool: "kv"}, code: codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := h.index().Lookup(ctxT(t), tt.req)
			if status.Code(err) != tt.code {
				t.Fatalf("code %v (%v), want %v", status.Code(err), err, tt.code)
			}
			if tt.code != codes.OK {
				return
			}
			if got.BlockSize != bs || got.Blocks != tt.blocks {
				t.Errorf("block size %d blocks %d, want %d %d", got.BlockSize, got.Blocks, bs, tt.blocks)
			}
			var ms []match
			for _, m := range got.Matches {
				ms = append(ms, match{m.Instance, m.Blocks, m.Tokens})
			}
			if len(ms) != len(tt.want) {
				t.Fatalf("matches %v, want %v", ms, tt.want)
			}
			for i := range ms {
				w := tt.want[i]
				if ms[i].inst != w.inst || ms[i].blocks.String() != w.blocks.String() || ms[i].tokens.String() != w.tokens.String() {
					t.Errorf("match %d: %s blocks {%v} tokens {%v}, want %s {%v} {%v}", i, ms[i].inst, ms[i].blocks, ms[i].tokens, w.inst, w.blocks, w.tokens)
				}
			}
		})
	}
}

// TestAuth: with an admin token, Index and Events need it, Pick does not
// (unless TokenForPick), health and reflection never do.
func TestAuth(t *testing.T) {
	const token = "s3cret-token"
	for _, forPick := range []bool{false, true} {
		t.Run(fmt.Sprintf("token_for_pick=%v", forPick), func(t *testing.T) {
			h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.AdminToken, g.TokenForPick = token, forPick })
			with := func(tok string) context.Context {
				ctx := ctxT(t)
				if tok == "" {
					return ctx
				}
				return metadata.AppendToOutgoingContext(ctx, "authorization", tok)
			}
			lookup := func(ctx context.Context) error {
				_, err := h.index().Lookup(ctx, &kvrouterv1.LookupRequest{Pool: "kv", TokenIds: prompt(1, 32)})
				return err
			}
			pick := func(ctx context.Context) error {
				_, err := h.router().Pick(ctx, &kvrouterv1.PickRequest{Pool: "hash", Prompt: "x"})
				return err
			}
			watch := func(ctx context.Context) error {
				st, err := kvrouterv1.NewEventsClient(h.conn).Watch(ctx, &kvrouterv1.WatchRequest{Pool: "kv"})
				if err != nil {
					return err
				}
				_, err = st.Recv()
				return err
			}
			health := func(ctx context.Context) error {
				_, err := healthpb.NewHealthClient(h.conn).Check(ctx, &healthpb.HealthCheckRequest{})
				return err
			}
			pickNeeds := codes.OK
			if forPick {
				pickNeeds = codes.Unauthenticated
			}
			tests := []struct {
				name string
				call func(context.Context) error
				tok  string
				want codes.Code
			}{
				{"lookup without token", lookup, "", codes.Unauthenticated},
				{"lookup wrong token", lookup, "Bearer wrong", codes.Unauthenticated},
				{"lookup token without scheme", lookup, token, codes.Unauthenticated},
				{"lookup basic scheme", lookup, "Basic " + token, codes.Unauthenticated},
				{"lookup with token", lookup, "Bearer " + token, codes.OK},
				{"lookup lower-case scheme", lookup, "bearer " + token, codes.OK},
				// No NATS in this harness: past auth, Watch is Unavailable.
				{"watch without token", watch, "", codes.Unauthenticated},
				{"watch with token", watch, "Bearer " + token, codes.Unavailable},
				{"pick without token", pick, "", pickNeeds},
				{"pick with token", pick, "Bearer " + token, codes.OK},
				{"health without token", health, "", codes.OK},
			}
			for _, tc := range tests {
				if got := status.Code(tc.call(with(tc.tok))); got != tc.want {
					t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
				}
			}
		})
	}
}

// TestHealthAndReflection: standard tooling works: health answers per
// service, reflection lists every service.
func TestHealthAndReflection(t *testing.T) {
	h := newHarness(t)
	hc := healthpb.NewHealthClient(h.conn)
	for _, svc := range []string{"", "liveness", "readiness", "kvrouter.v1.Router", "kvrouter.v1.Index", "kvrouter.v1.Events", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		r, err := hc.Check(ctxT(t), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q: %v %v, want SERVING", svc, r.GetStatus(), err)
		}
	}
	// Every instance down: not ready, still alive.
	for _, p := range h.srv.Pools() {
		for _, in := range p.Instances() {
			in.SetHealthy(false)
		}
	}
	h.api.UpdateHealth()
	for svc, want := range map[string]healthpb.HealthCheckResponse_ServingStatus{
		"readiness": healthpb.HealthCheckResponse_NOT_SERVING,
		"liveness":  healthpb.HealthCheckResponse_SERVING,
	} {
		r, err := hc.Check(ctxT(t), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.Status != want {
			t.Errorf("health %q with no healthy instance: %v %v, want %v", svc, r.GetStatus(), err, want)
		}
	}

	rc, err := reflectpb.NewServerReflectionClient(h.conn).ServerReflectionInfo(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Send(&reflectpb.ServerReflectionRequest{MessageRequest: &reflectpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := rc.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.Name)
	}
	for _, want := range []string{"kvrouter.v1.Router", "kvrouter.v1.Index", "kvrouter.v1.Events", "envoy.service.ext_proc.v3.ExternalProcessor", "grpc.health.v1.Health"} {
		if !slices.Contains(names, want) {
			t.Errorf("reflection lists %v, missing %s", names, want)
		}
	}
	// And it can describe the API's messages.
	if err := rc.Send(&reflectpb.ServerReflectionRequest{MessageRequest: &reflectpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "kvrouter.v1.Router"}}); err != nil {
		t.Fatal(err)
	}
	if resp, err = rc.Recv(); err != nil || len(resp.GetFileDescriptorResponse().GetFileDescriptorProto()) == 0 {
		t.Errorf("file containing kvrouter.v1.Router: %v %v", resp, err)
	}
}

// TestTLS serves over TLS: a client trusting the certificate picks, a
// plaintext client fails.
func TestTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, pool := selfSigned(t, dir)
	cfg, err := grpcapi.LoadTLS(certFile, keyFile, "")
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.TLS = cfg })
	conn := h.dial(grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})))
	if _, err := kvrouterv1.NewRouterClient(conn).Pick(ctxT(t), &kvrouterv1.PickRequest{Pool: "hash", Prompt: "x"}); err != nil {
		t.Fatalf("TLS pick: %v", err)
	}
	plain := h.dial()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := kvrouterv1.NewRouterClient(plain).Pick(ctx, &kvrouterv1.PickRequest{Pool: "hash", Prompt: "x"}); status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("plaintext pick on a TLS listener: %v, want a transport failure", err)
	}
	if _, err := grpcapi.LoadTLS(filepath.Join(dir, "missing.pem"), keyFile, ""); err == nil {
		t.Error("LoadTLS of a missing file succeeded")
	}
}

// TestMutualTLS: with a client CA, only clients presenting a certificate
// it signed get through.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, pool := selfSigned(t, dir)
	cfg, err := grpcapi.LoadTLS(certFile, keyFile, certFile)
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(_ *config.Config, g *grpcapi.Config) { g.TLS = cfg })
	clientCert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	pick := func(certs []tls.Certificate) error {
		conn := h.dial(grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "127.0.0.1", Certificates: certs})))
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := kvrouterv1.NewRouterClient(conn).Pick(ctx, &kvrouterv1.PickRequest{Pool: "hash", Prompt: "x"})
		return err
	}
	if err := pick([]tls.Certificate{clientCert}); err != nil {
		t.Fatalf("client with a certificate: %v", err)
	}
	if err := pick(nil); err == nil {
		t.Fatal("client without a certificate got through")
	}
	if _, err := grpcapi.LoadTLS(certFile, keyFile, keyFile); err == nil {
		t.Error("LoadTLS accepted a key file as the client CA")
	}
}

// TestConfigValidation: bad configs fail with ErrInvalidConfig.
func TestConfigValidation(t *testing.T) {
	h := newHarness(t)
	for name, cfg := range map[string]grpcapi.Config{
		"negative watch buffer": {WatchBuffer: -1},
		"negative max queued":   {ExtProc: grpcapi.ExtProcConfig{MaxQueued: -1}},
		"pick token no token":   {TokenForPick: true},
		"negative message size": {MaxMessageBytes: -5},
		"negative drain":        {DrainTimeout: -time.Second},
	} {
		if _, err := grpcapi.New(h.srv, cfg); err == nil || !errors.Is(err, grpcapi.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
	if _, err := grpcapi.New(nil, grpcapi.Config{}); err == nil {
		t.Error("New without a router succeeded")
	}
}

func selfSigned(t *testing.T, dir string) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvrouter-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}
