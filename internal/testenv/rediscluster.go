package testenv

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a Redis Cluster of one test: three masters, each with
// one replica, all redis-server processes on free ports with their own
// directories, created with `redis-cli --cluster create` and killed at
// cleanup. Nodes time out after a second, so a killed master's replica is
// promoted within a few seconds.
type RedisCluster struct {
	// Nodes are the six servers, in the order given to redis-cli: the
	// first three start as masters.
	Nodes []*RedisServer
	t     testing.TB
}

// ClusterNodeTimeout is the test cluster's cluster-node-timeout: how long
// a node may be unreachable before it counts as failed and its replica
// takes over.
const ClusterNodeTimeout = time.Second

// StartRedisCluster starts and creates the cluster and waits until every
// node reports it healthy (all slots served, three replicas attached).
func StartRedisCluster(t testing.TB) *RedisCluster {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("testenv: no redis-server on PATH (run `make deps-test`): %v", err)
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		t.Fatalf("testenv: no redis-cli on PATH (run `make deps-test`): %v", err)
	}
	c := &RedisCluster{t: t}
	var addrs []string
	for range 6 {
		port := FreePort(t)
		// The cluster bus port defaults to port+10000, which may lie in
		// the kernel's ephemeral range: name a free one.
		bus := FreePort(t)
		s := &RedisServer{Addr: fmt.Sprintf("127.0.0.1:%d", port), t: t, bin: bin, port: port, dir: t.TempDir(),
			args: []string{"--cluster-enabled", "yes", "--cluster-port", fmt.Sprint(bus),
				"--cluster-config-file", "nodes.conf", "--cluster-node-timeout", fmt.Sprint(ClusterNodeTimeout.Milliseconds()),
				"--enable-debug-command", "local"}}
		s.Start()
		t.Cleanup(s.Kill)
		c.Nodes = append(c.Nodes, s)
		addrs = append(addrs, s.Addr)
	}
	args := append(append([]string{"--cluster", "create"}, addrs...), "--cluster-replicas", "1", "--cluster-yes")
	out, err := exec.Command(cli, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("testenv: redis-cli --cluster create: %v\n%s", err, out)
	}
	c.WaitHealthy(30 * time.Second)
	return c
}

// Addrs are every node's address: seeds for a cluster client.
func (c *RedisCluster) Addrs() []string {
	out := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		out[i] = n.Addr
	}
	return out
}

// Role is a node's view of itself: "master", "slave", or "" when it does
// not answer.
func (c *RedisCluster) Role(n *RedisServer) string {
	cl := redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond, DialerRetries: 1})
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	v, err := cl.Do(ctx, "role").Slice()
	if err != nil || len(v) == 0 {
		return ""
	}
	s, _ := v[0].(string)
	return s
}

// Masters are the nodes that are masters now.
func (c *RedisCluster) Masters() []*RedisServer {
	var out []*RedisServer
	for _, n := range c.Nodes {
		if c.Role(n) == "master" {
			out = append(out, n)
		}
	}
	return out
}

// WaitHealthy waits until every running node says cluster_state:ok, knows
// all six nodes, and three masters each have a replica online, and every
// node answers the same slot map (CLUSTER SLOTS: each range's master). A
// failover is announced by gossip, so for a round after it the nodes can
// disagree on who serves a range; a client asking any node (as kvindex's
// epoch does) would otherwise read either view.
func (c *RedisCluster) WaitHealthy(within time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(within)
	var why string
	for time.Now().Before(deadline) {
		if why = c.health(); why == "" {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.t.Fatalf("testenv: redis cluster not healthy within %v: %s", within, why)
}

// health returns "" when the cluster is healthy, else what is not.
func (c *RedisCluster) health() string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	masters := 0
	var view, viewOf string
	for _, n := range c.Nodes {
		n.mu.Lock()
		running := n.cmd != nil
		n.mu.Unlock()
		if !running {
			return n.Addr + " is not running"
		}
		cl := redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1, DialerRetries: 1})
		info, err := cl.ClusterInfo(ctx).Result()
		var repl string
		if err == nil {
			repl, err = cl.Info(ctx, "replication").Result()
		}
		var slots []redis.ClusterSlot
		if err == nil {
			slots, err = cl.ClusterSlots(ctx).Result()
		}
		_ = cl.Close()
		if err != nil {
			return fmt.Sprintf("%s: %v", n.Addr, err)
		}
		if !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_known_nodes:6") ||
			!strings.Contains(info, "cluster_slots_ok:16384") {
			return n.Addr + ": " + strings.Join(strings.Fields(info)[:6], " ")
		}
		v := slotView(slots)
		if viewOf == "" {
			view, viewOf = v, n.Addr
		} else if v != view {
			return fmt.Sprintf("%s and %s answer different slot maps", viewOf, n.Addr)
		}
		if strings.Contains(repl, "role:master") {
			masters++
			if !strings.Contains(repl, "connected_slaves:1") {
				return n.Addr + ": a master without its replica"
			}
		} else if !strings.Contains(repl, "master_link_status:up") {
			return n.Addr + ": a replica not linked to its master"
		}
	}
	if masters != 3 {
		return fmt.Sprintf("%d masters", masters)
	}
	return ""
}

// slotView is a slot map as one string: each range and its master's id,
// sorted.
func slotView(slots []redis.ClusterSlot) string {
	ranges := make([]string, 0, len(slots))
	for _, s := range slots {
		if len(s.Nodes) > 0 {
			ranges = append(ranges, fmt.Sprintf("%d-%d:%s", s.Start, s.End, s.Nodes[0].ID))
		}
	}
	slices.Sort(ranges)
	return strings.Join(ranges, ",")
}

// Save has the server write its RDB (SAVE), which a restart loads. A
// Cluster master may be running a background save for a replica's full
// sync (diskless or not, a child process is running), and refuses SAVE
// until it ends: Save waits for it, up to a minute.
func (s *RedisServer) Save() {
	s.t.Helper()
	cl := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer cl.Close()
	deadline := time.Now().Add(time.Minute)
	for {
		err := cl.Save(context.Background()).Err()
		if err == nil {
			return
		}
		if !strings.Contains(err.Error(), "save already in progress") || time.Now().After(deadline) {
			s.t.Fatalf("testenv: SAVE on %s: %v", s.Addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
