package kvaware

import (
	"math"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/zero"
	"github.com/kvrouter/kvrouter/tiers"
)

// Defaults of the kv_aware scoring constants that tiers.CostModel does not
// already carry (its doc comment derives P and the tier load rates). The
// reasoning for each is in docs/kv-aware.md.
const (
	// DefaultWaitingRequestTokens is the prefill work assumed for each
	// request the engine reports waiting beyond those this router has
	// pending there (other routers' traffic: the router does not know their
	// prompts). 1,024 sits between ShareGPT's mean input of 202 tokens and
	// the 8,000-token shared-prefix workloads, after their prefix hits
	// (`docs/reference/workload-facts.md` §5, §6).
	DefaultWaitingRequestTokens = 1024
	// DefaultRunningRequestSeconds is what each running (decoding) request
	// adds to a new request's time to first token: with chunked prefill a
	// step carries one decode token per running sequence beside the prefill
	// chunk, so each running sequence costs a little of every step. NIM's
	// Llama-3.3-70B TP2 inter-token latency grows from 18.6 ms at
	// concurrency 1 to 59.7 ms at 50, ≈ 0.84 ms per added sequence per
	// step (docs/reference/workload-facts.md §2, derived here); at TP8 a step is cheaper, hence
	// 0.5 ms. It makes 64 running requests cost ~30 ms, a tenth of an
	// 8,000-token prefill at 25,000 tokens/s, so cached prefixes dominate
	// until an instance is clearly busier.
	DefaultRunningRequestSeconds = 0.0005
	// DefaultDecodeStepSeconds is the time of one engine step that carries
	// only decode tokens: memory bound, it reads each GPU's share of the
	// weights once. The published inter-token latencies of Llama-3.x-70B
	// at low concurrency with ~35 GB of weights per GPU are 18.6 ms (NIM,
	// FP8 TP2) and 13–14 ms (llm-d, BF16 TP4); BF16 TP8 reads half that
	// per GPU, so 7–9 ms (docs/reference/workload-facts.md §2, derived
	// here). A request that arrives while an engine runs steps joins at
	// the next step boundary: for back-to-back steps of length S it waits
	// S/2 on average (the residual of a renewal interval, E[S²]/2E[S], S
	// nearly constant), a wait an idle engine does not have.
	DefaultDecodeStepSeconds = 0.008
	// DefaultMaxNumBatchedTokens is B, the engines' per-step token budget:
	// vLLM's default for the OpenAI server on GPUs of 70 GiB or more other
	// than A100 (the H100 nodes the other defaults describe), 8,192 tokens
	// (`EngineArgs.get_batch_defaults` in vllm-project/vllm
	// vllm/engine/arg_utils.py; 2,048 on smaller GPUs and A100). With
	// chunked prefill, vLLM V1's default, each step prefills at most B
	// tokens, first come first served, and a request's first token comes at
	// the end of the step that holds its last chunk (kvScoring.stepShare).
	DefaultMaxNumBatchedTokens = 8192
	// DefaultPrefillCostWeight is the least weight w of the adaptive rule:
	// the pick minimises ttft + w·(tokens it makes the instance
	// prefill)/P. TTFT alone is greedy for the one request: a burst sharing
	// a new prefix would see the first request's pending prefill on its
	// instance and spread over idle instances, each recomputing the prefix
	// (the very waste the speculative entries exist to avoid), and every
	// token prefilled delays whoever queues behind it. w = 1 values that
	// delay at least like the request's own wait.
	DefaultPrefillCostWeight = 1.0
	// MaxAdaptiveCostWeight caps the adaptive weight: a recompute is worth
	// it only when it saves 20 times its own prefill time in waiting.
	// ρ/(1−ρ)² reaches it at ρ ≈ 0.8; past that the busy fraction the
	// router measures (a decoding engine counts as busy) no longer tells
	// how long the prefill queue is, and a larger weight would stop every
	// move off a holder however long its queue — at saturation moving
	// bursts off overloaded holders is what keeps the hit rate from
	// collapsing (docs/BENCHMARKS.md §7).
	MaxAdaptiveCostWeight = 19.0
	// DefaultUtilisationWindow is the time constant of the busy-fraction
	// average the adaptive weight reads: long against one prefill (an
	// 8,000-token prompt takes ~0.3 s) and against arrival bursts (the
	// Mooncake conversation trace arrives in 3 s waves), so that it
	// measures utilisation rather than whether a burst is in progress;
	// short against load changes that matter (minutes).
	DefaultUtilisationWindow = 10 * time.Second
	// DefaultTieTolerance: predicted TTFTs within 1 ms are a tie, broken by
	// rendezvous order so that replicas with slightly different local load
	// still agree, and equal prefixes with nothing cached stay together.
	DefaultTieTolerance = time.Millisecond
	// DefaultLoadBound ε of the bounded-load rule: the preferred instance
	// keeps a request while its load (the predicted queue without the step
	// in progress, kvScoring.queue) is at most (1+ε) × the fleet's mean.
	// This is consistent hashing with bounded loads
	// (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded
	// Loads", SODA 2018): no instance is preferred past (1+ε) × the mean,
	// and the expected number of requests that leave their preferred
	// instance, hence of prefixes computed twice, shrinks as 1/ε². 0.25 caps
	// the preferred instance at a quarter above the mean load: under it,
	// waiting costs a request at most a quarter of a mean queue's work
	// (plus, at a decoding home, the residual of the step in progress,
	// which every decoding instance makes a request wait alike), less than
	// a recomputed prefix costs the fleet once load is high enough for
	// queues to matter; above it, load differences are large enough that
	// the score (queue plus recompute) should decide.
	DefaultLoadBound = 0.25
	// DefaultSpeculativeTTL is a few prefill times of a long prompt (an
	// 8,000-token prompt takes ~0.3 s at 25,000 tokens/s) plus the event
	// path (bridge → NATS → index, milliseconds): long enough for the
	// engine's BlockStored to arrive, short enough that a wrong guess (the
	// request failed, its blocks were evicted) is forgotten quickly.
	DefaultSpeculativeTTL = 2 * time.Second
	// DefaultSpeculativeCapacity bounds the speculative overlay in (block,
	// instance) entries: 256k entries are ~500 long prompts in flight,
	// about 20 MB at worst.
	DefaultSpeculativeCapacity = 1 << 18
	// DefaultScrapeInterval of instances' /metrics: vLLM's gauges change per
	// scheduler step, and the router's own counters cover the sub-second
	// picture, so 1 s keeps scrape load negligible.
	DefaultScrapeInterval = time.Second
	// DefaultScrapeTimeout bounds one scrape; an instance slower than this
	// to answer /metrics is loaded anyway.
	DefaultScrapeTimeout = 500 * time.Millisecond
	// DefaultScrapePath is vLLM's Prometheus endpoint.
	DefaultScrapePath = "/metrics"
	// DefaultTokenizeTimeout bounds the token source (the engine's
	// /tokenize is a network round trip): 200 ms is well under an 8k
	// prefill (~330 ms); a later exact answer is worth less than the
	// heuristic's answer now.
	DefaultTokenizeTimeout = 200 * time.Millisecond
)

// kvScoring is KVScoringConfig with defaults applied, in scoring's units.
type kvScoring struct {
	prefill       float64              // P, tokens/s
	load          [tiers.Count]float64 // X per tier, tokens/s (+Inf for GPU)
	blockSize     int                  // 0 = the index's
	partialReuse  bool                 // the engine reuses a held block in part (reusable)
	waitingTokens float64
	runningSec    float64
	stepSec       float64 // decode step time; its half is the wait at a busy engine
	budget        float64 // B, the engines' per-step token budget; 0 = no step-sharing term
	costWeight    float64 // fixed weight; adaptive when < 0
	adaptive      bool
	tieTol        float64 // seconds
	loadBound     float64 // ε; < 0 = off
	specTTL       time.Duration
	specCap       int
	scrape        time.Duration // < 0 = no scraping
	scrapeTimeout time.Duration
	scrapePath    string
	tokTimeout    time.Duration
}

// resolve applies the documented defaults to k (nil = all defaults).
func resolveScoring(k *config.KVScoringConfig) kvScoring {
	var c config.KVScoringConfig
	if k != nil {
		c = *k
	}
	var cm tiers.CostModel // zero value = the documented defaults
	s := kvScoring{
		prefill:       pos(c.PrefillTokensPerSecond, cm.PrefillRate()),
		blockSize:     c.BlockSize,
		waitingTokens: float64(c.WaitingRequestTokens),
		runningSec:    c.RunningRequestSeconds,
		stepSec:       c.DecodeStepSeconds,
		budget:        float64(c.MaxNumBatchedTokens),
		tieTol:        c.TieTolerance.Seconds(),
		specTTL:       c.SpeculativeTTL,
		specCap:       c.SpeculativeCapacity,
		scrape:        c.ScrapeInterval,
		scrapeTimeout: c.ScrapeTimeout,
		scrapePath:    c.ScrapePath,
		tokTimeout:    c.TokenizeTimeout,
		partialReuse:  c.Engine == config.EngineTRTLLM,
	}
	s.load[tiers.GPU] = math.Inf(1)
	s.load[tiers.CPU] = pos(c.CPULoadTokensPerSecond, cm.LoadTokensPerSec(tiers.CPU))
	s.load[tiers.Disk] = pos(c.DiskLoadTokensPerSecond, cm.LoadTokensPerSec(tiers.Disk))
	s.load[tiers.Shared] = pos(c.SharedLoadTokensPerSecond, cm.LoadTokensPerSec(tiers.Shared))
	s.costWeight = c.PrefillCostWeight
	if c.PrefillCostWeight == 0 {
		s.costWeight, s.adaptive = DefaultPrefillCostWeight, true
	}
	zero.Default(&s.waitingTokens, DefaultWaitingRequestTokens)
	zero.Default(&s.runningSec, DefaultRunningRequestSeconds)
	zero.Default(&s.stepSec, DefaultDecodeStepSeconds)
	zero.Default(&s.budget, DefaultMaxNumBatchedTokens)
	zero.Default(&s.tieTol, DefaultTieTolerance.Seconds())
	s.loadBound = c.LoadBound
	zero.Default(&s.loadBound, DefaultLoadBound)
	zero.Default(&s.specTTL, DefaultSpeculativeTTL)
	zero.Default(&s.specCap, DefaultSpeculativeCapacity)
	zero.Default(&s.scrape, DefaultScrapeInterval)
	zero.Default(&s.scrapeTimeout, DefaultScrapeTimeout)
	zero.Default(&s.scrapePath, DefaultScrapePath)
	zero.Default(&s.tokTimeout, DefaultTokenizeTimeout)
	// Negative means "off" for the knobs where off makes sense.
	s.waitingTokens = max(s.waitingTokens, 0)
	s.costWeight = max(s.costWeight, 0)
	s.runningSec = max(s.runningSec, 0)
	s.stepSec = max(s.stepSec, 0)
	s.budget = max(s.budget, 0)
	s.tieTol = max(s.tieTol, 0)
	return s
}

func pos(v, def float64) float64 {
	if v > 0 && !math.IsInf(v, 0) && !math.IsNaN(v) {
		return v
	}
	return def
}

// tierTokens splits a match (cumulative blocks per tier, Blocks[t] = leading
// blocks held in tier t or faster) into tokens per tier, each beyond those
// of faster tiers, capped at what the engine can reuse of the prompt
// (reusable).
func tierTokens(blocks [tiers.Count]int, blockSize, promptTokens int) [tiers.Count]int {
	return tierTokensUpTo(blocks, blockSize, reusable(promptTokens, blockSize))
}

// tierTokensUpTo is tierTokens with the cap given: most tokens reused.
func tierTokensUpTo(blocks [tiers.Count]int, blockSize, most int) (out [tiers.Count]int) {
	prev := 0
	for t := range tiers.Count {
		n := min(blocks[t]*blockSize, most)
		if n > prev {
			out[t] = n - prev
			prev = n
		}
	}
	return out
}

// reusable is the most of a promptTokens-token prompt an engine takes from
// its prefix cache: whole blocks, and never the last token, whose logits
// give the first output token. vLLM caps the hit at num_tokens − 1
// (v1 KVCacheManager.get_computed_blocks, max_cache_hit_length) and hits
// whole blocks only, so a prompt of exactly k blocks recomputes its last
// block: at most (T − 1)/B blocks are reused.
func reusable(promptTokens, blockSize int) int {
	if promptTokens <= 0 || blockSize <= 0 {
		return 0
	}
	return (promptTokens - 1) / blockSize * blockSize
}

// reusable is the cap of the pool's engine (routing.kv.engine). SGLang's is
// vLLM's: it matches fill_ids[:T − 1] (Req.adjust_max_prefix_ids,
// python/sglang/srt/managers/schedule_batch.py @ 000eaff) aligned down to
// whole pages (RadixCache.match_prefix, mem_cache/radix_cache.py @
// 95769b2). TensorRT-LLM chops T − 1 tokens into blocks, the last partial
// (WindowBlockManager::addSequence, cpp/tensorrt_llm/batch_manager/
// kvCacheManager.cpp @ b35ac1b), and with enable_partial_reuse, its
// default (tensorrt_llm/llmapi/llm_args.py @ fcd3f31), that partial block
// hits the held block it begins (KVCacheBlock::findMatchingBlock): up to
// T − 1 tokens of the held blocks, so a whole-block prompt held whole
// recomputes one token, not a block.
func (sc *kvScoring) reusable(promptTokens, blockSize int) int {
	if sc.partialReuse && blockSize > 0 {
		return max(promptTokens-1, 0)
	}
	return reusable(promptTokens, blockSize)
}

// ttft is the ARCHITECTURE's predicted time to first token, in seconds:
//
//	queue + (T − g − c − d − s)/P + c/X_cpu + d/X_disk + s/X_shared
//
// (the disk tier, which the architecture folds into "shared", has its own
// rate here because tiers.CostModel prices it separately).
func (s *kvScoring) ttft(queue float64, promptTokens int, matched [tiers.Count]int) float64 {
	rest := promptTokens
	load := 0.0
	for t := range tiers.Count {
		rest -= matched[t]
		if t != int(tiers.GPU) && matched[t] > 0 {
			load += float64(matched[t]) / s.load[t]
		}
	}
	return queue + float64(max(rest, 0))/s.prefill + load
}

// recompute is the prompt tokens a match leaves the instance to prefill.
func recompute(promptTokens int, matched [tiers.Count]int) int {
	rest := promptTokens
	for _, n := range matched {
		rest -= n
	}
	return max(rest, 0)
}

// prefillCost is the weighted time the fleet spends prefilling the rest
// tokens the instance does not hold (recompute): the second term of the
// score, at weight w.
func (s *kvScoring) prefillCost(w float64, rest int) float64 {
	return w * float64(rest) / s.prefill
}

// weight is the prefill cost weight the score uses: the fixed one when
// prefill_cost_weight sets it, else the measured one (measuredWeight).
func (s *kvScoring) weight(measured float64) float64 {
	if !s.adaptive {
		return s.costWeight
	}
	return measured
}

// measuredWeight is the adaptive weight, measured whatever the
// configuration: the number of other requests that a recompute's work
// delays, estimated two ways and the larger taken (each misses what the
// other sees), at least the floor, capped. Work added at the back of a first-come-first-served queue delays
// every request that arrives after it before the server next idles:
//
//   - from the busy fraction ρ, for Poisson arrivals (M/M/1): a request
//     finds work V ahead of it, E[V] = ρ/(1−ρ) services; the busy period
//     it extends lasts (V + its own service)/(1−ρ) and takes arrivals at
//     rate ρ per service, so ρ/(1−ρ)² requests come after it;
//   - measured directly, behind: the mean number of requests that joined
//     an instance's prefill queue after another in the same busy period
//     (as the router saw it), which follows bursts that a time-average
//     busy fraction smooths away (by symmetry, the mean number ahead of a
//     request in its busy period equals the mean number after it).
//
// Past the floor requests queue behind each other's prefill, which is a
// fact about load, not a price: the placement term reads it even when the
// operator fixes the weight (notePlacement).
func measuredWeight(rho, behind float64) float64 {
	if !(rho < 1) {
		return MaxAdaptiveCostWeight
	}
	w := max(DefaultPrefillCostWeight, rho/((1-rho)*(1-rho)), behind)
	return min(w, MaxAdaptiveCostWeight)
}

// queue is the predicted wait before a new request's prefill starts on an
// instance, in seconds: the router's own pending prefill tokens there,
// or the engine's reported waiting requests when they say more (other
// routers' traffic), plus a per-running-request share of each step.
//
// The max, not the sum: the engine's waiting count already includes this
// router's pending requests, so adding both would count them twice.
//
// load is the same wait without the residual of the step in progress:
// the work queued there (prefill ahead, and each running sequence's share
// of every step), the quantity the bounded-load rule compares. The
// residual is not load: every decoding engine has it alike, it does not
// grow with the work given to the instance (beyond the running share
// load already counts) and is never more than one step.
func (s *kvScoring) queue(pendingTokens float64, pendingReqs, inflight int, ld loadSample, haveLoad bool) (wait, load float64) {
	waitTokens := pendingTokens
	running := float64(max(inflight-pendingReqs, 0))
	if haveLoad {
		if extra := ld.waiting - float64(pendingReqs); extra > 0 {
			waitTokens = max(waitTokens, pendingTokens+extra*s.waitingTokens)
		}
		running = max(running, ld.running)
	}
	wait = waitTokens / s.prefill
	load = wait + running*s.runningSec
	if running > 0 || pendingReqs > 0 {
		// The engine is running steps: nothing starts before the step in
		// progress ends, S/2 on average for a step of S = the decode step
		// plus the running sequences' share of it. Prefill work ahead
		// already includes that step. A request routed there and not yet
		// answered holds a step however little it has to prefill (a
		// prompt all cached takes one too): a burst's requests for one
		// hot prefix stacked on one holder, each a whole step behind the
		// first, while its predicted wait was a few tokens' time.
		wait = max(wait, (s.stepSec+running*s.runningSec)/2)
	}
	return wait + running*s.runningSec, load
}

// stepShare says which of the requests routed to an instance and waiting
// for their first token a new request's prefill delays, under chunked
// prefill with a per-step budget of B tokens: the engine fills each step
// first come first served up to B, and a request's first token comes at
// the end of the step holding its last chunk. With ahead tokens of
// prefill before it (the drained queue, kvaware_drain.go), the new
// request's first chunk goes into the step holding the queue's last
// rem = ahead mod B tokens, beside them, and takes the room B − rem left
// there. Only the waiting requests whose last chunk is in that step wait
// for it: all of those with work left when ahead < B (the next step holds
// the whole queue), those ending in the last rem tokens of the queue
// otherwise. The router knows the count, waiting, and the work they
// brought, pending tokens (before draining); spread evenly over it, that
// is waiting × rem / pending requests, at least one when rem > 0 (the
// last of the queue always ends in that step). A request waiting with no
// work left to prefill (its prompt all cached) still takes a step: with no
// pending tokens at all, every waiting request shares it.
//
// share is that number of requests; room is the new request's tokens the
// step can take, so each of them waits min(recompute, room)/P longer
// (kvScoring.shareCost). The adaptive weight prices the requests that
// arrive after the new one; these are already there.
func (s *kvScoring) stepShare(ahead, pending float64, waiting int64) (share, room float64) {
	if s.budget <= 0 || waiting <= 0 {
		return 0, 0
	}
	k := float64(waiting)
	pending = max(pending, ahead)
	if !(pending > 0) {
		return k, s.budget
	}
	rem := math.Mod(max(ahead, 0), s.budget)
	return min(k, math.Ceil(k*rem/pending)), s.budget - rem
}

// shareCost is what a prefill of rest tokens costs the requests it shares
// its first step with (stepShare), in seconds.
func (s *kvScoring) shareCost(ce *candEval, rest int) float64 {
	if ce.share == 0 || rest <= 0 {
		return 0
	}
	return ce.share * min(float64(rest), ce.room) / s.prefill
}
