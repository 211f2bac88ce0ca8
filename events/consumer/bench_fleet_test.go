//go:build unix

package consumer

import (
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/events/kvstream"
	"github.com/kvrouter/kvrouter/kvindex"
)

// fleetShape is one engine scheduler step's KVEventBatch as a vLLM engine
// publishes it (one batch per step, vllm/v1/core/sched/scheduler.py
// update_from_output; one BlockStored per request whose full blocks grew
// that step and one single-block BlockRemoved per cached block evicted to
// make room, vllm/v1/core/block_pool.py): blocks stored blocks over
// stores BlockStored events — stores−1 of one block (decoding requests
// crossing a block boundary) and one of the rest (a prefill chunk) — and,
// when evict is set, as many single-block BlockRemoved events as blocks
// stored (a full cache: every new block evicts a cached one).
type fleetShape struct {
	blocks, stores int
	evict          bool
}

func (s fleetShape) String() string {
	n := fmt.Sprintf("msg=%dblocks/stores=%d", s.blocks, s.stores)
	if s.evict {
		n += "/evict"
	}
	return n
}

// BenchmarkConsumerFleet is BenchmarkConsumerThroughput (server=process:
// the router process's CPU alone) on the messages a 256-engine fleet
// sends at 2 M stored blocks/s in all (7,813 per engine): one message per
// engine scheduler step, so blocks per message = 7,813 × step time — 50
// at a 6.44 ms step (Llama-3.1-8B, concurrency 1) and 102 at a 13 ms step
// (Llama-3.1-70B TP4), docs/reference/workload-facts.md §2 — split over
// stores events as a step produces them (fleetShape), round-robin over the
// 256 instances as the fleet interleaves. msg=16blocks/stores=1 is the
// shape of BenchmarkConsumerThroughput's 16-block case on this fleet (2 M
// blocks/s in 16-block messages would need 2.05 ms steps). Tokens are
// vLLM-sized ids, hashes integers, the batch and events maps (the newest
// vLLM's kv_events.py, docs/events-codec.md). With evict, each op's index
// first holds (untimed) the blocks the stream evicts: a full cache.
func BenchmarkConsumerFleet(b *testing.B) {
	for _, s := range []fleetShape{
		{16, 1, false},
		{50, 1, false}, {50, 17, false}, {50, 50, false}, {50, 1, true}, {50, 50, true},
		{102, 1, false}, {102, 102, false}, {102, 1, true}, {102, 102, true},
	} {
		b.Run(s.String(), func(b *testing.B) { benchConsumerFleet(b, s) })
	}
}

func benchConsumerFleet(b *testing.B, s fleetShape) {
	const instances, perInst = 256, 4096 // stored blocks per instance
	steps := (perInst + s.blocks - 1) / s.blocks
	perStep := s.stores
	if s.evict {
		perStep += s.blocks
	}
	build := func(pool string) []*nats.Msg {
		var msgs []*nats.Msg
		for step := 0; step < steps; step++ {
			for inst := 0; inst < instances; inst++ {
				name := fmt.Sprintf("e%d", inst)
				subj, _ := kvstream.EventsSubject(pool, name)
				p, err := events.Encode(nil, fleetBatch(inst, step, s), events.EncodingMap)
				if err != nil {
					b.Fatal(err)
				}
				h := kvstream.EventHeaders{Seq: uint64(step + 1), HasSeq: true, Pool: pool, Instance: name}
				msgs = append(msgs, &nats.Msg{Subject: subj, Data: p, Header: h.Header()})
			}
		}
		return msgs
	}
	dc := drainCase{name: "cf", build: build, blocks: instances * steps * s.blocks, events: instances * steps * perStep,
		capacity: 2 * instances * perInst, proc: true, sink: "index", applies: instances * steps}
	if s.evict {
		// The cache is full from the start: every block the stream
		// evicts is one the index holds.
		n := steps * s.blocks
		dc.capacity += instances * n
		dc.prefill = func(idx *kvindex.Memory) { fleetPrefill(b, idx, instances, n) }
	}
	drainStream(b, dc)
}

// fleetOld is the request whose blocks an evicting stream's index holds
// before it starts, the blocks the stream evicts (oldest first).
const fleetOld = 0xffff

// fleetPrefill stores n blocks of request fleetOld in each instance: a
// full cache, the blocks an evicting stream removes.
func fleetPrefill(b *testing.B, idx *kvindex.Memory, instances, n int) {
	for inst := 0; inst < instances; inst++ {
		ev := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: fleetTokens(inst, fleetOld, n)}
		for j := 0; j < n; j++ {
			ev.BlockHashes = append(ev.BlockHashes, fleetHash(inst, fleetOld, j))
		}
		if _, err := idx.Apply(b.Context(), fmt.Sprintf("e%d", inst), []events.Event{ev}); err != nil {
			b.Fatal(err)
		}
	}
}

// fleetBatch is fleetStep's batch as the newest vLLM writes it: a map
// batch of map events (docs/events-codec.md).
func fleetBatch(inst, step int, s fleetShape) events.Batch {
	return events.Batch{TS: 1.7e9, HasDPRank: true, Events: fleetStep(inst, step, s),
		Layout: events.BatchLayout{N: 3, Map: true, Order: 0 | 1<<2 | 2<<4}}
}

// fleetStep is instance inst's batch at step (see fleetShape): request 0
// is the prefill chain, requests 1 … stores−1 decoding chains, one block
// each per step; the evicted blocks are request fleetOld's, oldest first.
func fleetStep(inst, step int, s fleetShape) []events.Event {
	big := s.blocks - (s.stores - 1)
	var evs []events.Event
	for r := 0; r < s.stores; r++ {
		n, pos := 1, step
		if r == 0 {
			n, pos = big, step*big
		}
		ev := events.Event{Kind: events.BlockStored, BlockSize: 16, Medium: "GPU", TokenIDs: fleetTokens(inst, r, n)}
		for j := 0; j < n; j++ {
			ev.BlockHashes = append(ev.BlockHashes, fleetHash(inst, r, pos+j))
		}
		if pos > 0 {
			ev.ParentHash, ev.HasParent = fleetHash(inst, r, pos-1), true
		}
		evs = append(evs, ev)
	}
	if s.evict {
		for j := 0; j < s.blocks; j++ {
			h := fleetHash(inst, fleetOld, step*s.blocks+j)
			evs = append(evs, events.Event{Kind: events.BlockRemoved, Medium: "GPU", BlockHashes: []uint64{h}})
		}
	}
	return evs
}

// fleetHash is the engine hash of instance inst's request r's block pos.
func fleetHash(inst, r, pos int) uint64 { return uint64(inst+1)<<40 | uint64(r)<<24 | uint64(pos) }

// fleetTokens is n blocks of 16 token ids in a Llama-3 vocabulary's range
// (three-byte msgpack integers, as real prompts mostly are).
func fleetTokens(inst, r, n int) []uint32 {
	t := make([]uint32, 16*n)
	for i := range t {
		t[i] = uint32(1000 + (inst*7919+r*104729+i*31)%127000)
	}
	return t
}
