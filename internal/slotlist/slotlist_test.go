package slotlist

import (
	"container/list"
	"math/rand/v2"
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

// check compares l's order, both ways, with ref's.
func check(t *testing.T, l *List, ref *list.List) {
	t.Helper()
	s := l.head
	for e := ref.Front(); e != nil; e = e.Next() {
		if s != e.Value.(int32) {
			t.Fatalf("forward: slot %d, want %d", s, e.Value.(int32))
		}
		s = l.next[s]
	}
	if s != -1 {
		t.Fatalf("forward: list longer than %d", ref.Len())
	}
	s = l.tail
	for e := ref.Back(); e != nil; e = e.Prev() {
		if s != e.Value.(int32) {
			t.Fatalf("backward: slot %d, want %d", s, e.Value.(int32))
		}
		s = l.prev[s]
	}
	if s != -1 {
		t.Fatalf("backward: list longer than %d", ref.Len())
	}
}
