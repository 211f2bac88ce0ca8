package slotlist

import (
	"container/list"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestAgainstContainerList runs random adds and moves on a List and on
// container/list side by side and compares the whole order after each.
func TestAgainstContainerList(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		l := New()
		ref := list.New()
		var elems []*list.Element
		if l.Back() != -1 || l.Len() != 0 {
			t.Fatalf("empty list: back %d, len %d", l.Back(), l.Len())
		}
		for range 500 {
			switch op := rng.IntN(4); {
			case op == 0 || l.Len() == 0:
				s := l.Add()
				if int(s) != len(elems) {
					t.Fatalf("Add returned %d, want %d", s, len(elems))
				}
				elems = append(elems, ref.PushFront(s))
			case op == 1: // evict: the back is reused at the front
				s := l.Back()
				if want := ref.Back().Value.(int32); s != want {
					t.Fatalf("Back %d, want %d", s, want)
				}
				l.MoveToFront(s)
				ref.MoveToFront(elems[s])
			default:
				s := int32(rng.IntN(l.Len()))
				l.MoveToFront(s)
				ref.MoveToFront(elems[s])
			}
			check(t, &l, ref)
		}
	}
}

// check compares l's order, walked both ways, with ref's.
func check(t *testing.T, l *List, ref *list.List) {
	t.Helper()
	var want []int32
	for e := ref.Front(); e != nil; e = e.Next() {
		want = append(want, e.Value.(int32))
	}
	forward := walk(l.head, l.next, len(want))
	backward := walk(l.tail, l.prev, len(want))
	slices.Reverse(backward)
	if !slices.Equal(forward, want) || !slices.Equal(backward, want) {
		t.Fatalf("order: forward %v, backward reversed %v, want %v", forward, backward, want)
	}
}

// walk follows links from s until -1, at most limit+1 steps (a cycle or a
// list longer than limit shows as an extra slot).
func walk(s int32, links []int32, limit int) []int32 {
	var out []int32
	for ; s != -1 && len(out) <= limit; s = links[s] {
		out = append(out, s)
	}
	return out
}
