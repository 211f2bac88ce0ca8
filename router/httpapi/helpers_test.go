package httpapi_test

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func newRecorder(t *testing.T, h http.Handler, method, path string) *httptest.ResponseRecorder {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, path, nil))
	return rec
}
