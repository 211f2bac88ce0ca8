package tokenizer

import (
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// benchCorpusFiles is a realistic mixed corpus that every Go installation has: English
// technical prose with HTML markup (the Go spec), Markdown, and Go source with comments.
// tokenizer/testdata/bench.mjs tokenizes the same files with Hugging Face's JS tokenizer.
var benchCorpusFiles = []string{"doc/go_spec.html", "doc/go_mem.html", "doc/godebug.md", "src/net/http/server.go", "src/runtime/proc.go"}

// processCPU is the process's user+system CPU time. The machine is shared (2 cores, many
// processes), so wall time per op mostly measures waiting for a core; the benchmarks also
// report CPU time per op (GC included) and throughput per CPU-second.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuLoop runs fn in b.Loop and reports cpu-ns/op, and cpu-MB/s when bytes > 0.
func cpuLoop(b *testing.B, bytes int, fn func()) {
	b.Helper()
	b.ReportAllocs()
	if bytes > 0 {
		b.SetBytes(int64(bytes))
	}
	cpu0, n := processCPU(), 0
	for b.Loop() {
		n++
		fn()
	}
	cpu := processCPU() - cpu0
	if n > 0 && cpu > 0 {
		b.ReportMetric(float64(cpu)/float64(n), "cpu-ns/op")
		if bytes > 0 {
			b.ReportMetric(float64(bytes)*float64(n)/cpu.Seconds()/1e6, "cpu-MB/s")
		}
	}
}

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
		cold.cache, cold.segs = nil, nil
		b.Run(name+"/cold", func(b *testing.B) {
			cpuLoop(b, len(corpus), func() {
				if _, err := cold.Encode(corpus); err != nil {
					b.Fatal(err)
				}
			})
		})
		b.Run(name+"/warm", func(b *testing.B) {
			warm := cold
			warm.cache = newPieceCache(1 << 20)
			ids, _ := warm.Encode(corpus)
			cpuLoop(b, len(corpus), func() {
				if _, err := warm.Encode(corpus); err != nil {
					b.Fatal(err)
				}
			})
			b.ReportMetric(float64(len(ids)), "tokens") // after the loop, which resets metrics
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
// template rendering plus tokenization.
//   - cold: no caches (a never-seen prompt on a fresh router);
//   - pieces: piece cache warm, segment cache off (new text in a familiar vocabulary);
//   - repeat: both caches warm, the same prompt again (every message cached whole);
//   - newturn: both warm, the conversation grows by a never-seen ~250-token user turn
//     per request (the history's messages are cache hits, the new turn is not).
func BenchmarkRenderEncode8k(b *testing.B) {
	corpus := benchCorpus(b)
	for _, name := range models {
		tok := loadModel(b, name)
		msgs := chatPrompt(b, tok, corpus, 8000)
		opts := RenderOptions{AddGenerationPrompt: true}
		for _, mode := range []string{"cold", "pieces", "repeat", "newturn"} {
			t := *tok
			t.cache, t.segs = newPieceCache(DefaultCacheEntries), newSegmentCache(DefaultSegmentCacheBytes)
			switch mode {
			case "cold":
				t.cache, t.segs = nil, nil
			case "pieces":
				t.segs = nil
			}
			ids, _, err := EncodeChat(&t, msgs, opts)
			if err != nil {
				b.Fatal(err)
			}
			b.Run(name+"/"+mode, func(b *testing.B) {
				turn := append(slices.Clone(msgs), Message{Role: "user"})
				off := len(corpus) / 2
				cpuLoop(b, 0, func() {
					m := msgs
					if mode == "newturn" {
						// A fresh ~1 KB question each time, from a moving window of the corpus.
						off = (off + 997) % (len(corpus) - 1024)
						turn[len(turn)-1].Content = corpus[off : off+1000]
						m = turn
					}
					if _, _, err := EncodeChat(&t, m, opts); err != nil {
						b.Fatal(err)
					}
				})
				b.ReportMetric(float64(len(ids)), "tokens")
			})
		}
		b.Run(name+"/render-only", func(b *testing.B) {
			cpuLoop(b, 0, func() {
				if _, err := tok.Render(msgs, opts); err != nil {
					b.Fatal(err)
				}
			})
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
