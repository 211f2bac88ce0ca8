package router

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/openai"
)

// benchPick measures one prefix_aware decision: hashing the routing text
// (the request's hash is reset each iteration, so it is computed every
// time) and scoring every candidate.
func benchPick(b *testing.B, instances, promptBytes int) {
	insts := mustInstances(b, instances)
	s := mustStrategy(b, config.StrategyPrefixAware, config.RoutingConfig{PrefixLength: config.MaxPrefixLength})
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", promptBytes/45+1)[:promptBytes]
	req := &Request{RoutingText: text, TenantKey: "tenant-1"}
	ctx := context.Background()
	b.SetBytes(int64(promptBytes))
	b.ReportAllocs()
	for b.Loop() {
		req.hashOnce = false
		if _, err := s.Pick(ctx, req, insts); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPrefixAwarePick8x1KiB(b *testing.B)    { benchPick(b, 8, 1<<10) }
func BenchmarkPrefixAwarePick64x1KiB(b *testing.B)   { benchPick(b, 64, 1<<10) }
func BenchmarkPrefixAwarePick64x32KiB(b *testing.B)  { benchPick(b, 64, 32<<10) }
func BenchmarkPrefixAwarePick256x32KiB(b *testing.B) { benchPick(b, 256, 32<<10) }
func BenchmarkPrefixAwarePick64x64KiB(b *testing.B)  { benchPick(b, 64, 64<<10) }

func benchStrategy(b *testing.B, name string) {
	insts := mustInstances(b, 64)
	s := mustStrategy(b, name, config.RoutingConfig{})
	req := &Request{RoutingText: "x"}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Pick(ctx, req, insts); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRandomPick64(b *testing.B)           { benchStrategy(b, config.StrategyRandom) }
func BenchmarkRoundRobinPick64(b *testing.B)       { benchStrategy(b, config.StrategyRoundRobin) }
func BenchmarkLeastOutstandingPick64(b *testing.B) { benchStrategy(b, config.StrategyLeastOutstanding) }

// BenchmarkParseAndRoutingText measures the request side before the
// decision: decoding a chat body and cutting its routing text.
func benchParse(b *testing.B, promptBytes int) {
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
		{"role": "system", "content": "You are a careful assistant."},
		{"role": "user", "content": strings.Repeat("lorem ipsum dolor sit amet ", promptBytes/27+1)[:promptBytes]},
	}})
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		r, err := ParseOpenAI(EndpointChatCompletions, body)
		if err != nil {
			b.Fatal(err)
		}
		_ = openai.RoutingText(r, config.DefaultPrefixLength)
	}
}

func BenchmarkParseAndRoutingText1KiB(b *testing.B)  { benchParse(b, 1<<10) }
func BenchmarkParseAndRoutingText32KiB(b *testing.B) { benchParse(b, 32<<10) }

func BenchmarkCanonicalJSON4KiB(b *testing.B) {
	var parts []string
	for i := range 60 {
		parts = append(parts, fmt.Sprintf(`"k%02d": {"v": %d, "s": "some text here"}`, 59-i, i))
	}
	body := []byte("{" + strings.Join(parts, ", ") + "}")
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		_ = RawRoutingText(body, config.DefaultPrefixLength, true)
	}
}

// BenchmarkParseStdJSON32KiB is the same body through encoding/json, the
// reference the hand-written decoder replaced (jsonscan.go).
func BenchmarkParseStdJSON32KiB(b *testing.B) {
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
		{"role": "system", "content": "You are a careful assistant."},
		{"role": "user", "content": strings.Repeat("lorem ipsum dolor sit amet ", (32<<10)/27+1)[:32<<10]},
	}})
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		r, err := parseOpenAIStd(body)
		if err != nil {
			b.Fatal(err)
		}
		_ = openai.RoutingText(r, config.DefaultPrefixLength)
	}
}
