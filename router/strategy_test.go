package router

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
)

func mustInstances(t testing.TB, n int) []*Instance {
	t.Helper()
	out := make([]*Instance, n)
	for i := range out {
		in, err := NewInstance(fmt.Sprintf("vllm-%d", i), fmt.Sprintf("http://10.0.0.%d:8000", i+1))
		if err != nil {
			t.Fatal(err)
		}
		out[i] = in
	}
	return out
}

func mustStrategy(t testing.TB, name string, cfg config.RoutingConfig, opts ...StrategyOption) Strategy {
	t.Helper()
	s, err := NewStrategy(name, cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func pick(t testing.TB, s Strategy, req *Request, cands []*Instance) Decision {
	t.Helper()
	d, err := s.Pick(context.Background(), req, cands)
	if err != nil {
		t.Fatalf("Pick: %v", err)
	}
	return d
}

// prefixes returns n distinct routing texts shaped like long shared prompts.
func prefixes(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("You are assistant number %d. Follow the policy document below.\n%s", i, strings.Repeat("policy ", 20))
	}
	return out
}

// TestPrefixAwareBalance is the balance property: 7 instances,
// 10,000 distinct prefixes, every share within 14.3% +- 1.5 points.
func TestPrefixAwareBalance(t *testing.T) {
	insts := mustInstances(t, 7)
	s := mustStrategy(t, config.StrategyPrefixAware, config.RoutingConfig{})
	counts := map[string]int{}
	texts := prefixes(10000)
	for _, p := range texts {
		counts[pick(t, s, &Request{RoutingText: p}, insts).Instance.ID()]++
	}
	for _, in := range insts {
		share := 100 * float64(counts[in.ID()]) / float64(len(texts))
		t.Logf("%s: %.2f%%", in.ID(), share)
		if math.Abs(share-100.0/7) > 1.5 {
			t.Errorf("%s share %.2f%%, want 14.29 +- 1.5", in.ID(), share)
		}
	}
}

// TestPrefixAwareStability: adding an 8th instance moves at most 1/8 + 1
// point of prefixes, all of them to the new instance; removing one moves
// only the prefixes it held.
func TestPrefixAwareStability(t *testing.T) {
	insts := mustInstances(t, 8)
	s := mustStrategy(t, config.StrategyPrefixAware, config.RoutingConfig{})
	texts := prefixes(10000)
	place := func(cands []*Instance) []string {
		out := make([]string, len(texts))
		for i, p := range texts {
			out[i] = pick(t, s, &Request{RoutingText: p}, cands).Instance.ID()
		}
		return out
	}
	seven := place(insts[:7])
	eight := place(insts)
	moved := 0
	for i := range texts {
		if seven[i] != eight[i] {
			moved++
			if eight[i] != insts[7].ID() {
				t.Fatalf("prefix %d moved from %s to %s, not to the new instance", i, seven[i], eight[i])
			}
		}
	}
	frac := 100 * float64(moved) / float64(len(texts))
	t.Logf("adding an 8th instance moved %.2f%% of prefixes", frac)
	if frac > 100.0/8+1 {
		t.Errorf("adding an instance moved %.2f%%, want <= %.2f%%", frac, 100.0/8+1)
	}
	for _, gone := range []int{0, 3, 7} {
		rest := append(append([]*Instance{}, insts[:gone]...), insts[gone+1:]...)
		after := place(rest)
		for i := range texts {
			if eight[i] != insts[gone].ID() && after[i] != eight[i] {
				t.Fatalf("removing %s moved prefix %d from %s to %s", insts[gone].ID(), i, eight[i], after[i])
			}
			if after[i] == insts[gone].ID() {
				t.Fatalf("prefix %d still placed on removed %s", i, insts[gone].ID())
			}
		}
	}
}

func TestPrefixAwareOverflow(t *testing.T) {
	insts := mustInstances(t, 5)
	const thr = 2
	s := mustStrategy(t, config.StrategyPrefixAware, config.RoutingConfig{ConcurrencyThreshold: thr})
	req := &Request{RoutingText: "the same long system prompt", TenantKey: "tenant-a"}
	order := RendezvousOrder(req, insts)

	tests := []struct {
		name   string
		full   int // how many of the rendezvous order (from the top) are full
		want   string
		reason Reason
	}{
		{"first choice free", 0, order[0].ID(), ReasonHash},
		{"first full: second in order", 1, order[1].ID(), ReasonOverflow},
		{"three full: fourth in order", 3, order[3].ID(), ReasonOverflow},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for i, in := range order {
				setInFlight(in, 0)
				if i < tc.full {
					setInFlight(in, thr)
				}
			}
			for range 3 { // deterministic: the same answer every time
				d := pick(t, s, req, insts)
				if d.Instance.ID() != tc.want || d.Reason != tc.reason {
					t.Fatalf("got %s/%s, want %s/%s", d.Instance.ID(), d.Reason, tc.want, tc.reason)
				}
			}
		})
	}
	t.Run("all full: least outstanding", func(t *testing.T) {
		for i, in := range order {
			setInFlight(in, thr+5-i%3)
		}
		setInFlight(order[2], thr)
		d := pick(t, s, req, insts)
		if d.Instance != order[2] || d.Reason != ReasonSaturated {
			t.Fatalf("got %s/%s, want %s/saturated", d.Instance.ID(), d.Reason, order[2].ID())
		}
	})
}

func setInFlight(in *Instance, n int) { in.inflight.Store(int64(n)) }

func TestPrefixAwareTenantIsolation(t *testing.T) {
	insts := mustInstances(t, 16)
	s := mustStrategy(t, config.StrategyPrefixAware, config.RoutingConfig{})
	// With 16 instances, 50 tenants sharing one prompt should spread out;
	// one tenant always lands on the same instance.
	seen := map[string]bool{}
	for i := range 50 {
		req := &Request{RoutingText: "shared prompt", TenantKey: fmt.Sprintf("tenant-%d", i)}
		a := pick(t, s, req, insts).Instance.ID()
		b := pick(t, s, &Request{RoutingText: "shared prompt", TenantKey: fmt.Sprintf("tenant-%d", i)}, insts).Instance.ID()
		if a != b {
			t.Fatalf("tenant %d placed on %s then %s", i, a, b)
		}
		seen[a] = true
	}
	if len(seen) < 8 {
		t.Errorf("50 tenants with one prompt used only %d of 16 instances", len(seen))
	}
	// No tenant key differs from an empty one only by the tenant.
	if RoutingHashOf("p", "") == RoutingHashOf("p", "x") {
		t.Error("tenant key does not change the routing hash")
	}
}

func RoutingHashOf(text, tenant string) uint64 {
	r := &Request{RoutingText: text, TenantKey: tenant}
	return r.RoutingHash()
}

func TestRoundRobin(t *testing.T) {
	insts := mustInstances(t, 3)
	s := mustStrategy(t, config.StrategyRoundRobin, config.RoutingConfig{ConcurrencyThreshold: 1})
	var got []string
	for range 6 {
		got = append(got, pick(t, s, &Request{}, insts).Instance.ID())
	}
	if want := "vllm-0 vllm-1 vllm-2 vllm-0 vllm-1 vllm-2"; strings.Join(got, " ") != want {
		t.Fatalf("order %v, want %s", got, want)
	}
	setInFlight(insts[1], 1) // full: skipped
	for range 4 {
		if d := pick(t, s, &Request{}, insts); d.Instance == insts[1] {
			t.Fatal("round robin picked a full instance")
		}
	}
	for _, in := range insts {
		setInFlight(in, 3)
	}
	setInFlight(insts[2], 2)
	if d := pick(t, s, &Request{}, insts); d.Instance != insts[2] || d.Reason != ReasonSaturated {
		t.Fatalf("all full: got %s/%s, want vllm-2/saturated", d.Instance.ID(), d.Reason)
	}
}

func TestLeastOutstanding(t *testing.T) {
	insts := mustInstances(t, 4)
	s := mustStrategy(t, config.StrategyLeastOutstanding, config.RoutingConfig{}, WithSeed(1))
	for i, n := range []int{5, 2, 7, 2} {
		setInFlight(insts[i], n)
	}
	seen := map[string]int{}
	for range 400 {
		d := pick(t, s, &Request{}, insts)
		if d.Reason != ReasonLeastOutstanding {
			t.Fatalf("reason %s", d.Reason)
		}
		seen[d.Instance.ID()]++
	}
	if len(seen) != 2 || seen["vllm-1"] < 150 || seen["vllm-3"] < 150 {
		t.Fatalf("ties not broken evenly among the least loaded: %v", seen)
	}
}

func TestRandom(t *testing.T) {
	insts := mustInstances(t, 4)
	s := mustStrategy(t, config.StrategyRandom, config.RoutingConfig{ConcurrencyThreshold: 3}, WithSeed(7))
	setInFlight(insts[0], 3) // full: never picked while others are free
	seen := map[string]int{}
	for range 3000 {
		seen[pick(t, s, &Request{}, insts).Instance.ID()]++
	}
	if seen["vllm-0"] != 0 {
		t.Fatalf("random picked a full instance %d times", seen["vllm-0"])
	}
	for _, id := range []string{"vllm-1", "vllm-2", "vllm-3"} {
		if seen[id] < 850 || seen[id] > 1150 {
			t.Errorf("%s picked %d of 3000 times, want ~1000", id, seen[id])
		}
	}
}

func TestWithSeedDeterministic(t *testing.T) {
	insts := mustInstances(t, 9)
	run := func() string {
		s := mustStrategy(t, config.StrategyRandom, config.RoutingConfig{}, WithSeed(42))
		var b strings.Builder
		for range 50 {
			b.WriteString(pick(t, s, &Request{}, insts).Instance.ID())
		}
		return b.String()
	}
	if run() != run() {
		t.Fatal("WithSeed does not make random picks reproducible")
	}
}

// TestProxyCanWarm: the HTTP data plane can send a warm-up copy of an
// OpenAI request with a body, but not for a disaggregated request's decode
// pick, whose instance pulls the prompt's KV from the prefill instance.
func TestProxyCanWarm(t *testing.T) {
	body := []byte(`{"prompt":"x"}`)
	for _, c := range []struct {
		name string
		req  *Request
		want bool
	}{
		{"completions", &Request{Endpoint: EndpointCompletions, Body: body}, true},
		{"chat", &Request{Endpoint: EndpointChatCompletions, Body: body}, true},
		{"no body", &Request{Endpoint: EndpointCompletions}, false},
		{"invoke", &Request{Endpoint: EndpointInvoke, Body: body}, false},
		{"decode pick", &Request{Endpoint: EndpointChatCompletions, Body: body, RemotePrefill: true}, false},
	} {
		if got := c.req.ProxyCanWarm(); got != c.want {
			t.Errorf("%s: ProxyCanWarm %v, want %v", c.name, got, c.want)
		}
	}
}
