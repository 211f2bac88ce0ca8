package simserver

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
)

// Roles a simulated server plays in disaggregated serving, as vLLM's
// --kv-transfer-config kv_role: a prefill worker (kv_producer) only takes
// prefill requests (kv_transfer_params.do_remote_decode), a decode worker
// (kv_consumer) never does, and "both" (kv_both, the default) takes
// anything. vLLM itself serves a plain request on a kv_producer; kvsim
// refuses it so that a router that sends work to the wrong set is caught.
const (
	RoleBoth    = "both"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// ValidRole reports whether r names a role ("" is RoleBoth).
func ValidRole(r string) bool {
	return r == "" || r == RoleBoth || r == RolePrefill || r == RoleDecode
}

// kvTransferParams is the kv_transfer_params object of vLLM's
// disaggregated serving protocol (NixlConnector): a prefill request carries
// do_remote_decode; the prefill's answer carries what the decode instance
// needs to pull the KV (do_remote_prefill, remote_engine_id,
// remote_block_ids, remote_host, remote_port), which the proxy passes on
// unchanged in the decode request. Fields as in vLLM's
// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py
// (request_finished) and tests/v1/kv_connector/nixl_integration/toy_proxy_server.py.
type kvTransferParams struct {
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	RemoteEngineID  *string `json:"remote_engine_id"`
	RemoteBlockIDs  []int   `json:"remote_block_ids"`
	RemoteHost      *string `json:"remote_host"`
	RemotePort      *int    `json:"remote_port"`
	RemoteRequestID *string `json:"remote_request_id,omitempty"`
}

// transfer is what a request asks of the disaggregation protocol.
type transfer uint8

const (
	transferNone    transfer = iota
	transferPrefill          // compute the prompt, answer with kv_transfer_params
	transferDecode           // receive the prompt's KV from a remote prefill
)

// RemotePrefill is one decode request's transfer parameters, as received.
type RemotePrefill struct {
	EngineID string
	Blocks   int
	Host     string
	Port     int
}

// disaggState is an instance's side of the protocol.
type disaggState struct {
	role     string
	prefills atomic.Uint64 // prefill requests answered with transfer params
	mu       sync.Mutex
	received []RemotePrefill // decode requests' parameters, newest last (bounded)
}

const maxReceived = 1024

// checkTransfer validates a request's kv_transfer_params against the
// instance's role; ok is false after the error was answered.
func (in *Instance) checkTransfer(w http.ResponseWriter, p *genParams) (transfer, bool) {
	kt := p.KVTransferParams
	role := in.disagg.role
	switch {
	case kt != nil && kt.DoRemoteDecode && kt.DoRemotePrefill:
		badRequest(w, "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
		return 0, false
	case kt != nil && kt.DoRemoteDecode:
		if role == RoleDecode {
			badRequest(w, "this kvsim instance is --role decode: it does not take prefill requests (kv_transfer_params.do_remote_decode)")
			return 0, false
		}
		if p.Stream {
			badRequest(w, "a prefill request (kv_transfer_params.do_remote_decode) is not streamed")
			return 0, false
		}
		return transferPrefill, true
	case kt != nil && kt.DoRemotePrefill:
		if role == RolePrefill {
			badRequest(w, "this kvsim instance is --role prefill: it does not take decode requests (kv_transfer_params.do_remote_prefill)")
			return 0, false
		}
		if kt.RemoteEngineID == nil || *kt.RemoteEngineID == "" || kt.RemoteHost == nil || kt.RemotePort == nil {
			badRequest(w, "kv_transfer_params.do_remote_prefill needs remote_engine_id, remote_host and remote_port (from the prefill instance's answer)")
			return 0, false
		}
		rp := RemotePrefill{EngineID: *kt.RemoteEngineID, Blocks: len(kt.RemoteBlockIDs), Host: *kt.RemoteHost, Port: *kt.RemotePort}
		in.disagg.mu.Lock()
		if len(in.disagg.received) == maxReceived {
			in.disagg.received = append(in.disagg.received[:0], in.disagg.received[1:]...)
		}
		in.disagg.received = append(in.disagg.received, rp)
		in.disagg.mu.Unlock()
		return transferDecode, true
	}
	if role == RolePrefill {
		badRequest(w, "this kvsim instance is --role prefill: it takes only prefill requests (kv_transfer_params.do_remote_decode)")
		return 0, false
	}
	return transferNone, true
}

// transferAnswer is the kv_transfer_params of a prefill's answer: the
// prompt's full blocks (vLLM sends the computed block ids; a partial last
// block is recomputed by the decode instance) and where to pull them.
func (in *Instance) transferAnswer(t transfer, promptTokens int) any {
	if t != transferPrefill {
		return nil
	}
	in.disagg.prefills.Add(1)
	bs := in.cfg.Engine.BlockSizeOrDefault()
	ids := make([]int, promptTokens/bs)
	for i := range ids {
		ids[i] = i
	}
	host, port, _ := net.SplitHostPort(in.Addr())
	p, _ := strconv.Atoi(port)
	id := in.EngineID()
	return kvTransferParams{DoRemotePrefill: true, RemoteEngineID: &id, RemoteBlockIDs: ids, RemoteHost: &host, RemotePort: &p}
}

// EngineID is the engine id a prefill answer names (vLLM's engine_id).
func (in *Instance) EngineID() string { return "kvsim-" + in.Addr() }

// Role is the instance's disaggregation role.
func (in *Instance) Role() string { return in.disagg.role }

// Prefills counts prefill requests answered with transfer parameters.
func (in *Instance) Prefills() uint64 { return in.disagg.prefills.Load() }

// RemotePrefills returns the transfer parameters decode requests carried,
// oldest first (the last 1,024).
func (in *Instance) RemotePrefills() []RemotePrefill {
	in.disagg.mu.Lock()
	defer in.disagg.mu.Unlock()
	return append([]RemotePrefill(nil), in.disagg.received...)
}

func validateRole(r string) (string, error) {
	if !ValidRole(r) {
		return "", fmt.Errorf("simserver: role %q: want both, prefill or decode", r)
	}
	if r == "" {
		r = RoleBoth
	}
	return r, nil
}
