package kvindex

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// Rewound sees Redis restarted from its own persistence to an earlier
// point (the RDB saved two checks ago), which keeps the epoch; not a
// restart that lost nothing (the RDB saved at the last check), nor a
// check whose reply was lost after the increment ran (the next one skips a
// value). A flushed counter (a Redis restarted empty keeps no epoch
// either) reads as rewound too.
func TestRedisRewound(t *testing.T) {
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = admin.Close() })
	r, err := NewRedis(client, RedisConfig{Prefix: testenv.UniqueName(t), Model: testModel, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string, want bool) {
		t.Helper()
		got, err := r.Rewound(ctx)
		if err != nil || got != want {
			t.Fatalf("%s: Rewound = %v, %v; want %v", what, got, err, want)
		}
	}
	restart := func() {
		t.Helper()
		srv.Kill()
		srv.Start()
	}
	check("first check", false)
	check("second check", false)
	if err := admin.Save(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	check("after the save", false)
	check("two after the save", false)
	restart() // loads the RDB: the counter as of two checks ago
	check("restored to an earlier point", true)
	check("the check after", false)

	if err := admin.Save(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	restart() // nothing written since the save: nothing lost
	check("restarted with nothing lost", false)

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
