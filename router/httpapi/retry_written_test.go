package httpapi_test

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/httpapi"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/router/servertest"
)

// silentMode is what silentUpstream does once it has read a whole request.
type silentMode int

const (
	silentClose silentMode = iota // close the connection (FIN)
	silentReset                   // close it with a RST
	silentHang                    // keep it open and never answer
)

// silentUpstream accepts connections, reads one whole request (headers and
// body) from each, then fails it without answering a byte.
type silentUpstream struct {
	ln       net.Listener
	mode     silentMode
	requests atomic.Int64 // requests read in full
	wg       sync.WaitGroup
	mu       sync.Mutex // guards conns
	conns    []net.Conn
}

func newSilentUpstream(t *testing.T, mode silentMode) *silentUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &silentUpstream{ln: ln, mode: mode}
	u.wg.Add(1)
	go u.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		u.mu.Lock()
		for _, c := range u.conns {
			_ = c.Close()
		}
		u.mu.Unlock()
		u.wg.Wait()
	})
	return u
}

func (u *silentUpstream) URL() string { return "http://" + u.ln.Addr().String() }

func (u *silentUpstream) accept() {
	defer u.wg.Done()
	for {
		c, err := u.ln.Accept()
		if err != nil {
			return // listener closed by the test's cleanup
		}
		u.mu.Lock()
		u.conns = append(u.conns, c)
		u.mu.Unlock()
		u.wg.Add(1)
		go u.serve(c)
	}
}

func (u *silentUpstream) serve(c net.Conn) {
	defer u.wg.Done()
	defer c.Close()
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	if _, err := io.Copy(io.Discard, req.Body); err != nil {
		return
	}
	u.requests.Add(1)
	switch u.mode {
	case silentReset:
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
	case silentHang:
		_, _ = io.Copy(io.Discard, br) // until the router gives up (or cleanup)
	}
}

// refusedURL is an address nothing listens on: connecting is refused.
func refusedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

// firstChoiceText returns a user message whose rendezvous order puts
// instance id first, so the test controls which instance fails.
func firstChoiceText(t *testing.T, srv *httpapi.Server, id string) string {
	t.Helper()
	p, _ := srv.Pool("llama")
	for i := range 1000 {
		text := "written " + string(rune('a'+i%26)) + string(rune('a'+i/26))
		order := router.RendezvousOrder(&router.Request{RoutingText: "You are a helpful assistant.\n" + text}, p.Instances())
		if order[0].ID() == id {
			return text
		}
	}
	t.Fatalf("no text puts %s first", id)
	return ""
}

// TestRetryOnlyBeforeWrite: a transport failure is retried on the next
// candidate only when the request never reached the first instance; once
// it was written, the instance may be prefilling it, so the client gets
// the failure and the next instance is not called.
func TestRetryOnlyBeforeWrite(t *testing.T) {
	tests := []struct {
		name       string
		bad        func(t *testing.T) (url string, requests func() int64)
		retried    bool
		wantStatus int
	}{
		{"connection refused", func(t *testing.T) (string, func() int64) {
			return refusedURL(t), func() int64 { return 0 }
		}, true, 200},
		{"closed after reading the request", func(t *testing.T) (string, func() int64) {
			u := newSilentUpstream(t, silentClose)
			return u.URL(), u.requests.Load
		}, false, 502},
		{"reset after reading the request", func(t *testing.T) (string, func() int64) {
			u := newSilentUpstream(t, silentReset)
			return u.URL(), u.requests.Load
		}, false, 502},
		{"response header timeout", func(t *testing.T) (string, func() int64) {
			u := newSilentUpstream(t, silentHang)
			return u.URL(), u.requests.Load
		}, false, 504},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			badURL, badRequests := tc.bad(t)
			good := routertest.New(t, "good", model)
			pc := config.PoolConfig{
				Name: "llama", Model: model,
				Health:    config.HealthConfig{Disable: true},
				Discovery: config.DiscoveryConfig{Disable: true},
				Instances: []config.InstanceConfig{{ID: "bad", URL: badURL}, {ID: good.ID, URL: good.URL()}},
			}
			cfg := config.Config{Pools: []config.PoolConfig{pc}}
			cfg.Proxy.ResponseHeaderTimeout = 300 * time.Millisecond
			srv, ts := servertest.Serve(t, cfg, httpapi.Options{Logger: slog.New(slog.DiscardHandler)})
			h := &harness{t: t, srv: srv, ts: ts}

			r := h.do("POST", "/v1/chat/completions", chatBody(model, firstChoiceText(t, srv, "bad"), false), nil)
			if r.Status != tc.wantStatus {
				t.Fatalf("status %d, want %d: %s", r.Status, tc.wantStatus, r.Body)
			}
			if tc.retried {
				if got := r.Header.Get(router.HeaderInstance); got != good.ID {
					t.Errorf("answered by %q, want the retry on %q", got, good.ID)
				}
				if a := r.Header.Get(httpapi.HeaderAttempts); a != "2" {
					t.Errorf("attempts %q, want 2", a)
				}
				if n := good.Requests.Load(); n != 1 {
					t.Errorf("second instance saw %d requests, want 1", n)
				}
				return
			}
			errorOf(t, r)
			if got := r.Header.Get(router.HeaderInstance); got != "bad" {
				t.Errorf("failure reported for %q, want bad", got)
			}
			if a := r.Header.Get(httpapi.HeaderAttempts); a != "" {
				t.Errorf("attempts %q: the request was retried", a)
			}
			if n := badRequests(); n != 1 {
				t.Errorf("first instance read %d whole requests, want 1", n)
			}
			if n := good.Requests.Load(); n != 0 {
				t.Errorf("second instance saw %d requests after the first had the request: duplicated", n)
			}
		})
	}
}
