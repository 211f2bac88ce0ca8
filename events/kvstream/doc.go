// Package kvstream is the NATS side of the KV-event stream: the kv.* subjects
// (events, evictions, instances, snapshot) and their tokens, the event
// headers, JetStream stream, bucket and object-store setup, snapshots,
// eviction records and their server-sent-events handler, heartbeat signing,
// the NATS client configuration and the embedded NATS server with its store
// lock. Payloads on the stream are the engine's batches unchanged; the codec
// for them is package events.
package kvstream
