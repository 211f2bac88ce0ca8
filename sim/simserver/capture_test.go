package simserver

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router/routertest"
	"github.com/kvrouter/kvrouter/sim"
)

// TestAgreesWithCapturedSimulator replays the HTTP calls captured from an
// independent simulator (llm-d-inference-sim, same dummy tokenizer, 64
// blocks of 16) and checks that kvsim reports the same prompt_tokens and
// cached_tokens for every request — tokenization, chat flattening, block
// boundaries, the (n−1)/B hit cap, LoRA isolation and eviction under a
// full cache all have to agree for that — and that /sleep sends
// AllBlocksCleared as it did there.
func TestAgreesWithCapturedSimulator(t *testing.T) {
	f, err := os.Open("testdata/captured-requests.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pubPort := testenv.FreePort(t)
	in := startInstance(t, Config{
		Engine:    sim.Config{Model: "fake-model", GPUBlocks: 64},
		TimeScale: 50,
		LoRAs:     map[string]string{"lora-a": "/adapters/lora-a"},
		Events:    EventsConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort)},
	})
	s := subscribe(t, fmt.Sprintf("tcp://127.0.0.1:%d", pubPort))
	testenv.WaitFor(t, 10*time.Second, "subscription", in.EventsSubscribed)

	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	n := 0
	for sc.Scan() {
		var c struct {
			Label   string            `json:"label"`
			Path    string            `json:"path"`
			Request json.RawMessage   `json:"request"`
			Status  int               `json:"status"`
			Usage   *routertest.Usage `json:"usage"`
		}
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatal(err)
		}
		var body any
		if len(c.Request) > 0 && string(c.Request) != "null" {
			body = json.RawMessage(c.Request)
		}
		code, out := post(t, in.URL()+c.Path, body)
		if code != c.Status {
			t.Fatalf("%s: status %d, captured %d (%s)", c.Label, code, c.Status, out)
		}
		if c.Path == "/sleep" {
			testenv.WaitFor(t, 10*time.Second, "AllBlocksCleared after /sleep", func() bool {
				m := s.messages()
				if len(m) == 0 {
					return false
				}
				b, err := events.Decode(m[len(m)-1].Payload)
				return err == nil && len(b.Events) == 1 && b.Events[0].Kind == events.AllBlocksCleared
			})
		}
		if c.Usage == nil {
			continue
		}
		var u usageResp
		if err := json.Unmarshal(out, &u); err != nil {
			t.Fatalf("%s: %v", c.Label, err)
		}
		if u.Usage.PromptTokens != c.Usage.PromptTokens || u.Usage.Details.Cached != c.Usage.Details.Cached {
			t.Errorf("%s: prompt %d cached %d; captured prompt %d cached %d", c.Label,
				u.Usage.PromptTokens, u.Usage.Details.Cached, c.Usage.PromptTokens, c.Usage.Details.Cached)
		}
		n++
	}
	if n != 13 {
		t.Fatalf("compared %d requests, want 13", n)
	}

	// Every block the captured engine stored (its 16 token ids, and whether
	// it started a chain) was stored by kvsim too. kvsim stores more: it
	// also caches blocks filled by generated tokens, as vLLM does.
	capt, err := os.Open("testdata/captured-array.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer capt.Close()
	sc = bufio.NewScanner(capt)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var want []string
	for sc.Scan() {
		var line struct {
			Payload []byte `json:"payload_b64"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatal(err)
		}
		b, err := events.Decode(line.Payload)
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range b.Events {
			if ev.Kind == events.BlockStored {
				for i := range ev.BlockHashes {
					want = append(want, blockKey(ev.TokenIDs[i*16:(i+1)*16], i == 0 && !ev.HasParent))
				}
			}
		}
	}
	if len(want) != 144 {
		t.Fatalf("read %d captured blocks, want 144", len(want))
	}
	testenv.WaitFor(t, 10*time.Second, "kvsim's events to cover the captured blocks", func() bool {
		ours := map[string]bool{}
		for _, m := range s.messages() {
			b, err := events.Decode(m.Payload)
			if err != nil {
				t.Fatal(err)
			}
			for _, ev := range b.Events {
				if ev.Kind == events.BlockStored && len(ev.TokenIDs) > 0 {
					for i := range ev.BlockHashes {
						ours[blockKey(ev.TokenIDs[i*16:(i+1)*16], i == 0 && !ev.HasParent)] = true
					}
				}
			}
		}
		for _, k := range want {
			if !ours[k] {
				return false
			}
		}
		return true
	})
}

func blockKey(tokens []uint32, start bool) string { return fmt.Sprint(start, tokens) }
