// Package kvstate is the router's KV-state pipeline: the NATS connection
// (or an embedded NATS server with JetStream), one block index per pool
// (memory or Redis, indexes.go) fed by one events consumer per pool, the
// per-tier block accounting around the index (the applier in
// pipeline.go), heartbeat admission (admission.go) and instance
// discovery. It knows nothing of the HTTP server: it hands each pool's
// index and freshness out through KV, and reports what heartbeats
// announced as a Discovery value for the caller (package fleet) to apply.
package kvstate
