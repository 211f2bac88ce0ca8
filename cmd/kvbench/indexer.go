package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/internal/cputime"
	"github.com/kvrouter/kvrouter/internal/slotlist"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/workload"
)

// The indexer benchmark replays a Mooncake-format trace against the block
// index alone, in the order a fleet produces its operations: for each
// request, the router's lookup of its prompt, then the KV events of the
// engine it was placed on (the blocks it evicted, then the blocks it
// stored). The shape follows Dynamo's lib/kv-router indexer benchmark
// (https://github.com/ai-dynamo/dynamo, lib/kv-router/src/indexer/INDEXER_BENCH.md:
// a Mooncake trace replayed through simulated workers, events and
// find_matches interleaved); the engines here are LRU caches of the trace's
// blocks, not a full engine simulation, so that only the index is measured.
//
// Each fleet size plays fleet/--trace-per copies of the trace (disjoint
// hash ids, as --replicate), so every instance sees the same load at every
// size and only the fleet grows. Operations run on one locked OS thread;
// each is timed in CPU time of that thread (CLOCK_THREAD_CPUTIME_ID) and
// wall time, so "ops per CPU-second" is the index's own cost, without the
// generator's.

// indexerBlockSize is the index's block size in the replay: each trace
// hash id becomes --blocks-per-id blocks of this many synthetic tokens.
const indexerBlockSize = 16

func runIndexer(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("indexer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs, stderr, "kvbench indexer [--workload mooncake | synth-<shape>] [--instances 8,64,256] [flags]",
		"Trace-replay benchmark of the KV block index: each request's lookup, then its engine's KV events\n(LRU caches of the trace's blocks), interleaved as a fleet produces them, on one thread. Reports\nops per CPU-second and per wall second, lookup and apply CPU-time percentiles, and the index's heap.",
		[]string{"kvbench indexer", "kvbench indexer --workload synth-shared-prompts --instances 8,64,256", "kvbench indexer --blocks-per-id 32"})
	var wf workloadFlags
	wf.register(fs)
	sizes := fs.String("instances", "8,64,256", "comma-separated fleet sizes")
	gpu := fs.String("gpu-tokens", "1.35M", "GPU KV capacity per instance in tokens (each engine's LRU cache)")
	perID := fs.Int("blocks-per-id", 1, "index blocks per trace hash id (a Mooncake id covers 512 tokens: 32 gives vLLM's 16-token blocks)")
	tracePer := fs.Int("trace-per", 8, "play one copy of the trace per this many instances (0: one copy at every size)")
	batch := fs.Int("batch", 64, "also replay the same operations timed a batch of this many requests at a time, their inputs made beforehand (0: off): ops per CPU-second without the per-operation timers' system calls")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the replays (all sizes) to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	stop, err := startCPUProfile(*cpuProfile)
	if err != nil {
		return err
	}
	defer stop()
	set := wf.setFlags()
	if !set["workload"] {
		wf.name = "mooncake"
	}
	if !isTrace(wf.name) {
		return fmt.Errorf("--workload %s: the indexer benchmark replays traces (mooncake or synth-*)", wf.name)
	}
	if *perID < 1 {
		return fmt.Errorf("--blocks-per-id %d: want >= 1", *perID)
	}
	gpuTokens, err := parseTokens(*gpu)
	if err != nil {
		return fmt.Errorf("--gpu-tokens: %w", err)
	}
	capBlocks := int(gpuTokens / workload.TraceBlockTokens) // trace blocks per engine
	if capBlocks < 1 {
		return fmt.Errorf("--gpu-tokens %d is under one block", gpuTokens)
	}
	var rows []replayResult
	name := wf.name
	for _, s := range splitList(*sizes) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			return fmt.Errorf("--instances: %q is not a fleet size", s)
		}
		if !set["replicate"] {
			wf.replicate = 1
			if *tracePer > 0 {
				wf.replicate = max(1, n / *tracePer)
			}
		}
		b, err := wf.buildAll()
		if err != nil {
			return err
		}
		r, err := replayIndex(ctx, b.recs, n, capBlocks, *perID)
		if err != nil {
			return err
		}
		if *batch > 0 {
			if r.BatchCPU, r.BatchWall, err = replayBatched(ctx, b.recs, r.picks, n, capBlocks, *perID, *batch); err != nil {
				return err
			}
		}
		r.picks = nil
		runtime.KeepAlive(b.w) // freed mid-replay, it would read as the index's heap shrinking
		name = b.w.Name        // trace:<file> for a trace other than the bundled one
		r.Copies = wf.replicate
		fmt.Fprintf(stderr, "%d instances: %d requests, %.0f ops/CPU-s\n", n, r.Requests, r.opsPerCPU())
		rows = append(rows, r)
	}
	fmt.Fprintf(stdout, "workload %s, %d index block(s) of %d tokens per trace id, engines of %d trace blocks (LRU)\n\n",
		name, *perID, indexerBlockSize, capBlocks)
	writeReplayTable(stdout, rows)
	return nil
}

// replayResult is one fleet size's replay.
type replayResult struct {
	Instances, Copies, Requests int
	Lookups, Applies, Events    int
	Stored, Removed             int
	Lookup, Apply               opStats
	Entries                     int
	HeapBytes                   int64
	// BatchCPU and BatchWall are the same operations' time replayed in
	// batches (replayBatched); 0 when not run.
	BatchCPU, BatchWall time.Duration
	picks               []int32 // the instance each request was placed on
}

// ops counts as Dynamo's benchmark does: requests (lookups) and KV events
// (one BlockStored or BlockRemoved, whatever its block count); an Apply
// is one engine batch of events.
func (r replayResult) ops() int { return r.Lookups + r.Events }

func (r replayResult) opsPerCPU() float64 {
	return float64(r.ops()) / (r.Lookup.cpu + r.Apply.cpu).Seconds()
}

func (r replayResult) opsPerWall() float64 {
	return float64(r.ops()) / (r.Lookup.wall + r.Apply.wall).Seconds()
}

// batchedPerCPU is ops per CPU-second of the batched replay ("–" when
// not run).
func (r replayResult) batchedPerCPU() string {
	if r.BatchCPU <= 0 {
		return "–"
	}
	return strconv.FormatFloat(float64(r.ops())/r.BatchCPU.Seconds(), 'f', 0, 64)
}

// opStats accumulates one kind of operation's times, less the timer's
// own cost (overhead: CPU, wall).
type opStats struct {
	cpuTimes  []time.Duration
	wallTimes []time.Duration
	cpu, wall time.Duration
	overhead  [2]time.Duration
}

func (s *opStats) add(cpu, wall time.Duration) {
	cpu, wall = max(cpu-s.overhead[0], 0), max(wall-s.overhead[1], 0)
	s.cpuTimes = append(s.cpuTimes, cpu)
	s.wallTimes = append(s.wallTimes, wall)
	s.cpu += cpu
	s.wall += wall
}

func writeReplayTable(w io.Writer, rows []replayResult) {
	us := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e3, 'f', 1, 64) }
	fmt.Fprintln(w, "| instances | trace copies | lookups | events (applies) | blocks stored | blocks removed | ops/CPU-s | ops/CPU-s batched | ops/s (wall) | lookup p50 / p99 CPU µs | lookup p99 wall µs | apply p50 / p99 CPU µs | entries | index heap MB | B/entry |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range rows {
		perEntry := 0.0
		if r.Entries > 0 {
			perEntry = float64(r.HeapBytes) / float64(r.Entries)
		}
		fmt.Fprintf(w, "| %d | %d | %d | %d (%d) | %d | %d | %.0f | %s | %.0f | %s / %s | %s | %s / %s | %d | %.1f | %.1f |\n",
			r.Instances, r.Copies, r.Lookups, r.Events, r.Applies, r.Stored, r.Removed, r.opsPerCPU(), r.batchedPerCPU(), r.opsPerWall(),
			us(cputime.Quantile(r.Lookup.cpuTimes, 0.5)), us(cputime.Quantile(r.Lookup.cpuTimes, 0.99)), us(cputime.Quantile(r.Lookup.wallTimes, 0.99)),
			us(cputime.Quantile(r.Apply.cpuTimes, 0.5)), us(cputime.Quantile(r.Apply.cpuTimes, 0.99)),
			r.Entries, float64(r.HeapBytes)/(1<<20), perEntry)
	}
}

// replayIndex plays recs on a fleet of n LRU engines of capBlocks trace
// blocks each, through a fresh memory index.
func replayIndex(ctx context.Context, recs []workload.TraceRecord, n, capBlocks, perID int) (replayResult, error) {
	res := replayResult{Instances: n, Requests: len(recs), picks: make([]int32, len(recs))}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	bs := indexerBlockSize
	engines, names := newReplayFleet(n, capBlocks, perID)
	heap0 := cputime.LiveHeap()
	idx, root, err := newReplayIndex(n, capBlocks, perID)
	if err != nil {
		return res, err
	}
	cpuOver, wallOver := cputime.Overhead()
	res.Lookup.overhead = [2]time.Duration{max(cpuOver, 0), wallOver}
	res.Apply.overhead = res.Lookup.overhead
	var (
		toks   []uint32
		hashes []uint64
		keys   []kvindex.Key
		evs    []events.Event
		ms     []kvindex.Match
		served = make([]int, n)
	)
	for ri, rec := range recs {
		if ri%1024 == 0 && ctx.Err() != nil {
			return res, ctx.Err()
		}
		toks, hashes = replayPrompt(toks[:0], hashes[:0], rec, perID)
		keys = kvindex.AppendKeys(keys[:0], root, toks, bs)
		c0, w0 := cputime.Thread(), time.Now()
		// Into a reused buffer, as kv_aware looks up (Memory.LookupAppend).
		ms, err = idx.LookupAppend(ctx, ms, keys)
		w, c := time.Since(w0), cputime.Thread()
		res.Lookup.add(c-c0, w)
		res.Lookups++
		if err != nil {
			return res, err
		}
		pick := placeByMatch(ms, served, names)
		served[pick]++
		res.picks[ri] = int32(pick)
		evs = engines[pick].serve(evs[:0], hashes, toks, bs)
		if len(evs) == 0 {
			continue
		}
		res.Events += len(evs)
		for _, ev := range evs {
			if ev.Kind == events.BlockStored {
				res.Stored += len(ev.BlockHashes)
			} else {
				res.Removed += len(ev.BlockHashes)
			}
		}
		c0, w0 = cputime.Thread(), time.Now()
		_, err = idx.Apply(ctx, names[pick], evs)
		w, c = time.Since(w0), cputime.Thread()
		res.Apply.add(c-c0, w)
		res.Applies++
		if err != nil {
			return res, err
		}
	}
	res.Entries, _ = idx.Len(ctx)
	// The heap grown since the index was made: the index, and what the
	// engines' caches grew by (small next to it: a map entry per cached
	// block, preallocated to capacity).
	res.HeapBytes = int64(cputime.LiveHeap()) - int64(heap0)
	runtime.KeepAlive(idx)
	return res, nil
}

// newReplayFleet makes n empty LRU engines of capBlocks trace blocks
// each, and their names.
func newReplayFleet(n, capBlocks, perID int) ([]*lruEngine, []string) {
	engines := make([]*lruEngine, n)
	names := make([]string, n)
	for i := range engines {
		engines[i] = newLRUEngine(capBlocks * perID)
		names[i] = fmt.Sprintf("engine-%d", i)
	}
	return engines, names
}

// newReplayIndex makes a fresh memory index sized for that fleet, and
// its root key.
func newReplayIndex(n, capBlocks, perID int) (*kvindex.Memory, kvindex.Key, error) {
	const model = "replay"
	idx, err := kvindex.NewMemory(kvindex.MemoryConfig{Model: model, BlockSize: indexerBlockSize,
		Capacity: min(2*n*capBlocks*perID, kvindex.MaxCapacity)})
	return idx, kvindex.Root(model, "", ""), err
}

// replayPrompt appends a request's tokens and engine hashes: each trace
// hash id becomes perID blocks of indexerBlockSize synthetic tokens.
func replayPrompt(toks []uint32, hashes []uint64, rec workload.TraceRecord, perID int) ([]uint32, []uint64) {
	const bs = indexerBlockSize
	for _, id := range rec.HashIDs {
		for j := 0; j < perID; j++ {
			h := uint64(id)*uint64(perID) + uint64(j) + 1
			hashes = append(hashes, h)
			for t := 0; t < bs; t++ {
				toks = append(toks, uint32(splitmix(h*uint64(bs)+uint64(t))))
			}
		}
	}
	return toks, hashes
}

// replayBatched replays the operations replayIndex timed one by one, on a
// fresh index and fresh engines, with each request placed where
// replayIndex placed it (the index answers the same, so the events are the
// same): the inputs of batch requests at a time (keys, events) are made
// first, then their lookups and applies run back to back between one pair
// of clock reads. It returns the CPU and wall time of the operations alone:
// no per-operation timer (two clock_gettime system calls a side, which also
// cost the next operation its cached lines) and no generator between them.
// The lookup results are not used (the placements are given).
func replayBatched(ctx context.Context, recs []workload.TraceRecord, picks []int32, n, capBlocks, perID, batch int) (cpu, wall time.Duration, err error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	bs := indexerBlockSize
	engines, names := newReplayFleet(n, capBlocks, perID)
	idx, root, err := newReplayIndex(n, capBlocks, perID)
	if err != nil {
		return 0, 0, err
	}
	type op struct {
		keys []kvindex.Key
		evs  []events.Event
		pick int32
	}
	var (
		toks   []uint32
		hashes []uint64
		ms     []kvindex.Match
		ops    = make([]op, batch)
	)
	for lo := 0; lo < len(recs); lo += batch {
		if ctx.Err() != nil {
			return 0, 0, ctx.Err()
		}
		chunk := ops[:min(batch, len(recs)-lo)]
		for k := range chunk {
			rec, pick := recs[lo+k], picks[lo+k]
			toks, hashes = replayPrompt(toks[:0], hashes[:0], rec, perID)
			o := &chunk[k]
			o.keys = kvindex.AppendKeys(o.keys[:0], root, toks, bs)
			o.evs = engines[pick].serve(o.evs[:0], hashes, toks, bs)
			o.pick = pick
		}
		c0, w0 := cputime.Thread(), time.Now()
		for k := range chunk {
			o := &chunk[k]
			if ms, err = idx.LookupAppend(ctx, ms, o.keys); err != nil {
				return 0, 0, err
			}
			if len(o.evs) > 0 {
				if _, err = idx.Apply(ctx, names[o.pick], o.evs); err != nil {
					return 0, 0, err
				}
			}
		}
		w, c := time.Since(w0), cputime.Thread()
		cpu += c - c0
		wall += w
	}
	runtime.KeepAlive(idx)
	return cpu, wall, nil
}

// placeByMatch is the replay's router: the instance matching the most
// leading GPU blocks, unless it already served over 1.5× the mean (then,
// as for a request nobody holds, the instance that served fewest).
func placeByMatch(ms []kvindex.Match, served []int, names []string) int {
	total := 0
	for _, s := range served {
		total += s
	}
	best, bestBlocks := -1, 0
	for _, m := range ms {
		if m.Blocks[0] <= bestBlocks {
			continue
		}
		i, err := strconv.Atoi(strings.TrimPrefix(m.Instance, "engine-"))
		if err != nil || i < 0 || i >= len(names) {
			continue
		}
		if 2*served[i]*len(served) > 3*(total+len(served)) {
			continue // overloaded: it would queue behind its own hits
		}
		best, bestBlocks = i, m.Blocks[0]
	}
	if best >= 0 {
		return best
	}
	least := 0
	for i, s := range served {
		if s < served[least] {
			least = i
		}
	}
	return least
}

// lruEngine is an engine's GPU cache of blocks (by engine hash) with LRU
// eviction, emitting the KV events vLLM would: a request's leading cached
// blocks are hits, the rest are stored (after evicting what they displace),
// and its blocks are touched last block first, so that eviction trims a
// chain from its end, as vLLM's free queue does.
type lruEngine struct {
	capacity int
	slot     map[uint64]int32
	key      []uint64 // by slot
	order    slotlist.List
	removed  []uint64
}

func newLRUEngine(capacity int) *lruEngine {
	return &lruEngine{capacity: capacity, slot: make(map[uint64]int32, capacity), order: slotlist.New()}
}

// serve appends to evs the events of serving a prompt of hashes (tokens of
// bs per block).
func (e *lruEngine) serve(evs []events.Event, hashes []uint64, toks []uint32, bs int) []events.Event {
	hit := 0
	for hit < len(hashes) {
		if _, ok := e.slot[hashes[hit]]; !ok {
			break
		}
		hit++
	}
	end := min(len(hashes), max(hit, e.capacity)) // a prompt larger than the cache keeps its head
	for i := hit - 1; i >= 0; i-- {               // hits become most recent
		e.order.MoveToFront(e.slot[hashes[i]])
	}
	e.removed = e.removed[:0]
	for i := end - 1; i >= hit; i-- {
		var s int32
		switch {
		case len(e.slot) < e.capacity:
			s = e.order.Add()
			e.key = append(e.key, 0)
		default: // evict the least recent block
			s = e.order.Back()
			e.order.MoveToFront(s)
			delete(e.slot, e.key[s])
			e.removed = append(e.removed, e.key[s])
		}
		e.key[s] = hashes[i]
		e.slot[hashes[i]] = s
	}
	// Stored blocks were pushed last first: the chain's head is the most
	// recent, ahead of the hits pushed before them; put the hits back on top.
	for i := hit - 1; i >= 0; i-- {
		e.order.MoveToFront(e.slot[hashes[i]])
	}
	if len(e.removed) > 0 {
		evs = append(evs, events.Event{Kind: events.BlockRemoved, Medium: "GPU", BlockHashes: slices.Clone(e.removed)})
	}
	if end > hit {
		ev := events.Event{Kind: events.BlockStored, Medium: "GPU", BlockSize: bs,
			BlockHashes: slices.Clone(hashes[hit:end]), TokenIDs: slices.Clone(toks[hit*bs : end*bs])}
		if hit > 0 {
			ev.ParentHash, ev.HasParent = hashes[hit-1], true
		}
		evs = append(evs, ev)
	}
	return evs
}

// splitmix is a 64-bit mixer (SplitMix64's finaliser): synthetic token ids
// from a block's engine hash.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}
