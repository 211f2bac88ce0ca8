package testenv

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSCluster is a JetStream cluster of embedded NATS servers for one
// test: each node has its own client port, cluster (route) port and store
// directory, and routes to every other node, as a 3-node StatefulSet does.
// Nodes can be killed and restarted on the same ports and store, so tests
// can take one away mid-load and bring it back.
type NATSCluster struct {
	Name string // the cluster name (server.ClusterOpts.Name)

	t     testing.TB
	mu    sync.Mutex // guards nodes[i].srv
	nodes []*clusterNode
}

type clusterNode struct {
	name        string
	port, route int
	dir         string
	srv         *server.Server // nil while killed
}

// StartNATSCluster starts n embedded NATS servers with JetStream, clustered
// with each other, and waits until JetStream has a meta leader (streams
// with up to n replicas can then be created). They are shut down at
// cleanup.
func StartNATSCluster(t testing.TB, n int) *NATSCluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("testenv: nats cluster of %d nodes", n)
	}
	c := &NATSCluster{Name: "c" + UniqueName(t)[1:], t: t}
	if len(c.Name) > 32 {
		c.Name = c.Name[:32]
	}
	for i := 0; i < n; i++ {
		c.nodes = append(c.nodes, &clusterNode{name: fmt.Sprintf("n%d", i), port: FreePort(t), route: FreePort(t), dir: t.TempDir()})
	}
	t.Cleanup(func() {
		for i := range c.nodes {
			c.Kill(i)
		}
	})
	for i := range c.nodes {
		c.start(i)
	}
	c.WaitJetStream(30 * time.Second)
	return c
}

func (c *NATSCluster) routes() []*url.URL {
	var rs []*url.URL
	for _, n := range c.nodes {
		rs = append(rs, &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", n.route)})
	}
	return rs
}

func (c *NATSCluster) start(i int) {
	c.t.Helper()
	n := c.nodes[i]
	opts := &server.Options{
		ServerName: n.name,
		Host:       "127.0.0.1",
		Port:       n.port,
		JetStream:  true,
		StoreDir:   n.dir,
		NoSigs:     true,
		NoLog:      true,
		Cluster:    server.ClusterOpts{Name: c.Name, Host: "127.0.0.1", Port: n.route},
		Routes:     c.routes(),
	}
	s, err := server.NewServer(opts)
	if err != nil {
		c.t.Fatalf("testenv: nats cluster node %s: %v", n.name, err)
	}
	go s.Start()
	if !s.ReadyForConnections(15 * time.Second) {
		s.Shutdown()
		c.t.Fatalf("testenv: nats cluster node %s not ready within 15s", n.name)
	}
	c.mu.Lock()
	n.srv = s
	c.mu.Unlock()
}

// Size is the number of nodes, running or not.
func (c *NATSCluster) Size() int { return len(c.nodes) }

// URL is node i's client URL.
func (c *NATSCluster) URL(i int) string { return fmt.Sprintf("nats://127.0.0.1:%d", c.nodes[i].port) }

// URLs is every node's client URL, comma-separated: the seed list bridges
// and routers are given.
func (c *NATSCluster) URLs() string {
	us := make([]string, len(c.nodes))
	for i := range c.nodes {
		us[i] = c.URL(i)
	}
	return strings.Join(us, ",")
}

// Server is node i's server, nil while it is killed.
func (c *NATSCluster) Server(i int) *server.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].srv
}

// Kill shuts node i down at once (its clients are disconnected and fail
// over to the other nodes); its store stays for Restart. Killing a stopped
// node does nothing.
func (c *NATSCluster) Kill(i int) {
	c.mu.Lock()
	s := c.nodes[i].srv
	c.nodes[i].srv = nil
	c.mu.Unlock()
	if s != nil {
		s.Shutdown()
		s.WaitForShutdown()
	}
}

// Restart starts node i again on its ports and store directory; it rejoins
// the cluster and catches its streams up from the others.
func (c *NATSCluster) Restart(i int) {
	c.t.Helper()
	c.Kill(i)
	c.start(i)
}

// WaitJetStream waits until the running nodes agree on a JetStream meta
// leader that counts every running node as a peer it can place replicas
// on (online, with JetStream and its first statistics: before that a
// stream of as many replicas as nodes is refused "no suitable peers for
// placement"), and fails the test after d.
func (c *NATSCluster) WaitJetStream(d time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		c.mu.Lock()
		leader := false
		for _, n := range c.nodes {
			if n.srv != nil && n.srv.JetStreamIsLeader() {
				leader = c.allPeers(n.srv.JetStreamClusterPeers())
			}
		}
		c.mu.Unlock()
		if leader && c.jetStreamAnswers() {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.t.Fatalf("testenv: nats cluster %s has no JetStream meta leader after %v", c.Name, d)
}

// allPeers reports whether peers names every running node; c.mu is held.
func (c *NATSCluster) allPeers(peers []string) bool {
	for _, n := range c.nodes {
		if n.srv != nil && !slices.Contains(peers, n.srv.Name()) {
			return false
		}
	}
	return true
}

// jetStreamAnswers reports whether the JetStream API answers through the
// cluster (account info needs the meta layer).
func (c *NATSCluster) jetStreamAnswers() bool {
	nc, err := nats.Connect(c.URLs(), nats.Timeout(time.Second))
	if err != nil {
		return false
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err == nil
}

// StreamLeader returns the index of the node that leads stream (in the
// global account), or -1 when none does.
func (c *NATSCluster) StreamLeader(stream string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, n := range c.nodes {
		if n.srv != nil && n.srv.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, stream) {
			return i
		}
	}
	return -1
}

// MetaLeader returns the index of the JetStream meta leader (the node
// that answers consumer and stream creates), or -1 when none does.
func (c *NATSCluster) MetaLeader() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, n := range c.nodes {
		if n.srv != nil && n.srv.JetStreamIsLeader() {
			return i
		}
	}
	return -1
}

// Health reports each node's JetStream health (the server's /healthz with
// details: every stream and consumer replica it holds is current), or
// "down" for a killed node: what a test prints when the cluster does not
// recover.
func (c *NATSCluster) Health() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, n := range c.nodes {
		out = append(out, n.name+": "+nodeHealth(n.srv))
	}
	return strings.Join(out, "; ")
}

func nodeHealth(s *server.Server) string {
	if s == nil {
		return "down"
	}
	h := s.Healthz(&server.HealthzOptions{Details: true})
	if h.Status == "ok" {
		return "ok"
	}
	var errs []string
	for _, e := range h.Errors {
		errs = append(errs, strings.TrimSpace(e.Stream+" "+e.Consumer+" "+e.Error))
	}
	return h.Status + " (" + strings.Join(errs, ", ") + ")"
}

// WaitHealthy waits until every running node reports JetStream healthy
// (nodeHealth: meta, streams and consumers current, which a restarted node
// is only once it has caught up from the others), and fails the test
// after d. Killing a second node before a restarted one is current takes
// away two of a 3-replica stream's peers, not one.
func (c *NATSCluster) WaitHealthy(d time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(d)
	for {
		h := c.Health()
		healthy := true
		for _, part := range strings.Split(h, "; ") {
			if !strings.HasSuffix(part, ": ok") && !strings.HasSuffix(part, ": down") {
				healthy = false
			}
		}
		if healthy {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("testenv: nats cluster %s not healthy after %v: %s", c.Name, d, h)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
