package kvaware

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// The benchmark world of docs/benchmarks (kv_aware decision): 64 instances, 1,000,000
// indexed blocks, an 8,000-token prompt held in full by one instance, by
// half and a quarter by two others; every instance full of other 500-block
// prefixes up to the million.
const (
	benchInstances = 64
	benchBlocks    = 1_000_000
	benchPrompt    = 8000
)

type benchWorld struct {
	st    *KVState
	insts []*router.Instance
}

var (
	benchOnce   sync.Once
	benchShared *benchWorld
	benchErr    error
)

// benchKVWorld builds the world once per process (it takes seconds).
func benchKVWorld(b *testing.B, prompt []uint32, tokens router.TokenSource) *benchWorld {
	b.Helper()
	benchOnce.Do(func() {
		idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: kvTestModel, BlockSize: kvTestBS, Capacity: 2 * benchBlocks})
		if err != nil {
			benchErr = err
			return
		}
		w := &benchWorld{}
		for i := range benchInstances {
			in, _ := router.NewInstance(fmt.Sprintf("vllm-%02d", i), "http://127.0.0.1:9")
			w.insts = append(w.insts, in)
		}
		ctx := context.Background()
		storeChain := func(inst string, toks []uint32, nBlocks int) {
			keys := kvindex.Keys(kvindex.Root(kvTestModel, "", ""), toks[:nBlocks*kvTestBS], kvTestBS)
			ev := events.Event{Kind: events.BlockStored, BlockSize: kvTestBS, Medium: "GPU", TokenIDs: toks[:nBlocks*kvTestBS]}
			for _, k := range keys {
				ev.BlockHashes = append(ev.BlockHashes, engineHash(inst, k))
			}
			if _, err := idx.Apply(ctx, inst, []events.Event{ev}); err != nil {
				benchErr = err
			}
		}
		total := 0
		promptBlocks := len(prompt) / kvTestBS
		for i, frac := range []int{1, 2, 4} { // full, half, quarter
			storeChain(w.insts[7+i*13].ID(), prompt, promptBlocks/frac)
			total += promptBlocks / frac
		}
		for seed := uint32(1); total < benchBlocks; seed++ {
			n := min(500, benchBlocks-total)
			storeChain(w.insts[int(seed)%benchInstances].ID(), promptTokens(seed+1000, n*kvTestBS), n)
			total += n
		}
		if got, _ := idx.Len(ctx); got != benchBlocks {
			benchErr = fmt.Errorf("index holds %d entries, want %d", got, benchBlocks)
		}
		w.st, benchErr = NewKVState(KVStateConfig{Pool: "p", Model: kvTestModel, Index: idx, Tokens: tokens, Logger: slog.New(slog.DiscardHandler)})
		benchShared = w
	})
	if benchErr != nil {
		b.Fatal(benchErr)
	}
	return benchShared
}

// benchChat is an 8,000-token-class chat: a long system prompt of
// documentation-like text and a question.
func benchChat() []byte {
	var sb strings.Builder
	for i := 0; sb.Len() < 37200; i++ {
		fmt.Fprintf(&sb, "Section %d. The router keeps a global map of which instance holds which KV block, per tier; requests go where their prompt is cached, blended with load. ", i)
	}
	body, _ := json.Marshal(map[string]any{
		"model": kvTestModel,
		"messages": []map[string]any{
			{"role": "system", "content": sb.String()},
			{"role": "user", "content": "Summarise the routing policy in two sentences."},
		},
	})
	return body
}

var benchTokenizer = sync.OnceValues(func() (router.TokenSource, error) {
	return NewTokenSource(&config.TokenizerConfig{Source: TokenSourceFiles, Path: filepath.Join("..", "..", "tokenizer", "testdata", "llama-3.1")}, config.PoolConfig{})
})

// benchPromptIDs is the chat's token ids (the world's held prompt).
var benchPromptIDs = sync.OnceValues(func() ([]uint32, error) {
	src, err := benchTokenizer()
	if err != nil {
		return nil, err
	}
	return src.Tokens(context.Background(), &router.Request{Endpoint: router.EndpointChatCompletions, Body: benchChat()})
})

func benchSetup(b *testing.B) (*benchWorld, []uint32) {
	b.Helper()
	src, err := benchTokenizer()
	if err != nil {
		b.Fatal(err)
	}
	ids, err := benchPromptIDs()
	if err != nil {
		b.Fatal(err)
	}
	if len(ids) < benchPrompt || len(ids) > benchPrompt+500 {
		b.Fatalf("chat is %d tokens, want ~%d", len(ids), benchPrompt)
	}
	return benchKVWorld(b, ids, src), ids
}

func benchDecide(b *testing.B, w *benchWorld, s *KVAware, mk func() *router.Request, want *router.Instance) {
	b.ReportAllocs()
	b.ResetTimer()
	report, n := cputime.Report(b), 0
	defer func() { report(n) }()
	for b.Loop() {
		n++
		d, err := s.Pick(context.Background(), mk(), w.insts)
		if err != nil {
			b.Fatal(err)
		}
		if want != nil && d.Instance != want {
			b.Fatalf("picked %s (%s), want %s", d.Instance.ID(), d.Reason, want.ID())
		}
		if d.Observer != nil {
			d.Observer.Done(200, -1)
		}
	}
}

// BenchmarkKVAwareDecision: one kv_aware decision for an 8,000-token prompt
// over 64 instances and 1,000,000 indexed blocks, from token ids
// (target ≤ 50 µs/op) and from the chat body through the Llama 3.1 chat
// template and tokenizer (target ≤ 1 ms/op).
func BenchmarkKVAwareDecision(b *testing.B) {
	w, ids := benchSetup(b)
	s, err := NewKVAware(config.RoutingConfig{}, w.st)
	if err != nil {
		b.Fatal(err)
	}
	holder := w.insts[7]
	text := strings.Repeat("x", config.DefaultPrefixLength)
	body := benchChat()
	b.Logf("prompt: %d tokens, %d blocks; chat body %d bytes", len(ids), len(ids)/kvTestBS, len(body))
	b.Run("token_ids", func(b *testing.B) {
		benchDecide(b, w, s, func() *router.Request {
			return &router.Request{Endpoint: router.EndpointCompletions, Model: kvTestModel, RoutingText: text, PromptTokens: ids}
		}, holder)
	})
	b.Run("chat_template_and_tokenize", func(b *testing.B) {
		benchDecide(b, w, s, func() *router.Request {
			return &router.Request{Endpoint: router.EndpointChatCompletions, Model: kvTestModel, RoutingText: text, Body: body}
		}, holder)
	})
	// The proxy's path: the body parsed once (ParseOpenAI, in the op), the
	// decision reading the parsed request rather than the body again.
	parseReq := func(body []byte) func() *router.Request {
		return func() *router.Request {
			p, err := router.ParseOpenAI(router.EndpointChatCompletions, body)
			if err != nil {
				b.Fatal(err)
			}
			return &router.Request{Endpoint: router.EndpointChatCompletions, Model: kvTestModel, RoutingText: text, Body: body, Parsed: p}
		}
	}
	b.Run("chat_parse_and_decide", func(b *testing.B) {
		benchDecide(b, w, s, parseReq(body), holder)
	})
	b.Run("chat_client_salt_parse_and_decide", func(b *testing.B) {
		// A client's own cache_salt: its blocks are keyed apart (no holder).
		salted := append(body[:len(body)-1:len(body)-1], `,"cache_salt":"tenant-a"}`...)
		benchDecide(b, w, s, parseReq(salted), nil)
	})
	b.Run("chat_uncached_tokenizer", func(b *testing.B) {
		// The tokenizer's per-piece cache off: every op runs BPE on every
		// piece, the cost of a prompt made of words never seen before.
		hf, err := tokenizer.LoadHF(filepath.Join("..", "..", "tokenizer", "testdata", "llama-3.1"), tokenizer.HFConfig{CacheEntries: -1})
		if err != nil {
			b.Fatal(err)
		}
		cold := &ChatTokenSource{Tokenizer: tokenizer.Local(hf)}
		benchDecide(b, w, s, func() *router.Request {
			return &router.Request{Endpoint: router.EndpointChatCompletions, Model: kvTestModel, RoutingText: text, Body: body, Tokenizer: cold}
		}, holder)
	})
	b.Run("token_ids_nothing_held", func(b *testing.B) {
		other := promptTokens(999_999, len(ids))
		benchDecide(b, w, s, func() *router.Request {
			return &router.Request{Endpoint: router.EndpointCompletions, Model: kvTestModel, RoutingText: text, PromptTokens: other}
		}, nil)
	})
}

// BenchmarkDisaggDecision: the two-stage decision of a disaggregated
// request (kv_aware over the prefill half of the benchmark world's 64
// instances, then over the decode half) beside one kv_aware decision over
// all 64, same prompt and index, from token ids (docs/benchmarks/disagg.md:
// the design allows 2×).
func BenchmarkDisaggDecision(b *testing.B) {
	w, ids := benchSetup(b)
	s, err := NewKVAware(config.RoutingConfig{}, w.st)
	if err != nil {
		b.Fatal(err)
	}
	text := strings.Repeat("x", config.DefaultPrefixLength)
	mk := func() *router.Request {
		return &router.Request{Endpoint: router.EndpointCompletions, Model: kvTestModel, RoutingText: text, PromptTokens: ids}
	}
	pick := func(req *router.Request, cands []*router.Instance) {
		d, err := s.Pick(context.Background(), req, cands)
		if err != nil {
			b.Fatal(err)
		}
		if d.Observer != nil {
			d.Observer.Done(200, -1)
		}
	}
	run := func(b *testing.B, stages [][]*router.Instance) {
		b.ReportAllocs()
		cpu0, n := cputime.Process(), 0
		for b.Loop() {
			n++
			req := mk()
			req.ShareKeys = len(stages) > 1 // as disaggregate sets it
			for _, cands := range stages {
				pick(req, cands)
			}
		}
		b.ReportMetric(float64(cputime.Process()-cpu0)/float64(n), "cpu-ns/op")
	}
	half := len(w.insts) / 2
	b.Run("aggregated", func(b *testing.B) { run(b, [][]*router.Instance{w.insts}) })
	b.Run("prefill_then_decode", func(b *testing.B) { run(b, [][]*router.Instance{w.insts[:half], w.insts[half:]}) })
}

// BenchmarkQueuedDecision: what flow control adds to a kv_aware request —
// HeldBy over the pool's candidates when the request arrives (before it
// is offered to the queue), then the pick, the prompt's keys shared
// between them — beside the pick alone; same prompt, index and 64
// instances, from token ids.
func BenchmarkQueuedDecision(b *testing.B) {
	w, ids := benchSetup(b)
	s, err := NewKVAware(config.RoutingConfig{}, w.st)
	if err != nil {
		b.Fatal(err)
	}
	text := strings.Repeat("x", config.DefaultPrefixLength)
	run := func(b *testing.B, held bool) {
		b.ReportAllocs()
		var per []int
		cpu0, n := cputime.Process(), 0
		for b.Loop() {
			n++
			req := &router.Request{Endpoint: router.EndpointCompletions, Model: kvTestModel, RoutingText: text, PromptTokens: ids}
			if held {
				req.ShareKeys = true // as httpapi's cachedHolds sets it
				var ok bool
				if per, _, ok = s.HeldBy(context.Background(), req, w.insts, per[:0]); !ok {
					b.Fatal("HeldBy: prompt unknown")
				}
			}
			d, err := s.Pick(context.Background(), req, w.insts)
			if err != nil {
				b.Fatal(err)
			}
			if d.Observer != nil {
				d.Observer.Done(200, -1)
			}
		}
		b.ReportMetric(float64(cputime.Process()-cpu0)/float64(n), "cpu-ns/op")
	}
	b.Run("pick", func(b *testing.B) { run(b, false) })
	b.Run("held_by_then_pick", func(b *testing.B) { run(b, true) })
}
