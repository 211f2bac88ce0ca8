package simserver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/enginezmq"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/tokenizer"
)

// sub is a plain zmq4 SUB socket collecting an instance's KV events.
type sub struct {
	t    *testing.T
	sock zmq4.Socket
	mu   sync.Mutex // guards msgs
	msgs []enginezmq.Message
	done chan struct{}
}

func subscribe(t *testing.T, endpoint string) *sub {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &sub{t: t, sock: zmq4.NewSub(ctx), done: make(chan struct{})}
	if err := s.sock.Dial(endpoint); err != nil {
		t.Fatalf("dial %s: %v", endpoint, err)
	}
	if err := s.sock.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(s.done)
		for {
			m, err := s.sock.Recv()
			if err != nil {
				return
			}
			msg, err := enginezmq.ParseLiveFrames(m.Frames)
			if err != nil {
				t.Errorf("bad frames: %v", err)
				continue
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, msg)
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() { cancel(); s.sock.Close(); <-s.done })
	return s
}

func (s *sub) messages() []enginezmq.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.msgs)
}

func startInstance(t *testing.T, cfg Config) *Instance {
	t.Helper()
	in, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	return in
}

func post(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	r := testenv.PostJSON(t, url, body)
	return r.Status, r.Body
}

type usageResp struct {
	Usage   routertest.Usage `json:"usage"`
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
}

// replay applies decoded batches to a tier → hashes model.
type replay struct{ tier [2]map[uint64]bool }

func (r *replay) apply(t *testing.T, b events.Batch) {
	if r.tier[0] == nil {
		r.tier = [2]map[uint64]bool{{}, {}}
	}
	for _, ev := range b.Events {
		tier := 0
		if ev.Medium == sim.MediumCPU {
			tier = 1
		}
		switch ev.Kind {
		case events.AllBlocksCleared:
			r.tier = [2]map[uint64]bool{{}, {}}
		case events.BlockStored:
			for _, h := range ev.BlockHashes {
				r.tier[tier][h] = true
			}
		case events.BlockRemoved:
			for _, h := range ev.BlockHashes {
				if !r.tier[tier][h] {
					t.Errorf("removal of unknown block %x", h)
				}
				delete(r.tier[tier], h)
			}
		}
	}
}

func (r *replay) sorted(tier int) []uint64 {
	var out []uint64
	for h := range r.tier[tier] {
		out = append(out, h)
	}
	slices.Sort(out)
	return out
}

func TestEndToEnd(t *testing.T) {
	for _, enc := range []events.Encoding{events.EncodingArray, events.EncodingMap} {
		t.Run(enc.String(), func(t *testing.T) { testEndToEnd(t, enc) })
	}
}

func testEndToEnd(t *testing.T, enc events.Encoding) {
	pubPort, replayPort := testenv.FreePort(t), testenv.FreePort(t)
	in := startInstance(t, Config{
		Engine:    sim.Config{Model: "fake-model", GPUBlocks: 40, CPUBlocks: 20},
		TimeScale: 20,
		Events: EventsConfig{
			Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", pubPort),
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort),
			Encoding:       enc,
		},
	})
	s := subscribe(t, fmt.Sprintf("tcp://127.0.0.1:%d", pubPort))
	testenv.WaitFor(t, 10*time.Second, "subscription", in.EventsSubscribed)

	msgs := []map[string]string{
		{"role": "system", "content": strings.Repeat("You are a careful assistant who answers briefly. ", 8)},
		{"role": "user", "content": "What is the capital of France?"},
	}
	chat := map[string]any{"model": "fake-model", "messages": msgs, "max_tokens": 5}
	want, _, _ := tokenizer.EncodeChat(tokenizer.Simple{}, toMessages(msgs), tokenizer.RenderOptions{AddGenerationPrompt: true})

	var r1, r2 usageResp
	code, body := post(t, in.URL()+"/v1/chat/completions", chat)
	if code != 200 || json.Unmarshal(body, &r1) != nil {
		t.Fatalf("chat: %d %s", code, body)
	}
	if r1.Usage.PromptTokens != len(want) || r1.Usage.CompletionTokens != 5 || r1.Usage.Details.Cached != 0 {
		t.Fatalf("first chat usage %+v, want %d prompt tokens, 5 out, 0 cached", r1.Usage, len(want))
	}
	if r1.Choices[0].FinishReason != "length" || len(strings.Fields(r1.Choices[0].Message.Content)) != 5 {
		t.Fatalf("choice %+v", r1.Choices[0])
	}
	code, body = post(t, in.URL()+"/v1/chat/completions", chat)
	if code != 200 || json.Unmarshal(body, &r2) != nil {
		t.Fatalf("chat repeat: %d %s", code, body)
	}
	if got, exp := r2.Usage.Details.Cached, (len(want)-1)/16*16; got != exp || exp == 0 {
		t.Fatalf("repeat cached_tokens %d, want %d", got, exp)
	}

	// Streamed completion with usage.
	resp := testenv.Do(t, "POST", in.URL()+"/v1/completions", []byte(
		`{"model":"fake-model","prompt":"`+strings.Repeat("stream me please ", 20)+`","max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`), nil)
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("stream content type %q", ct)
	}
	chunks := testenv.SSEData(bytes.NewReader(resp.Body))
	if len(chunks) != 7+2 || chunks[len(chunks)-1] != "[DONE]" {
		t.Fatalf("stream: %d chunks (want 7 tokens + usage + [DONE]): %q", len(chunks), chunks)
	}
	var last usageResp
	if err := json.Unmarshal([]byte(chunks[7]), &last); err != nil || last.Usage.CompletionTokens != 7 || len(last.Choices) != 0 {
		t.Fatalf("usage chunk %s", chunks[7])
	}

	// Token-id prompts work and share blocks with the equal text prompt.
	ids, _ := tokenizer.Simple{}.Encode(strings.Repeat("stream me please ", 20))
	var r3 usageResp
	code, body = post(t, in.URL()+"/v1/completions", map[string]any{"model": "fake-model", "prompt": ids, "max_tokens": 1})
	if code != 200 || json.Unmarshal(body, &r3) != nil || r3.Usage.Details.Cached != (len(ids)-1)/16*16 {
		t.Fatalf("token-id prompt: %d %s", code, body)
	}

	// The events received equal the engine's cache.
	var gpuHashes, cpuHashes []uint64
	check := func() bool {
		in.Engine(0, func(e *sim.Engine) { gpuHashes, cpuHashes = e.CachedBlocks() })
		var r replay
		for _, m := range s.messages() {
			b, err := events.Decode(m.Payload)
			if err != nil {
				t.Fatalf("decode seq %d: %v", m.Seq, err)
			}
			r.apply(t, b)
		}
		return slices.Equal(r.sorted(0), gpuHashes) && slices.Equal(r.sorted(1), cpuHashes)
	}
	testenv.WaitFor(t, 10*time.Second, "events to match the cache", check)
	live := s.messages()
	for i, m := range live {
		if m.Seq != uint64(i+1) {
			t.Fatalf("message %d has seq %d: want 1, 2, ... without gaps", i, m.Seq)
		}
		if want := "kv@" + in.Addr() + "@fake-model"; m.Topic != want {
			t.Fatalf("topic %q, want %q", m.Topic, want)
		}
	}
	first, _ := events.Decode(live[0].Payload)
	if first.Encoding != enc || !first.HasDPRank || first.DPRank != 0 {
		t.Fatalf("first batch encoding %v rank %v/%d", first.Encoding, first.HasDPRank, first.DPRank)
	}
	ev := first.Events[0]
	if ev.Kind != events.BlockStored || ev.HasParent || !slices.Equal(ev.TokenIDs, want[:len(ev.BlockHashes)*16]) {
		t.Fatalf("first event %+v: want the chat prompt's blocks from 0 with its tokens", ev)
	}

	// Replay from seq 2 returns the same payloads, then the end marker.
	dealer := zmq4.NewDealer(context.Background())
	defer dealer.Close()
	if err := dealer.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", replayPort)); err != nil {
		t.Fatal(err)
	}
	if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, enginezmq.SeqBytes(2))); err != nil {
		t.Fatal(err)
	}
	for i := 1; ; i++ {
		m, err := dealer.Recv()
		if err != nil {
			t.Fatal(err)
		}
		msg, end, err := enginezmq.ParseReplayFrames(m.Frames)
		if err != nil {
			t.Fatal(err)
		}
		if end {
			if i-1 < len(live)-1 {
				t.Fatalf("replay ended after %d messages, want ≥ %d", i-1, len(live)-1)
			}
			break
		}
		if i < len(live) && (msg.Seq != live[i].Seq || !bytes.Equal(msg.Payload, live[i].Payload) || msg.Topic != live[i].Topic) {
			t.Fatalf("replayed seq %d differs from live", msg.Seq)
		}
	}

	// Reset: AllBlocksCleared goes out, and the cache is empty.
	code, body = post(t, in.URL()+"/reset_prefix_cache", nil)
	if code != 200 {
		t.Fatalf("reset: %d %s", code, body)
	}
	testenv.WaitFor(t, 10*time.Second, "AllBlocksCleared", func() bool {
		m := s.messages()
		b, err := events.Decode(m[len(m)-1].Payload)
		return err == nil && len(b.Events) > 0 && b.Events[len(b.Events)-1].Kind == events.AllBlocksCleared
	})
}

func toMessages(m []map[string]string) []tokenizer.Message {
	out := make([]tokenizer.Message, len(m))
	for i, x := range m {
		out[i] = tokenizer.Message{Role: x["role"], Content: x["content"]}
	}
	return out
}

func TestAPISurface(t *testing.T) {
	in := startInstance(t, Config{Engine: sim.Config{Model: "base", GPUBlocks: 100}, TimeScale: 50})
	get := func(path string) (int, string) {
		r := testenv.Do(t, "GET", in.URL()+path, nil, nil)
		return r.Status, string(r.Body)
	}
	if code, _ := get("/health"); code != 200 {
		t.Fatalf("/health %d", code)
	}

	// LoRA lifecycle.
	code, body := post(t, in.URL()+"/v1/load_lora_adapter", map[string]string{"lora_name": "sql", "lora_path": "/a/sql"})
	if code != 200 || !strings.Contains(string(body), "added successfully") {
		t.Fatalf("load: %d %s", code, body)
	}
	if code, _ := post(t, in.URL()+"/v1/load_lora_adapter", map[string]string{"lora_name": "sql", "lora_path": "/a/sql"}); code != 400 {
		t.Fatalf("double load: %d", code)
	}
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string  `json:"id"`
			Root   string  `json:"root"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	_, mb := get("/v1/models")
	if err := json.Unmarshal([]byte(mb), &models); err != nil || models.Object != "list" || len(models.Data) != 2 ||
		models.Data[0].ID != "base" || models.Data[1].ID != "sql" || *models.Data[1].Parent != "base" || models.Data[1].Root != "/a/sql" {
		t.Fatalf("/v1/models %s", mb)
	}
	var u usageResp
	code, body = post(t, in.URL()+"/v1/completions", map[string]any{"model": "sql", "prompt": "hello adapter", "max_tokens": 2})
	if code != 200 || json.Unmarshal(body, &u) != nil || u.Usage.CompletionTokens != 2 {
		t.Fatalf("LoRA completion %d %s", code, body)
	}
	if code, _ := post(t, in.URL()+"/v1/unload_lora_adapter", map[string]string{"lora_name": "sql"}); code != 200 {
		t.Fatalf("unload %d", code)
	}
	if code, _ := post(t, in.URL()+"/v1/unload_lora_adapter", map[string]string{"lora_name": "sql"}); code != 404 {
		t.Fatalf("second unload %d", code)
	}

	// /tokenize, both shapes.
	var tok struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
	}
	_, body = post(t, in.URL()+"/tokenize", map[string]any{"model": "base", "prompt": "Hello, world!"})
	want, _ := tokenizer.Simple{}.Encode("Hello, world!")
	if json.Unmarshal(body, &tok) != nil || tok.Count != len(want) || !slices.Equal(tok.Tokens, want) || tok.MaxModelLen != 131072 {
		t.Fatalf("/tokenize prompt: %s", body)
	}
	_, body = post(t, in.URL()+"/tokenize", map[string]any{"messages": []map[string]string{{"role": "user", "content": "hi"}}})
	want, _ = tokenizer.Simple{}.Encode("### user: hi\n")
	if json.Unmarshal(body, &tok) != nil || !slices.Equal(tok.Tokens, want) {
		t.Fatalf("/tokenize messages: %s", body)
	}

	// Sleep clears the cache and refuses requests until wake-up.
	if code, _ := post(t, in.URL()+"/sleep", nil); code != 200 {
		t.Fatalf("/sleep %d", code)
	}
	if _, b := get("/is_sleeping"); !strings.Contains(b, `"is_sleeping":true`) {
		t.Fatalf("/is_sleeping %s", b)
	}
	if code, _ := post(t, in.URL()+"/v1/completions", map[string]any{"prompt": "x"}); code != 503 {
		t.Fatalf("request while sleeping: %d", code)
	}
	if code, _ := post(t, in.URL()+"/wake_up", nil); code != 200 {
		t.Fatalf("/wake_up %d", code)
	}
	if code, _ := post(t, in.URL()+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1}); code != 200 {
		t.Fatalf("request after wake-up: %d", code)
	}

	// Metrics carry vLLM's names.
	_, m := get("/metrics")
	for _, name := range []string{
		`vllm:num_requests_running{engine="0",model_name="base"}`, `vllm:num_requests_waiting{`,
		`vllm:kv_cache_usage_perc{`, `vllm:prefix_cache_queries_total{`, `vllm:prefix_cache_hits_total{`,
		`vllm:time_to_first_token_seconds_bucket{`, `vllm:cache_config_info{block_size="16"`,
		`vllm:lora_requests_info{max_lora="1"`,
	} {
		if !strings.Contains(m, name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}

	// Bad input gets vLLM-style errors, never a crash.
	tests := []struct {
		name, path, body string
		code             int
	}{
		{"malformed JSON", "/v1/completions", `{"prompt":`, 400},
		{"unknown model", "/v1/completions", `{"model":"nope","prompt":"x"}`, 404},
		{"empty prompt", "/v1/completions", `{"prompt":""}`, 400},
		{"no prompt", "/v1/completions", `{}`, 400},
		{"bad prompt type", "/v1/completions", `{"prompt":{"a":1}}`, 400},
		{"zero max tokens", "/v1/completions", `{"prompt":"x","max_tokens":0}`, 400},
		{"too long", "/v1/completions", `{"prompt":"x","max_tokens":200000}`, 400},
		{"no messages", "/v1/chat/completions", `{"messages":[]}`, 400},
		{"bad message", "/v1/chat/completions", `{"messages":[{"role":"user","content":7}]}`, 400},
		{"tokenize nothing", "/tokenize", `{}`, 400},
		{"load without path", "/v1/load_lora_adapter", `{"lora_name":"x"}`, 400},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp := testenv.Do(t, "POST", in.URL()+tc.path, []byte(tc.body), nil)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if resp.Status != tc.code || json.Unmarshal(resp.Body, &e) != nil || e.Error.Code != tc.code || e.Error.Message == "" {
				t.Fatalf("status %d error %+v, want %d with a message", resp.Status, e, tc.code)
			}
		})
	}
}

func TestDataParallelRanks(t *testing.T) {
	pubPort := testenv.FreePorts(t, 2) // rank 1 publishes on pubPort+1
	in := startInstance(t, Config{
		Engine:           sim.Config{Model: "m", GPUBlocks: 200},
		DataParallelSize: 2,
		TimeScale:        5,
		Events:           EventsConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort)},
	})
	s0 := subscribe(t, fmt.Sprintf("tcp://127.0.0.1:%d", pubPort))
	s1 := subscribe(t, fmt.Sprintf("tcp://127.0.0.1:%d", pubPort+1))
	testenv.WaitFor(t, 10*time.Second, "subscriptions", in.EventsSubscribed)
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			post(t, in.URL()+"/v1/completions", map[string]any{"prompt": strings.Repeat(fmt.Sprintf("request %d ", i), 40), "max_tokens": 30})
		}()
		time.Sleep(2 * time.Millisecond)
	}
	wg.Wait()
	for r, s := range []*sub{s0, s1} {
		testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("rank %d events", r), func() bool { return len(s.messages()) > 0 })
		m := s.messages()[0]
		b, err := events.Decode(m.Payload)
		if err != nil || !b.HasDPRank || b.DPRank != r || m.Seq != 1 {
			t.Fatalf("rank %d: seq %d rank %d (%v)", r, m.Seq, b.DPRank, err)
		}
		if !strings.HasSuffix(m.Topic, fmt.Sprintf(":%d@m", portOf(t, in))) {
			t.Fatalf("rank %d topic %q", r, m.Topic)
		}
	}
}

func portOf(t *testing.T, in *Instance) int {
	var p int
	if _, err := fmt.Sscanf(in.Addr()[strings.LastIndexByte(in.Addr(), ':')+1:], "%d", &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestStreamChunks checks the SSE framing of both endpoints: one chunk per
// token (chat: plus the opening role chunk), the last carrying
// finish_reason, then usage when asked, then [DONE] — including
// max_tokens 1, where the engine reports the only token as both first and last.
func TestStreamChunks(t *testing.T) {
	in := startInstance(t, Config{Engine: sim.Config{Model: "m", GPUBlocks: 100}, TimeScale: 50})
	type chunk struct {
		Choices []struct {
			Text  *string `json:"text"`
			Delta *struct {
				Role    string  `json:"role"`
				Content *string `json:"content"`
			} `json:"delta"`
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
		Usage *struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	for _, tc := range []struct {
		path  string
		body  string
		max   int
		chat  bool
		usage bool
	}{
		{"/v1/completions", `{"prompt":"one two three","max_tokens":1,"stream":true}`, 1, false, false},
		{"/v1/completions", `{"prompt":"one two three","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`, 3, false, true},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":true}`, 1, true, false},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, 4, true, true},
	} {
		t.Run(fmt.Sprintf("%s_%d", tc.path, tc.max), func(t *testing.T) {
			lines := testenv.SSEData(bytes.NewReader(testenv.Do(t, "POST", in.URL()+tc.path, []byte(tc.body), nil).Body))
			if len(lines) == 0 || lines[len(lines)-1] != "[DONE]" {
				t.Fatalf("stream did not end with [DONE]: %q", lines)
			}
			lines = lines[:len(lines)-1]
			var tokens, finishes, usages, roles int
			for _, l := range lines {
				var c chunk
				if err := json.Unmarshal([]byte(l), &c); err != nil {
					t.Fatalf("chunk %q: %v", l, err)
				}
				if c.Usage != nil {
					usages++
					if c.Usage.CompletionTokens != tc.max || len(c.Choices) != 0 {
						t.Fatalf("usage chunk %q", l)
					}
					continue
				}
				ch := c.Choices[0]
				if ch.FinishReason != nil {
					finishes++
				}
				switch {
				case tc.chat && ch.Delta != nil && ch.Delta.Role == "assistant":
					roles++
				case tc.chat && ch.Delta != nil && ch.Delta.Content != nil && *ch.Delta.Content != "":
					tokens++
				case !tc.chat && ch.Text != nil && *ch.Text != "":
					tokens++
				}
			}
			wantUsage := 0
			if tc.usage {
				wantUsage = 1
			}
			wantRoles := 0
			if tc.chat {
				wantRoles = 1
			}
			if tokens != tc.max || finishes != 1 || usages != wantUsage || roles != wantRoles {
				t.Fatalf("tokens %d finishes %d usage %d roles %d; want %d, 1, %d, %d: %q",
					tokens, finishes, usages, roles, tc.max, wantUsage, wantRoles, lines)
			}
		})
	}
}

// A kvsim playing TensorRT-LLM reuses as TensorRT-LLM does (partial reuse:
// up to T − 1 tokens of the blocks held), so a fleet of them agrees with a
// router pool of routing.kv.engine: trtllm; one playing vLLM keeps vLLM's
// whole-block cap.
func TestEngineFormatSetsReuse(t *testing.T) {
	ids := make([]int, 32) // two blocks of 16
	for i := range ids {
		ids[i] = 100 + i
	}
	for _, tc := range []struct {
		format string
		want   int
	}{{FormatVLLM, 16}, {FormatTRTLLM, 31}} {
		t.Run(tc.format, func(t *testing.T) {
			in := startInstance(t, Config{
				Engine: sim.Config{Model: "fake-model", GPUBlocks: 40},
				Events: EventsConfig{Format: tc.format},
			})
			req := map[string]any{"model": "fake-model", "prompt": ids, "max_tokens": 1}
			var r usageResp
			for range 2 {
				code, body := post(t, in.URL()+"/v1/completions", req)
				if code != 200 || json.Unmarshal(body, &r) != nil {
					t.Fatalf("completion: %d %s", code, body)
				}
			}
			if r.Usage.PromptTokens != 32 || r.Usage.Details.Cached != tc.want {
				t.Fatalf("repeat usage %+v, want 32 prompt tokens, %d cached", r.Usage, tc.want)
			}
		})
	}
}
