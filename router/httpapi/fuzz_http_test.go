package httpapi_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

// FuzzServeHTTP sends arbitrary bodies and tenant headers through the real
// handler to a real upstream: the router never panics, answers with a known
// status, and every error it produces itself is OpenAI-shaped JSON.
func FuzzServeHTTP(f *testing.F) {
	for _, s := range []string{
		`{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"` + model + `","prompt":[1,2,3],"stream":true}`,
		`{"model":"` + model + `","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"prompt_cache_key":"k"}`,
		`{"model":"nope","prompt":"x"}`, `{"prompt":"x"}`, `{`, ``, `[]`, `{"model":"` + model + `","prompt":[-1]}`,
	} {
		f.Add([]byte(s), "tenant", uint8(0))
		f.Add([]byte(s), "", uint8(1))
		f.Add([]byte(s), "\x01", uint8(2))
	}
	h := newHarness(f, 2, func(c *config.Config) { c.MaxBodyBytes = 1 << 16 })
	paths := []string{"/v1/chat/completions", "/v1/completions", "/invocations", "/invocations-response-stream"}
	f.Fuzz(func(t *testing.T, body []byte, tenant string, p uint8) {
		req := httptest.NewRequest("POST", paths[int(p)%len(paths)], bytes.NewReader(body))
		if tenant != "" {
			req.Header.Set("X-Amzn-SageMaker-Prefix-Aware-Id", tenant)
		}
		rec := httptest.NewRecorder()
		h.srv.Handler().ServeHTTP(rec, req)
		switch rec.Code {
		case http.StatusOK:
			if rec.Header().Get("X-Kvrouter-Instance") == "" {
				t.Fatal("200 without decision headers")
			}
		case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge:
			var e struct {
				Error struct {
					Message string `json:"message"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error.Code != rec.Code || e.Error.Message == "" {
				t.Fatalf("%d with a non-OpenAI error body %q (%v)", rec.Code, rec.Body.Bytes(), err)
			}
		default:
			t.Fatalf("unexpected status %d: %s", rec.Code, rec.Body.Bytes())
		}
	})
}
