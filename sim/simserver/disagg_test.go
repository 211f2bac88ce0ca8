package simserver

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/sim"
)

// The disaggregated-serving protocol between two kvsim instances, driven
// the way vLLM's toy proxy drives two vLLM servers: the prefill request
// (do_remote_decode, max_tokens 1, not streamed) answers with
// kv_transfer_params naming its engine and blocks; the decode request
// carries them and receives the prompt's KV instead of computing it; each
// role refuses the other's requests and plain ones go nowhere near a
// prefill-only worker.
func TestDisaggProtocol(t *testing.T) {
	pre := startInstance(t, Config{Role: RolePrefill, Engine: sim.Config{GPUBlocks: 4096}})
	dec := startInstance(t, Config{Role: RoleDecode, Engine: sim.Config{GPUBlocks: 4096}})
	prompt := strings.Repeat("the quick brown fox jumps over the lazy dog ", 60)

	for _, ep := range []string{"/v1/completions", "/v1/chat/completions"} {
		body := map[string]any{"model": pre.Model(), "max_tokens": 1, "stream": false,
			"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
				"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}}
		if ep == "/v1/completions" {
			body["prompt"] = prompt
		} else {
			body["messages"] = []map[string]string{{"role": "user", "content": prompt}}
		}
		code, out := post(t, pre.URL()+ep, body)
		if code != 200 {
			t.Fatalf("%s prefill: %d %s", ep, code, out)
		}
		var ans struct {
			KV    map[string]any `json:"kv_transfer_params"`
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(out, &ans); err != nil {
			t.Fatal(err)
		}
		kv := ans.KV
		if kv["do_remote_prefill"] != true || kv["do_remote_decode"] != false || kv["remote_engine_id"] != pre.EngineID() ||
			kv["remote_host"] != "127.0.0.1" || int(kv["remote_port"].(float64)) != portOf(t, pre) {
			t.Fatalf("%s prefill answer's kv_transfer_params = %v", ep, kv)
		}
		if n := len(kv["remote_block_ids"].([]any)); n != ans.Usage.PromptTokens/16 {
			t.Fatalf("%s: %d remote blocks for %d prompt tokens", ep, n, ans.Usage.PromptTokens)
		}

		// The decode request: the original, with the prefill's parameters.
		delete(body, "kv_transfer_params")
		body["max_tokens"] = 8
		body["kv_transfer_params"] = kv
		code, out = post(t, dec.URL()+ep, body)
		if code != 200 {
			t.Fatalf("%s decode: %d %s", ep, code, out)
		}
	}
	got := dec.RemotePrefills()
	if len(got) != 2 || got[0].EngineID != pre.EngineID() || got[0].Blocks == 0 || got[0].Port != portOf(t, pre) {
		t.Fatalf("decode instance received %+v", got)
	}
	if pre.Prefills() != 2 {
		t.Fatalf("prefill instance answered %d prefills, want 2", pre.Prefills())
	}
	var remote uint64
	dec.Engine(0, func(e *sim.Engine) { remote = e.Stats().RemoteTokens })
	if remote == 0 {
		t.Fatal("the decode engine computed the prompt instead of receiving it")
	}

	// Each role refuses what is not its own.
	plain := map[string]any{"model": pre.Model(), "prompt": "hello", "max_tokens": 2}
	if code, out := post(t, pre.URL()+"/v1/completions", plain); code != 400 || !strings.Contains(string(out), "--role prefill") {
		t.Fatalf("plain request to a prefill worker: %d %s", code, out)
	}
	asPrefill := map[string]any{"model": pre.Model(), "prompt": "hello", "max_tokens": 1, "kv_transfer_params": map[string]any{"do_remote_decode": true}}
	if code, out := post(t, dec.URL()+"/v1/completions", asPrefill); code != 400 || !strings.Contains(string(out), "--role decode") {
		t.Fatalf("prefill request to a decode worker: %d %s", code, out)
	}
	noSource := map[string]any{"model": pre.Model(), "prompt": "hello", "max_tokens": 2, "kv_transfer_params": map[string]any{"do_remote_prefill": true}}
	if code, out := post(t, dec.URL()+"/v1/completions", noSource); code != 400 || !strings.Contains(string(out), "remote_engine_id") {
		t.Fatalf("decode request without the prefill's parameters: %d %s", code, out)
	}
	streamed := map[string]any{"model": pre.Model(), "prompt": "hello", "max_tokens": 1, "stream": true, "kv_transfer_params": map[string]any{"do_remote_decode": true}}
	if code, _ := post(t, pre.URL()+"/v1/completions", streamed); code != 400 {
		t.Fatalf("streamed prefill request: %d", code)
	}
	if _, err := Start(t.Context(), Config{Role: "prefil"}); err == nil || !strings.Contains(err.Error(), "prefil") {
		t.Fatalf("Start with role prefil: %v", err)
	}
}
