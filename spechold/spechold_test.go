package spechold

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"
)

// A slot is 32 bytes, two to a cache line and none across two (with
// names in holds it was 48: half the slots straddled two lines), and a
// ring entry 24 (was 32).
func TestSetLayout(t *testing.T) {
	if n := unsafe.Sizeof(slot{}); n != 32 {
		t.Errorf("slot is %d bytes, want 32", n)
	}
	if n := unsafe.Sizeof(ref[uint64]{}); n != 24 {
		t.Errorf("ring entry is %d bytes, want 24", n)
	}
}

// boundCases are Extend's answers over keys 1..6 added by "a" until 100
// in epoch 0 into a set of bound 4 (Set, Chains).
var boundCases = []struct {
	name  string
	from  int
	inst  string
	epoch uint64
	now   int64
	want  int
}{
	{"the newest four kept", 2, "a", 0, 50, 6},
	{"the oldest two made way", 0, "a", 0, 50, 0},
	{"another instance holds nothing", 2, "b", 0, 50, 2},
	{"another cache epoch counts nothing", 2, "a", 1, 50, 2},
	{"expired", 2, "a", 0, 100, 2},
}

func TestSet(t *testing.T) {
	s := New[uint64](4)
	keys := []uint64{1, 2, 3, 4, 5, 6}
	if ev := s.Add(keys, "a", 100, 0, 0); ev != 2 || s.Len() != 4 {
		t.Fatalf("bound: evicted %d, held %d", ev, s.Len())
	}
	for _, tc := range boundCases {
		if got := s.Extend(keys, tc.from, tc.inst, tc.epoch, tc.now); got != tc.want {
			t.Errorf("%s: extend %d, want %d", tc.name, got, tc.want)
		}
	}
	if h := s.Holders(nil, 3, 50); !slices.Equal(h, []string{"a"}) {
		t.Fatalf("holders %v", h)
	}
	// A refresh keeps the later expiry; the sweep at now=150 drops the
	// first insertions' ring entries without dropping refreshed holds.
	s.Add([]uint64{5}, "a", 200, 0, 0)
	s.Add([]uint64{9}, "b", 300, 0, 150)
	if got := s.Extend(keys, 4, "a", 0, 160); got != 5 {
		t.Fatalf("refreshed hold of 5: extend %d, want 5", got)
	}
	s.Drop([]uint64{5}, "a")
	if s.HeldBy(5, "a") || !s.HeldBy(9, "b") {
		t.Fatal("drop")
	}
	if z := New[uint64](0); z.Add(keys, "a", 1, 0, 0) != 0 || z.Len() != 0 || z.Extend(keys, 0, "a", 0, 0) != 0 {
		t.Fatal("a zero-capacity set holds something")
	}
}

// model is the Set as first written (a map of hold lists, instances by
// name), the reference the table-based Set must agree with operation for
// operation, holders' order included (routing reads them in order).
type model struct {
	holds map[uint64][]mhold
	ring  []mref
	head  int
	n     int
}

type mhold struct {
	inst  string
	exp   int64
	epoch uint64
}

type mref struct {
	key  uint64
	inst string
	exp  int64
}

func (m *model) add(keys []uint64, inst string, exp int64, epoch uint64, now int64) (evicted int) {
	if len(m.ring) == 0 || len(keys) == 0 {
		return 0
	}
	for m.n > 0 && m.ring[m.head].exp <= now {
		m.pop()
	}
	for _, k := range keys {
		if m.n == len(m.ring) {
			m.pop()
			evicted++
		}
		hs := m.holds[k]
		held, found := exp, false
		for i := range hs {
			if hs[i].inst == inst {
				hs[i].exp, hs[i].epoch, found = max(hs[i].exp, exp), epoch, true
				held = hs[i].exp
				break
			}
		}
		if !found {
			m.holds[k] = append(hs, mhold{inst: inst, exp: exp, epoch: epoch})
		}
		m.ring[(m.head+m.n)%len(m.ring)] = mref{key: k, inst: inst, exp: held}
		m.n++
	}
	return evicted
}

func (m *model) pop() {
	r := m.ring[m.head]
	m.head = (m.head + 1) % len(m.ring)
	m.n--
	m.drop(r.key, func(h mhold) bool { return h.inst == r.inst && h.exp == r.exp })
}

func (m *model) drop(k uint64, match func(mhold) bool) {
	hs := m.holds[k]
	for i := range hs {
		if match(hs[i]) {
			hs[i] = hs[len(hs)-1]
			hs = hs[:len(hs)-1]
			break
		}
	}
	if len(hs) == 0 {
		delete(m.holds, k)
	} else {
		m.holds[k] = hs
	}
}

func (m *model) extend(keys []uint64, from int, inst string, epoch uint64, now int64) int {
	k := from
	for ; k < len(keys); k++ {
		held := false
		for _, h := range m.holds[keys[k]] {
			if h.inst == inst && h.exp > now && h.epoch == epoch {
				held = true
				break
			}
		}
		if !held {
			break
		}
	}
	return max(k, from)
}

// TestSetAgreesWithModel plays random chains of keys (sharing prefixes,
// several instances, refreshes, drops, expiry and the bound) on a Set and
// on the model, comparing every answer. The fleet churns: now and then an
// instance leaves (it adds no more, its holds stay until they expire or
// make way, and it is still asked about), a new one joins under a new
// name, or one that left comes back under its old name, so that ids are
// given back and reused while other ids' holds remain, and a name is
// interned again both while its old holds remain and after they are gone.
func TestSetAgreesWithModel(t *testing.T) {
	reused := 0
	for seed := range uint64(24) {
		rng := rand.New(rand.NewPCG(seed, 7))
		capacity := []int{1, 7, 64, 500}[seed%4]
		s := New[uint64](capacity)
		m := &model{holds: map[uint64][]mhold{}, ring: make([]mref, capacity)}
		insts := []string{"a", "b", "c", "d"}
		var left []string
		all := slices.Clone(insts)
		churn := seed >= 4 // the first four seeds keep one fleet of four
		var now int64
		for step := range 3000 {
			now += int64(rng.IntN(3))
			if churn && rng.IntN(40) == 0 {
				left, all = churnFleet(rng, insts, left, all)
			}
			keys := make([]uint64, rng.IntN(40))
			root := uint64(rng.IntN(6))
			for i := range keys {
				keys[i] = root*1000 + uint64(i) // chains sharing their heads
				if rng.IntN(10) == 0 {
					root = uint64(6 + rng.IntN(50))
				}
			}
			inst := insts[rng.IntN(len(insts))]
			epoch := uint64(rng.IntN(2))
			switch rng.IntN(4) {
			case 0, 1:
				exp := now + int64(rng.IntN(20))
				if got, want := s.Add(keys, inst, exp, epoch, now), m.add(keys, inst, exp, epoch, now); got != want {
					t.Fatalf("seed %d step %d: Add evicted %d, model %d", seed, step, got, want)
				}
			case 2:
				s.Drop(keys, inst)
				for _, k := range keys {
					m.drop(k, func(h mhold) bool { return h.inst == inst })
				}
			}
			// Asked about: the instance that acted, and any that ever
			// held (left ones and their reused ids included).
			for _, q := range []string{inst, all[rng.IntN(len(all))]} {
				from := rng.IntN(len(keys) + 1)
				if got, want := s.Extend(keys, from, q, epoch, now), m.extend(keys, from, q, epoch, now); got != want {
					t.Fatalf("seed %d step %d: Extend(%s) %d, model %d", seed, step, q, got, want)
				}
				for _, k := range keys {
					if got, want := s.HeldBy(k, q), slices.ContainsFunc(m.holds[k], func(h mhold) bool { return h.inst == q }); got != want {
						t.Fatalf("seed %d step %d: HeldBy(%d, %s) %v, model %v", seed, step, k, q, got, want)
					}
				}
			}
			for _, k := range keys {
				var want []string
				for _, h := range m.holds[k] {
					if h.exp > now {
						want = append(want, h.inst)
					}
				}
				if got := s.Holders(nil, k, now); !slices.Equal(got, want) {
					t.Fatalf("seed %d step %d: Holders(%d) %v, model %v", seed, step, k, got, want)
				}
				if got, want := s.Any(k), len(m.holds[k]) > 0; got != want {
					t.Fatalf("seed %d step %d: Any(%d) %v, model %v", seed, step, k, got, want)
				}
			}
			if s.Len() != m.n {
				t.Fatalf("seed %d step %d: Len %d, model %d", seed, step, s.Len(), m.n)
			}
			checkInterned(t, &s.ids, m, seed, step)
		}
		if len(s.ids.names)-1 < len(all) {
			reused++ // fewer ids were ever made than names held
		}
	}
	if reused < 10 {
		t.Fatalf("ids reused in %d of 20 churning seeds", reused)
	}
}

// listRoom is the holds' room the Set's holder lists keep, in use or free.
func listRoom[K ~uint64](s *Set[K]) int {
	n := 0
	for _, l := range s.lists {
		n += cap(l)
	}
	return n
}

// A key's holder list grown by many instances and shrunk again, or freed,
// keeps no more room than its holds need: the lists' room stays within a
// few holds per entry of the bound however many instances held each key
// once (before, a list kept its largest room for good, in use or free:
// 100 lists of 200 instances' room each, 25 holds per entry of the bound).
func TestSetListsRoomBounded(t *testing.T) {
	const capacity, keys, many = 1000, 100, 200
	s := New[uint64](capacity)
	for j := range keys {
		all := make([]uint64, keys)
		for i := range all {
			all[i] = uint64(i)
		}
		// a and b hold every key (b in the key's list), refreshed so that
		// their older ring entries pop without effect.
		s.Add(all, "a", int64(1e9+j), 0, 0)
		s.Add(all, "b", int64(1e9+j), 0, 0)
		for i := range many {
			s.Add([]uint64{uint64(j)}, fmt.Sprint("x", i), int64(1e9+j), 0, 0)
		}
		for i := range many {
			s.Drop([]uint64{uint64(j)}, fmt.Sprint("x", i))
		}
	}
	if got := listRoom(s); got > 4*capacity {
		t.Fatalf("lists in use keep room for %d holds, bound %d", got, capacity)
	}
	all := make([]uint64, keys)
	for i := range all {
		all[i] = uint64(i)
	}
	s.Drop(all, "b")
	if got := listRoom(s); got > 4*capacity {
		t.Fatalf("free lists keep room for %d holds, bound %d", got, capacity)
	}
}

// churnFleet replaces one of insts: by one that left, under its old
// name, now and then, else by a new name; it returns left and all.
func churnFleet(rng *rand.Rand, insts, left, all []string) ([]string, []string) {
	i := rng.IntN(len(insts))
	left = append(left, insts[i])
	if len(left) > 1 && rng.IntN(3) == 0 {
		j := rng.IntN(len(left) - 1)
		insts[i] = left[j] // back under its old name
		left = slices.Delete(left, j, j+1)
	} else {
		insts[i] = fmt.Sprint("n", len(all))
		all = append(all, insts[i])
	}
	return left, all
}

// checkInterned: exactly the names of the model ring's entries have ids.
func checkInterned(t *testing.T, d *ids, m *model, seed uint64, step int) {
	t.Helper()
	named := map[string]bool{}
	for j := range m.n {
		named[m.ring[(m.head+j)%len(m.ring)].inst] = true
	}
	if len(d.byName) != len(named) {
		t.Fatalf("seed %d step %d: %d names interned, %d in the ring", seed, step, len(d.byName), len(named))
	}
	for name := range named {
		if id := d.byName[name]; id == 0 || d.names[id] != name {
			t.Fatalf("seed %d step %d: %s in the ring has id %d", seed, step, name, id)
		}
	}
}
