package httpapi

import (
	"bytes"
	"encoding/json"
	"io"
)

// Caps of what the usage tee keeps: a non-streamed completion body (only
// its usage object matters; bodies beyond this are not parsed), and one SSE
// line.
const (
	maxUsageBody = 1 << 20
	maxUsageLine = 256 << 10
)

// usageTee passes a response body through unchanged while looking for
// usage.prompt_tokens_details.cached_tokens: in the whole body of a JSON
// response, or in the data lines of an event stream (vLLM sends usage in
// the last chunk when stream_options.include_usage is set).
type usageTee struct {
	rc      io.ReadCloser
	sse     bool
	onFirst func()
	first   bool
	buf     []byte // JSON: the body so far; SSE: the current line
	over    bool   // JSON: body beyond maxUsageBody; SSE: current line beyond maxUsageLine
	cached  int
	found   bool
	done    bool
}

func (t *usageTee) Read(p []byte) (int, error) {
	n, err := t.rc.Read(p)
	if n > 0 {
		if !t.first {
			t.first = true
			if t.onFirst != nil {
				t.onFirst()
			}
		}
		t.feed(p[:n])
	}
	return n, err
}

func (t *usageTee) Close() error { return t.rc.Close() }

func (t *usageTee) feed(b []byte) {
	if !t.sse {
		if t.over {
			return
		}
		if len(t.buf)+len(b) > maxUsageBody {
			t.over, t.buf = true, nil
			return
		}
		t.buf = append(t.buf, b...)
		return
	}
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		seg := b
		if i >= 0 {
			seg = b[:i]
		}
		if !t.over {
			if len(t.buf)+len(seg) > maxUsageLine {
				t.over, t.buf = true, t.buf[:0]
			} else {
				t.buf = append(t.buf, seg...)
			}
		}
		if i < 0 {
			return
		}
		if !t.over {
			t.line(t.buf)
		}
		t.buf, t.over = t.buf[:0], false
		b = b[i+1:]
	}
}

// line handles one SSE line.
func (t *usageTee) line(l []byte) {
	l = bytes.TrimSuffix(l, []byte("\r"))
	data, ok := bytes.CutPrefix(l, []byte("data:"))
	if !ok || !bytes.Contains(data, []byte(`"cached_tokens"`)) {
		return
	}
	if c, ok := parseCachedTokens(data); ok {
		t.cached, t.found = c, true
	}
}

// result finishes the scan and returns the reported cached tokens.
func (t *usageTee) result() (int, bool) {
	if !t.done {
		t.done = true
		switch {
		case !t.sse && !t.over:
			if c, ok := parseCachedTokens(t.buf); ok {
				t.cached, t.found = c, true
			}
		case t.sse && !t.over && len(t.buf) > 0:
			t.line(t.buf) // a last line without its newline
		}
		t.buf = nil
	}
	return t.cached, t.found
}

// parseCachedTokens reads usage.prompt_tokens_details.cached_tokens from a
// JSON document (a completion body or one stream chunk).
func parseCachedTokens(doc []byte) (int, bool) {
	if !bytes.Contains(doc, []byte(`"cached_tokens"`)) {
		return 0, false
	}
	var v struct {
		Usage *struct {
			Details *struct {
				Cached *int64 `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(doc, &v) != nil || v.Usage == nil || v.Usage.Details == nil || v.Usage.Details.Cached == nil {
		return 0, false
	}
	c := *v.Usage.Details.Cached
	if c < 0 || c > 1<<40 {
		return 0, false
	}
	return int(c), true
}

// cachedTokens is what an Observer's Done takes: the engine-reported
// cached prompt tokens, -1 when t is nil (no response) or none was seen.
func (t *usageTee) cachedTokens() int {
	if t == nil {
		return -1
	}
	if c, ok := t.result(); ok {
		return c
	}
	return -1
}
