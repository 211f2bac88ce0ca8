// Package enginezmq is the engine's side of the KV-event transport: vLLM's
// ZMQ PUB stream ([topic, seq, payload] frames), the sequence tracker that
// finds gaps and restarts, the SUB-side Subscriber the bridge runs, the
// replay client for the engine's ROUTER socket, and a Publisher speaking the
// same protocol (used by the simulator and tests). Payloads are passed
// through as bytes; the codec for them is package events.
package enginezmq
