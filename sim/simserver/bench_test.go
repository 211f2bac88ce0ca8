package simserver

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/sim"
)

// BenchmarkChatCompletion is kvsim's own per-request cost (HTTP, chat
// flattening, Simple tokenization of a ~1,000-token prompt, driver
// hand-off), with virtual time scaled so the engine's simulated latency is
// negligible.
func BenchmarkChatCompletion(b *testing.B) {
	in, err := Start(context.Background(), Config{Engine: sim.Config{Model: "m"}, TimeScale: 1e6})
	if err != nil {
		b.Fatal(err)
	}
	defer in.Close()
	body, _ := json.Marshal(map[string]any{
		"model":      "m",
		"messages":   []map[string]string{{"role": "system", "content": strings.Repeat("Answer with care and cite sources. ", 170)}, {"role": "user", "content": "hello"}},
		"max_tokens": 1,
	})
	client := &http.Client{}
	b.ReportAllocs()
	for b.Loop() {
		resp, err := client.Post(in.URL()+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatal(resp.Status)
		}
	}
}
