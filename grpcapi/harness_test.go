package grpcapi_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	kvrouterv1 "github.com/kvrouter/kvrouter/api/kvrouter/v1"
	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/grpcapi"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/kvaware"
	"github.com/kvrouter/kvrouter/router/routertest"
)

// The HTTP data plane's server is what cmd/kvrouter gives the gRPC services.
var _ grpcapi.Pools = (*httpapi.Server)(nil)

const (
	kvModel   = "llama-grpc"
	hashModel = "qwen-grpc"
	bs        = 16
)

// harness is a real router (two pools over httptest upstreams: "kv" routes
// kv_aware over a memory index, "hash" routes prefix_aware) served over
// gRPC on a loopback listener.
type harness struct {
	t     testing.TB
	srv   *httpapi.Server
	idx   *kvindex.Memory
	ups   map[string]*routertest.Upstream // by instance id
	api   *grpcapi.Server
	conn  *grpc.ClientConn
	addr  string
	admin string
	// stop cancels Serve's context and waits for it to return.
	stop func() time.Duration
}

type harnessOpt func(*config.Config, *grpcapi.Config)

func newHarness(t testing.TB, opts ...harnessOpt) *harness {
	t.Helper()
	return newFreshHarness(t, nil, opts...)
}

// newFreshHarness is newHarness whose kv pool reads its index by fresh
// (nil: always fresh; a pool's replica sync comes in it, as
// router/kvstate's PeerFreshness).
func newFreshHarness(t testing.TB, fresh kvindex.Freshness, opts ...harnessOpt) *harness {
	t.Helper()
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvModel, BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, idx: idx, ups: map[string]*routertest.Upstream{}}
	pool := func(name, model string, strategy string, n int) config.PoolConfig {
		pc := config.PoolConfig{Name: name, Model: model, Routing: config.RoutingConfig{Strategy: strategy},
			Health: config.HealthConfig{Disable: true}, Discovery: config.DiscoveryConfig{Disable: true}}
		for i := range n {
			id := fmt.Sprintf("%s-%d", name, i)
			u := routertest.New(t, id, model)
			h.ups[id] = u
			pc.Instances = append(pc.Instances, config.InstanceConfig{ID: id, URL: u.URL()})
		}
		return pc
	}
	kv := pool("kv", kvModel, config.StrategyKVAware, 3)
	kv.Tokenizer = &config.TokenizerConfig{Source: kvaware.TokenSourceSimple}
	kv.Adapters = []string{"kv-lora"}
	rcfg := config.Config{Pools: []config.PoolConfig{kv, pool("hash", hashModel, config.StrategyPrefixAware, 4)}}
	gcfg := grpcapi.Config{Logger: slog.New(slog.DiscardHandler)}
	for _, o := range opts {
		o(&rcfg, &gcfg)
	}
	h.srv, err = httpapi.NewServer(rcfg, httpapi.Options{
		Logger: slog.New(slog.DiscardHandler),
		KV: kvaware.NewSource(func(p config.PoolConfig) (kvindex.Index, kvindex.Freshness) {
			if p.Name == "kv" {
				return idx, fresh
			}
			return nil, nil
		}),
	})
	if err != nil {
		t.Fatal(err)
	}
	h.admin = gcfg.AdminToken
	h.api, err = grpcapi.New(h.srv, gcfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.addr = lis.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.api.Serve(ctx, lis) }()
	var stopped bool
	h.stop = func() time.Duration {
		if stopped {
			return 0
		}
		stopped = true
		t0 := time.Now()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		return time.Since(t0)
	}
	t.Cleanup(func() { h.stop() })
	if gcfg.TLS == nil {
		h.conn = h.dial()
	}
	return h
}

func (h *harness) dial(opts ...grpc.DialOption) *grpc.ClientConn {
	h.t.Helper()
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	c, err := grpc.NewClient(h.addr, opts...)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = c.Close() })
	return c
}

func (h *harness) router() kvrouterv1.RouterClient { return kvrouterv1.NewRouterClient(h.conn) }
func (h *harness) index() kvrouterv1.IndexClient   { return kvrouterv1.NewIndexClient(h.conn) }

// addr is the host:port of an upstream, as Envoy would address it.
func (h *harness) upAddr(id string) string {
	u, err := url.Parse(h.ups[id].URL())
	if err != nil {
		h.t.Fatal(err)
	}
	return u.Host
}

func (h *harness) instance(pool, id string) *router.Instance {
	p, ok := h.srv.Pool(pool)
	if !ok {
		h.t.Fatalf("no pool %s", pool)
	}
	for _, in := range p.Instances() {
		if in.ID() == id {
			return in
		}
	}
	h.t.Fatalf("no instance %s", id)
	return nil
}

// engineHash is the fake engine's block hash for a router key.
func engineHash(inst string, k kvindex.Key) uint64 {
	return uint64(k) ^ 0x9e3779b9 ^ uint64(len(inst))<<48
}

// store tells the index that inst holds the full blocks of tokens on GPU.
func (h *harness) store(inst string, tokens []uint32) []kvindex.Key {
	h.t.Helper()
	return h.storeSalted(inst, "", tokens)
}

// storeSalted is store for the blocks of requests carrying cache_salt salt.
func (h *harness) storeSalted(inst, salt string, tokens []uint32) []kvindex.Key {
	h.t.Helper()
	keys := kvindex.Keys(kvindex.Root(kvModel, "", salt), tokens, bs)
	ev := events.Event{Kind: events.BlockStored, BlockSize: bs, Medium: "GPU", TokenIDs: tokens[:len(keys)*bs], CacheSalt: salt}
	for _, k := range keys {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(inst, k))
	}
	h.apply(inst, ev)
	return keys
}

func (h *harness) apply(inst string, evs ...events.Event) {
	h.t.Helper()
	if _, err := h.idx.Apply(context.Background(), inst, evs); err != nil {
		h.t.Fatal(err)
	}
}
