package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

// tailRun is a tail running in the background.
type tailRun struct {
	out, errOut *testenv.Logs // written by the tail, read by the test meanwhile
	done        chan error
	cancel      context.CancelFunc
}

func startTail(t *testing.T, args ...string) *tailRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &tailRun{out: &testenv.Logs{}, errOut: &testenv.Logs{}, done: make(chan error, 1), cancel: cancel}
	go func() { r.done <- tailEvictions(ctx, args, r.out, r.errOut) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
			t.Error("tail did not stop after cancel")
		}
	})
	return r
}

// ready waits until the tail follows the stream, so that no record
// published from now on is missed.
func (r *tailRun) ready(t *testing.T) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, "the tail to follow", func() bool { return strings.Contains(r.errOut.String(), "following ") })
}

// wait returns the tail's result, failing the test if it does not end.
func (r *tailRun) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("tail did not end; stdout:\n%s\nstderr:\n%s", r.out, r.errOut)
		return nil
	}
}

// publisher publishes eviction records as the bridge does.
type publisher struct {
	t    *testing.T
	nc   *nats.Conn
	pool string
}

func (p publisher) publish(rec kvstream.EvictionRecord) {
	p.t.Helper()
	rec.Pool = p.pool
	if rec.Time.IsZero() {
		rec.Time = time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)
	}
	b, err := json.Marshal(rec)
	if err != nil {
		p.t.Fatal(err)
	}
	p.raw(rec.Instance, b)
}

func (p publisher) raw(instance string, b []byte) {
	p.t.Helper()
	subj, err := kvstream.EvictionsSubject(p.pool, instance)
	if err != nil {
		p.t.Fatal(err)
	}
	if err := p.nc.Publish(subj, b); err != nil {
		p.t.Fatal(err)
	}
	if err := p.nc.Flush(); err != nil {
		p.t.Fatal(err)
	}
}

// records are the published records of the tail tests, in order.
var tailRecords = []kvstream.EvictionRecord{
	{Instance: "vllm-0", Tier: "gpu", Blocks: 3, Hashes: []uint64{1, 2, 0xdeadbeef}, Reason: kvstream.ReasonEvicted},
	{Instance: "vllm-1", Tier: "cpu", Blocks: 100, Hashes: []uint64{7, 8, 9, 10}, Reason: kvstream.ReasonEvicted},
	{Instance: "vllm-0", Tier: kvstream.TierAll, Blocks: 9, Reason: kvstream.ReasonCleared},
	{Instance: "vllm-1", Tier: "gpu", Blocks: 1, Hashes: []uint64{11}, Reason: kvstream.ReasonGap},
}

// tailCases are the filters both transports must apply alike: want are
// indexes into tailRecords, in order.
var tailCases = []struct {
	name string
	args []string
	want []int
}{
	{"all", nil, []int{0, 1, 2, 3}},
	{"instance", []string{"--instance", "vllm-1"}, []int{1, 3}},
	{"tier gpu keeps clears", []string{"--tier", "GPU"}, []int{0, 2, 3}},
	{"tier cpu", []string{"--tier", "cpu"}, []int{1, 2}},
	{"instance and tier", []string{"--instance", "vllm-0", "--tier", "gpu"}, []int{0, 2}},
}

// checkJSONLines checks the tail printed exactly the wanted records.
func checkJSONLines(t *testing.T, out string, want []int) {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), out)
	}
	for i, l := range lines {
		var got kvstream.EvictionRecord
		if err := json.Unmarshal([]byte(l), &got); err != nil {
			t.Fatalf("line %d %q: %v", i, l, err)
		}
		w := tailRecords[want[i]]
		if got.Instance != w.Instance || got.Tier != w.Tier || got.Blocks != w.Blocks || got.Reason != w.Reason || len(got.Hashes) != len(w.Hashes) || got.Time.IsZero() {
			t.Errorf("line %d = %+v, want %+v", i, got, w)
		}
	}
}

// natsConn starts a NATS server and connects to it.
func natsConn(t *testing.T) (*testenv.NATSServer, *nats.Conn) {
	t.Helper()
	srv := testenv.StartNATS(t)
	return srv, testenv.Connect(t, srv.URL())
}

// TestTailEvictionsFilters: both transports print the records tailCases
// want, and neither prints another pool's record; over NATS, where the
// tail decodes what the bridge published, malformed records are skipped and
// reported.
func TestTailEvictionsFilters(t *testing.T) {
	srv, nc := natsConn(t)
	routerURL := sseRouter(t, nc)
	for _, tr := range []struct {
		name      string
		args      []string
		malformed bool
	}{
		{"nats", []string{"--nats", srv.URL()}, true},
		{"sse", []string{"--router", routerURL}, false},
	} {
		for _, tc := range tailCases {
			t.Run(tr.name+"/"+tc.name, func(t *testing.T) {
				pool := testenv.UniqueName(t)
				pub := publisher{t, nc, pool}
				args := append(append([]string{"--pool", pool, "--json", "--count", itoa(len(tc.want))}, tr.args...), tc.args...)
				r := startTail(t, args...)
				r.ready(t)
				publisher{t, nc, pool + "x"}.publish(tailRecords[0])
				if tr.malformed {
					pub.raw("vllm-0", []byte("{not json"))
					pub.raw("vllm-1", []byte("[1,2]"))
				}
				for _, rec := range tailRecords {
					pub.publish(rec)
				}
				if err := r.wait(t); err != nil {
					t.Fatalf("tail: %v\nstderr %s", err, r.errOut)
				}
				checkJSONLines(t, r.out.String(), tc.want)
				if tr.malformed && !strings.Contains(r.errOut.String(), "skipped a malformed record from kv.evictions."+pool+".vllm-") {
					t.Errorf("stderr %q: want the malformed record reported", r.errOut)
				}
			})
		}
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// sseRouter serves the eviction stream the way the router mounts it, on
// any port, for the whole test.
func sseRouter(t *testing.T, nc *nats.Conn) string {
	t.Helper()
	url, _ := sseRouterAt(t, nc, "127.0.0.1:0")
	return url
}

// sseRouterAt serves the eviction stream on addr ("127.0.0.1:0" for any
// port) until stop, which closes the streams as a router shutting down does.
func sseRouterAt(t *testing.T, nc *nats.Conn, addr string) (url string, stop func()) {
	t.Helper()
	var ln net.Listener
	var err error
	for i := 0; i < 50; i++ { // the old router's port may linger a moment
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	mux := http.NewServeMux()
	mux.Handle("GET /v1/kv/evictions", kvstream.EvictionSSEHandler(ctx, nc, kvstream.EvictionSSEConfig{Heartbeat: 20 * time.Millisecond}))
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(ln) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			sctx, done := context.WithTimeout(context.Background(), 5*time.Second)
			defer done()
			_ = srv.Shutdown(sctx)
		})
	}
	t.Cleanup(stop)
	return "http://" + ln.Addr().String(), stop
}

// TestTailEvictionsEachAndReconnect: --each prints one row per record; the
// router restarting ends its stream with a close event, and the tail
// reconnects to the new router and goes on.
func TestTailEvictionsEachAndReconnect(t *testing.T) {
	_, nc := natsConn(t)
	url, stopRouter := sseRouterAt(t, nc, "127.0.0.1:0")
	pool := testenv.UniqueName(t)
	r := startTail(t, "--pool", pool, "--router", url, "--each")
	r.ready(t)
	for _, rec := range tailRecords[:2] {
		publisher{t, nc, pool}.publish(rec)
	}
	testenv.WaitFor(t, 10*time.Second, "2 rows", func() bool { return strings.Count(r.out.String(), "\n") == 3 })
	stopRouter()
	testenv.WaitFor(t, 10*time.Second, "the tail to say it reconnects", func() bool {
		return strings.Contains(r.errOut.String(), "the router closed the stream (shutting down); reconnecting")
	})
	_, _ = sseRouterAt(t, nc, strings.TrimPrefix(url, "http://"))
	testenv.WaitFor(t, 10*time.Second, "the tail to follow the new router", func() bool { return strings.Count(r.errOut.String(), "following ") == 2 })
	for _, rec := range tailRecords[2:] {
		publisher{t, nc, pool}.publish(rec)
	}
	testenv.WaitFor(t, 10*time.Second, "4 rows", func() bool { return strings.Count(r.out.String(), "\n") == 5 })
	r.cancel()
	if err := r.wait(t); err != nil {
		t.Fatalf("interrupted tail: %v", err)
	}
	want := []string{
		"TIME                      INSTANCE              TIER     BLOCKS  REASON    HASHES",
		"2026-11-29T10:00:00.000Z  vllm-0                gpu           3  evicted   0000000000000001,0000000000000002,00000000deadbeef",
		"2026-11-29T10:00:00.000Z  vllm-1                cpu         100  evicted   0000000000000007,0000000000000008,0000000000000009 +97",
		"2026-11-29T10:00:00.000Z  vllm-0                all           9  cleared   -",
		"2026-11-29T10:00:00.000Z  vllm-1                gpu           1  gap       000000000000000b",
	}
	if got := strings.TrimSpace(r.out.String()); got != strings.Join(want, "\n") {
		t.Errorf("table:\n%s\nwant:\n%s", got, strings.Join(want, "\n"))
	}
}

// TestTailEvictionsSummary: by default the tail sums records per instance,
// tier and reason over each period instead of a line per record.
func TestTailEvictionsSummary(t *testing.T) {
	srv, nc := natsConn(t)
	pool := testenv.UniqueName(t)
	// A long period, so every record below lands in one summary: the one
	// printed when --count ends the tail.
	r := startTail(t, "--pool", pool, "--nats", srv.URL(), "--every", "1h", "--count", "1003")
	r.ready(t)
	pub := publisher{t, nc, pool}
	for i := range 1000 {
		pub.publish(kvstream.EvictionRecord{Instance: "vllm-0", Tier: "gpu", Blocks: 1 + i%2, Hashes: []uint64{uint64(i)}, Reason: kvstream.ReasonEvicted})
	}
	pub.publish(tailRecords[1])
	pub.publish(tailRecords[2])
	pub.publish(tailRecords[3])
	if err := r.wait(t); err != nil {
		t.Fatalf("tail: %v\nstderr %s", err, r.errOut)
	}
	lines := strings.Split(strings.TrimSpace(r.out.String()), "\n")
	if len(lines) != 5 {
		t.Fatalf("summary of 1003 records in %d lines, want 5:\n%s", len(lines), r.out)
	}
	if strings.Join(strings.Fields(lines[0]), " ") != "TIME INSTANCE TIER REASON RECORDS BLOCKS" {
		t.Errorf("header %q", lines[0])
	}
	want := []string{"vllm-0 gpu evicted 1000 1500", "vllm-1 cpu evicted 1 100", "vllm-0 all cleared 1 9", "vllm-1 gpu gap 1 1"}
	for i, w := range want {
		if f := strings.Fields(lines[i+1]); len(f) != 6 || strings.Join(f[1:], " ") != w {
			t.Errorf("row %d %q, want time + %q", i, lines[i+1], w)
		}
	}
}

func TestTailEvictionsInterrupt(t *testing.T) {
	srv, nc := natsConn(t)
	routerURL := sseRouter(t, nc)
	for _, extra := range [][]string{{"--router", routerURL}, {"--nats", srv.URL()}} {
		pool := testenv.UniqueName(t)
		r := startTail(t, append([]string{"--pool", pool}, extra...)...)
		r.ready(t)
		r.cancel() // Ctrl-C
		if err := r.wait(t); err != nil {
			t.Errorf("%v: interrupted tail returned %v, want a clean end", extra, err)
		}
	}
}

func TestTailEvictionsErrors(t *testing.T) {
	_, nc := natsConn(t)
	routerURL := sseRouter(t, nc)
	closed := "http://127.0.0.1:" + itoa(testenv.FreePort(t))
	tests := []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"--router", routerURL}, 2, "--pool is required"},
		{[]string{"--pool", "a.b", "--router", routerURL}, 2, `pool "a.b" has '.'`},
		{[]string{"--pool", "p", "--instance", "*", "--router", routerURL}, 2, "--instance"},
		{[]string{"--pool", "p", "--tier", "vram", "--router", routerURL}, 2, `--tier "vram": want gpu, cpu, disk, shared or all`},
		{[]string{"--pool", "p", "--count", "-1", "--router", routerURL}, 2, "--count -1"},
		{[]string{"--pool", "p", "--nats-creds", "x"}, 2, "need --nats"},
		{[]string{"--pool", "p", "--router", closed}, 1, "connection refused"},
		{[]string{"--pool", "p", "--router", routerURL + "/old"}, 1, "404 Not Found"},
		{[]string{"--pool", "p", "--nats", "nats://127.0.0.1:" + itoa(testenv.FreePort(t)), "--timeout", "1s"}, 1, "connect to nats"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, out, errOut := runCLI(t, append([]string{"tail", "evictions"}, tc.args...)...)
			if code != tc.code || !strings.Contains(errOut, tc.msg) {
				t.Errorf("exit %d (want %d), stderr %q (want %q)\nstdout %s", code, tc.code, errOut, tc.msg, out)
			}
		})
	}
}

func TestReadSSE(t *testing.T) {
	type ev struct{ event, data string }
	tests := []struct {
		name string
		in   string
		want []ev
	}{
		{"router shape", ": kv evictions for pool p\n\nevent: eviction\ndata: {\"a\":1}\n\n: ping\n\nevent: close\ndata: {}\n\n", []ev{{"eviction", `{"a":1}`}, {"close", "{}"}}},
		{"crlf and no space", "data:x\r\n\r\n", []ev{{"", "x"}}},
		{"multi-line data", "data: a\ndata: b\n\n", []ev{{"", "a\nb"}}},
		{"unterminated last event is dropped", "data: a\n\ndata: b\n", []ev{{"", "a"}}},
		{"unknown fields ignored", "id: 3\nretry: 10\ndata: z\n\n", []ev{{"", "z"}}},
		{"empty", "", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got []ev
			err := readSSE(strings.NewReader(tc.in), func(e string, d []byte) error {
				got = append(got, ev{e, string(d)})
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Errorf("event %d = %q, want %q", i, got[i], tc.want[i])
				}
			}
		})
	}
	// A line longer than maxSSELine is an error, not a hang or a crash.
	err := readSSE(strings.NewReader("data: "+strings.Repeat("x", maxSSELine+1)+"\n\n"), func(string, []byte) error { return nil })
	if err == nil {
		t.Fatal("over-long line accepted")
	}
	// fn's error stops the reader.
	stop := errors.New("stop")
	n := 0
	err = readSSE(strings.NewReader("data: 1\n\ndata: 2\n\n"), func(string, []byte) error { n++; return stop })
	if !errors.Is(err, stop) || n != 1 {
		t.Fatalf("err %v after %d events", err, n)
	}
}

func FuzzReadSSE(f *testing.F) {
	f.Add([]byte(": hi\n\nevent: eviction\ndata: {\"pool\":\"p\",\"blocks\":3}\n\nevent: close\ndata: {}\n\n"))
	f.Add([]byte("data:\r\ndata: x\n\n\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		sink := &recordSink{w: io.Discard, stderr: io.Discard}
		_ = readSSE(bytes.NewReader(in), func(event string, data []byte) error {
			if event == "close" {
				return io.EOF
			}
			return sink.add("fuzz", data)
		})
		sinkJSON := &recordSink{w: io.Discard, stderr: io.Discard, json: true, tier: "gpu"}
		_ = sinkJSON.add("fuzz", in)
	})
}

// BenchmarkTailRecord is the per-record cost of 'tail evictions' (decode,
// filter, print): a busy pool evicts thousands of blocks per second, in
// records of up to 64 hashes.
func BenchmarkTailRecord(b *testing.B) {
	hs := make([]uint64, kvstream.MaxEvictionHashes)
	for i := range hs {
		hs[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	rec, _ := json.Marshal(kvstream.EvictionRecord{Pool: "llama", Instance: "vllm-0", Tier: "gpu", Blocks: 64, Hashes: hs, Time: time.Now(), Reason: kvstream.ReasonEvicted})
	for _, mode := range []struct {
		name string
		json bool
	}{{"table", false}, {"json", true}} {
		b.Run(mode.name, func(b *testing.B) {
			sink := &recordSink{w: io.Discard, stderr: io.Discard, json: mode.json}
			b.ReportAllocs()
			b.SetBytes(int64(len(rec)))
			for b.Loop() {
				if err := sink.add("bench", rec); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
