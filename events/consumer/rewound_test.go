package consumer

import (
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A JetStream server restarted on a store that lost its newest messages
// (written but not yet synced to disk when its host failed, or a store
// restored from a backup) keeps the stream, creation time included, and
// numbers the next messages from its last stored sequence again: below
// the position the router's consumer resumes after. Once the bridges'
// backlog has carried the stream past that position, neither the
// creation time nor the stream's last sequence shows it, and the messages
// stored in place of the lost ones were never applied: an instance that
// sent one and went quiet stayed live without it (seen on the real
// binaries, docs/BENCHMARKS.md §3, Session 25: 41 engine messages missing).
// The last message delivered before the connection dropped is looked for
// again once it is back; not the one delivered, the stream is consumed
// from its start with every instance reloaded.
func TestStreamRewoundNoticed(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	port := testenv.FreePort(t)
	start := func(dir string) *kvstream.EmbeddedNATS {
		t.Helper()
		srv, err := kvstream.StartEmbeddedNATS(ctx, kvstream.EmbeddedNATSConfig{Port: port, StoreDir: dir})
		if err != nil {
			t.Fatal(err)
		}
		return srv
	}
	dir := t.TempDir()
	srv := start(dir)
	defer func() { srv.Shutdown() }()
	url := srv.ClientURL()
	// The router's connection comes back a second after the server: the
	// bridges' backlog is stored by then.
	nc := testenv.Connect(t, url, nats.MaxReconnects(-1), nats.ReconnectWait(time.Second))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := testenv.UniqueName(t)
	e := &env{t: t, ctx: ctx, nc: nc, js: js, pool: "p_" + name}
	e.cfg = Config{Conn: nc, Pool: e.pool, Stream: kvstream.StreamConfig{Name: "S_" + name},
		Bucket: kvstream.BucketConfig{Name: "B_" + name}, Logger: slog.New(slog.DiscardHandler)}
	if _, err := kvstream.EnsureStream(ctx, js, e.cfg.Stream); err != nil {
		t.Fatal(err)
	}
	c, a := e.startRecording()
	applied := func(instance string, hash uint64) func() bool {
		return func() bool { got, _ := a.get(instance); return slices.Contains(got, hash) }
	}
	for seq := uint64(1); seq <= 3; seq++ {
		e.store("i0", seq, 10+seq)
	}
	testenv.WaitFor(t, 20*time.Second, "first messages applied", applied("i0", 13))

	// A plain restart: the store keeps everything, and the check finds
	// the last message delivered where it was (no reload).
	srv.Shutdown()
	backup := t.TempDir()
	if err := os.CopyFS(backup, os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	srv = start(dir)
	e.store("i0", 4, 14)
	e.store("i0", 5, 15)
	testenv.WaitFor(t, 20*time.Second, "messages after a plain restart applied", applied("i0", 15))
	testenv.WaitFor(t, 20*time.Second, "the last message before the restart found again", func() bool {
		c.sc.mu.Lock()
		defer c.sc.mu.Unlock()
		return c.sc.check.seq == 0
	})
	if n := counterValue(c.m.streamRecreated); n != 0 {
		t.Fatalf("a restart on a whole store read as a rewound stream %v times", n)
	}

	// The server comes back on the store as it was at stream seq 3:
	// messages 4 and 5 (applied) are gone, and what the bridges had
	// buffered meanwhile is stored at once: i0's next message at stream
	// seq 4, then i1's two past the consumer's position (5).
	srv.Shutdown()
	srv = start(backup)
	pub := testenv.Connect(t, url)
	pjs, err := jetstream.New(pub)
	if err != nil {
		t.Fatal(err)
	}
	e.js = pjs
	e.store("i0", 6, 16)
	e.store("i1", 1, 21)
	e.store("i1", 2, 22)
	e.js = js
	testenv.WaitFor(t, 20*time.Second, "i0's message stored in place of a lost one applied", applied("i0", 16))
	// i1's second message (stream seq 6) may be delivered before the
	// watchdog looks; its first (5) is applied only when the stream is
	// consumed from its start before that (i1 has no snapshot: its engine
	// seq then skips 1 as applied), so only the second is checked.
	testenv.WaitFor(t, 20*time.Second, "i1 applied", applied("i1", 22))
	if n := counterValue(c.m.streamRecreated); n != 1 {
		t.Fatalf("rewound stream counted %v times, want 1", n)
	}
}

// A rollback found by rewound whose re-consumption fails (the consumer
// not made: here the stream's consumer limit, in production a meta leader
// being elected) is tried again at the next heartbeat. Before, the mark
// was cleared and recreated left set with nothing to act on it: the
// messages stored in place of the lost ones were never applied, and some
// later stall reloaded every instance for no visible reason.
func TestStreamRewoundRetriedAfterFailedRestream(t *testing.T) {
	e := newEnv(t)
	c, a := e.startRecording()
	for seq := uint64(1); seq <= 3; seq++ {
		e.store("i0", seq, 10+seq)
	}
	testenv.WaitFor(t, 20*time.Second, "i0's three messages applied", func() bool {
		got, _ := a.get("i0")
		return slices.Contains(got, 13)
	})
	st, err := e.js.Stream(e.ctx, e.cfg.Stream.Name)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.MaxConsumers = 1 // the consumer running: no other can be made
	if _, err := e.js.UpdateStream(e.ctx, cfg); err != nil {
		t.Fatal(err)
	}
	errs := counterValue(c.m.consumeErrors)
	// What markOnDisconnect takes, with the stream holding another
	// message at that sequence since (a store time that differs).
	c.sc.mu.Lock()
	c.sc.check = streamMark{seq: c.sc.seq, stored: c.sc.stored.Add(time.Nanosecond)}
	c.sc.mu.Unlock()
	testenv.WaitFor(t, 20*time.Second, "the rollback found and its re-consumption refused", func() bool {
		return counterValue(c.m.consumeErrors) > errs
	})
	if n := counterValue(c.m.streamRecreated); n != 0 {
		t.Fatalf("re-consumed with the consumer limit reached: %v", n)
	}
	cfg.MaxConsumers = -1
	if _, err := e.js.UpdateStream(e.ctx, cfg); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 20*time.Second, "the rollback followed once the consumer can be made", func() bool {
		return counterValue(c.m.streamRecreated) == 1
	})
	e.store("i0", 4, 14)
	testenv.WaitFor(t, 20*time.Second, "the stream consumed after the retry", func() bool {
		got, _ := a.get("i0")
		return slices.Contains(got, 14)
	})
	if n := counterValue(c.m.streamRecreated); n != 1 {
		t.Fatalf("followed %v times, want once", n)
	}
}
