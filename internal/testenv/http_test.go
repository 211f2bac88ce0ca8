package testenv

import (
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
)

// TestDoAndSSEData: Do sends the body, the JSON Content-Type and the
// headers, and returns the status, headers and body whole; SSEData keeps
// only the data fields, in order; EachSSEData stops when fn says so.
func TestDoAndSSEData(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" || r.Header.Get("X-Tenant") != "t1" || string(b) != `{"a":1}` {
			http.Error(w, "unexpected request", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(w, "event: x\ndata: one\n\n: comment\ndata: two\n\ndata: [DONE]\n\n")
	}))
	defer ts.Close()
	r := Do(t, http.MethodPost, ts.URL, []byte(`{"a":1}`), map[string]string{"X-Tenant": "t1"})
	if r.Status != http.StatusAccepted || r.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d, Content-Type %q: %s", r.Status, r.Header.Get("Content-Type"), r.Body)
	}
	if got := SSEData(strings.NewReader(string(r.Body))); !slices.Equal(got, []string{"one", "two", "[DONE]"}) {
		t.Fatalf("SSEData %q", got)
	}
	var first []string
	EachSSEData(strings.NewReader(string(r.Body)), func(d string) bool { first = append(first, d); return false })
	if !slices.Equal(first, []string{"one"}) {
		t.Fatalf("EachSSEData read on after fn returned false: %q", first)
	}
	if r := PostJSON(t, ts.URL, map[string]int{"a": 1}); r.Status != http.StatusBadRequest {
		t.Fatalf("PostJSON without the header: %d, want 400", r.Status)
	}
}
