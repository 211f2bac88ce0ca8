package spechold

import (
	"slices"
	"testing"
)

func TestSet(t *testing.T) {
	s := New[uint64](4)
	keys := []uint64{1, 2, 3, 4, 5, 6}
	if ev := s.Add(keys, "a", 100, 0, 0); ev != 2 || s.Len() != 4 {
		t.Fatalf("bound: evicted %d, held %d", ev, s.Len())
	}
	tests := []struct {
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
	for _, tc := range tests {
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
