package httpapi

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkHeaderBytes: the header-size check every request pays.
func BenchmarkHeaderBytes(b *testing.B) {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	for _, h := range []string{"Content-Type", "Authorization", "User-Agent", "Accept", router.TenantHeader, "X-Request-Id", "Traceparent"} {
		r.Header.Set(h, "some-typical-value-of-forty-characters-x")
	}
	b.ReportAllocs()
	for b.Loop() {
		if headerBytes(r) < 100 {
			b.Fatal("short")
		}
	}
}
