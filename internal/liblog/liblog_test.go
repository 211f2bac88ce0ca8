package liblog_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/liblog"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// records returns the JSON log records, failing on any line that is not one.
func records(t *testing.T, logs *testenv.Logs) []map[string]any {
	t.Helper()
	recs := logs.Records()
	for _, rec := range recs {
		if line, ok := rec["unstructured"]; ok {
			t.Fatalf("an unstructured log line: %q", line)
		}
	}
	return recs
}

func newLogs(t *testing.T) (*liblog.Logs, *testenv.Logs, *prometheus.Registry) {
	buf := &testenv.Logs{}
	reg := prometheus.NewRegistry()
	l, err := liblog.New(reg, slog.New(slog.NewJSONHandler(buf, nil)), "test_library_log_lines_total")
	if err != nil {
		t.Fatal(err)
	}
	return l, buf, reg
}

// count sums the library's line counter, of one kind or ("") all.
func count(t *testing.T, reg *prometheus.Registry, library, kind string) float64 {
	t.Helper()
	labels := map[string]string{"library": library}
	if kind != "" {
		labels["kind"] = kind
	}
	return testenv.Metric(t, reg, "test_library_log_lines_total", labels)
}

// A go-redis client hammering a dead server: every line it reports is
// counted, a few are logged as structured records.
func TestRedisOutageLinesAreStructuredAndBounded(t *testing.T) {
	l, buf, reg := newLogs(t)
	redis.SetLogger(l.Redis())
	c := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)), DialTimeout: 100 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	ctx := context.Background()
	for range 8 {
		if err := c.Ping(ctx).Err(); err == nil {
			t.Fatal("ping to a dead port succeeded")
		}
	}
	n := count(t, reg, "go-redis", "")
	if n == 0 {
		t.Fatal("no go-redis line counted during the outage")
	}
	if n <= liblog.Burst {
		t.Fatalf("only %v go-redis lines for 8 failed pings: nothing to rate-limit", n)
	}
	recs := records(t, buf)
	if len(recs) == 0 || len(recs) > liblog.Burst*2 || float64(len(recs)) >= n {
		t.Fatalf("%d log records for %v go-redis lines, want a few (at most %d per kind per %v)", len(recs), n, liblog.Burst, liblog.Window)
	}
	if recs[0]["library"] != "go-redis" || !strings.HasPrefix(recs[0]["msg"].(string), "redis client: ") {
		t.Fatalf("record %v", recs[0])
	}
}

// A subscription that cannot keep up: nats.go's slow-consumer error goes
// to the structured log and the metric, not to stderr.
func TestNATSSlowConsumerIsStructured(t *testing.T) {
	l, buf, reg := newLogs(t)
	nc, err := kvstream.NATSConfig{URL: testenv.NATSURL(t), Logger: slog.New(slog.NewJSONHandler(buf, nil)), ErrorHandler: l.NATSErrorHandler()}.Connect()
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	release := make(chan struct{})
	subj := "liblog." + testenv.UniqueName(t)
	sub, err := nc.Subscribe(subj, func(*nats.Msg) { <-release })
	if err != nil {
		t.Fatal(err)
	}
	defer close(release)
	if err := sub.SetPendingLimits(5, 1<<20); err != nil {
		t.Fatal(err)
	}
	for range 200 {
		if err := nc.Publish(subj, []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for count(t, reg, "nats.go", "slow_consumer") == 0 {
		if time.Now().After(deadline) {
			t.Fatal("slow consumer not reported")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The count goes up before the line is written (emit counts, then
	// logs): wait for the line too.
	for {
		found := false
		for _, rec := range records(t, buf) {
			if rec["kind"] == "slow_consumer" && rec["subject"] == subj {
				found = true
			}
		}
		if found {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no structured slow_consumer record with the subject")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRedisKindIsTheCallSite(t *testing.T) {
	l, buf, reg := newLogs(t)
	r := l.Redis()
	for i := range 100 {
		r.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", i, "refused")
	}
	r.Printf(context.Background(), "%s", "bare")
	if n := count(t, reg, "go-redis", "redis: connection pool: failed to dial after"); n != 100 {
		t.Fatalf("counted %v, want 100 under the call site's kind", n)
	}
	if n := count(t, reg, "go-redis", "log"); n != 1 {
		t.Fatalf("a format with no words counted %v under kind log", n)
	}
	recs := records(t, buf)
	if len(recs) != liblog.Burst+1 {
		t.Fatalf("%d records, want %d (the rate) + 1 (another kind)", len(recs), liblog.Burst+1)
	}
}
