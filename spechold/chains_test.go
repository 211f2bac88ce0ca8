package spechold

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/internal/fmix"
)

// chain keys blocks of toks as kvindex does: each key names its block and
// every block before it.
func chain(toks []int) []uint64 {
	keys := make([]uint64, len(toks))
	parent := uint64(0x5bd1e995)
	for i, t := range toks {
		parent = fmix.Mix64(parent*31 + uint64(t) + 1)
		keys[i] = parent
	}
	return keys
}

func TestChains(t *testing.T) {
	keys := chain([]int{1, 2, 3, 4, 5, 6})
	var sc Scan[uint64]
	s := NewChains[uint64](4)
	if ev := s.Add(keys, "a", 100, 0, 0); ev != 2 || s.Len() != 4 {
		t.Fatalf("bound: evicted %d, held %d", ev, s.Len())
	}
	for _, tc := range boundCases {
		if got := s.Extend(&sc, keys, tc.from, tc.inst, tc.epoch, tc.now); got != tc.want {
			t.Errorf("%s: extend %d, want %d", tc.name, got, tc.want)
		}
	}
	if h := s.Holders(nil, &sc, keys[2:], 50); !slices.Equal(h, []string{"a"}) {
		t.Fatalf("holders of the held run's first block %v", h)
	}
	if !s.Any(&sc, keys, 2) || s.Any(&sc, keys, 1) || !s.HeldBy(&sc, keys, 5, "a") || s.HeldBy(&sc, keys, 5, "b") {
		t.Fatal("any / held by")
	}
	// A later run of a over blocks 3..4 in epoch 1: it decides for them
	// (its epoch), the first run still holds 5 in epoch 0.
	s = NewChains[uint64](100)
	s.Add(keys[2:], "a", 100, 0, 0)
	s.Add(keys[3:5], "a", 200, 1, 60)
	if got := s.Extend(&sc, keys, 3, "a", 1, 150); got != 5 {
		t.Fatalf("the later run's epoch: extend %d, want 5", got)
	}
	if got := s.Extend(&sc, keys, 2, "a", 0, 60); got != 3 {
		t.Fatalf("epoch 0 stops where the later run's epoch 1 decides: extend %d, want 3", got)
	}
	// Confirmation: a's holds of the first four blocks go; the first run
	// keeps blocks 4 and 5, the second run block 4. Entries stay counted.
	s.Drop(&sc, keys, 4, "a")
	if s.HeldBy(&sc, keys, 3, "a") || !s.HeldBy(&sc, keys, 4, "a") || s.Len() != 6 {
		t.Fatalf("drop: held 3 %v, 4 %v, len %d", s.HeldBy(&sc, keys, 3, "a"), s.HeldBy(&sc, keys, 4, "a"), s.Len())
	}
	if got := s.Extend(&sc, keys, 4, "a", 1, 60); got != 5 {
		t.Fatalf("after the drop: extend %d, want 5", got)
	}
	// Live counts what is held now: 2 + 1 entries past the drop, the
	// first run's gone once it expires at 100, though Len keeps all 6.
	if l60, l150 := s.Live(60), s.Live(150); l60 != 3 || l150 != 1 {
		t.Fatalf("live: %d at 60, %d at 150; want 3 and 1 (len %d)", l60, l150, s.Len())
	}
	// The sweep at 150 pops the first run; the second still holds 4.
	s.Add(chain([]int{9}), "b", 300, 0, 150)
	if s.Len() != 3 || !s.HeldBy(&sc, keys, 4, "a") || s.HeldBy(&sc, keys, 5, "a") {
		t.Fatalf("sweep: len %d", s.Len())
	}
	if l150, l250 := s.Live(150), s.Live(250); l150 != 2 || l250 != 1 {
		t.Fatalf("live after the sweep: %d at 150, %d at 250; want 2 and 1", l150, l250)
	}
	if z := NewChains[uint64](0); z.Add(keys, "a", 1, 0, 0) != 0 || z.Len() != 0 || z.Extend(&sc, keys, 0, "a", 0, 0) != 0 {
		t.Fatal("a zero-capacity set holds something")
	}
}

// TestChainsAgreesWithModel plays random prompts from a tree of chains
// (shared heads, branching tails) as the router's overlay does (a run of
// a prompt's blocks from some block on, an expiry later than every
// earlier one, confirmation of a prefix) on Chains and on the Set's
// reference model (model, per block and instance), comparing every
// answer: Extend from anywhere, HeldBy, Any and Holders of every block,
// Len, evictions, and that exactly the ring's names are interned. The
// fleet churns as in TestSetAgreesWithModel.
func TestChainsAgreesWithModel(t *testing.T) {
	reused := 0
	for seed := range uint64(24) {
		rng := rand.New(rand.NewPCG(seed, 11))
		capacity := []int{1, 7, 64, 500}[seed%4]
		s := NewChains[uint64](capacity)
		m := &model{holds: map[uint64][]mhold{}, ring: make([]mref, capacity)}
		insts := []string{"a", "b", "c", "d"}
		var left []string
		all := slices.Clone(insts)
		churn := seed >= 4
		var now int64
		var sc Scan[uint64]
		for step := range 3000 {
			if churn && rng.IntN(40) == 0 {
				left, all = churnFleet(rng, insts, left, all)
			}
			toks := make([]int, rng.IntN(40))
			for i := range toks {
				if rng.IntN(8) == 0 {
					toks[i] = 1 + rng.IntN(3)
				}
			}
			keys := chain(toks)
			sc.Reset()
			inst := insts[rng.IntN(len(insts))]
			epoch := uint64(rng.IntN(2))
			switch rng.IntN(4) {
			case 0, 1:
				now += 1 + int64(rng.IntN(3)) // each Add's expiry later than the last
				from := rng.IntN(len(keys) + 1)
				to := from + rng.IntN(len(keys)-from+1)
				exp := now + 12
				if got, want := s.Add(keys[from:to], inst, exp, epoch, now), m.add(keys[from:to], inst, exp, epoch, now); got != want {
					t.Fatalf("seed %d step %d: Add evicted %d, model %d", seed, step, got, want)
				}
			case 2:
				n := rng.IntN(len(keys) + 1)
				s.Drop(&sc, keys, n, inst)
				for _, k := range keys[:n] {
					m.drop(k, func(h mhold) bool { return h.inst == inst })
				}
			default:
				now += int64(rng.IntN(3))
			}
			for _, q := range []string{inst, all[rng.IntN(len(all))]} {
				from := rng.IntN(len(keys) + 1)
				if got, want := s.Extend(&sc, keys, from, q, epoch, now), m.extend(keys, from, q, epoch, now); got != want {
					t.Fatalf("seed %d step %d: Extend(%s, %d) %d, model %d", seed, step, q, from, got, want)
				}
				for j, k := range keys {
					if got, want := s.HeldBy(&sc, keys, j, q), slices.ContainsFunc(m.holds[k], func(h mhold) bool { return h.inst == q }); got != want {
						t.Fatalf("seed %d step %d: HeldBy(%d, %s) %v, model %v", seed, step, j, q, got, want)
					}
				}
			}
			for j, k := range keys {
				if got, want := s.Any(&sc, keys, j), len(m.holds[k]) > 0; got != want {
					t.Fatalf("seed %d step %d: Any(%d) %v, model %v", seed, step, j, got, want)
				}
			}
			if len(keys) > 0 {
				var want []string
				for _, h := range m.holds[keys[0]] {
					if h.exp > now {
						want = append(want, h.inst)
					}
				}
				got := s.Holders(nil, &sc, keys, now)
				slices.Sort(got)
				slices.Sort(want)
				if !slices.Equal(got, want) {
					t.Fatalf("seed %d step %d: Holders %v, model %v", seed, step, got, want)
				}
			}
			if s.Len() != m.n {
				t.Fatalf("seed %d step %d: Len %d, model %d", seed, step, s.Len(), m.n)
			}
			checkInterned(t, &s.ids, m, seed, step)
			checkChainsBounds(t, s)
		}
		if len(s.ids.names)-1 < len(all) {
			reused++
		}
	}
	if reused < 10 {
		t.Fatalf("ids reused in %d of 20 churning seeds", reused)
	}
}

// checkChainsBounds: the key ring within the first power of two of the
// bound (or its least size), one run per entry at most, one index slot
// per held run, the index at most half full.
func checkChainsBounds[K ~uint64](t *testing.T, s *Chains[K]) {
	t.Helper()
	limit := 1024
	for limit < s.bound {
		limit *= 2
	}
	if len(s.keys) > limit || len(s.runs) > max(64, 2*s.bound) || s.rn > s.n {
		t.Fatalf("bounds: key ring %d (limit %d), run ring %d, runs %d, entries %d", len(s.keys), limit, len(s.runs), s.rn, s.n)
	}
	held, listed := 0, 0
	for num := s.r0; num < s.r0+uint64(s.rn); num++ {
		if r := s.runAt(num); r.lo < r.hi {
			held++
		}
	}
	for _, sl := range s.idx {
		for num := sl.run; num != 0; num = s.runAt(num - 1).next {
			listed++
		}
	}
	if held != listed || s.ilive*2 > len(s.idx) {
		t.Fatalf("index: %d held runs, %d listed, %d of %d slots", held, listed, s.ilive, len(s.idx))
	}
}

// A scan is rebuilt after any change and for other keys; Reset lets a
// caller rewrite its keys in place.
func TestChainsScanFollowsChanges(t *testing.T) {
	s := NewChains[uint64](100)
	keys := chain([]int{1, 2, 3, 4})
	var sc Scan[uint64]
	if s.Extend(&sc, keys, 0, "a", 0, 0) != 0 {
		t.Fatal("empty")
	}
	s.Add(keys, "a", 10, 0, 0)
	if got := s.Extend(&sc, keys, 0, "a", 0, 0); got != 4 {
		t.Fatalf("after an Add: %d", got)
	}
	copy(keys, chain([]int{5, 6, 7, 8}))
	sc.Reset()
	if s.Any(&sc, keys, 0) {
		t.Fatal("rewritten keys read through a stale scan")
	}
	s.Add(keys[:2], "b", 10, 0, 0)
	if got := s.Extend(&sc, keys, 0, "b", 0, 0); got != 2 {
		t.Fatalf("after a second Add: %d", got)
	}
}

// Many instances holding one prompt's blocks from many points, churned
// through a small bound: nothing outgrows the bound.
func TestChainsBounded(t *testing.T) {
	const capacity = 300
	s := NewChains[uint64](capacity)
	rng := rand.New(rand.NewPCG(3, 3))
	toks := make([]int, 200)
	keys := chain(toks)
	for i := range 20000 {
		from := rng.IntN(len(keys))
		to := from + 1 + rng.IntN(min(len(keys)-from, 4))
		s.Add(keys[from:to], fmt.Sprint("x", rng.IntN(500)), int64(i+1000), 0, int64(i))
		if i%97 == 0 {
			var sc Scan[uint64]
			s.Drop(&sc, keys, rng.IntN(len(keys)), fmt.Sprint("x", rng.IntN(500)))
		}
	}
	checkChainsBounds(t, s)
	if s.Len() != capacity || len(s.runs) > 512 {
		t.Fatalf("len %d, run ring %d", s.Len(), len(s.runs))
	}
}
