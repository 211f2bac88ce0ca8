package consumer

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A router whose Redis user may not run INFO still checks the shared index
// (on its counter alone) and says once in its log that a restart losing
// only writes newer than its last check would go unseen; a router whose
// user may run it says nothing.
func TestSharedRedisInfoRefusedLogged(t *testing.T) {
	w := newSharedWorld(t, 31, "e0", "e1")
	var logs testenv.Logs
	w.cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	admin := redis.NewClient(&redis.Options{Addr: w.redis.Addr})
	t.Cleanup(func() {
		_ = admin.Do(w.ctx, "acl", "deluser", w.prefix).Err()
		_ = admin.Close()
	})
	if err := admin.Do(w.ctx, "acl", "setuser", w.prefix, "on", ">pw", "~"+w.prefix+":*", "+@all", "-@dangerous").Err(); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	hb := w.heartbeats(stop)
	defer func() { close(stop); hb.Wait() }()
	refused := w.startRouterWith(redis.NewClient(&redis.Options{Addr: w.redis.Addr, Username: w.prefix, Password: "pw",
		PoolSize: 4, MaxRetries: -1, DialTimeout: 200 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second}), sharedLease)
	allowed := w.startRouter()
	w.publish(5)
	w.converge("one router refused INFO", refused, allowed)
	// Many checks (every 50 ms) after the first.
	time.Sleep(500 * time.Millisecond)
	const line = "refuses INFO to this router's user"
	var got []string
	for l := range strings.SplitSeq(logs.String(), "\n") {
		if strings.Contains(l, line) {
			got = append(got, l)
		}
	}
	if len(got) != 1 || !strings.Contains(got[0], "router=1") {
		t.Fatalf("want the warning once, from router 1 (INFO refused), got %d lines: %q", len(got), got)
	}
}
