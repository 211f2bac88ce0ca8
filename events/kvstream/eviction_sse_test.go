package kvstream

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// A client that stops reading (a stalled proxy, a suspended process)
// ends its stream once a write has waited WriteTimeout. Before the fix
// the handler's write blocked for good (the router's server has no write
// timeout, streams last), holding the goroutine and the subscription, and
// the close event at shutdown behind it: here the handler had not
// returned 20 s after the socket filled.
func TestEvictionSSEStalledClientEnds(t *testing.T) {
	ctx := testenv.Context(t, time.Minute)
	nc := testenv.Connect(t, testenv.NATSURL(t))
	pool := "p_" + testenv.UniqueName(t)
	h := EvictionSSEHandler(ctx, nc, EvictionSSEConfig{Heartbeat: time.Hour, WriteTimeout: 200 * time.Millisecond})
	returned := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(returned)
		h.ServeHTTP(w, r)
	}))
	defer srv.Close()
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "GET /?pool=%s HTTP/1.1\r\nHost: x\r\n\r\n", pool); err != nil {
		t.Fatal(err)
	}
	// Read the response head, so the subscription is known to be made;
	// then read nothing more.
	br := bufio.NewReader(conn)
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(l, ": kv evictions") {
			break
		}
	}
	subj, _ := EvictionsSubject(pool, "i0")
	hashes := make([]uint64, MaxEvictionHashes)
	for i := range hashes {
		hashes[i] = ^uint64(0) - uint64(i)
	}
	rec, err := EvictionRecord{Pool: pool, Instance: "i0", Tier: "gpu", Blocks: len(hashes), Hashes: hashes, Reason: ReasonEvicted}.AppendJSON(nil)
	if err != nil {
		t.Fatal(err)
	}
	// Publish until the handler has returned (the fix) or far more than
	// any socket buffer holds has been offered and 20 s passed.
	deadline := time.Now().Add(20 * time.Second)
	for sent := 0; ; sent++ {
		select {
		case <-returned:
			return
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the handler still writes to a client that reads nothing, %d records (%d MB) offered", sent, sent*len(rec)>>20)
		}
		if err := nc.Publish(subj, rec); err != nil {
			t.Fatal(err)
		}
		if sent%256 == 255 {
			if err := nc.FlushTimeout(10 * time.Second); err != nil {
				t.Fatal(err)
			}
		}
	}
}
