package deploy

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router/kvstate"
)

// TestProductionRedisClusterForms runs the production-redis-cluster
// overlay's Redis Cluster as local processes: the StatefulSet's six
// redis-server command lines (the downward API's pod name and the Secret's
// password substituted as the kubelet would, ports mapped to loopback),
// then the create Job's script with the pods' DNS names mapped. Then what
// the manifests promise: every slot served, three masters each with a
// replica linked through the replication user; the Job run again changes
// nothing; the routers' index, built from the rendered router.yaml by the
// router's own code, stores and looks up blocks as the kvrouter user, who
// is refused keys outside the index's prefix; and with one master killed
// (what the PDB allows) its replica takes over and the index keeps working.
func TestProductionRedisClusterForms(t *testing.T) {
	if testing.Short() {
		t.Log("-short: the Redis Cluster is not started")
		return
	}
	p := renderCluster(t)
	server, b, sts, c, cfg := p.server, p.b, p.sts, p.c, p.cfg
	n := int(derefReplicas(sts.Spec.Replicas))

	// Each pod: its own port, bus port and directory.
	addr := map[string]string{} // pod DNS name:6379 -> 127.0.0.1:port
	procs := make([]*exec.Cmd, n)
	var local []string
	for i := range n {
		pod := fmt.Sprintf("%s-%d", sts.Name, i)
		port, dir := testenv.FreePort(t), t.TempDir()
		cmd := exec.Command(server, nodeArgs(t, c.Args, sts.Spec.ServiceName, password, port, dir)...)
		cmd.Dir = dir
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[i] = cmd
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		addr[pod+"."+sts.Spec.ServiceName+":6379"] = fmt.Sprintf("127.0.0.1:%d", port)
		local = append(local, fmt.Sprintf("127.0.0.1:%d", port))
	}

	// The create Job's script, the pods' names mapped, run twice.
	job := b.jobs["redis-cluster-create"]
	jc := &job.Spec.Template.Spec.Containers[0]
	script := jc.Args[0]
	for from, to := range addr {
		script = strings.ReplaceAll(script, from, to)
	}
	runJob := func() {
		var out []byte
		var err error
		deadline := time.Now().Add(30 * time.Second)
		for {
			cmd := exec.Command(jc.Command[0], append(jc.Command[1:], script)...)
			cmd.Env = append(os.Environ(), "REDISCLI_AUTH="+password)
			out, err = cmd.CombinedOutput()
			if err == nil {
				return
			}
			if time.Now().After(deadline) { // the Job's pod restarts until the nodes answer
				t.Fatalf("create Job: %v\n%s", err, out)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	runJob()
	admin := func(a string) *redis.Client {
		cl := redis.NewClient(&redis.Options{Addr: a, Username: "admin", Password: password})
		t.Cleanup(func() { _ = cl.Close() })
		return cl
	}
	ctx := testenv.Context(t, 2*time.Minute)
	healthy := func(nodes []string) error {
		masters, linked := 0, 0
		for _, a := range nodes {
			info, err := admin(a).ClusterInfo(ctx).Result()
			if err != nil || !strings.Contains(info, "cluster_state:ok") {
				return fmt.Errorf("%s: cluster not ok (%v)", a, err)
			}
			repl, err := admin(a).Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			switch {
			case strings.Contains(repl, "role:master"):
				masters++
			case strings.Contains(repl, "master_link_status:up"):
				linked++
			}
		}
		if masters != n/2 || linked != n/2 {
			return fmt.Errorf("%d masters, %d replicas linked", masters, linked)
		}
		return nil
	}
	waitFor(t, 30*time.Second, "cluster ok, 3 masters, 3 linked replicas", func() error { return healthy(local) })
	runJob() // again: a no-op on a formed cluster
	if err := healthy(local); err != nil {
		t.Fatalf("after the second run of the create Job: %v", err)
	}

	// The routers' index, from the rendered router.yaml.
	rc := cfg.Index.Redis
	for i, a := range rc.Addrs {
		rc.Addrs[i] = addr[a]
	}
	rc.Password = password
	idx, err := kvstate.NewPoolIndexes(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = idx.Close() })
	pool := cfg.Pools[0]
	index := idx.ByPool[pool.Name]
	const bs = 16
	tokens := make([]uint32, 64*bs)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	hashes := make([]uint64, 64)
	for i := range hashes {
		hashes[i] = uint64(500 + i)
	}
	keys := kvindex.Keys(kvindex.Root(pool.Model, "", ""), tokens, bs)
	store := func(inst string) {
		_, err := index.Apply(ctx, inst, []events.Event{{Kind: events.BlockStored, BlockHashes: hashes, TokenIDs: tokens, BlockSize: bs, Medium: "GPU"}})
		if err != nil {
			t.Fatalf("apply %s: %v", inst, err)
		}
	}
	held := func(inst string) int {
		ms, err := index.Lookup(ctx, keys)
		if err != nil {
			return -1
		}
		for _, m := range ms {
			if m.Instance == inst {
				return m.Blocks[0]
			}
		}
		return 0
	}
	store("vllm-0")
	if got := held("vllm-0"); got != len(keys) {
		t.Fatalf("lookup after store: %d blocks, want %d", got, len(keys))
	}
	// The shared index's epoch (events/consumer watches it): a failover
	// must change it, because replication is asynchronous and the
	// promoted replica may miss recent writes that positions elsewhere
	// say were applied (kvindex/redis_shared.go): the consumers then reload
	// every instance.
	type epocher interface {
		Epoch(ctx context.Context) (string, bool, error)
	}
	ep, ok := index.(epocher)
	if !ok {
		t.Fatalf("the Redis index (%T) has no epoch", index)
	}
	epoch0, _, err := ep.Epoch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	user := redis.NewClusterClient(&redis.ClusterOptions{Addrs: local, Username: rc.Username, Password: password})
	t.Cleanup(func() { _ = user.Close() })
	if err := user.Set(ctx, "not-the-index", "x", time.Minute).Err(); err == nil || !strings.Contains(err.Error(), "NOPERM") {
		t.Errorf("the routers' user wrote outside the index's keys: %v", err)
	}
	// Every master's run_id, read in the index's check (INFO inside a
	// script, as the routers' user): how a router tells a master
	// restarted from its own persistence (kvindex.Redis.Rewound).
	type rewinder interface {
		Rewound(ctx context.Context) (bool, error)
		RestartsUnseen() bool
	}
	rw, ok := index.(rewinder)
	if !ok {
		t.Fatalf("the Redis index (%T) has no rewind check", index)
	}
	if back, err := rw.Rewound(ctx); err != nil || back || rw.RestartsUnseen() {
		t.Errorf("the index's first rewind check: %v, %v, run_id hidden %v; want false, nil, false", back, err, rw.RestartsUnseen())
	}

	// Kill one master (the one serving the slot of a key under the index's
	// prefix; the index's 64 blocks spread over every slot range): its
	// replica takes over within cluster-node-timeout and the index works
	// again.
	slot, err := user.ClusterKeySlot(ctx, rc.KeyPrefix+":x").Result()
	if err != nil {
		t.Fatal(err)
	}
	victim := -1
	for i, a := range local {
		slots, err := admin(a).ClusterSlots(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range slots {
			if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 && strings.HasSuffix(s.Nodes[0].Addr, a[strings.LastIndexByte(a, ':'):]) {
				victim = i
			}
		}
		if victim >= 0 {
			break
		}
	}
	if victim < 0 {
		t.Fatalf("no master found for slot %d", slot)
	}
	_ = procs[victim].Process.Kill()
	_ = procs[victim].Wait()
	killed := time.Now()
	rest := append(append([]string{}, local[:victim]...), local[victim+1:]...)
	waitFor(t, 60*time.Second, "replica promoted", func() error {
		slots, err := admin(rest[0]).ClusterSlots(ctx).Result()
		if err != nil {
			return err
		}
		for _, s := range slots {
			if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 && s.Nodes[0].Addr != "" && !strings.HasSuffix(s.Nodes[0].Addr, local[victim][strings.LastIndexByte(local[victim], ':'):]) {
				return nil
			}
		}
		return fmt.Errorf("slot %d still on the killed master", slot)
	})
	promoted := time.Since(killed)
	// The routers' index: a store and a lookup through the promoted replica.
	// Within 30 s of the promotion (measured ~1 s). This bound catches a
	// client stuck on the dead master for go-redis's 60 s between slot-map
	// reloads, but the index's pipelined writes also recover through a
	// MOVED on retry, so it does not by itself show kvstate's 1 s reload:
	// router/kvstate's TestRedisClusterSlotMapReload checks that setting.
	waitFor(t, 30*time.Second, "the index follows the failover", func() error {
		if _, err := index.Apply(ctx, "vllm-1", []events.Event{{Kind: events.BlockStored, BlockHashes: hashes, TokenIDs: tokens, BlockSize: bs, Medium: "GPU"}}); err != nil {
			return err
		}
		if got := held("vllm-1"); got != len(keys) {
			return fmt.Errorf("lookup: %d blocks", got)
		}
		return nil
	})
	// vllm-0's blocks written before the kill may or may not all have
	// reached the replica; what must hold is that the epoch says so.
	if epoch1, _, err := ep.Epoch(ctx); err != nil || epoch1 == epoch0 {
		t.Errorf("epoch after failover %q (err %v), before %q: consumers would not reload what the failover may have lost", epoch1, err, epoch0)
	}
	t.Logf("vllm-0's blocks after failover: %d of %d (asynchronous replication; the epoch changed)", held("vllm-0"), len(keys))
	t.Logf("master %s killed: its replica promoted %.1f s later, the index worked again %.1f s after the kill (cluster-node-timeout %s ms)",
		local[victim], promoted.Seconds(), time.Since(killed).Seconds(), mustRedisArg(t, c.Args, "cluster-node-timeout"))
}

// password is the Secret's, as the tests substitute it.
const password = "test-secret"

// renderedCluster is the production-redis-cluster overlay, rendered: the
// StatefulSet, its redis-server container, the router's configuration,
// and the local redis-server to run its command lines with.
type renderedCluster struct {
	server string
	b      *bundle
	sts    *appsv1.StatefulSet
	c      *corev1.Container
	cfg    config.Config
}

func renderCluster(t *testing.T) renderedCluster {
	t.Helper()
	server, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("no redis-server on PATH (run `make deps-test`): %v", err)
	}
	b := render(t, "kubernetes/overlays/production-redis-cluster")
	sts := b.statefulSets["redis-cluster"]
	return renderedCluster{server: server, b: b, sts: sts, c: &sts.Spec.Template.Spec.Containers[0], cfg: checkRouter(t, b, overlays[2])}
}

// nodeArgs is a StatefulSet pod's redis-server command line as the
// kubelet would run it (the Secret's password and the downward API's pod
// name substituted), on a local port and directory, with a free bus port
// (the client port + 10000 in the pod).
func nodeArgs(t *testing.T, rendered []string, service, password string, port int, dir string) []string {
	args := make([]string, 0, len(rendered)+6)
	for k := 0; k < len(rendered); k++ {
		a := strings.ReplaceAll(rendered[k], "$(REDIS_PASSWORD)", password)
		a = strings.ReplaceAll(a, "$(POD_NAME)."+service, "127.0.0.1")
		switch rendered[k] {
		case "--port":
			args = append(args, a, fmt.Sprint(port))
			k++
			continue
		case "--dir":
			args = append(args, a, dir)
			k++
			continue
		case "--cluster-config-file":
			args = append(args, a, filepath.Join(dir, filepath.Base(rendered[k+1])))
			k++
			continue
		}
		args = append(args, a)
	}
	return append(args, "--cluster-port", fmt.Sprint(testenv.FreePort(t)))
}

// TestProductionRedisClusterAOFReload restarts one node of the
// production-redis-cluster overlay, with its rendered command line, from
// its append-only file, and finds there what the routers' user wrote in a
// transaction (MULTI/EXEC: how Redis logs a script's writes, every index
// write among them). The file is loaded by a client that runs as the
// default user, and Redis re-checks its permissions at EXEC (until
// redis/redis#14545; valkey-io/valkey#3983): with the default user off and
// given nothing, every transaction in the file was refused, silently —
// each restart of a master dropped its index writes but the few outside a
// script, and the routers reloaded on a state no one had written.
func TestProductionRedisClusterAOFReload(t *testing.T) {
	if testing.Short() {
		t.Log("-short: no Redis node is started")
		return
	}
	p := renderCluster(t)
	server, sts, c, rc := p.server, p.sts, p.c, p.cfg.Index.Redis
	port, dir := testenv.FreePort(t), t.TempDir()
	args := nodeArgs(t, c.Args, sts.Spec.ServiceName, password, port, dir)
	var cmd *exec.Cmd
	start := func() {
		t.Helper()
		cmd = exec.Command(server, args...)
		cmd.Dir = dir
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
	}
	start()
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	a := fmt.Sprintf("127.0.0.1:%d", port)
	ctx := testenv.Context(t, time.Minute)
	admin := redis.NewClient(&redis.Options{Addr: a, Username: "admin", Password: password})
	t.Cleanup(func() { _ = admin.Close() })
	user := redis.NewClient(&redis.Options{Addr: a, Username: rc.Username, Password: password})
	t.Cleanup(func() { _ = user.Close() })
	// One node serving every slot: a cluster of its own, writable.
	waitFor(t, 15*time.Second, "the node answers", func() error { return admin.Ping(ctx).Err() })
	if err := admin.Do(ctx, "cluster", "addslotsrange", 0, 16383).Err(); err != nil {
		t.Fatal(err)
	}
	key := func(k string) string { return rc.KeyPrefix + ":{aof}:" + k }
	waitFor(t, 15*time.Second, "the one-node cluster serves", func() error { return user.Set(ctx, key("plain"), "1", 0).Err() })
	if _, err := user.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, key("tx1"), "1", 0)
		p.Set(ctx, key("tx2"), "2", 0)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// appendfsync everysec writes the file within two seconds: wait that
	// out, then kill the node (what a container's end does) and start it
	// from its file.
	time.Sleep(2500 * time.Millisecond)
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	start()
	waitFor(t, 15*time.Second, "the node back, its file loaded", func() error { return user.Get(ctx, key("plain")).Err() })
	n, err := user.Exists(ctx, key("tx1"), key("tx2")).Result()
	if err != nil || n != 2 {
		t.Fatalf("after a restart from the append-only file, %d of the 2 keys written in a transaction (err %v): the file's transactions were refused at load", n, err)
	}
}

func mustRedisArg(t *testing.T, args []string, name string) string {
	t.Helper()
	for i, a := range args {
		if a == "--"+name && i+1 < len(args) {
			return args[i+1]
		}
	}
	t.Fatalf("no --%s in %v", name, args)
	return ""
}
