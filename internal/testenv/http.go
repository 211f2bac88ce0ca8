package testenv

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Result is an HTTP response, read whole.
type Result struct {
	Status int
	Header http.Header
	Body   []byte
}

// doClient gives up on a response not read whole within two minutes: a
// handler that streams when it should answer (an event stream served for
// an unknown pool) fails its test with the URL instead of hanging it
// until go test's own timeout.
var doClient = &http.Client{Timeout: 2 * time.Minute}

// Do sends a request with a JSON body (nil for none) and the headers hdr
// to url and reads the response whole, failing the test when it cannot
// (or not within two minutes).
func Do(t testing.TB, method, url string, body []byte, hdr map[string]string) Result {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := doClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return Result{resp.StatusCode, resp.Header, b}
}

// PostJSON posts v, encoded as JSON, to url.
func PostJSON(t testing.TB, url string, v any) Result {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return Do(t, http.MethodPost, url, b, nil)
}

// SSEData returns the data fields of the server-sent events in r, in order
// ("[DONE]" included), reading until r ends.
func SSEData(r io.Reader) []string {
	var out []string
	EachSSEData(r, func(d string) bool { out = append(out, d); return true })
	return out
}

// EachSSEData calls fn with the data field of each server-sent event in r
// as it arrives, until r ends or fn returns false.
func EachSSEData(r io.Reader, fn func(data string) bool) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok && !fn(d) {
			return
		}
	}
}
