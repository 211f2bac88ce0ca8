package httpapi

import (
	"bufio"
	"bytes"
	"fmt"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"io"
	"mime"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// A declared Content-Length is not an allocation the client gets for free:
// a client that claims the limit and sends a few bytes must not pin the
// limit's worth of memory, and real bodies of any size still read whole.
func TestReadBodyPreallocIsBounded(t *testing.T) {
	const limit = 256 << 20
	tests := []struct {
		name      string
		declared  int64
		body      []byte
		maxAlloc  uint64 // bytes allocated by readBody, at most
		wantBytes int    // -1: refused as cut short (400)
	}{
		{"claims the limit, sends 10 bytes", limit, bytes.Repeat([]byte("x"), 10), 2 << 20, -1},
		{"claims 8 MiB, sends 10 bytes", 8 << 20, bytes.Repeat([]byte("x"), 10), 2 << 20, -1},
		{"honest 3 MiB body", 3 << 20, bytes.Repeat([]byte("y"), 3<<20), 8 << 20, 3 << 20},
		{"honest small body", 100, bytes.Repeat([]byte("z"), 100), 16 << 10, 100},
	}
	s := &Server{body: newBodyBudget(1 << 40)}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPost, "/invocations", bytes.NewReader(tt.body))
			r.ContentLength = tt.declared
			w := httptest.NewRecorder()
			var got []byte
			var held int64
			var status int
			alloc := testenv.Allocated(func() { got, held, status = s.readBody(w, r, limit) })
			switch {
			case tt.wantBytes < 0 && status != http.StatusBadRequest:
				t.Fatalf("status %d for a body short of its Content-Length, want 400", status)
			case tt.wantBytes >= 0 && status != 0:
				t.Fatalf("status %d, body %s", status, w.Body.String())
			case tt.wantBytes >= 0 && (len(got) != tt.wantBytes || !bytes.Equal(got, tt.body)):
				t.Fatalf("read %d bytes, want %d", len(got), tt.wantBytes)
			}
			if alloc > tt.maxAlloc {
				t.Fatalf("readBody allocated %d bytes for a %d-byte body declared as %d, want at most %d",
					alloc, len(tt.body), tt.declared, tt.maxAlloc)
			}
			s.body.release(held)
			if u := s.body.used.Load(); u != 0 {
				t.Fatalf("budget holds %d bytes after release", u)
			}
		})
	}
}

// TestReadBodyCutShort: an upload that ends before its Content-Length, or
// before its chunked encoding's last chunk, is refused (400), not taken for
// the whole body. net/http's body reader reports the cut as
// io.ErrUnexpectedEOF, which readBody took for io.ReadFull's normal end
// of a body: the truncated JSON was resolved and routed.
func TestReadBodyCutShort(t *testing.T) {
	body := `{"prompt":"` + strings.Repeat("x", 200) + `"}`
	for _, tc := range []struct{ name, head, sent string }{
		{"content-length", fmt.Sprintf("Content-Length: %d\r\n", len(body)), body[:len(body)/2]},
		{"chunked", "Transfer-Encoding: chunked\r\n", fmt.Sprintf("%x\r\n%s\r\n", len(body)/2, body[:len(body)/2])},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Server{body: newBodyBudget(1 << 40)}
			statuses := make(chan int, 1)
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got, held, status := s.readBody(w, r, 1<<20)
				s.body.release(held)
				if status == 0 {
					t.Errorf("read %d bytes of a body cut short as the whole body: %.40q", len(got), got)
				}
				statuses <- status
			}))
			defer ts.Close()
			conn, err := net.Dial("tcp", ts.Listener.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			fmt.Fprintf(conn, "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n%s", tc.head, tc.sent)
			_ = conn.(*net.TCPConn).CloseWrite()
			if status := <-statuses; status != http.StatusBadRequest {
				t.Fatalf("status %d, want 400", status)
			}
			// The client closed only its side: it reads the answer.
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if line, err := bufio.NewReader(conn).ReadString('\n'); err != nil || !strings.Contains(line, " 400 ") {
				t.Fatalf("answered %q, %v; want 400", line, err)
			}
			if s.body.used.Load() != 0 {
				t.Fatal("the budget still holds the cut body")
			}
		})
	}
}

// endless yields 'a' forever: a chunked upload that never ends.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'a'
	}
	return len(p), nil
}

// An upload without a Content-Length costs at most about the limit before
// its 413, not the doubling of a growing buffer past it, and gives its
// budget back.
func TestReadBodyChunkedOverLimitCostsTheLimit(t *testing.T) {
	for _, limit := range []int64{64 << 10, 1 << 20, 8 << 20} {
		t.Run(fmt.Sprint(limit), func(t *testing.T) {
			s := &Server{body: newBodyBudget(1 << 40)}
			r := httptest.NewRequest(http.MethodPost, "/v1/completions", io.LimitReader(endless{}, 100<<20))
			r.ContentLength = -1
			w := httptest.NewRecorder()
			var status int
			alloc := testenv.Allocated(func() { _, _, status = s.readBody(w, r, limit) })
			if status != http.StatusRequestEntityTooLarge {
				t.Fatalf("status %d, want 413", status)
			}
			// The chunks plus a probe byte each, and the recorder's answer.
			if alloc > uint64(limit)+64<<10 {
				t.Fatalf("a chunked over-limit upload allocated %d bytes with a limit of %d", alloc, limit)
			}
			if u := s.body.used.Load(); u != 0 {
				t.Fatalf("budget holds %d bytes after a refused body", u)
			}
		})
	}
}

// Every size around the chunk boundaries and the limit reads back exactly,
// with or without a Content-Length, and one byte over the limit is 413.
func TestReadBodyExactAtEverySize(t *testing.T) {
	const limit = 3 << 20
	sizes := []int{0, 1, minBodyChunk - 1, minBodyChunk, minBodyChunk + 1, 3*minBodyChunk + 7,
		smallBodyBytes, maxBodyChunk - 1, maxBodyChunk, maxBodyChunk + 1, 2*maxBodyChunk + 3, limit - 1, limit, limit + 1}
	for _, n := range sizes {
		for _, declared := range []bool{true, false} {
			t.Run(fmt.Sprintf("%d/declared=%v", n, declared), func(t *testing.T) {
				s := &Server{body: newBodyBudget(1 << 40)}
				body := make([]byte, n)
				for i := range body {
					body[i] = byte(i*7 + i>>12)
				}
				r := httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(body))
				r.ContentLength = -1
				if declared {
					r.ContentLength = int64(n)
				}
				w := httptest.NewRecorder()
				got, held, status := s.readBody(w, r, limit)
				if n > limit {
					if status != http.StatusRequestEntityTooLarge {
						t.Fatalf("status %d for %d bytes over a %d limit", status, n, limit)
					}
				} else if status != 0 || !bytes.Equal(got, body) {
					t.Fatalf("status %d, read %d bytes, want %d exactly", status, len(got), n)
				}
				if held < int64(len(got)) {
					t.Fatalf("holds %d bytes of budget for a %d-byte body", held, len(got))
				}
				s.body.release(held)
				if u := s.body.used.Load(); u != 0 {
					t.Fatalf("budget holds %d bytes after release", u)
				}
			})
		}
	}
}

// The budget refuses what it cannot cover with 503 and Retry-After, counts
// it, keeps its last quarter for small bodies, and serves again once
// reservations are released.
func TestReadBodyBudget(t *testing.T) {
	const budget = 4 << 20
	s := &Server{body: newBodyBudget(budget)}
	read := func(n int, declared bool) (*httptest.ResponseRecorder, int64, int) {
		r := httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(make([]byte, n)))
		r.ContentLength = -1
		if declared {
			r.ContentLength = int64(n)
		}
		w := httptest.NewRecorder()
		_, held, status := s.readBody(w, r, 32<<20)
		return w, held, status
	}
	// A 2 MiB chunked body fits in the large share (3 MiB) even while it
	// is joined (2 x 2 MiB would not; its chunks are less than that).
	_, held1, status := read(1<<20, false)
	if status != 0 {
		t.Fatalf("1 MiB body: status %d", status)
	}
	// Held: about 1 MiB. A second 2 MiB body needs more than the 2 MiB
	// left of the large share.
	w, _, status := read(2<<20, true)
	if status != http.StatusServiceUnavailable {
		t.Fatalf("a body beyond the budget: status %d, want 503", status)
	}
	if w.Header().Get("Retry-After") == "" || !bytes.Contains(w.Body.Bytes(), []byte("max_body_memory_bytes")) {
		t.Fatalf("503 without Retry-After or a clear message: %v %s", w.Header(), w.Body.String())
	}
	if got := s.body.rejected.Load(); got != 1 {
		t.Fatalf("rejected counter %d, want 1", got)
	}
	// Fill the large share: small bodies still fit in the reserve.
	if !s.body.reserve(smallBodyBytes+1, 3<<20-held1-64<<10) {
		t.Fatal("could not fill the large share")
	}
	for i := range 8 {
		if _, held, status := read(4<<10, true); status != 0 {
			t.Fatalf("small body %d refused with the large share full: status %d", i, status)
		} else {
			s.body.release(held)
		}
	}
	if _, _, status := read(256<<10, true); status != http.StatusServiceUnavailable {
		t.Fatalf("a 256 KiB body with the large share full: status %d, want 503", status)
	}
	s.body.release(3<<20 - held1 - 64<<10)
	s.body.release(held1)
	if u := s.body.used.Load(); u != 0 {
		t.Fatalf("budget holds %d bytes after every release", u)
	}
	if _, held, status := read(1<<20, false); status != 0 {
		t.Fatalf("after release a 1 MiB body: status %d", status)
	} else {
		s.body.release(held)
	}
}

// readBodyBuffer is how bodies were read before the budget (a
// bytes.Buffer growing by doubling), kept as the benchmark's reference.
func readBodyBuffer(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, int64, int) {
	var buf bytes.Buffer
	if r.ContentLength > 0 {
		buf.Grow(int(min(r.ContentLength, maxBodyPrealloc)))
	}
	if _, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, limit)); err != nil {
		return nil, 0, http.StatusRequestEntityTooLarge
	}
	return buf.Bytes(), 0, 0
}

// BenchmarkReadBody reports readBody's allocations per request by body size,
// with and without a Content-Length, beside the bytes.Buffer reading it
// replaced (impl=buffer):
//
//	go test -run '^$' -bench ReadBody -benchtime 2000x ./router/
func BenchmarkReadBody(b *testing.B) {
	s := &Server{body: newBodyBudget(1 << 40)}
	impls := []struct {
		name string
		read func(http.ResponseWriter, *http.Request, int64) ([]byte, int64, int)
	}{{"chunks", s.readBody}, {"buffer", readBodyBuffer}}
	for _, n := range []int{1 << 10, 16 << 10, 256 << 10, 4 << 20} {
		for _, declared := range []bool{true, false} {
			for _, impl := range impls {
				b.Run(fmt.Sprintf("%dKiB/declared=%v/impl=%s", n>>10, declared, impl.name), func(b *testing.B) {
					body := bytes.Repeat([]byte("x"), n)
					rd := bytes.NewReader(body)
					r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
					w := httptest.NewRecorder()
					b.SetBytes(int64(n))
					b.ReportAllocs()
					cpu0, ops := cputime.Process(), 0
					defer func() { b.ReportMetric(float64(cputime.Process()-cpu0)/float64(max(ops, 1)), "cpu-ns/op") }()
					for b.Loop() {
						ops++
						rd.Reset(body)
						r.Body = io.NopCloser(rd)
						r.ContentLength = -1
						if declared {
							r.ContentLength = int64(n)
						}
						_, held, status := impl.read(w, r, 32<<20)
						if status != 0 {
							b.Fatal(status)
						}
						s.body.release(held)
					}
				})
			}
		}
	}
}

// FuzzCheckContentType: never panics, and what it accepts is JSON.
func FuzzCheckContentType(f *testing.F) {
	for _, s := range []string{"", "application/json", "text/plain", "application/json; charset=utf-8", "a/b+json;x=\"y\""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ct string) {
		if checkContentType(ct) != "" || strings.TrimSpace(ct) == "" {
			return
		}
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || !strings.HasSuffix(mt, "json") {
			t.Fatalf("accepted %q (%q, %v)", ct, mt, err)
		}
	})
}
