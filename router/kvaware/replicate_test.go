package kvaware

import (
	"context"
	"math"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/events"
	"github.com/kvrouter/kvrouter/kvindex"
	"github.com/kvrouter/kvrouter/router"
)

// TestHotPrefixReplicates: requests sharing a prefix whose one holder is
// busier than the rest of the fleet pay rent (their extra wait there) on
// the prefix; once the rent paid covers the price of a copy on the
// least-loaded instance (the score difference of sending the request
// there), the request goes there, reason replicate, and the account
// starts again. A prefix whose holder is no busier pays nothing, and
// shadow scoring pays nothing.
func TestHotPrefixReplicates(t *testing.T) {
	const running = 20 // in flight on the holder: a queue of (S + 20 × R)/2 + 20 × R
	system := promptTokens(61, 64*kvTestBS)
	req := func(i int) *router.Request {
		return kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
	}
	fixed := config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}}

	w := newKVWorld(t, 4)
	s := w.strategy(fixed)
	holder := w.insts[1]
	w.store(holder.ID(), system, 0, 64)
	for range running {
		holder.Acquire()
	}
	queue := (DefaultDecodeStepSeconds+running*DefaultRunningRequestSeconds)/2 + running*DefaultRunningRequestSeconds
	// Price of a copy elsewhere: the alternative's score less the
	// holder's, (q_alt − q_holder) + (1 + w) × 64 blocks / P, with w = 1.
	price := -queue + 2*float64(64*kvTestBS)/25000
	want := int(math.Ceil(price/queue)) + 1 // the request after the rent reaches the price
	got := -1
	for i := 0; i < 4*want; i++ {
		d := kvPick(t, s, req(i), w.insts)
		if d.Reason == router.ReasonReplicate {
			got = i + 1
			if d.Instance == holder {
				t.Fatalf("replicated onto the holder")
			}
			break
		}
		if d.Instance != holder || d.Reason != router.ReasonKVMatch {
			t.Fatalf("request %d: %s (%s), want the holder (kv_match)", i, d.Instance.ID(), d.Reason)
		}
	}
	if got != want {
		t.Fatalf("replicated at request %d, want %d (price %.1f ms, rent %.1f ms a request)", got, want, price*1e3, queue*1e3)
	}
	// The copy (speculative entries) now takes the prefix's requests: the
	// same match, a shorter queue.
	if d := kvPick(t, s, req(1000), w.insts); d.Instance == holder || d.Reason != router.ReasonKVMatch {
		t.Errorf("after the copy: %s (%s), want the copy (kv_match)", d.Instance.ID(), d.Reason)
	}

	// Shadow scoring reads the account without paying into it.
	w2 := newKVWorld(t, 4)
	s2 := w2.strategy(fixed)
	w2.store(w2.insts[1].ID(), system, 0, 64)
	for range running {
		w2.insts[1].Acquire()
	}
	for i := 0; i < 4*want; i++ {
		_, ev, err := s2.pick(context.Background(), req(i), w2.insts, false)
		if err != nil {
			t.Fatal(err)
		}
		w2.st.putEval(ev)
	}
	if d := kvPick(t, s2, req(0), w2.insts); d.Instance != w2.insts[1] || d.Reason != router.ReasonKVMatch {
		t.Errorf("after dry scoring: %s (%s), want the holder (kv_match): dry scoring paid rent", d.Instance.ID(), d.Reason)
	}

	// A holder no busier than the rest pays no rent: it keeps the prefix.
	w3 := newKVWorld(t, 4)
	s3 := w3.strategy(fixed)
	w3.store(w3.insts[1].ID(), system, 0, 64)
	for i := 0; i < 4*want; i++ {
		if d := kvPick(t, s3, req(i), w3.insts); d.Instance != w3.insts[1] || d.Reason != router.ReasonKVMatch {
			t.Fatalf("idle holder, request %d: %s (%s)", i, d.Instance.ID(), d.Reason)
		}
	}
}

// TestRentTable: accounts add up per key, a reset clears one, and a full
// set keeps the account with more rent.
func TestRentTable(t *testing.T) {
	var rt rentTable
	rt.add(7, 0.5)
	rt.add(7, 0.25)
	rt.add(7, math.Inf(1)) // ignored
	rt.add(7, -1)          // ignored
	if got := rt.get(7); got != 0.75 {
		t.Fatalf("rent on 7: %v", got)
	}
	// Keys of one set: 7 + k·rentSets (the low bits pick the set).
	a, b := kvindex.Key(7+rentSets), kvindex.Key(7+2*rentSets)
	if rt.set(a) != rt.set(7) || rt.set(b) != rt.set(7) {
		t.Fatal("keys below 2^29 that agree mod rentSets should share a set")
	}
	rt.add(a, 0.1)
	rt.add(b, 0.2) // evicts a (less rent than 7)
	if rt.get(7) != 0.75 || rt.get(a) != 0 || rt.get(b) != 0.2 {
		t.Fatalf("after eviction: 7=%v a=%v b=%v", rt.get(7), rt.get(a), rt.get(b))
	}
	rt.reset(7)
	if rt.get(7) != 0 || rt.get(b) != 0.2 {
		t.Fatalf("after reset: 7=%v b=%v", rt.get(7), rt.get(b))
	}
}

// TestHotPrefixWarmCopy: where the edge can send a warm-up copy
// (Request.Warmable), the purchase of TestHotPrefixReplicates keeps the
// request on the holder and names the least-loaded instance for the copy
// (Decision.Warm), at the same request: the copy is of the prefix the
// holder has stored (Warm.Tokens), not of the request's own tail; its
// recompute counts as pending prefill there until its observer ends, only
// its blocks become speculative entries there, and the prefix's next
// request follows the copy. A holder congested enough that moving would
// cost the request nothing keeps it too: where the request goes is the
// score's decision, the copy the rent's. An edge that cannot send a copy
// moves the request.
func TestHotPrefixWarmCopy(t *testing.T) {
	system := promptTokens(61, 64*kvTestBS)
	req := func(i int) *router.Request {
		r := kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
		r.Warmable = true
		return r
	}
	fixed := config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}}
	buy := func(running int) (w *kvWorld, s *KVAware, at int, d router.Decision) {
		w = newKVWorld(t, 4)
		s = w.strategy(fixed)
		w.store(w.insts[1].ID(), system, 0, 64)
		for range running {
			w.insts[1].Acquire()
		}
		for i := 0; i < 200; i++ {
			d, err := s.Pick(context.Background(), req(i), w.insts)
			if err != nil {
				t.Fatal(err)
			}
			if d.Observer != nil {
				d.Observer.Done(200, -1)
			}
			if d.Warm != nil || d.Reason == router.ReasonReplicate {
				return w, s, i + 1, d
			}
			if d.Instance != w.insts[1] || d.Reason != router.ReasonKVMatch {
				t.Fatalf("request %d: %s (%s), want the holder (kv_match)", i, d.Instance.ID(), d.Reason)
			}
		}
		t.Fatal("no purchase in 200 requests")
		return
	}

	const running = 20 // as TestHotPrefixReplicates: the holder's TTFT ~20 ms, the recompute ~42 ms
	queue := (DefaultDecodeStepSeconds+running*DefaultRunningRequestSeconds)/2 + running*DefaultRunningRequestSeconds
	price := -queue + 2*float64(64*kvTestBS)/25000
	w, s, at, d := buy(running)
	if want := int(math.Ceil(price/queue)) + 1; at != want {
		t.Fatalf("bought at request %d, want %d (the rent rule's request)", at, want)
	}
	holder := w.insts[1]
	if d.Instance != holder || d.Reason != router.ReasonKVMatch || d.Warm == nil || d.Warm.Instance == holder || d.Warm.Observer == nil {
		t.Fatalf("purchase: %s (%s), warm %+v; want the holder (kv_match) and a warm-up copy elsewhere", d.Instance.ID(), d.Reason, d.Warm)
	}
	alt := d.Warm.Instance
	if d.Warm.Tokens != 64*kvTestBS {
		t.Fatalf("copy of %d tokens, want the holder's stored prefix, %d", d.Warm.Tokens, 64*kvTestBS)
	}
	if tok, n := w.st.PendingPrefill(alt.ID()); tok != int64(64*kvTestBS) || n != 1 {
		t.Fatalf("pending on the copy's instance: %d tokens in %d requests, want the prefix (%d) in 1", tok, n, 64*kvTestBS)
	}
	// The request's own two blocks are speculative on the holder only.
	own := kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+at-1), 2*kvTestBS)...))
	if p := kvPick(t, s, own, []*router.Instance{alt}); p.Explain == nil || p.Explain.MatchedTokens[0] != 64*kvTestBS {
		t.Fatalf("the copy's instance predicted to hold %v of the buyer's prompt, want the prefix's %d tokens", p.Explain, 64*kvTestBS)
	}
	d.Warm.Observer.FirstByte()
	d.Warm.Observer.Done(200, -1)
	if tok, n := w.st.PendingPrefill(alt.ID()); tok != 0 || n != 0 {
		t.Fatalf("after the copy: %d pending tokens in %d requests, want none", tok, n)
	}
	if d := kvPick(t, s, req(1000), w.insts); d.Instance != alt || d.Reason != router.ReasonKVMatch || d.Warm != nil {
		t.Errorf("after the copy: %s (%s, warm %v), want the copy's instance %s (kv_match)", d.Instance.ID(), d.Reason, d.Warm != nil, alt.ID())
	}

	// A dry evaluation (Preview: replicas compared at one instant, the
	// admin decide endpoint) of the buying request decides as the commit
	// will — the holder — and asks for no copy.
	w4 := newKVWorld(t, 4)
	s4 := w4.strategy(fixed)
	w4.store(w4.insts[1].ID(), system, 0, 64)
	for range running {
		w4.insts[1].Acquire()
	}
	for i := 0; i < at-1; i++ {
		kvPick(t, s4, req(i), w4.insts)
	}
	if kv, _, err := Preview(context.Background(), s4, req(at-1), w4.insts); err != nil || kv.Instance != w4.insts[1] || kv.Reason != router.ReasonKVMatch || kv.Warm != nil {
		t.Fatalf("preview of the purchase: %v %s (%s), warm %v; want the holder, no copy", err, kv.Instance.ID(), kv.Reason, kv.Warm != nil)
	}
	if d := kvPick(t, s4, req(at-1), w4.insts); d.Instance != w4.insts[1] || d.Warm == nil {
		t.Fatalf("the purchase after its preview: %s, warm %v; want the holder with a copy", d.Instance.ID(), d.Warm != nil)
	}

	// Without the edge's support, the same purchase moves the request.
	w2 := newKVWorld(t, 4)
	s2 := w2.strategy(fixed)
	w2.store(w2.insts[1].ID(), system, 0, 64)
	for range running {
		w2.insts[1].Acquire()
	}
	for i := 0; i < at; i++ {
		r := req(i)
		r.Warmable = false
		d := kvPick(t, s2, r, w2.insts)
		if d.Warm != nil {
			t.Fatalf("request %d: a warm-up copy for a request whose edge cannot send one", i)
		}
		if i == at-1 && (d.Reason != router.ReasonReplicate || d.Instance == w2.insts[1]) {
			t.Fatalf("request %d: %s (%s), want the purchase to move it (replicate)", i, d.Instance.ID(), d.Reason)
		}
	}

	// A congested holder: 60 in flight (under the concurrency threshold,
	// 64), a queue of ~49 ms, over the 42 ms recompute, while the holder's
	// score (queue + its own 2 blocks) still beats the alternative's
	// (recompute, weighted twice): the request stays, the copy is made.
	w3, _, _, d := buy(60)
	if d.Warm == nil || d.Reason != router.ReasonKVMatch || d.Instance != w3.insts[1] || d.Warm.Tokens != 64*kvTestBS {
		t.Fatalf("congested holder: %s (%s), warm %+v; want the holder (kv_match) and a copy of the prefix elsewhere", d.Instance.ID(), d.Reason, d.Warm)
	}
}

// TestCopyGoesToKeptFree: a request that fits a step names the instances
// the admission queue keeps free of long prompts (Request.KeptFree); the
// copy its prefix buys goes to one of them with room, not to the
// least-queue instance of the fleet (where long contexts may decode), and
// to the least-queue instance when the holder is the only one kept free.
func TestCopyGoesToKeptFree(t *testing.T) {
	system := promptTokens(61, 64*kvTestBS)
	fixed := config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}}
	buy := func(kept func(w *kvWorld) []string) *router.Instance {
		w := newKVWorld(t, 4)
		s := w.strategy(fixed)
		w.store(w.insts[1].ID(), system, 0, 64)
		for range 20 {
			w.insts[1].Acquire()
		}
		for i := 0; i < 200; i++ {
			r := kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
			r.Warmable = true
			r.KeptFree = kept(w)
			d, err := s.Pick(context.Background(), r, w.insts)
			if err != nil {
				t.Fatal(err)
			}
			if d.Observer != nil {
				d.Observer.Done(200, -1)
			}
			if d.Warm != nil {
				return d.Warm.Instance
			}
		}
		t.Fatal("no purchase in 200 requests")
		return nil
	}
	least := buy(func(*kvWorld) []string { return nil })
	// Every instance but the holder is idle: keep one the least-queue
	// rule does not pick.
	other := ""
	for _, id := range []string{"vllm-0", "vllm-2", "vllm-3"} {
		if id != least.ID() {
			other = id
			break
		}
	}
	if got := buy(func(w *kvWorld) []string { return []string{w.insts[1].ID(), other} }); got.ID() != other {
		t.Fatalf("copy on %s, want %s, the instance kept free of long prompts (least queue: %s)", got.ID(), other, least.ID())
	}
	if got := buy(func(w *kvWorld) []string { return []string{w.insts[1].ID()} }); got.ID() != least.ID() {
		t.Fatalf("only the holder kept free: copy on %s, want the least-queue %s", got.ID(), least.ID())
	}
}

// TestHotPrefixWarmCopyMedia: a request with media (an image) is copied
// whole (Warm.Tokens 0: the edge sends the client's request, image
// included, router/httpapi/warm.go), so its copy counts the whole
// prompt's recompute as pending prefill there, not only the prefix the
// holder has stored, which the edge does not send alone.
func TestHotPrefixWarmCopyMedia(t *testing.T) {
	system := promptTokens(61, 64*kvTestBS)
	parsed, err := router.ParseOpenAI(router.EndpointChatCompletions,
		[]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"what"}]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	req := func(i int) *router.Request {
		r := kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
		r.Warmable, r.Parsed = true, parsed
		return r
	}
	w := newKVWorld(t, 4)
	s := w.strategy(config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1}})
	w.store(w.insts[1].ID(), system, 0, 64)
	for range 20 {
		w.insts[1].Acquire()
	}
	for i := range 200 {
		d, err := s.Pick(context.Background(), req(i), w.insts)
		if err != nil {
			t.Fatal(err)
		}
		if d.Observer != nil {
			d.Observer.Done(200, -1)
		}
		if d.Warm == nil {
			continue
		}
		if d.Warm.Tokens != 0 {
			t.Errorf("copy of a request with media names a %d-token prefix, want the whole request (0)", d.Warm.Tokens)
		}
		if tok, n := w.st.PendingPrefill(d.Warm.Instance.ID()); tok != int64(66*kvTestBS) || n != 1 {
			t.Errorf("pending on the copy's instance: %d tokens in %d requests, want the whole prompt (%d) in 1", tok, n, 66*kvTestBS)
		}
		return
	}
	t.Fatal("no purchase in 200 requests")
}

// TestNoCopyAlternativeHolds: when the least-queue alternative already
// holds the holder's whole stored prefix (here in its CPU tier, slow
// enough to load that the score keeps the request on the busy holder),
// there is no copy to buy: no rent is paid and no warm-up is sent, nor is
// the request moved as a purchase. An alternative holding only part of it
// buys a copy as before.
func TestNoCopyAlternativeHolds(t *testing.T) {
	const running = 20
	system := promptTokens(61, 64*kvTestBS)
	req := func(i int) *router.Request {
		r := kvRequest("tenant", append(slices.Clone(system), promptTokens(uint32(5000+i), 2*kvTestBS)...))
		r.Warmable = i%2 == 0 // both kinds of edge
		return r
	}
	// X_cpu 20K tokens/s: loading the 64 blocks takes ~51 ms, more than
	// the holder's ~20 ms queue.
	cfg := config.RoutingConfig{KV: &config.KVScoringConfig{PrefillCostWeight: 1, CPULoadTokensPerSecond: 20000}}
	for _, held := range []int{64, 32} {
		w := newKVWorld(t, 2)
		s := w.strategy(cfg)
		holder, alt := w.insts[1], w.insts[0]
		w.store(holder.ID(), system, 0, 64)
		w.store(alt.ID(), system, 0, held)
		w.tierEvent(events.BlockStored, alt.ID(), "CPU", system, 0, held)
		w.tierEvent(events.BlockRemoved, alt.ID(), "GPU", system, 0, held)
		for range running {
			holder.Acquire()
		}
		bought := -1
		for i := range 20 {
			d := kvPick(t, s, req(i), w.insts)
			if d.Warm != nil || d.Reason == router.ReasonReplicate {
				bought = i
				break
			}
			if d.Instance != holder || d.Reason != router.ReasonKVMatch {
				t.Fatalf("alternative holding %d blocks, request %d: %s (%s), want the holder (kv_match)", held, i, d.Instance.ID(), d.Reason)
			}
		}
		switch {
		case held == 64 && bought >= 0:
			t.Fatalf("the alternative holds the whole prefix (CPU tier), yet request %d bought a copy", bought)
		case held < 64 && bought < 0:
			t.Fatalf("the alternative holds %d of 64 blocks, and no request bought a copy", held)
		}
	}
}
