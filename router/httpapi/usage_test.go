package httpapi

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"
)

// Response bodies shaped like vLLM's (OpenAI) completions: a JSON body with
// usage.prompt_tokens_details, and a stream whose last data chunk carries
// usage (stream_options.include_usage).
const (
	usageJSON = `{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],` +
		`"usage":{"prompt_tokens":1040,"total_tokens":1041,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":1024}}}`
	usageSSE = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"h\"}}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"i\"}}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n" +
		"data: [DONE]\n\n"
)

func TestUsageTee(t *testing.T) {
	tests := []struct {
		name   string
		body   string
		sse    bool
		cached int
		found  bool
	}{
		{"json", usageJSON, false, 1024, true},
		{"json without details", `{"usage":{"prompt_tokens":5}}`, false, 0, false},
		{"json details null", `{"usage":{"prompt_tokens_details":null}}`, false, 0, false},
		{"json cached null", `{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}`, false, 0, false},
		{"json negative", `{"usage":{"prompt_tokens_details":{"cached_tokens":-4}}}`, false, 0, false},
		{"json truncated", usageJSON[:len(usageJSON)-3], false, 0, false},
		{"json string in content mentioning cached_tokens", `{"choices":[{"text":"\"cached_tokens\": 5"}]}`, false, 0, false},
		{"sse", usageSSE, true, 32, true},
		{"sse crlf", strings.ReplaceAll(usageSSE, "\n", "\r\n"), true, 32, true},
		{"sse last line without newline", "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":7}}}", true, 7, true},
		{"sse no usage", "data: {\"choices\":[]}\n\ndata: [DONE]\n\n", true, 0, false},
		{"sse error event", "event: error\ndata: {\"error\":{\"message\":\"boom\"}}\n\n", true, 0, false},
		{"sse oversized line skipped", "data: {\"x\":\"" + strings.Repeat("a", maxUsageLine) + "\"}\n" + "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n", true, 3, true},
		{"json over the cap", `{"pad":"` + strings.Repeat("a", maxUsageBody) + `","usage":{"prompt_tokens_details":{"cached_tokens":3}}}`, false, 0, false},
	}
	for _, tc := range tests {
		for _, chunk := range []int{1, 7, 4096} {
			first := 0
			tee := &usageTee{rc: io.NopCloser(&chunkReader{b: []byte(tc.body), n: chunk}), sse: tc.sse, onFirst: func() { first++ }}
			out, err := io.ReadAll(tee)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out, []byte(tc.body)) {
				t.Fatalf("%s: the tee changed the body", tc.name)
			}
			if first != 1 && len(tc.body) > 0 {
				t.Errorf("%s: first-byte callback ran %d times", tc.name, first)
			}
			c, ok := tee.result()
			if c != tc.cached || ok != tc.found {
				t.Errorf("%s (chunks of %d): got (%d, %v), want (%d, %v)", tc.name, chunk, c, ok, tc.cached, tc.found)
			}
		}
	}
}

// chunkReader returns b in reads of at most n bytes.
type chunkReader struct {
	b []byte
	n int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := min(len(p), r.n, len(r.b))
	copy(p, r.b[:n])
	r.b = r.b[n:]
	return n, nil
}

// FuzzUsageTee: any body, split anywhere, passes through unchanged, and
// the result does not depend on how it was split.
func FuzzUsageTee(f *testing.F) {
	f.Add([]byte(usageJSON), false, 3)
	f.Add([]byte(usageSSE), true, 5)
	f.Add([]byte("data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":1e99}}}\n"), true, 1)
	f.Fuzz(func(t *testing.T, body []byte, sse bool, chunk int) {
		chunk = 1 + (chunk%64+64)%64
		run := func(n int) (int, bool) {
			tee := &usageTee{rc: io.NopCloser(&chunkReader{b: body, n: n}), sse: sse}
			out, err := io.ReadAll(tee)
			if err != nil || !bytes.Equal(out, body) {
				t.Fatalf("body changed (err %v)", err)
			}
			return tee.result()
		}
		c1, ok1 := run(chunk)
		c2, ok2 := run(len(body) + 1)
		if c1 != c2 || ok1 != ok2 {
			t.Fatalf("split-dependent result: (%d,%v) vs (%d,%v)", c1, ok1, c2, ok2)
		}
		if c1 < 0 {
			t.Fatalf("negative cached tokens %d", c1)
		}
	})
}

// BenchmarkUsageTee: what reading cached_tokens costs a response on its
// way to the client (per response, SSE of 200 chunks and a 4 KB JSON body).
func BenchmarkUsageTee(b *testing.B) {
	var sse strings.Builder
	for i := range 200 {
		fmt.Fprintf(&sse, "data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"tok%d \"}],\"usage\":null}\n\n", i)
	}
	sse.WriteString(usageSSE)
	js := strings.Replace(usageJSON, `"content":"hi"`, `"content":"`+strings.Repeat("x", 4000)+`"`, 1)
	for _, tc := range []struct {
		name string
		body string
		sse  bool
	}{{"sse_200_chunks", sse.String(), true}, {"json_4KB", js, false}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(tc.body)))
			buf := make([]byte, 32<<10)
			for b.Loop() {
				tee := &usageTee{rc: io.NopCloser(&chunkReader{b: []byte(tc.body), n: 512}), sse: tc.sse}
				for {
					if _, err := tee.Read(buf); err != nil {
						break
					}
				}
				if _, ok := tee.result(); !ok {
					b.Fatal("no usage found")
				}
			}
		})
	}
}
