package simserver

import (
	"fmt"
	"net/http"
	"sync"

	"github.com/kvrouter/kvrouter/events"
)

// Engine formats the simulator can speak (EventsConfig.Format), so that a
// source other than vLLM runs end to end through the real kvbridge, NATS
// and router.
const (
	// FormatVLLM: vLLM's msgpack batches on ZMQ (EventsConfig.Encoding).
	FormatVLLM = "vllm"
	// FormatSGLang: SGLang's (events.EncodeSGLang, with the medium field):
	// one event per page, signed hashes, [ts, events, attn_dp_rank], on the
	// same ZMQ sockets.
	FormatSGLang = "sglang"
	// FormatTRTLLM: TensorRT-LLM's executor events as JSON, drained by
	// POST /kv_cache_events as trtllm-serve serves them; no ZMQ sockets.
	FormatTRTLLM = "trtllm"
)

// FirstSeq is the seq of the first message each rank's ZMQ publisher
// sends, as the captured engine (llm-d-inference-sim) numbers them; vLLM
// counts from 0. A bridge reading the simulator is told so
// (bridge.Source.FirstSeq, kvbridge --first-seq 1): a history replayed
// from it is the whole history.
const FirstSeq = 1

// ValidFormat reports whether f names a format ("" is vLLM's).
func ValidFormat(f string) error {
	switch f {
	case "", FormatVLLM, FormatSGLang, FormatTRTLLM:
		return nil
	}
	return fmt.Errorf("%w: engine format %q (want vllm, sglang or trtllm)", ErrConfig, f)
}

// trtWindow is the window_size the simulated TensorRT-LLM reports: one
// full-attention window (its max_attention_window).
const trtWindow = 4096

// trtMaxBuffered bounds the events kept between two polls, as TensorRT-LLM's
// event_buffer_max_size does (dropping the oldest: the ids then skip).
const trtMaxBuffered = 100000

// trtBuffer holds one rank's events in TensorRT-LLM's form until polled.
type trtBuffer struct {
	mu     sync.Mutex // guards evs and nextID
	evs    []events.TRTLLMEvent
	nextID uint64
	rank   int
	dp     bool // report attention_dp_rank (more than one rank)
}

func newTRTBuffer(rank int, dp bool) *trtBuffer {
	t := &trtBuffer{rank: rank, dp: dp}
	t.push(events.TRTLLMEvent{Type: "created", BlocksPerLevel: []int{0, 0}})
	return t
}

func (t *trtBuffer) push(e events.TRTLLMEvent) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e.EventID, e.WindowSize = t.nextID, trtWindow
	e.DPRank, e.HasDPRank = t.rank, t.dp
	t.nextID++
	if len(t.evs) >= trtMaxBuffered {
		t.evs = t.evs[1:]
	}
	t.evs = append(t.evs, e)
}

// add converts one engine batch. The simulated GPU pool maps to cache level
// 0; a clear is a new KV cache manager ("created"). Offload-tier events are
// not carried: TensorRT-LLM moves a block between levels ("updated"), which
// the simulator's tiers do not model.
func (t *trtBuffer) add(b events.Batch) {
	for i := range b.Events {
		e := &b.Events[i]
		if e.Medium != "" && e.Medium != "GPU" {
			continue
		}
		switch e.Kind {
		case events.AllBlocksCleared:
			t.push(events.TRTLLMEvent{Type: "created", BlocksPerLevel: []int{0, 0}})
		case events.BlockRemoved:
			t.push(events.TRTLLMEvent{Type: "removed", Hashes: append([]uint64(nil), e.BlockHashes...)})
		case events.BlockStored:
			if e.BlockSize <= 0 || len(e.TokenIDs) != e.BlockSize*len(e.BlockHashes) {
				continue
			}
			st := events.TRTLLMEvent{Type: "stored", ParentHash: e.ParentHash, HasParent: e.HasParent}
			for j, h := range e.BlockHashes {
				st.Blocks = append(st.Blocks, events.TRTLLMBlock{Hash: h, Priority: 35,
					Tokens: append([]uint32(nil), e.TokenIDs[j*e.BlockSize:(j+1)*e.BlockSize]...)})
			}
			t.push(st)
		}
	}
}

func (t *trtBuffer) take() []events.TRTLLMEvent {
	t.mu.Lock()
	defer t.mu.Unlock()
	evs := t.evs
	t.evs = nil
	return evs
}

// handleKVCacheEvents is trtllm-serve's POST /kv_cache_events: every
// rank's buffered events (gathered as on rank 0), drained.
func (in *Instance) handleKVCacheEvents(w http.ResponseWriter, _ *http.Request) {
	var all []events.TRTLLMEvent
	for _, d := range in.ranks {
		if d.trt != nil {
			all = append(all, d.trt.take()...)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(events.AppendTRTLLMJSON(nil, all))
}
