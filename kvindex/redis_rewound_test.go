package kvindex

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// Rewound sees Redis restarted from its own persistence to an earlier
// point (the RDB saved two checks ago), which keeps the epoch, and a
// restart whose loss is newer than the last check (the RDB saved after
// it, writes after the save lost): the counter alone cannot see that one,
// the run_id can. Not a check whose reply was lost after the increment ran
// (the next one skips a value). A flushed counter (a Redis restarted empty
// keeps no epoch either) reads as rewound too.
func TestRedisRewound(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = admin.Close() })
	r, check := rewoundChecker(t, client, testenv.UniqueName(t))
	save := func() {
		t.Helper()
		if err := admin.Save(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	restart := func() {
		t.Helper()
		srv.Kill()
		srv.Start()
	}
	check("first check", false)
	check("second check", false)
	save()
	check("after the save", false)
	check("two after the save", false)
	restart() // loads the RDB: the counter as of two checks ago
	check("restored to an earlier point", true)
	check("the check after", false)

	// The RDB saved after the last check, a block stored after the save:
	// the restart loses the block and none of the counter's increments.
	check("before the save", false)
	save()
	ch := newChain(Root(testModel, "", ""), 4, 4, 1, 1)
	if res, err := r.LoadAt(ctx, "i", 1, []events.Event{ch.stored(0, 4)}); err != nil || res.Status != SeqApplied {
		t.Fatalf("LoadAt: %+v, %v", res, err)
	}
	restart()
	if p, err := r.Position(ctx, "i"); err != nil || p.Seeded {
		t.Fatalf("the store after the save survived the restart (%v, %v): the case is not the one meant", p, err)
	}
	check("restarted, the writes since the last check lost", true)
	check("the check after that", false)

	// A reply lost after the increment ran: the counter moved on without
	// this handle knowing.
	if err := client.Incr(ctx, r.ns+"n:"+r.token).Err(); err != nil {
		t.Fatal(err)
	}
	check("after an increment whose reply was lost", false)

	if err := admin.Del(ctx, r.ns+"n:"+r.token).Err(); err != nil {
		t.Fatal(err)
	}
	check("counter gone", true)

	srv.Kill()
	if _, err := r.Rewound(ctx); err == nil {
		t.Fatal("Rewound answered with Redis down")
	}
}

// Where the routers' user may not run INFO (an ACL without it, a renamed
// command), the check does not fail: the run_id reads empty, the counter
// alone tells, and RestartsUnseen says so for the operator. A rewind that
// takes back an increment is still seen; one newer than the last check is
// not (the gap RestartsUnseen names).
func TestRedisRewoundWithoutInfo(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = admin.Close() })
	prefix := testenv.UniqueName(t)
	// The ACL user is not persisted: made again after every restart,
	// before the handle's client redials.
	user := func() {
		t.Helper()
		err := admin.Do(ctx, "acl", "setuser", prefix, "on", ">pw", "~"+prefix+":*", "+@all", "-@dangerous").Err()
		if err != nil {
			t.Fatal(err)
		}
	}
	user()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: prefix, Password: "pw", MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	if err := client.Info(ctx, "server").Err(); err == nil {
		t.Fatal("the test's user may run INFO: the case is not the one meant")
	}
	r, check := rewoundChecker(t, client, prefix)
	restart := func() {
		t.Helper()
		if err := admin.Save(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		srv.Kill()
		srv.Start()
		user()
	}
	check("first check", false)
	if !r.RestartsUnseen() {
		t.Fatal("RestartsUnseen false where INFO is refused")
	}
	// Refused once, INFO is left out of the next checks (infoRetry):
	// Redis logs each refusal (the check's own: context lua), and an
	// operator's alerts read that log.
	check("second check", false)
	check("third check", false)
	if !r.RestartsUnseen() {
		t.Fatal("RestartsUnseen false while INFO is left out")
	}
	if n := scriptRefusals(t, admin, "info"); n != 1 {
		t.Fatalf("INFO refused %d times in three checks, want once", n)
	}
	restart() // saved at the last check: the counter lost nothing
	check("restarted, nothing of the counter lost", false)
	if err := admin.Save(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	check("saved", false)
	check("two after the save", false)
	srv.Kill()
	srv.Start()
	user()
	check("restored two checks back", true)

	// The same server, a user who may run INFO: the restart is seen.
	full, checkFull := rewoundChecker(t, admin, prefix)
	checkFull("first check, INFO allowed", false)
	if full.RestartsUnseen() {
		t.Fatal("RestartsUnseen true where INFO is allowed")
	}
	restart()
	checkFull("restart with INFO allowed", true)
}

// rewoundChecker returns a handle on the index under prefix and a
// function asserting its Rewound's answer.
func rewoundChecker(t *testing.T, client redis.UniversalClient, prefix string) (*Redis, func(what string, want bool)) {
	r, err := NewRedis(client, RedisConfig{Prefix: prefix, Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	return r, func(what string, want bool) {
		t.Helper()
		got, err := r.Rewound(context.Background())
		if err != nil || got != want {
			t.Fatalf("%s: Rewound = %v, %v; want %v", what, got, err, want)
		}
	}
}

// scriptRefusals counts the refusals of command (as ACL LOG names it:
// "info", "cluster|myid") inside scripts in a server's ACL LOG, which
// groups repeated ones under a count.
func scriptRefusals(t *testing.T, admin *redis.Client, command string) int64 {
	t.Helper()
	logged, err := admin.Do(context.Background(), "acl", "log").Slice()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, e := range logged {
		if entry, ok := e.(map[any]any); ok && entry["object"] == command && entry["context"] == "lua" {
			n += entry["count"].(int64)
		}
	}
	return n
}
