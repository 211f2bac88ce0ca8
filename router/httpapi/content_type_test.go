package httpapi_test

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
)

// doContentType posts body with Content-Type ct ("" = no header at all).
func (h *harness) doContentType(path, ct string, body []byte) result {
	h.t.Helper()
	req, err := http.NewRequest("POST", h.ts.URL+path, bytes.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	if ct != "" {
		req.Header.Set("Content-Type", ct)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return result{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// Data-plane bodies are JSON: another declared media type is 415 before
// the body is read, a missing Content-Type is taken as JSON, and a body
// that is not UTF-8 is 400; on both the OpenAI and the raw path.
func TestRequestContentTypeAndUTF8(t *testing.T) {
	h := newHarness(t, 1, nil)
	tests := []struct {
		ct     string // "" = no Content-Type header
		status int
	}{
		{"", 200},
		{"application/json", 200},
		{"application/json; charset=utf-8", 200},
		{"Application/JSON; charset=UTF-8", 200},
		{"application/vnd.kvrouter+json", 200},
		{"text/plain", 415},
		{"text/plain; charset=utf-8", 415},
		{"application/x-www-form-urlencoded", 415},
		{"multipart/form-data; boundary=x", 415},
		{"application/xml", 415},
		{"text/json", 415},
		{"application/json; charset=latin1", 415},
		{"application/json; charset", 415}, // malformed parameter
	}
	for _, path := range []string{"/v1/chat/completions", "/invocations"} {
		for _, tc := range tests {
			r := h.doContentType(path, tc.ct, chatBody(model, "hello", false))
			if r.Status != tc.status {
				t.Errorf("POST %s with Content-Type %q: %d %s, want %d", path, tc.ct, r.Status, r.Body, tc.status)
			}
			if tc.status == 415 && !strings.Contains(string(r.Body), `"invalid_request_error"`) {
				t.Errorf("415 not OpenAI-shaped: %s", r.Body)
			}
		}
		bad := []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"caf` + "\xe9" + `"}]}`)
		if r := h.do("POST", path, bad, nil); r.Status != 400 || !strings.Contains(string(r.Body), "UTF-8") {
			t.Errorf("POST %s with a Latin-1 byte: %d %s, want 400 naming UTF-8", path, r.Status, r.Body)
		}
		good := []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"café ☕ 日本"}]}`)
		if r := h.do("POST", path, good, nil); r.Status != 200 {
			t.Errorf("POST %s with multi-byte UTF-8: %d %s", path, r.Status, r.Body)
		}
	}
}
