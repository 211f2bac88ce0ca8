package kvindex

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A Cluster master restarted from its own persistence to an earlier point
// inside cluster-node-timeout keeps its node id: the topology is the same,
// and what it lost is missing while instance positions on other masters
// say it was applied. Its check counter (one per master) goes back, which
// bumps the rewind generation: the epoch changes and every position
// stamped before stops counting, so the consumers reload every instance,
// as after a failover. The replicas are kept from failing over, so the
// master comes back with its node id whatever the machine's load.
func TestRedisClusterRewound(t *testing.T) {
	ctx := context.Background()
	c := testenv.StartRedisCluster(t)
	admin := nodeAdmin(t)
	noFailover(t, c, admin)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: 8})
	t.Cleanup(func() { _ = client.Close() })
	prefix := testenv.UniqueName(t)
	r, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	// A second router's handle on the same index: it finds the same
	// rewind, and the generation moves once.
	r2, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	checkOn := func(r *Redis, what string, want bool) {
		t.Helper()
		got, err := r.Rewound(ctx)
		if err != nil || got != want {
			t.Fatalf("%s: Rewound = %v, %v; want %v", what, got, err, want)
		}
	}
	check := func(what string, want bool) {
		t.Helper()
		checkOn(r, what, want)
		checkOn(r2, what+" (second router)", want)
	}
	epochOf := func(r *Redis) string {
		t.Helper()
		e, _, err := r.Epoch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	epoch := func() string {
		t.Helper()
		e := epochOf(r)
		if e2 := epochOf(r2); e2 != e {
			t.Fatalf("the routers read different epochs: %s and %s", e, e2)
		}
		return e
	}
	ch := newChain(Root(testModel, "", ""), 8, 4, 1, 1)
	at := func(s uint64) Position { return Position{Seq: s, Seeded: true} }
	e0 := epoch()
	// No generation set yet: the stamp is the earlier releases' (the slot
	// ranges' masters hashed alone), so their positions keep counting
	// through a rolling upgrade.
	slots, err := client.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	var ranges []string
	for _, s := range slots {
		ranges = append(ranges, fmt.Sprintf("%d-%d:%s", s.Start, s.End, s.Nodes[0].ID))
	}
	slices.Sort(ranges)
	if want := fmt.Sprintf("/%016x", xxhash.Sum64String(strings.Join(ranges, ","))); r.topology() != want {
		t.Fatalf("stamp %s without a rewind generation, want the earlier releases' %s", r.topology(), want)
	}
	// The counters' keys hash where this package computes (keySlot).
	for _, tag := range []string{"0", "zz", slotTags()[43], slotTags()[16383]} {
		if got, err := client.ClusterKeySlot(ctx, "x{"+tag+"}").Result(); err != nil || int(got) != keySlot(tag) {
			t.Fatalf("CLUSTER KEYSLOT of tag %q = %d, %v; keySlot %d", tag, got, err, keySlot(tag))
		}
	}
	if res, err := r.LoadAt(ctx, "i", 1, []events.Event{ch.stored(0, 8)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("LoadAt: %+v, %v", res, err)
	}
	check("first check", false)
	check("second check", false)

	m := c.Masters()[1]
	m.Save()
	check("after the save", false)
	check("two after the save", false)
	m.Kill()
	m.Start() // loads its RDB: its counter two checks back
	c.WaitHealthy(30 * time.Second)
	if got := c.Role(m); got != "master" {
		t.Fatalf("the restarted node is %q, not master: it failed over", got)
	}
	// Each router checks, then reads the epoch, as the consumer does; the
	// second finds the generation already moved and leaves it.
	checkOn(r, "a master restored to an earlier point", true)
	e1 := epochOf(r)
	checkOn(r2, "a master restored to an earlier point (second router)", true)
	if e2 := epochOf(r2); e2 != e1 {
		t.Fatalf("the second router moved the rewind generation again: epoch %s, the first router's %s", e2, e1)
	}
	if e1 == e0 {
		t.Fatal("the epoch did not change after a master went back in time")
	}
	if p, err := r.Position(ctx, "i"); err != nil || p.Seeded {
		t.Fatalf("position stamped before the rewind still counts: %v, %v", p, err)
	}
	check("the check after", false)
	if e := epoch(); e != e1 {
		t.Fatalf("epoch moved again without a rewind: %s, was %s", e, e1)
	}
	// Stamped under the new generation, a position counts again.
	if res, err := r.LoadAt(ctx, "i", 2, []events.Event{ch.stored(0, 8)}); err != nil || res.Position != at(2) {
		t.Fatalf("LoadAt after the rewind: %+v, %v", res, err)
	}
	if p, err := r.Position(ctx, "i"); err != nil || p != at(2) {
		t.Fatalf("position after the reload: %v, %v", p, err)
	}

	// A failover: the client follows it (a MOVED from the old master)
	// before the checks' slot map, the last epoch check's, shows it, so
	// the promoted replica answers the old master's check. A new master is
	// not a rewind: the failover moves the epoch by itself, once.
	var replica *testenv.RedisServer
	for _, n := range c.Nodes {
		if c.Role(n) == "slave" {
			replica = n
			break
		}
	}
	if err := admin(replica).Do(ctx, "cluster", "failover").Err(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the replica promoted", func() bool { return c.Role(replica) == "master" })
	c.WaitHealthy(30 * time.Second)
	check("after a failover, before the epoch check", false)
	e2 := epoch()
	if e2 == e1 {
		t.Fatal("the epoch did not change after a failover")
	}
	check("the check after the failover", false)
	if e := epoch(); e != e2 {
		t.Fatalf("the epoch moved again after the failover: %s, was %s", e, e2)
	}
}

// Rewound on a Cluster with one master down: the check skips it (what it
// last answered kept) instead of failing, and the restart is reported
// when it answers again, though it came back from a save taken at the
// last check (a loss newer than the last check: the run_id tells, not the
// counter). A rewind found while the master holding the rewind generation
// does not answer (stopped, not restarted: its run_id stands) stays
// reported until the generation has moved. The node timeout is raised far
// over the test, so nothing fails over and the cluster keeps serving.
func TestRedisClusterRewoundMasterDown(t *testing.T) {
	ctx := context.Background()
	c := testenv.StartRedisCluster(t)
	admin := nodeAdmin(t)
	slow := func(n *testenv.RedisServer) {
		t.Helper()
		if err := admin(n).ConfigSet(ctx, "cluster-node-timeout", "60000").Err(); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range c.Nodes {
		slow(n)
	}
	noFailover(t, c, admin)
	// The router's client options (router/kvstate): go-redis's own
	// retries; a read timeout shorter than its 3 s default, so the calls
	// to a stopped master give up sooner.
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), ContextTimeoutEnabled: true, ReadTimeout: time.Second})
	t.Cleanup(func() { _ = client.Close() })
	r, err := NewRedis(client, RedisConfig{Prefix: testenv.UniqueName(t), Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	rewound := func(what string, want bool, wantErr bool) {
		t.Helper()
		got, err := r.Rewound(ctx)
		if got != want || (err != nil) != wantErr {
			t.Fatalf("%s: Rewound = %v, %v; want %v, error %v", what, got, err, want, wantErr)
		}
	}
	epoch := func() string {
		t.Helper()
		e, _, err := r.Epoch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	// down saves a master's data and kills it; up restarts it from that.
	down := func(m *testenv.RedisServer) {
		t.Helper()
		m.Save()
		m.Kill()
	}
	up := func(m *testenv.RedisServer) {
		t.Helper()
		m.Start()
		slow(m)
		c.WaitHealthy(30 * time.Second)
		if got := c.Role(m); got != "master" {
			t.Fatalf("the restarted node is %q, not master: it failed over", got)
		}
	}
	// moved reads the epoch, which a rewind must have changed from was.
	moved := func(what, was string) string {
		t.Helper()
		e := epoch()
		if e == was {
			t.Fatalf("the epoch did not change after %s", what)
		}
		return e
	}
	// g serves the rewind generation's slot; x is another master.
	slot, err := client.ClusterKeySlot(ctx, r.genKey()).Result()
	if err != nil {
		t.Fatal(err)
	}
	var g, x *testenv.RedisServer
	for _, m := range c.Masters() {
		if serves(t, admin(m), int(slot)) {
			g = m
		} else if x == nil {
			x = m
		}
	}
	if g == nil || x == nil {
		t.Fatalf("no master found for slot %d or no other master", slot)
	}
	e0 := epoch()
	rewound("first check", false, false)
	rewound("second check", false, false)

	// A master down is skipped: no error, no rewind; back, from a save
	// taken after the last check, its restart is reported.
	down(g)
	rewound("one master down", false, false)
	up(g)
	rewound("the master back", true, false)
	e1 := moved("a master restarted", e0)
	rewound("the check after", false, false)
	if e := epoch(); e != e1 {
		t.Fatalf("the epoch moved again with no restart: %s, was %s", e, e1)
	}

	// x restarts; the master holding the generation is stopped when the
	// restart is found, so the generation cannot move.
	down(x)
	up(x)
	g.Pause()
	rewound("x restarted, the generation's master stopped", false, true)
	g.Resume()
	// x's new run_id is the one last seen by now, and g was never
	// restarted, so only the rewind kept from the failed call can report
	// it.
	rewound("the generation's master answering again", true, false)
	e1 = moved("x restarted", e1)
	rewound("the check after the move", false, false)
	if e := epoch(); e != e1 {
		t.Fatalf("epoch moved again without a rewind: %s, was %s", e, e1)
	}
}

// serves reports whether the node a client talks to is the master of slot.
func serves(t *testing.T, cl *redis.Client, slot int) bool {
	t.Helper()
	ctx := context.Background()
	id, err := cl.Do(ctx, "cluster", "myid").Text()
	if err != nil {
		t.Fatal(err)
	}
	slots, err := cl.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slots {
		if slot >= s.Start && slot <= s.End && len(s.Nodes) > 0 {
			return s.Nodes[0].ID == id
		}
	}
	return false
}

// nodeAdmin returns a function giving a client of one node of a cluster,
// closed at the test's end.
func nodeAdmin(t *testing.T) func(*testenv.RedisServer) *redis.Client {
	return func(n *testenv.RedisServer) *redis.Client {
		cl := redis.NewClient(&redis.Options{Addr: n.Addr})
		t.Cleanup(func() { _ = cl.Close() })
		return cl
	}
}

// noFailover keeps every replica of the cluster from failing over, so a
// master killed and restarted comes back with its node id whatever the
// machine's load.
func noFailover(t *testing.T, c *testenv.RedisCluster, admin func(*testenv.RedisServer) *redis.Client) {
	t.Helper()
	for _, n := range c.Nodes {
		if c.Role(n) == "slave" {
			if err := admin(n).ConfigSet(context.Background(), "cluster-replica-no-failover", "yes").Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// On a Cluster whose routers' user may not run CLUSTER MYID the check
// still answers, and asks it again only after infoRetry: Redis logs every
// refusal (ACL LOG), one a check per master per router otherwise.
func TestRedisClusterRewoundWithoutMyID(t *testing.T) {
	ctx := context.Background()
	c := testenv.StartRedisCluster(t)
	admin := nodeAdmin(t)
	user := testenv.UniqueName(t)
	for _, n := range c.Nodes {
		if err := admin(n).Do(ctx, "acl", "setuser", user, "on", ">pw", "~*", "+@all", "-cluster|myid").Err(); err != nil {
			t.Fatal(err)
		}
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), Username: user, Password: "pw"})
	t.Cleanup(func() { _ = client.Close() })
	r, check := rewoundChecker(t, client, user)
	check("first check", false)
	check("second check", false)
	check("third check", false)
	if r.RestartsUnseen() {
		t.Fatal("RestartsUnseen with INFO allowed")
	}
	for _, m := range c.Masters() {
		if n := scriptRefusals(t, admin(m), "cluster|myid"); n != 1 {
			t.Fatalf("CLUSTER MYID refused %d times on a master in three checks, want once", n)
		}
	}
}
