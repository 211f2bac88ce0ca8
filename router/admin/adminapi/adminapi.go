// Package adminapi is the admin API's wire types that its clients decode:
// the KV views of a pool (GET /admin/pools/{pool}/instances, POST
// /admin/pools/{pool}/lookup). Standard library only, so that a client
// (kvctl) decodes the very types router/admin encodes without linking
// the router.
package adminapi

import "time"

// KVLookupMatch is what one instance holds of the looked-up prompt: its
// leading blocks on GPU, then the blocks beyond those on CPU, and so on.
type KVLookupMatch struct {
	Instance     string `json:"instance"`
	GPUBlocks    int    `json:"gpu_blocks"`
	CPUBlocks    int    `json:"cpu_blocks"`
	DiskBlocks   int    `json:"disk_blocks"`
	SharedBlocks int    `json:"shared_blocks"`
	// Live is false when the consumer marks the instance stale or does
	// not know it: kv_aware does not count its blocks then.
	Live bool `json:"live"`
}

// KVLookupResponse answers POST /admin/pools/{pool}/lookup.
type KVLookupResponse struct {
	Pool         string          `json:"pool"`
	BlockSize    int             `json:"block_size"`
	PromptTokens int             `json:"prompt_tokens"`
	Blocks       int             `json:"blocks"`
	Matches      []KVLookupMatch `json:"matches"`
}

// KVInstanceView is one instance in GET /admin/pools/{pool}/instances: the
// index's blocks per tier merged with the consumer's view and the pool's
// membership.
type KVInstanceView struct {
	Instance string `json:"instance"`
	// State is the consumer's: live, stale, purged; "unknown" for an
	// instance it has never heard from.
	State string `json:"state"`
	// InPool: a candidate of the pool (configured or discovered);
	// Configured: listed in the file.
	InPool     bool   `json:"in_pool"`
	Configured bool   `json:"configured"`
	URL        string `json:"url,omitempty"`
	Healthy    bool   `json:"healthy"`
	// Blocks per tier as the index holds them; null when the index could
	// not be read (KVInstancesResponse.IndexError).
	Blocks        map[string]int `json:"blocks"`
	LastEvent     time.Time      `json:"last_event,omitzero"`
	LastHeartbeat time.Time      `json:"last_heartbeat,omitzero"`
	LastSeq       uint64         `json:"last_seq"`
	StreamSeq     uint64         `json:"stream_seq"`
	Gaps          uint64         `json:"gaps"`
	Clears        uint64         `json:"clears"`
	Malformed     uint64         `json:"malformed"`
	Unknown       uint64         `json:"unknown_events"`
	Invalid       uint64         `json:"invalid_events"`
	// ReplayLost counts holes in the instance's engine seqs the snapshot
	// loaded for them did not reach (consumer.InstanceStatus.ReplayLost).
	ReplayLost uint64 `json:"replay_lost"`
	// NotLive says why the instance is not live for kv_aware, empty when
	// it is: engine_down, hole, reloading, index_unsynced, purged, silent
	// (consumer.InstanceStatus.NotLive); "unknown" instances have none.
	NotLive string `json:"not_live,omitempty"`
	// IndexUnsynced: the instance's state in a shared (Redis) index is not
	// known whole (being repaired, or a hole pending): kv_aware does not
	// count it, whatever State says.
	IndexUnsynced bool `json:"index_unsynced,omitempty"`
}

// KVInstancesResponse answers GET /admin/pools/{pool}/instances.
type KVInstancesResponse struct {
	Pool          string           `json:"pool"`
	StreamHealthy bool             `json:"stream_healthy"`
	BlockSize     int              `json:"block_size"`
	Instances     []KVInstanceView `json:"instances"`
	// IndexError: the index did not answer in time or failed (a hung or
	// unreachable Redis): the answer is partial, the pool's and the
	// consumer's views alone, every instance's blocks unknown (null) and
	// its last event the consumer's.
	IndexError string `json:"index_error,omitempty"`
}

// DecidePick is one strategy's pick in POST /admin/pools/{pool}/decide,
// with kv_aware's prediction for that instance: the prompt's tokens it
// holds per tier (each beyond the faster tiers') and the time to first
// token the model predicts there. The prediction is absent when the
// prompt's tokens are unknown (no token ids and no tokenizer).
type DecidePick struct {
	Instance        string   `json:"instance"`
	Reason          string   `json:"reason"`
	PromptTokens    int      `json:"prompt_tokens,omitempty"`
	GPUTokens       int      `json:"gpu_tokens,omitempty"`
	CPUTokens       int      `json:"cpu_tokens,omitempty"`
	DiskTokens      int      `json:"disk_tokens,omitempty"`
	SharedTokens    int      `json:"shared_tokens,omitempty"`
	PredictedTTFTMs *float64 `json:"predicted_ttft_ms,omitempty"`
}

// DecideResponse answers POST /admin/pools/{pool}/decide: where kv_aware
// would send the request now, and where prefix_aware's hash would,
// evaluated dry (nothing is routed or committed).
type DecideResponse struct {
	Pool string `json:"pool"`
	// Endpoint is "chat" for a body with messages, else "completions".
	Endpoint string `json:"endpoint"`
	// Strategy is the strategy the pool routes with (kv_aware, or the
	// heuristic shadow scoring runs beside).
	Strategy    string     `json:"strategy"`
	KVAware     DecidePick `json:"kv_aware"`
	PrefixAware DecidePick `json:"prefix_aware"`
}

// NoRoute begins the message of the error object the data listener
// answers, with 404, for a path it has no route for ("no route for GET
// /admin/x"; the admin API is mounted there when admin_listen is empty):
// a client tells it from a handler's 404 (a pool, model or instance the
// router lacks) by it.
const NoRoute = "no route for"
