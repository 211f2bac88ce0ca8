package tokenizer

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// benchCorpusFiles is a realistic mixed corpus that every Go installation has: English
// technical prose with HTML markup (the Go spec), Markdown, and Go source with comments.
// tokenizer/testdata/bench.mjs tokenizes the same files with Hugging Face's JS tokenizer.
var benchCorpusFiles = []string{"doc/go_spec.html", "doc/go_mem.html", "doc/godebug.md", "src/net/http/server.go", "src/runtime/proc.go"}

func benchCorpus(b *testing.B) string {
	b.Helper()
	var sb strings.Builder
	for _, f := range benchCorpusFiles {
		data, err := os.ReadFile(filepath.Join(runtime.GOROOT(), f))
		if err != nil {
			b.Fatalf("benchmark corpus: %v", err)
		}
		sb.Write(data)
	}
	return sb.String()
}

// BenchmarkEncode reports MB/s over the corpus: cold (no piece cache, every piece runs
// BPE) and warm (the cache already holds the corpus's pieces).
func BenchmarkEncode(b *testing.B) {
	corpus := benchCorpus(b)
	for _, name := range models {
		tok := loadModel(b, name)
		cold := *tok
		cold.cache = nil
		b.Run(name+"/cold", func(b *testing.B) {
			b.SetBytes(int64(len(corpus)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := cold.Encode(corpus); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/warm", func(b *testing.B) {
			warm := cold
			warm.cache = newPieceCache(1 << 20)
			ids, _ := warm.Encode(corpus)
			b.ReportMetric(float64(len(ids)), "tokens")
			b.SetBytes(int64(len(corpus)))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := warm.Encode(corpus); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// chatPrompt builds a chat whose rendered prompt is about n tokens for tok: a long system
// prompt (the shared prefix), then user/assistant turns cut from the corpus.
func chatPrompt(b *testing.B, tok *HF, corpus string, n int) []Message {
	b.Helper()
	text := corpus[:n*4] // ~4 bytes per token; trimmed below
	ids, _ := tok.Encode(text)
	for len(ids) > n {
		text = text[:len(text)*n/len(ids)]
		ids, _ = tok.Encode(text)
	}
	q := len(text) / 8
	msgs := []Message{{Role: "system", Content: text[:4*q]}}
	for i := 4; i < 8; i++ {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, Message{Role: role, Content: text[i*q : (i+1)*q]})
	}
	return msgs
}

// BenchmarkRenderEncode8k is the request-path cost of an 8,000-token chat prompt:
// template rendering plus tokenization, with the piece cache warm (a steady stream of
// prompts sharing their vocabulary) and cold.
func BenchmarkRenderEncode8k(b *testing.B) {
	corpus := benchCorpus(b)
	for _, name := range models {
		tok := loadModel(b, name)
		msgs := chatPrompt(b, tok, corpus, 8000)
		opts := RenderOptions{AddGenerationPrompt: true}
		for _, mode := range []string{"warm", "cold"} {
			t := *tok
			if mode == "cold" {
				t.cache = nil
			} else {
				t.cache = newPieceCache(DefaultCacheEntries)
			}
			ids, _, err := EncodeChat(&t, msgs, opts)
			if err != nil {
				b.Fatal(err)
			}
			b.Run(name+"/"+mode, func(b *testing.B) {
				b.ReportMetric(float64(len(ids)), "tokens")
				b.ReportAllocs()
				for b.Loop() {
					if _, _, err := EncodeChat(&t, msgs, opts); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
		b.Run(name+"/render-only", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := tok.Render(msgs, opts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkLoadHF(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := LoadHF("testdata/qwen3", HFConfig{}); err != nil {
			b.Fatal(err)
		}
	}
}
