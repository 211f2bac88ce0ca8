package kvindex

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/tiers"
)

// nodeTrips counts round trips per cluster node (a single command or a
// pipeline each), through a hook on every node's client, and checks each
// command as tripCounter does (one key, or one instance's hash tag).
type nodeTrips struct {
	t     testing.TB
	mu    sync.Mutex // guards trips
	trips map[string]int
	keys  *tripCounter
}

func (n *nodeTrips) hook(addr string) redis.Hook { return &nodeHook{n: n, addr: addr} }

type nodeHook struct {
	n    *nodeTrips
	addr string
}

func (h *nodeHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *nodeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !connSetup(cmd) && !clusterSetup(cmd) {
			h.n.keys.record(cmd)
			h.n.add(h.addr)
		}
		return next(ctx, cmd)
	}
}

func (h *nodeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && !connSetup(cmds[0]) {
			for _, c := range cmds {
				h.n.keys.record(c)
			}
			h.n.add(h.addr)
		}
		return next(ctx, cmds)
	}
}

// clusterSetup reports the commands go-redis' cluster client sends to
// learn the cluster (slots, command table): not the backend's.
func clusterSetup(c redis.Cmder) bool {
	switch c.Name() {
	case "cluster", "command", "readonly", "ping":
		return true
	}
	return false
}

func (n *nodeTrips) add(addr string) {
	n.mu.Lock()
	n.trips[addr]++
	n.mu.Unlock()
}

// take returns the most round trips any one node saw, and resets.
func (n *nodeTrips) take() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	most := 0
	for _, v := range n.trips {
		most = max(most, v)
	}
	clear(n.trips)
	return most
}

// The Redis index on a 3-master, 3-replica Redis Cluster through go-redis'
// ClusterClient: the contract suite and the property test pass (a command
// across slots would fail them with CROSSSLOT), every command names one
// key or one instance's keys, and a lookup takes at most two round trips
// per node (the client splits each pipeline by slot owner and sends the
// parts in parallel).
func TestRedisCluster(t *testing.T) {
	c := testenv.StartRedisCluster(t)
	counter := &nodeTrips{t: t, trips: map[string]int{}, keys: &tripCounter{t: t}}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(),
		NewClient: func(o *redis.Options) *redis.Client {
			cl := redis.NewClient(o)
			cl.AddHook(counter.hook(o.Addr))
			return cl
		}})
	t.Cleanup(func() { _ = client.Close() })
	factory := func(exact bool) factory {
		return func(t *testing.T, cfg factoryConfig) Index {
			r, err := NewRedis(client, RedisConfig{Prefix: testenv.UniqueName(t), Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now, ExactLookup: exact})
			if err != nil {
				t.Fatal(err)
			}
			return r
		}
	}
	t.Run("contract", func(t *testing.T) { testIndexContract(t, factory(true)) })
	t.Run("contract-default-lookup", func(t *testing.T) { testIndexContract(t, factory(false)) })
	t.Run("property", func(t *testing.T) { testIndexProperty(t, factory(true), 3, 250, 4) })
	t.Run("round-trips", func(t *testing.T) {
		r, err := NewRedis(client, RedisConfig{Prefix: testenv.UniqueName(t), Model: testModel})
		if err != nil {
			t.Fatal(err)
		}
		root := Root(testModel, "", "")
		ch := newChain(root, 512, 16, 11, 1)
		var want = map[string][tiers.Count]int{}
		for i := range 9 {
			inst := fmt.Sprintf("pod-%d", i)
			mustApply(t, r, inst, ch.stored(0, 512-i))
			want[inst] = all(512 - i)
		}
		counter.take()
		mustApply(t, r, "pod-0", ch.tierStored("CPU", 0, 512))
		if n := counter.take(); n != 1 {
			t.Fatalf("Apply took up to %d round trips per node, want 1", n)
		}
		mustApply(t, r, "pod-0", ch.removed("CPU", 0, 512))
		counter.take()
		checkLookup(t, r, query{ch.keys, want}, "9 holders")
		if n := counter.take(); n > 2 || n < 1 {
			t.Fatalf("lookup took up to %d round trips per node, want at most 2", n)
		}
		ctx := context.Background()
		if err := r.Purge(ctx, "pod-3"); err != nil {
			t.Fatal(err)
		}
		delete(want, "pod-3")
		checkLookup(t, r, query{ch.keys, want}, "after a purge")
		if n, err := r.Len(ctx); err != nil || n != 512*8-(1+2+4+5+6+7+8) {
			t.Fatalf("Len = %d, %v", n, err)
		}
		if gone, err := r.Sweep(ctx); err != nil || len(gone) != 0 {
			t.Fatalf("Sweep = %v, %v; nobody is silent", gone, err)
		}
	})
}
