// Package sim models one vLLM engine: a paged, prefix-shared KV cache with
// LRU eviction and an optional CPU offload tier, a continuous-batching
// scheduler with chunked prefill and preemption, a roofline step-time model,
// and KV-cache events exactly as vLLM publishes them.
//
// The engine is driven by an explicit virtual clock and starts no
// goroutines: the same code runs in real time behind HTTP (cmd/kvsim, via
// package sim/simserver) and inside kvbench's discrete-event simulation, where
// an hour of traffic on hundreds of engines runs in seconds. Callers Submit
// requests at a time, ask NextEventTime when something happens next, and
// Advance the clock to collect first tokens, tokens and completions. Event
// batches (one per engine step that changed the cache) go to a sink func.
//
// An Engine is not safe for concurrent use; its owner serialises calls.
package sim

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/events"
)

// Errors returned by Submit and the adapter calls; test with errors.Is.
var (
	ErrEmptyPrompt    = errors.New("sim: empty prompt")
	ErrTooLong        = errors.New("sim: request longer than the model or cache allows")
	ErrBadMaxTokens   = errors.New("sim: max tokens must be at least 1")
	ErrUnknownAdapter = errors.New("sim: LoRA adapter not loaded")
	ErrAdapterExists  = errors.New("sim: LoRA adapter already loaded")
	ErrDuplicateID    = errors.New("sim: request id in use")
	ErrBusy           = errors.New("sim: blocks still in use by running requests")
	ErrBadName        = errors.New("sim: name too long")
)

// Request is one generation request as the engine sees it: tokens in, a
// number of tokens out.
type Request struct {
	// ID is chosen by the caller and must be unique among unfinished requests.
	ID uint64
	// Prompt is the tokenized prompt.
	Prompt []uint32
	// MaxTokens is the number of tokens to generate (the simulated model
	// never stops early).
	MaxTokens int
	// Output optionally fixes the generated token ids (e.g. a canned reply
	// tokenized by the server); missing ids are generated pseudo-randomly.
	Output []uint32
	// LoRA names a loaded adapter; empty means the base model.
	LoRA string
	// CacheSalt isolates this request's cache entries (vLLM's cache_salt).
	CacheSalt string
	// RemotePrefill says another engine computed the prompt's KV and this
	// one receives it over the network (vLLM's disaggregated decode: the
	// request carries kv_transfer_params with do_remote_prefill). The full
	// blocks of the prompt this engine does not hold arrive at
	// Timing.KVTransferTokensPerSec instead of being computed; they are then
	// stored in this engine's prefix cache like computed ones (and
	// announced), as vLLM's NixlConnector receiver does.
	RemotePrefill bool
}

// UpdateKind says what an Update reports.
type UpdateKind uint8

const (
	// FirstToken: prefill finished and the first token was sampled.
	FirstToken UpdateKind = iota + 1
	// Token: a later token was sampled (only with Config.TokenUpdates).
	Token
	// Finished: the request generated MaxTokens tokens and released its blocks.
	Finished
	// Aborted: the request was dropped (Abort, or it can never be scheduled).
	Aborted
)

func (k UpdateKind) String() string {
	switch k {
	case FirstToken:
		return "first_token"
	case Token:
		return "token"
	case Finished:
		return "finished"
	case Aborted:
		return "aborted"
	}
	return "unknown"
}

// Update is progress of one request at one virtual time.
type Update struct {
	ID   uint64
	Kind UpdateKind
	At   time.Duration
	// Token is the sampled token (FirstToken, Token).
	Token uint32
	// OutputTokens generated so far.
	OutputTokens int
	PromptTokens int
	// CachedTokens is the prefix served from cache at first admission (GPU
	// hits plus CPU-tier hits), as vLLM reports prompt_tokens_details.cached_tokens.
	CachedTokens int
	// CPUCachedTokens is the part of CachedTokens promoted from the CPU tier.
	CPUCachedTokens int
	Arrival         time.Duration
	Preemptions     int
}

// Stats is a point-in-time view of the engine, for /metrics and tests.
type Stats struct {
	Running, Waiting, Loading int
	// KVUsage is the fraction of GPU blocks held by requests (vLLM's
	// kv_cache_usage_perc, 0..1).
	KVUsage float64
	// GPUBlocks and CPUBlocks are the hashed blocks resident per tier.
	GPUBlocks, CPUBlocks int
	// PrefixQueries and PrefixHits count prompt tokens looked up and found
	// (vLLM's prefix_cache_queries / prefix_cache_hits).
	PrefixQueries, PrefixHits uint64
	// CPUHitTokens counts tokens promoted from the CPU tier.
	CPUHitTokens uint64
	// RemoteTokens counts prompt tokens received from a remote prefill
	// (Request.RemotePrefill) instead of computed or found cached.
	RemoteTokens                      uint64
	Steps, Preemptions                uint64
	GPUEvicted, CPUStored, CPUEvicted uint64
	PromptTokens, GenerationTokens    uint64
	Finished, Aborted                 uint64
	BusyTime                          time.Duration
	// PrefillBusyTime is the part of BusyTime spent in steps that carried
	// prompt tokens (a prefill chunk, or the recompute of a preempted
	// request), as opposed to decode-only steps.
	PrefillBusyTime time.Duration
	Now             time.Duration
	NextEvent       time.Duration
	HasNextEvent    bool
}

// LoRA is a loaded adapter; ID is vLLM's lora_int_id (1, 2, ... in load order).
type LoRA struct {
	Name string
	ID   int64
	Path string
}

type reqState uint8

const (
	stWaiting reqState = iota
	stLoading
	stRunning
	stDone
)

type request struct {
	Request
	state     reqState
	loraID    int64
	arrival   time.Duration
	tokens    []uint32 // prompt + sampled output
	hashes    []uint64 // hashes of full blocks of tokens, computed lazily
	held      []*block // GPU blocks held for tokens; nil = unhashed slot
	firstSlot int      // held[:firstSlot] are all hashed blocks
	computed  int      // tokens whose KV is on the GPU
	output    int
	readyAt   time.Duration // stLoading: when the CPU→GPU copy completes
	hitBlocks int           // stLoading: blocks to commit when loaded
	admitted  bool          // cached-token figures recorded
	cached    int
	cpuCached int
	preempted int
	firstSent bool
	scheduled int // tokens scheduled in the current step
}

// Engine is one simulated vLLM engine (one data-parallel rank).
type Engine struct {
	cfg    Config
	sink   func(events.Batch)
	pool   *pool
	hasher *hasher

	now        time.Duration
	stepActive bool
	stepStart  time.Duration
	stepEnd    time.Duration
	stepEvents []events.Event

	byID    map[uint64]*request
	waiting []*request
	running []*request
	loading []*request
	step    []*request // scheduled in the current step

	loras    map[string]LoRA
	nextLoRA int64
	// pendingUp holds updates produced outside Advance (by Submit, Abort,
	// ResetPrefixCache catching up); the next Advance returns them first.
	pendingUp []Update
	// unplaceable collects Aborted updates made inside startStep, which runs
	// both from advance and from Submit; callers move them to their output.
	unplaceable []Update
	stats       Stats
}

// New returns an engine; sink (may be nil) receives every event batch, in
// order, synchronously from Submit, Advance, Abort and ResetPrefixCache.
func New(cfg Config, sink func(events.Batch)) (*Engine, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	e := &Engine{
		cfg: c, sink: sink,
		pool:   newPool(c.BlockSize, c.GPUBlocks, c.CPUBlocks, c.CPUWriteThrough),
		hasher: newHasher(c.HashAlgo, c.HashSeed),
		byID:   make(map[uint64]*request),
		loras:  make(map[string]LoRA),
	}
	if sink != nil {
		e.pool.pending = &e.stepEvents
	}
	return e, nil
}

// Config returns the engine's configuration with defaults filled in.
func (e *Engine) Config() Config { return e.cfg }

// LoadLoRA makes an adapter servable; its name folds into block hashes.
func (e *Engine) LoadLoRA(name, path string) (LoRA, error) {
	if name == "" || len(name) > 1024 {
		return LoRA{}, fmt.Errorf("%w: adapter name must be 1..1024 bytes", ErrBadName)
	}
	if _, ok := e.loras[name]; ok {
		return LoRA{}, fmt.Errorf("%w: %q", ErrAdapterExists, name)
	}
	e.nextLoRA++
	l := LoRA{Name: name, ID: e.nextLoRA, Path: path}
	e.loras[name] = l
	return l, nil
}

// UnloadLoRA removes an adapter. Its cached blocks stay until evicted, as
// in vLLM; requests already admitted finish.
func (e *Engine) UnloadLoRA(name string) error {
	if _, ok := e.loras[name]; !ok {
		return fmt.Errorf("%w: %q", ErrUnknownAdapter, name)
	}
	delete(e.loras, name)
	return nil
}

// ActiveLoRAs returns the distinct adapters of running (and loading)
// requests and of waiting requests, sorted: what vLLM reports in its
// vllm:lora_requests_info metric.
func (e *Engine) ActiveLoRAs() (running, waiting []string) {
	collect := func(dst []string, qs []*request) []string {
		for _, q := range qs {
			if q.LoRA != "" && !slices.Contains(dst, q.LoRA) {
				dst = append(dst, q.LoRA)
			}
		}
		return dst
	}
	running = collect(collect(nil, e.running), e.loading)
	waiting = collect(nil, e.waiting)
	slices.Sort(running)
	slices.Sort(waiting)
	return running, waiting
}

// LoRAs lists loaded adapters in load order.
func (e *Engine) LoRAs() []LoRA {
	out := make([]LoRA, 0, len(e.loras))
	for _, l := range e.loras {
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b LoRA) int { return int(a.ID - b.ID) })
	return out
}

// Submit queues a request arriving at now (clamped to the engine's clock).
// Steps that end before now are run first; their updates are returned by
// the next Advance.
func (e *Engine) Submit(r Request, now time.Duration) error {
	if len(r.Prompt) == 0 {
		return ErrEmptyPrompt
	}
	if r.MaxTokens < 1 {
		return ErrBadMaxTokens
	}
	total := len(r.Prompt) + r.MaxTokens
	if total > e.cfg.MaxModelLen || (total+e.cfg.BlockSize-1)/e.cfg.BlockSize > e.cfg.GPUBlocks {
		return fmt.Errorf("%w: %d prompt + %d output tokens (max model len %d, %d GPU blocks of %d)",
			ErrTooLong, len(r.Prompt), r.MaxTokens, e.cfg.MaxModelLen, e.cfg.GPUBlocks, e.cfg.BlockSize)
	}
	if len(r.CacheSalt) > 1024 {
		return fmt.Errorf("%w: cache salt over 1024 bytes", ErrBadName)
	}
	var loraID int64
	if r.LoRA != "" {
		l, ok := e.loras[r.LoRA]
		if !ok {
			return fmt.Errorf("%w: %q", ErrUnknownAdapter, r.LoRA)
		}
		loraID = l.ID
	}
	if _, ok := e.byID[r.ID]; ok {
		return fmt.Errorf("%w: %d", ErrDuplicateID, r.ID)
	}
	e.pendingUp = e.advance(now, e.pendingUp)
	tokens := make([]uint32, len(r.Prompt), total)
	copy(tokens, r.Prompt)
	q := &request{Request: r, loraID: loraID, arrival: e.now, tokens: tokens}
	e.byID[r.ID] = q
	e.waiting = append(e.waiting, q)
	e.stats.PromptTokens += uint64(len(r.Prompt))
	if !e.stepActive {
		e.startStep(e.now)
		e.pendingUp = e.takeUnplaceable(e.pendingUp)
	}
	return nil
}

func (e *Engine) takeUnplaceable(out []Update) []Update {
	out = append(out, e.unplaceable...)
	e.unplaceable = e.unplaceable[:0]
	return out
}

// Abort drops an unfinished request (a client that went away) and frees
// its blocks. It reports whether the request was known.
func (e *Engine) Abort(id uint64, now time.Duration) bool {
	q, ok := e.byID[id]
	if !ok {
		return false
	}
	e.pendingUp = e.advance(now, e.pendingUp)
	if q, ok = e.byID[id]; !ok {
		return false // finished while catching up
	}
	e.drop(q)
	switch q.state {
	case stWaiting:
		e.waiting = remove(e.waiting, q)
	case stLoading:
		e.loading = remove(e.loading, q)
	case stRunning:
		e.running = remove(e.running, q)
		// It may be part of the step in flight. That step's blocks were
		// cached when it was scheduled and stay cached (freed, reusable):
		// vLLM handles an abort between steps, so the step that scheduled
		// them computes them. Only its write-through CPU copy is skipped.
		q.scheduled = 0
	}
	e.stats.Aborted++
	e.pendingUp = append(e.pendingUp, e.update(q, Aborted, e.now, 0))
	return true
}

// drop releases q's blocks (tail first, so they are evicted first) and
// forgets it.
func (e *Engine) drop(q *request) {
	e.freeBlocks(q)
	delete(e.byID, q.ID)
}

func (e *Engine) freeBlocks(q *request) {
	for i := len(q.held) - 1; i >= 0; i-- {
		if b := q.held[i]; b != nil {
			e.pool.unref(b)
		} else {
			e.pool.release(1)
		}
	}
	q.held = q.held[:0]
	q.firstSlot = 0
}

// ResetPrefixCache drops every cached block and announces AllBlocksCleared.
// Like vLLM it refuses (ErrBusy) while requests hold blocks.
func (e *Engine) ResetPrefixCache(now time.Duration) error {
	e.pendingUp = e.advance(now, e.pendingUp)
	if !e.pool.clear() {
		return ErrBusy
	}
	if e.sink != nil {
		// Events of the step in flight describe blocks that are gone now:
		// send them first, so the clear comes last.
		evs := append(e.stepEvents, events.Event{Kind: events.AllBlocksCleared})
		e.stepEvents = nil
		e.flush(evs, e.now)
	}
	return nil
}

// NextEventTime is when the engine next changes state on its own (a step
// ends, or a CPU→GPU load completes while idle); ok is false when idle.
func (e *Engine) NextEventTime() (t time.Duration, ok bool) {
	if len(e.pendingUp) > 0 {
		return e.now, true
	}
	if e.stepActive {
		return e.stepEnd, true
	}
	if len(e.loading) > 0 {
		return e.minReady(), true
	}
	return 0, false
}

// Advance runs the engine up to now and appends what happened, in time
// order, to out.
func (e *Engine) Advance(now time.Duration, out []Update) []Update {
	out = append(out, e.pendingUp...)
	e.pendingUp = e.pendingUp[:0]
	return e.advance(now, out)
}

// Now is the engine's virtual clock: the latest time it was advanced to.
func (e *Engine) Now() time.Duration { return e.now }

// Stats returns counters and gauges.
func (e *Engine) Stats() Stats {
	s := e.stats
	s.Running, s.Waiting, s.Loading = len(e.running), len(e.waiting), len(e.loading)
	s.KVUsage = float64(e.pool.used()) / float64(e.pool.gpuCap)
	s.GPUBlocks, s.CPUBlocks = e.pool.gpuCached, e.pool.cpuCount
	s.GPUEvicted, s.CPUStored, s.CPUEvicted = e.pool.counts.gpuEvicted, e.pool.counts.cpuStored, e.pool.counts.cpuEvicted
	s.Now = e.now
	s.NextEvent, s.HasNextEvent = e.NextEventTime()
	return s
}

// Backlog is what a request arriving at an engine finds ahead of it: the
// rest of the step in progress and the prompt work not yet done.
type Backlog struct {
	// StepLeft is the time from the moment asked to the end of the step in
	// progress (0 when the engine is idle).
	StepLeft time.Duration
	// PrefillTokens are the prompt tokens the running and waiting requests
	// leave to compute after the step in progress (a waiting request's
	// whole prompt: its cache lookup comes at admission); requests loading
	// from the CPU tier are not counted.
	PrefillTokens int
}

// BacklogAt returns the engine's Backlog at now (the driver's clock, which
// may be ahead of the engine's own), for tools that compare a router's
// predicted wait with what the engine held.
func (e *Engine) BacklogAt(now time.Duration) Backlog {
	var b Backlog
	if e.stepActive && e.stepEnd > now {
		b.StepLeft = e.stepEnd - now
	}
	for _, q := range e.running {
		b.PrefillTokens += max(len(q.Prompt)-q.computed-q.scheduled, 0)
	}
	for _, q := range e.waiting {
		b.PrefillTokens += len(q.Prompt)
	}
	return b
}

// CachedBlocks returns the hashes resident on the GPU and on the CPU tier,
// sorted (for tests and snapshots).
func (e *Engine) CachedBlocks() (gpuHashes, cpuHashes []uint64) {
	for h, b := range e.pool.blocks {
		if b.on[gpu] {
			gpuHashes = append(gpuHashes, h)
		}
		if b.on[cpu] {
			cpuHashes = append(cpuHashes, h)
		}
	}
	slices.Sort(gpuHashes)
	slices.Sort(cpuHashes)
	return gpuHashes, cpuHashes
}

// PromptHashes returns the engine block hashes of a prompt's full blocks,
// for tests and tools that want to predict what the engine will announce.
func (e *Engine) PromptHashes(prompt []uint32, lora, salt string) []uint64 {
	q := &request{Request: Request{LoRA: lora, CacheSalt: salt}, tokens: prompt}
	return slices.Clone(e.hashesUpTo(q, len(prompt)/e.cfg.BlockSize))
}

func (e *Engine) advance(now time.Duration, out []Update) []Update {
	if now < e.now {
		now = e.now
	}
	for {
		if e.stepActive {
			if e.stepEnd > now {
				break
			}
			e.now = e.stepEnd
			out = e.finishStep(out)
			e.startStep(e.now)
			out = e.takeUnplaceable(out)
			continue
		}
		if len(e.loading) > 0 {
			if r := e.minReady(); r <= now {
				e.now = r
				e.startStep(r)
				out = e.takeUnplaceable(out)
				continue
			}
		}
		break
	}
	e.now = now
	return out
}

func (e *Engine) minReady() time.Duration {
	m := time.Duration(math.MaxInt64)
	for _, q := range e.loading {
		m = min(m, q.readyAt)
	}
	return m
}

// hashesUpTo makes sure q.hashes covers n full blocks and returns them.
func (e *Engine) hashesUpTo(q *request, n int) []uint64 {
	bs := e.cfg.BlockSize
	for i := len(q.hashes); i < n; i++ {
		parent := e.hasher.root
		salt := ""
		if i > 0 {
			parent = q.hashes[i-1]
		} else {
			salt = q.CacheSalt
		}
		q.hashes = append(q.hashes, e.hasher.hash(parent, q.tokens[i*bs:(i+1)*bs], q.LoRA, salt))
	}
	return q.hashes[:n]
}

// startStep schedules the step beginning at t, following vLLM v1's
// scheduler: running requests first (a decode token, or their next prefill
// chunk), preempting the newest running request when blocks run out; then,
// if nobody was preempted, waiting requests in arrival order until the
// token budget, the sequence cap or the cache stops the first of them.
//
// Each scheduled chunk's full blocks are cached as it is scheduled, before
// the next request is looked up, as vLLM v1's KVCacheManager.allocate_slots
// caches up to computed + new tokens (vllm-project/vllm,
// vllm/v1/core/kv_cache_manager.py): a request admitted later in the same
// step, or in any later one, hits blocks this step is computing (one
// forward pass writes every layer's KV before attention reads it). Their
// BlockStored events still go out with the step's batch at its end.
func (e *Engine) startStep(t time.Duration) {
	e.stepStart = t
	// Promote finished CPU→GPU loads.
	if len(e.loading) > 0 {
		keep := e.loading[:0]
		for _, q := range e.loading {
			if q.readyAt > t {
				keep = append(keep, q)
				continue
			}
			from := q.firstSlot
			e.commitBlocks(q, q.hitBlocks)
			e.writeThrough(q, from, q.hitBlocks)
			q.computed = hitTokens(len(q.tokens), e.cfg.BlockSize, q.hitBlocks)
			q.state = stRunning
			e.running = append(e.running, q)
		}
		clear(e.loading[len(keep):])
		e.loading = keep
	}

	budget := e.cfg.MaxNumBatchedTokens
	e.step = e.step[:0]
	preempted := false
	for i := 0; i < len(e.running) && budget > 0; i++ {
		q := e.running[i]
		n := min(len(q.tokens)-q.computed, budget)
		for !e.grow(q, q.computed+n) {
			victim := e.running[len(e.running)-1]
			e.preempt(victim)
			preempted = true
			if victim == q {
				n = 0
				break
			}
		}
		if n == 0 {
			break
		}
		q.scheduled = n
		e.commitBlocks(q, (q.computed+n)/e.cfg.BlockSize)
		budget -= n
		e.step = append(e.step, q)
	}

	if !preempted {
		for len(e.waiting) > 0 && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs {
			q := e.waiting[0]
			if !e.admit(q, t, budget) {
				break
			}
			e.waiting = e.waiting[1:]
			if q.state == stRunning {
				budget -= q.scheduled
				e.step = append(e.step, q)
			}
		}
	}

	if len(e.step) == 0 {
		e.stepActive = false
		// An empty schedule still changed the cache when it evicted blocks
		// to make room for a request that now loads from the CPU tier (or
		// for one preempted at once). vLLM publishes whatever the cache
		// manager collected after every schedule, scheduled tokens or not;
		// holding these events for a later step would leave a listener
		// believing in evicted blocks for as long as the engine idles.
		e.flushStep(t)
		if preempted {
			// Everything running was preempted; now the queue may go.
			e.startStep(t)
			return
		}
		if len(e.loading) == 0 && len(e.waiting) > 0 && len(e.running) == 0 {
			// Nothing runs, nothing loads, yet the queue head cannot be
			// placed: it never will be. Drop it rather than hang.
			q := e.waiting[0]
			e.waiting = e.waiting[1:]
			e.drop(q)
			e.stats.Aborted++
			e.unplaceable = append(e.unplaceable, e.update(q, Aborted, t, 0))
			e.startStep(t)
		}
		return
	}
	e.stepActive = true
	e.stepEnd = t + e.stepCost()
}

// admit tries to place the waiting request q: look up its cached prefix,
// pin it and allocate blocks for its first chunk. A request whose prefix is
// partly on the CPU tier allocates blocks for it and waits for the copy
// (stLoading) without using this step's budget. It reports false, holding
// nothing, when the cache cannot take it.
func (e *Engine) admit(q *request, t time.Duration, budget int) bool {
	bs := e.cfg.BlockSize
	maxHit := maxHitBlocks(len(q.tokens), bs, e.cfg.PartialReuse)
	hashes := e.hashesUpTo(q, maxHit)
	hit, cpuOnly := e.pool.lookup(hashes, maxHit)
	remote := 0
	if q.RemotePrefill {
		remote = maxHit - hit
	}
	// Check room before touching anything, as vLLM's allocate_slots
	// returns None before it touches the computed blocks: a request that
	// cannot be admitted leaves the LRU order as it was, however many
	// steps it retries. Hit blocks on the free list take room too (pinning
	// them takes them off it).
	room := e.pool.available() - e.pool.freeListed(hashes[:hit])
	if cpuOnly > 0 || remote > 0 {
		if cpuOnly+remote > room {
			return false
		}
		// Pin the GPU part and touch the CPU part before allocating, so
		// that making room evicts neither.
		for i := 0; i < hit; i++ {
			b := e.pool.blocks[hashes[i]]
			if b.on[gpu] {
				e.pool.ref(b)
				q.held = append(q.held, b)
			} else {
				e.pool.cpuLRU.remove(b)
				e.pool.cpuLRU.pushBack(b)
				q.held = append(q.held, nil)
			}
		}
		if !e.pool.allocate(cpuOnly + remote) {
			for _, b := range q.held {
				if b != nil {
					e.pool.unref(b)
				}
			}
			q.held = q.held[:0]
			return false
		}
		for range remote {
			q.held = append(q.held, nil)
		}
		e.recordAdmission(q, hitTokens(len(q.tokens), bs, hit), hitTokens(len(q.tokens), bs, cpuOnly))
		e.stats.RemoteTokens += uint64(remote * bs)
		q.state = stLoading
		q.hitBlocks = hit + remote
		// The CPU copies and the network transfer run side by side.
		cpuTime := float64(cpuOnly*bs) / e.cfg.Timing.CPULoadTokensPerSec
		netTime := float64(remote*bs) / e.cfg.Timing.KVTransferTokensPerSec
		q.readyAt = t + time.Duration(math.Max(cpuTime, netTime)*float64(time.Second))
		e.loading = append(e.loading, q)
		return true
	}
	computed := hitTokens(len(q.tokens), bs, hit)
	n := min(len(q.tokens)-computed, budget)
	if (computed+n+bs-1)/bs-hit > room {
		return false
	}
	for i := 0; i < hit; i++ {
		b := e.pool.blocks[hashes[i]]
		e.pool.ref(b)
		q.held = append(q.held, b)
	}
	q.computed = computed
	if !e.grow(q, q.computed+n) {
		e.freeBlocks(q)
		q.computed = 0
		return false
	}
	e.recordAdmission(q, computed, 0)
	q.state = stRunning
	q.scheduled = n
	e.commitBlocks(q, (q.computed+n)/bs)
	e.running = append(e.running, q)
	return true
}

func (e *Engine) recordAdmission(q *request, cached, cpuCached int) {
	e.stats.PrefixQueries += uint64(len(q.tokens))
	e.stats.PrefixHits += uint64(cached)
	e.stats.CPUHitTokens += uint64(cpuCached)
	if !q.admitted {
		q.admitted = true
		q.cached, q.cpuCached = cached, cpuCached
	}
}

// grow makes q hold blocks for its first n tokens.
func (e *Engine) grow(q *request, n int) bool {
	need := (n+e.cfg.BlockSize-1)/e.cfg.BlockSize - len(q.held)
	if need <= 0 {
		return true
	}
	if !e.pool.allocate(need) {
		return false
	}
	for range need {
		q.held = append(q.held, nil)
	}
	return true
}

// preempt sends a running request back to the front of the queue, freeing
// its blocks (vLLM's recompute preemption; its cached blocks stay
// reusable until evicted).
func (e *Engine) preempt(q *request) {
	e.running = remove(e.running, q)
	e.freeBlocks(q)
	q.computed = 0
	q.scheduled = 0
	q.state = stWaiting
	q.preempted++
	e.stats.Preemptions++
	e.waiting = slices.Insert(e.waiting, 0, q)
}

// stepCost is the roofline cost of the scheduled step (see Timing).
func (e *Engine) stepCost() time.Duration {
	var w stepWork
	for _, q := range e.step {
		w.add(q.scheduled, q.computed)
	}
	return w.cost(&e.cfg.Timing)
}

// stepWork is what a step computes: tokens, attention pairs and the
// context read.
type stepWork struct{ tokens, pairs, ctx float64 }

// add counts n tokens scheduled after computed ones of one request.
func (w *stepWork) add(scheduled, computed int) {
	n, c := float64(scheduled), float64(computed)
	w.tokens += n
	w.pairs += n*c + n*(n+1)/2
	w.ctx += c + n
}

// cost is the step's roofline cost under tm (see Timing).
func (w *stepWork) cost(tm *Timing) time.Duration {
	compute := (w.tokens*tm.FLOPsPerToken + w.pairs*tm.AttnFLOPsPerPair) / tm.FLOPS
	memory := tm.WeightReadTime.Seconds() + w.ctx*tm.KVReadSecondsPerToken
	return tm.StepOverhead + time.Duration(math.Max(compute, memory)*float64(time.Second))
}

// maxHitBlocks is how many of a prompt's blocks can be cache hits. vLLM
// recomputes at least the last token, in whole blocks, so at most (n−1)/B
// (v1 KVCacheManager.get_computed_blocks, max_cache_hit_length =
// num_tokens − 1). TensorRT-LLM with partial reuse (Config.PartialReuse)
// matches T − 1 tokens, the last block partial, against the held blocks
// (WindowBlockManager::addSequence and KVCacheBlock::findMatchingBlock,
// NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp @
// b35ac1b): every whole block of the prompt can hit, the hit tokens capped
// at T − 1 (hitTokens). A partial tail block is keyed by no hash here, as
// by no block the router indexes.
func maxHitBlocks(promptTokens, blockSize int, partial bool) int {
	if partial {
		return promptTokens / blockSize
	}
	return (promptTokens - 1) / blockSize
}

// hitTokens is the prompt tokens that hit blocks reuse: all of them, but
// never the last token, whose logits give the first output token.
func hitTokens(promptTokens, blockSize, blocks int) int {
	return min(blocks*blockSize, promptTokens-1)
}

// AloneTTFT is the time to first token of a prompt of promptTokens tokens
// whose first cachedTokens are in GPU blocks, on an idle engine of this
// configuration: the prefill in chunks of the step budget, each step
// costed by Timing, the first token sampled at the end of the last. The
// cached tokens count in whole blocks, at most (promptTokens − 1)/B of them
// (vLLM recomputes at least the last token; with PartialReuse every whole
// block, up to promptTokens − 1 tokens), as the engine does.
//
// On a busy engine the same prefill waits for steps, shares them with
// other requests (each step costs more, and a smaller share of the budget
// makes more of them) or waits for blocks, so a run gives the request a
// longer TTFT with no more cached tokens, up to one exception: where
// steps are memory-bound, a first chunk cut short by another request
// makes the later chunks read less context, which can save a sliver (654
// ns of 25.8 ms in a constructed case with a 64-token budget; at the
// default budget a prefill's steps are compute-bound). kvbench uses it as
// a floor: a percentile of the requests' AloneTTFTs lower-bounds the same
// percentile of a run in which no request hits more than it was given
// here, to that sliver. Cached tokens loaded from the CPU tier would add
// their copy; counting them as GPU keeps the floor a floor.
func (c Config) AloneTTFT(promptTokens, cachedTokens int) (time.Duration, error) {
	c, err := c.withDefaults()
	if err != nil {
		return 0, err
	}
	if promptTokens < 1 {
		return 0, fmt.Errorf("%w: prompt of %d tokens", ErrConfig, promptTokens)
	}
	bs := c.BlockSize
	done := hitTokens(promptTokens, bs, min(max(cachedTokens, 0)/bs, maxHitBlocks(promptTokens, bs, c.PartialReuse)))
	var t time.Duration
	for done < promptTokens {
		n := min(promptTokens-done, c.MaxNumBatchedTokens)
		var w stepWork
		w.add(n, done)
		t += w.cost(&c.Timing)
		done += n
	}
	return t, nil
}

// finishStep completes the step ending at e.now: the scheduled tokens'
// KV is computed (their full blocks were cached when scheduled; with a
// write-through CPU tier they are copied there now), requests that reached
// the end of their tokens sample one, finished requests release their
// blocks, and the step's events go out as one batch (vLLM's scheduler
// publishes what the cache manager collected in update_from_output, after
// the step's forward pass).
func (e *Engine) finishStep(out []Update) []Update {
	t := e.now
	e.stepActive = false
	e.stats.Steps++
	e.stats.BusyTime += t - e.stepStart
	finished := false
	for _, q := range e.step {
		if q.scheduled > 1 || q.computed < len(q.Prompt) {
			e.stats.PrefillBusyTime += t - e.stepStart
			break
		}
	}
	for _, q := range e.step {
		if q.scheduled == 0 || q.state != stRunning {
			continue // aborted or preempted during the step
		}
		from := q.computed / e.cfg.BlockSize
		q.computed += q.scheduled
		q.scheduled = 0
		e.writeThrough(q, from, q.computed/e.cfg.BlockSize)
		if q.computed < len(q.tokens) {
			continue // mid-prefill chunk
		}
		tok := e.outputToken(q)
		q.tokens = append(q.tokens, tok)
		q.output++
		e.stats.GenerationTokens++
		switch {
		case q.output >= q.MaxTokens:
			if !q.firstSent {
				out = append(out, e.update(q, FirstToken, t, tok))
			}
			e.drop(q)
			q.state = stDone
			e.stats.Finished++
			out = append(out, e.update(q, Finished, t, tok))
			finished = true
		case !q.firstSent:
			q.firstSent = true
			out = append(out, e.update(q, FirstToken, t, tok))
		case e.cfg.TokenUpdates:
			out = append(out, e.update(q, Token, t, tok))
		}
	}
	if finished {
		e.running = slices.DeleteFunc(e.running, func(q *request) bool { return q.state == stDone })
	}
	e.flushStep(t)
	return out
}

// flushStep sends the events collected since the last batch, if any, as
// one batch at t.
func (e *Engine) flushStep(t time.Duration) {
	if len(e.stepEvents) > 0 {
		e.flush(e.stepEvents, t)
		e.stepEvents = nil
	}
}

// commitBlocks hashes q's blocks [0, n) that are still slots and announces
// the ones the GPU did not already hold, one BlockStored per contiguous run
// (vLLM announces each request's newly full blocks in one event).
func (e *Engine) commitBlocks(q *request, n int) {
	n = min(n, len(q.held))
	first := -1
	for i := q.firstSlot; i < n; i++ {
		created := false
		if q.held[i] == nil {
			q.held[i], created = e.pool.commit(e.hashesUpTo(q, i+1)[i])
		}
		if created {
			if first < 0 {
				first = i
			}
			continue
		}
		if first >= 0 {
			e.announce(q, first, i)
			first = -1
		}
	}
	if first >= 0 {
		e.announce(q, first, n)
	}
	for q.firstSlot < len(q.held) && q.held[q.firstSlot] != nil {
		q.firstSlot++
	}
}

// writeThrough copies q's computed blocks [from, to) to a write-through
// CPU tier. It runs once their KV exists (at the end of the step that
// computed them, or when a load lands), after their GPU BlockStored, so a
// listener maps the hashes (from their tokens) before it sees them on the
// CPU tier.
func (e *Engine) writeThrough(q *request, from, to int) {
	to = min(to, len(q.held))
	if e.pool.writeThrough && e.pool.cpuCap > 0 && from < to {
		e.pool.storeCPU(q.held[from:to])
	}
}

// announce emits BlockStored for q's blocks [from, to).
func (e *Engine) announce(q *request, from, to int) {
	if e.sink == nil {
		return
	}
	bs := e.cfg.BlockSize
	ev := events.Event{
		Kind:        events.BlockStored,
		BlockHashes: slices.Clone(q.hashes[from:to]),
		TokenIDs:    slices.Clone(q.tokens[from*bs : to*bs]),
		BlockSize:   bs,
		Medium:      MediumGPU,
	}
	if from > 0 {
		ev.ParentHash, ev.HasParent = q.hashes[from-1], true
	} else {
		ev.CacheSalt = q.CacheSalt
	}
	if q.LoRA != "" {
		ev.LoraID, ev.HasLoraID, ev.LoraName = q.loraID, true, q.LoRA
	}
	e.stepEvents = append(e.stepEvents, ev)
}

func (e *Engine) flush(evs []events.Event, t time.Duration) {
	e.sink(events.Batch{
		TS:        e.cfg.Epoch + t.Seconds(),
		Events:    evs,
		DPRank:    e.cfg.DPRank,
		HasDPRank: true,
	})
}

// outputToken is the next generated token: the caller's, else a
// deterministic pseudo-random id (splitmix64 of id and position).
func (e *Engine) outputToken(q *request) uint32 {
	if q.output < len(q.Output) {
		return q.Output[q.output]
	}
	x := q.ID*0x9E3779B97F4A7C15 + uint64(q.output+1)
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	x ^= x >> 31
	return uint32(x % 128000)
}

func (e *Engine) update(q *request, k UpdateKind, t time.Duration, tok uint32) Update {
	return Update{
		ID: q.ID, Kind: k, At: t, Token: tok,
		OutputTokens: q.output, PromptTokens: len(q.Prompt),
		CachedTokens: q.cached, CPUCachedTokens: q.cpuCached,
		Arrival: q.arrival, Preemptions: q.preempted,
	}
}

func remove(s []*request, q *request) []*request {
	if i := slices.Index(s, q); i >= 0 {
		return slices.Delete(s, i, i+1)
	}
	return s
}
