package router

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"
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
		wantBytes int
	}{
		{"claims the limit, sends 10 bytes", limit, bytes.Repeat([]byte("x"), 10), 16 << 20, 10},
		{"claims 8 MiB, sends 10 bytes", 8 << 20, bytes.Repeat([]byte("x"), 10), 4 << 20, 10},
		{"honest 3 MiB body", 3 << 20, bytes.Repeat([]byte("y"), 3<<20), 64 << 20, 3 << 20},
		{"honest small body", 100, bytes.Repeat([]byte("z"), 100), 1 << 20, 100},
	}
	s := &Server{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPost, "/invocations", bytes.NewReader(tt.body))
			r.ContentLength = tt.declared
			w := httptest.NewRecorder()
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			got, status := s.readBody(w, r, limit)
			runtime.ReadMemStats(&after)
			if status != 0 {
				t.Fatalf("status %d, body %s", status, w.Body.String())
			}
			if len(got) != tt.wantBytes || !bytes.Equal(got, tt.body) {
				t.Fatalf("read %d bytes, want %d", len(got), tt.wantBytes)
			}
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > tt.maxAlloc {
				t.Fatalf("readBody allocated %d bytes for a %d-byte body declared as %d, want at most %d",
					alloc, len(tt.body), tt.declared, tt.maxAlloc)
			}
		})
	}
}
