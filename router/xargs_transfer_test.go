package router_test

import (
	"encoding/json"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
	"github.com/kvrouter/kvrouter/router/openai"
)

// TestResolveStripsXargsTransferParams: vLLM copies a request's
// vllm_xargs into SamplingParams.extra_args and reads the engine
// request's kv_transfer_params from extra_args["kv_transfer_params"]
// (vllm/entrypoints/openai protocol.py to_sampling_params: extra_args =
// self.vllm_xargs, the top-level kv_transfer_params set over it only when
// present; vllm/v1/request.py: self.kv_transfer_params =
// sampling_params.extra_args.get("kv_transfer_params")). With the
// top-level member removed, a client's vllm_xargs.kv_transfer_params
// reaches the KV connector, which reads it as a dict (NixlConnector,
// LMCache: .get / .items on a string the client chose). The forwarded
// body must hold it in neither place, unless the pool passes them.
func TestResolveStripsXargsTransferParams(t *testing.T) {
	for _, pass := range []bool{false, true} {
		tb := onePoolTable(t, func(p *config.PoolConfig) { p.PassKVTransferParams = pass })
		for i, body := range []string{
			`{"model":"m","prompt":"hello","vllm_xargs":{"kv_transfer_params":"x","other":1}}`,
			`{"model":"m","prompt":"hello","kv_transfer_params":{"a":1},"vllm_xargs":{"kv_transfer_param\u0073":"x"}}`,
			`{"model":"m","prompt":"hello","vllm_xargs":{"other":1},"vllm_xargs":{"kv_transfer_params":["x"]}}`,
		} {
			for _, ep := range []router.Endpoint{router.EndpointCompletions, router.EndpointInvoke} {
				req, _, err := tb.Resolve(router.Inbound{Endpoint: ep, Forwards: true, Body: []byte(body)})
				if err != nil {
					t.Fatalf("%s: %v", body, err)
				}
				xargs := openai.TopLevelRaw(req.Body, "vllm_xargs")
				var m map[string]json.RawMessage
				_ = json.Unmarshal(xargs, &m)
				_, kept := m["kv_transfer_params"]
				if kept != pass {
					t.Errorf("pass %v, endpoint %v: forwarded %s keeps vllm_xargs.kv_transfer_params %v", pass, ep, req.Body, kept)
				}
				if i == 0 && string(m["other"]) != "1" {
					t.Errorf("forwarded %s lost the other vllm_xargs members", req.Body)
				}
			}
		}
	}
}
