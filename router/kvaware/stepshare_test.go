package kvaware

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/internal/testenv"
	"github.com/kvrouter/kvrouter/router"
)

// routeTo routes prompt with inst the only candidate and leaves the
// request waiting for its first token (the decision is not released).
func routeTo(t *testing.T, s *KVAware, inst *router.Instance, prompt []uint32) router.Decision {
	t.Helper()
	d, err := s.Pick(context.Background(), kvRequest("w", prompt), []*router.Instance{inst})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Observer.Done(200, -1) })
	return d
}

// TestPrefillSharesStepWithWaiting: under chunked prefill a request's
// first chunk goes into the step holding the end of the prefill queued
// ahead of it on its instance, so the requests whose last chunk is in that
// step wait for its prefill there. A cache-served request routed to the
// holder of a prompt's first quarter and still waiting for its first token
// shares the next step with the prompt's 48 uncached blocks: the holder
// saves 16 blocks twice (the prompt's own prefill and the fleet's, at
// weight 1) and makes the waiting request wait 48, so the idle vllm-1
// takes it. With nothing waiting on the holder it keeps the prompt.
func TestPrefillSharesStepWithWaiting(t *testing.T) {
	for _, waiting := range []bool{false, true} {
		w := newKVWorld(t, 2)
		s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}})
		prompt := promptTokens(41, 64*kvTestBS)
		other := append(prompt[:16*kvTestBS:16*kvTestBS], promptTokens(42, 48*kvTestBS)...)
		w.store("vllm-0", prompt, 0, 60)
		want := "vllm-0"
		if waiting {
			// The cache-served request: 4 blocks to prefill on vllm-0.
			if d := routeTo(t, s, w.insts[0], prompt); matchedSum(d) != 60*kvTestBS {
				t.Fatalf("served %d tokens from cache, want %d", matchedSum(d), 60*kvTestBS)
			}
			want = "vllm-1"
		}
		if d := kvPick(t, s, kvRequest("b", other), w.insts); d.Instance.ID() != want {
			t.Fatalf("a request waiting on the holder %v: picked %s, want %s", waiting, d.Instance.ID(), want)
		}
	}
}

// TestStepShareDeepQueue: behind a prefill queue longer than a step, a
// new request shares its first step with the end of the queue only, not
// with every request waiting there. vllm-0 holds a prompt's first 16
// blocks and has four 100-block prompts waiting; vllm-1 has one 400-block
// prompt waiting: the same 6,400 tokens ahead on both. With a 512-token
// budget the new prompt's first chunk shares the step holding the queue's
// last 256 tokens on either, where one waiting request ends and 256 of its
// tokens fit: the same delay on both, so the holder keeps the prompt (what
// it saves is all that differs). With the default budget (8,192) the whole
// 6,400-token queue goes into the next step, beside the prompt's chunk, so
// all four requests waiting on vllm-0 wait for its 48 blocks, against one
// on vllm-1 waiting for 64: the prompt goes to vllm-1.
func TestStepShareDeepQueue(t *testing.T) {
	for _, tc := range []struct {
		budget int
		want   string
	}{{512, "vllm-0"}, {0, "vllm-1"}} {
		w := newKVWorld(t, 2)
		s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1, MaxNumBatchedTokens: tc.budget}})
		prompt := promptTokens(51, 64*kvTestBS)
		w.store("vllm-0", prompt, 0, 16)
		for i := range 4 {
			routeTo(t, s, w.insts[0], promptTokens(uint32(60+i), 100*kvTestBS))
		}
		routeTo(t, s, w.insts[1], promptTokens(70, 400*kvTestBS))
		if d := kvPick(t, s, kvRequest("b", prompt), w.insts); d.Instance.ID() != tc.want {
			t.Fatalf("budget %d: picked %s, want %s", tc.budget, d.Instance.ID(), tc.want)
		}
	}
}

// TestStepShare: which waiting requests a new prefill shares its first
// step with, and how much of it that step takes.
func TestStepShare(t *testing.T) {
	sc := resolveScoring(&config.KVScoringConfig{MaxNumBatchedTokens: 1000})
	for _, tc := range []struct {
		ahead, pending float64
		waiting        int64
		share, room    float64
	}{
		{0, 0, 0, 0, 0},           // nothing waiting
		{0, 0, 3, 3, 1000},        // three all-cached requests: all in the next step
		{300, 300, 2, 2, 700},     // under a step: all of it in the next step
		{300, 600, 2, 1, 700},     // half the work done: one request has work left
		{2500, 2500, 5, 1, 500},   // last 500 of 2,500 in the shared step: one of five ends there
		{2500, 2500, 50, 10, 500}, // … ten of fifty
		{3000, 3000, 4, 0, 1000},  // the queue ends on a step boundary
		{0, 5000, 2, 0, 1000},     // the drain says all done: in the step in progress
	} {
		share, room := sc.stepShare(tc.ahead, tc.pending, tc.waiting)
		if share != tc.share || room != tc.room {
			t.Errorf("stepShare(%v, %v, %d) = %v, %v; want %v, %v", tc.ahead, tc.pending, tc.waiting, share, room, tc.share, tc.room)
		}
	}
	if off := resolveScoring(&config.KVScoringConfig{MaxNumBatchedTokens: -1}); off.budget != 0 {
		t.Fatalf("negative budget: %v, want off", off.budget)
	} else if share, _ := off.stepShare(300, 300, 2); share != 0 {
		t.Fatalf("off: share %v", share)
	}
}

// TestStepShareDrainedWithPeers: with replica sync the step share counts
// from the tokens the waiting requests brought, as without it: once the
// drained queue says their prefill is done (the model's 4 blocks at the
// default rate take under 3 ms), the request still waiting for its first
// byte shares no step with a new prompt, and the holder keeps it. Reading
// the drained queue as the tokens they brought (0) counted it as a
// request with all its prompt cached, sharing the whole next step.
func TestStepShareDrainedWithPeers(t *testing.T) {
	w := newPeerWorld(t, testenv.NATSURL(t), testenv.UniqueName(t), "a", 2)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}})
	prompt := promptTokens(41, 64*kvTestBS)
	other := append(prompt[:16*kvTestBS:16*kvTestBS], promptTokens(42, 48*kvTestBS)...)
	w.store("vllm-0", prompt, 0, 60)
	routeTo(t, s, w.insts[0], prompt)
	time.Sleep(200 * time.Millisecond)
	if d := kvPick(t, s, kvRequest("b", other), w.insts); d.Instance.ID() != "vllm-0" {
		t.Fatalf("a drained request waiting on the holder: picked %s, want vllm-0", d.Instance.ID())
	}
}

// TestStepShareColdKey: a cold candidate's key, by which kv_aware keeps
// only the cheapest cold candidates, carries the step share as the score
// does. vllm-0 has four short prompts waiting (3,968 tokens, under one
// step: a new prompt's prefill shares the next step with all four), vllm-1
// one long one (4,992 tokens: it shares with one); vllm-2 holds the new
// prompt's first blocks behind a long queue. By queue alone vllm-0 is the
// cheapest cold candidate and vllm-1 would be pruned; with the step share
// vllm-1 costs less (4,992 + 3,008 against 3,968 + 4 x 3,008 tokens of
// delay) and takes the prompt.
func TestStepShareColdKey(t *testing.T) {
	w := newKVWorld(t, 3)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}})
	prompt := promptTokens(81, 188*kvTestBS)
	w.store("vllm-2", prompt, 0, 4)
	for i := range 4 {
		routeTo(t, s, w.insts[0], promptTokens(uint32(90+i), 62*kvTestBS))
	}
	routeTo(t, s, w.insts[1], promptTokens(95, 312*kvTestBS))
	routeTo(t, s, w.insts[2], promptTokens(96, 4000*kvTestBS))
	if d := kvPick(t, s, kvRequest("b", prompt), w.insts); d.Instance.ID() != "vllm-1" {
		t.Fatalf("picked %s (%s), want vllm-1", d.Instance.ID(), d.Reason)
	}
}
