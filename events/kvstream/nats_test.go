package kvstream

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
)

func TestEventHeadersRoundTrip(t *testing.T) {
	tests := []EventHeaders{
		{},
		{Seq: 0, HasSeq: true},
		{Seq: enginezmq.EndSeq - 1, HasSeq: true, Rank: 3, Encoding: "map", Pool: "p", Instance: "i", Model: "m"},
		{Rank: 1, Encoding: "array", Synthetic: SyntheticGap},
		{Seq: 7, HasSeq: true, Batches: 3, Encoding: "array", Pool: "p", Instance: "i"},
		{Seq: 0, HasSeq: true, Batches: MaxCoalesced},
	}
	for _, h := range tests {
		got, err := ParseEventHeaders(h.Header())
		if err != nil || got != h {
			t.Fatalf("round trip %+v -> %+v, %v", h, got, err)
		}
	}
}

func TestParseEventHeadersRejects(t *testing.T) {
	for _, kv := range [][2]string{{HeaderSeq, "x"}, {HeaderSeq, "-1"}, {HeaderSeq, "18446744073709551616"}, {HeaderRank, "-2"}, {HeaderRank, "one"}} {
		h := nats.Header{}
		h.Set(kv[0], kv[1])
		if _, err := ParseEventHeaders(h); !errors.Is(err, ErrBadHeader) {
			t.Errorf("%s=%q: err = %v, want ErrBadHeader", kv[0], kv[1], err)
		}
	}
}

// A coalesced message's headers must agree: n in 2..MaxCoalesced engine
// payloads with consecutive seqs first..last, not synthetic.
func TestParseEventHeadersRejectsCoalesced(t *testing.T) {
	for _, c := range []struct{ seq, last, n, syn string }{
		{"5", "7", "2", ""},       // range of 3, count 2
		{"5", "6", "3", ""},       // range of 2, count 3
		{"5", "4", "2", ""},       // last before first
		{"", "6", "2", ""},        // no first seq
		{"5", "", "2", ""},        // no last seq
		{"5", "6", "", ""},        // no count
		{"5", "5", "1", ""},       // one payload is not coalesced
		{"5", "6", "2", "resync"}, // synthetic
		{"0", "1024", "1025", ""}, // over MaxCoalesced
		{"5", "x", "2", ""},
		{"5", "6", "two", ""},
		{"18446744073709551615", "0", "2", ""}, // wraps
	} {
		h := nats.Header{}
		for k, v := range map[string]string{HeaderSeq: c.seq, HeaderSeqLast: c.last, HeaderBatches: c.n, HeaderSynthetic: c.syn} {
			if v != "" {
				h.Set(k, v)
			}
		}
		if got, err := ParseEventHeaders(h); !errors.Is(err, ErrBadHeader) {
			t.Errorf("%+v: got %+v, err %v, want ErrBadHeader", c, got, err)
		}
	}
}

// SplitPayload gives a single message's payload as it is, a coalesced
// one's as its parts, and refuses a coalesced payload whose value count
// differs from its header's.
func TestSplitPayload(t *testing.T) {
	one := []byte{0x92, 0x01, 0x90} // [1, []]
	parts, err := SplitPayload(EventHeaders{Seq: 3, HasSeq: true}, one, nil)
	if err != nil || len(parts) != 1 || string(parts[0]) != string(one) {
		t.Fatalf("single: %q %v", parts, err)
	}
	three := append(append(append([]byte(nil), one...), one...), one...)
	h := EventHeaders{Seq: 3, HasSeq: true, Batches: 3}
	parts, err = SplitPayload(h, three, parts)
	if err != nil || len(parts) != 3 {
		t.Fatalf("coalesced: %d parts, %v", len(parts), err)
	}
	h.Batches = 2
	if _, err := SplitPayload(h, three, nil); !errors.Is(err, events.ErrMalformed) {
		t.Fatalf("3 values under a count of 2: err = %v", err)
	}
}

// FuzzParseEventHeaders: what parses renders back to the same headers,
// and coalesced headers always describe n consecutive engine seqs.
func FuzzParseEventHeaders(f *testing.F) {
	f.Add("12", "0", "map", "", "", "")
	f.Add("x", "-1", "", "gap", "", "")
	f.Add("5", "0", "array", "", "7", "3")
	f.Add("0", "1", "", "gap", "1", "2")
	f.Add("18446744073709551614", "0", "", "", "18446744073709551615", "2")
	f.Fuzz(func(t *testing.T, seq, rank, enc, syn, last, n string) {
		h := nats.Header{}
		for k, v := range map[string]string{HeaderSeq: seq, HeaderRank: rank, HeaderEncoding: enc, HeaderSynthetic: syn,
			HeaderSeqLast: last, HeaderBatches: n} {
			if v != "" {
				h.Set(k, v)
			}
		}
		got, err := ParseEventHeaders(h)
		if err != nil {
			return
		}
		if got.Coalesced() && (!got.HasSeq || got.Synthetic != "" || got.LastSeq()-got.Seq != uint64(got.Batches-1) || got.Batches > MaxCoalesced) {
			t.Fatalf("accepted inconsistent coalesced headers: %+v", got)
		}
		if !got.Coalesced() && (got.Batches != 0 || got.LastSeq() != got.Seq) {
			t.Fatalf("batches without coalescing: %+v", got)
		}
		again, err := ParseEventHeaders(got.Header())
		if err != nil || again != got {
			t.Fatalf("re-parse %+v -> %+v %v", got, again, err)
		}
	})
}

func TestEnsureStreamAndBucket(t *testing.T) {
	ctx := testenv.Context(t, 30*time.Second)
	nc := testenv.Connect(t, testenv.NATSURL(t))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := testenv.UniqueName(t)
	cfg := StreamConfig{Name: "S_" + name, MaxAge: time.Minute, MaxMsgs: 10, Memory: true}
	s, err := EnsureStream(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.MaxAge != time.Minute || info.Config.MaxMsgs != 10 || info.Config.MaxBytes != 1<<30 ||
		len(info.Config.Subjects) != 1 || info.Config.Subjects[0] != "kv.events.>" {
		t.Fatalf("stream config %+v", info.Config)
	}
	// Idempotent, and an existing stream is left alone.
	if _, err := EnsureStream(ctx, js, StreamConfig{Name: cfg.Name, MaxMsgs: 99}); err != nil {
		t.Fatal(err)
	}
	if info, _ = s.Info(ctx); info.Config.MaxMsgs != 10 {
		t.Fatalf("existing stream changed: %d", info.Config.MaxMsgs)
	}
	if _, err := EnsureStream(ctx, js, StreamConfig{Name: "X_" + name, MaxAge: -time.Second}); err == nil {
		t.Fatal("negative max age accepted")
	}
	kv, err := EnsureBucket(ctx, js, BucketConfig{Name: "B_" + name, Memory: true})
	if err != nil {
		t.Fatal(err)
	}
	key, _ := SnapshotKey("p", "i")
	if _, err := kv.Put(ctx, key, []byte("x")); err != nil {
		t.Fatal(err)
	}
	kv2, err := EnsureBucket(ctx, js, BucketConfig{Name: "B_" + name})
	if err != nil {
		t.Fatal(err)
	}
	if e, err := kv2.Get(ctx, key); err != nil || string(e.Value()) != "x" {
		t.Fatalf("bucket recreated? %v", err)
	}
}

func TestEmbeddedNATS(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	srv, err := StartEmbeddedNATS(ctx, EmbeddedNATSConfig{Port: -1, StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(nc)
	if _, err := EnsureStream(ctx, js, StreamConfig{}); err != nil {
		t.Fatalf("jetstream not enabled: %v", err)
	}
	nc.Close()
	cancel() // the server stops with its context
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := nats.Connect(srv.ClientURL(), nats.NoReconnect()); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("embedded server still up after its context ended")
		}
		time.Sleep(20 * time.Millisecond)
	}
	srv.Shutdown() // idempotent
	if _, err := StartEmbeddedNATS(context.Background(), EmbeddedNATSConfig{Port: 70000}); err == nil {
		t.Fatal("port 70000 accepted")
	}
}

func TestEvictionSSE(t *testing.T) {
	ctx, cancel := context.WithCancel(testenv.Context(t, 30*time.Second))
	defer cancel()
	nc := testenv.Connect(t, testenv.NATSURL(t))
	pool := "p_" + testenv.UniqueName(t)
	srvCtx, srvStop := context.WithCancel(context.Background())
	defer srvStop()
	srv := httptest.NewServer(EvictionSSEHandler(srvCtx, nc, EvictionSSEConfig{Heartbeat: 50 * time.Millisecond}))
	defer srv.Close()

	for _, q := range []string{"", "?pool=a.b", "?pool=p&instance=x*", "?pool=p&tier=hbm"} {
		resp, err := http.Get(srv.URL + q)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%q: status %d, want 400", q, resp.StatusCode)
		}
	}

	reqCtx, reqCancel := context.WithCancel(ctx)
	defer reqCancel()
	req, _ := http.NewRequestWithContext(reqCtx, http.MethodGet, srv.URL+"?pool="+pool+"&tier=cpu", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	lines := make(chan string, 100)
	go func() {
		s := bufio.NewScanner(resp.Body)
		for s.Scan() {
			lines <- s.Text()
		}
		close(lines)
	}()
	next := func(pred func(string) bool) string {
		t.Helper()
		timeout := time.After(10 * time.Second)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatal("stream closed")
				}
				if pred(l) {
					return l
				}
			case <-timeout:
				t.Fatal("timed out reading the stream")
			}
		}
	}
	next(func(l string) bool { return l == ": ping" })

	publish := func(rec EvictionRecord) {
		subj, _ := EvictionsSubject(pool, rec.Instance)
		rec.Pool = pool
		b, _ := json.Marshal(rec)
		if err := nc.Publish(subj, b); err != nil {
			t.Fatal(err)
		}
	}
	publish(EvictionRecord{Instance: "i0", Tier: "gpu", Blocks: 1, Reason: ReasonEvicted}) // filtered out: tier
	publish(EvictionRecord{Instance: "i1", Tier: "cpu", Blocks: 2, Hashes: []uint64{7, 8}, Reason: ReasonEvicted})
	publish(EvictionRecord{Instance: "i0", Tier: TierAll, Blocks: 9, Reason: ReasonCleared})
	var got []EvictionRecord
	for len(got) < 2 {
		l := next(func(l string) bool { return strings.HasPrefix(l, "data: ") })
		var rec EvictionRecord
		if err := json.Unmarshal([]byte(strings.TrimPrefix(l, "data: ")), &rec); err != nil {
			t.Fatal(err)
		}
		got = append(got, rec)
	}
	if got[0].Instance != "i1" || got[0].Blocks != 2 || got[1].Tier != TierAll {
		t.Fatalf("records %+v", got)
	}
	// Server shutdown closes the stream cleanly.
	srvStop()
	next(func(l string) bool { return l == "event: close" })
}

func TestNATSConfigConnect(t *testing.T) {
	for _, c := range []NATSConfig{{}, {URL: "nats://x", TLSCert: "c"}, {URL: "nats://x", TLSKey: "k"}} {
		if _, err := c.Connect(); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	// A server that is not up yet: the connection comes up with it.
	ns := testenv.StartNATS(t)
	url := ns.URL()
	ns.Shutdown()
	ns.WaitForShutdown()
	nc, err := NATSConfig{URL: url, ReconnectWait: 20 * time.Millisecond}.Connect()
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if nc.IsConnected() {
		t.Fatal("connected to a stopped server")
	}
	ns = ns.Restart(t)
	deadline := time.Now().Add(10 * time.Second)
	for !nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatal("never connected after the server came up")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
