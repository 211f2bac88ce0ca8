// Package slotlist is a recency order over slot numbers 0..n-1: a doubly
// linked list held in two slices, for an LRU whose entries live in the
// caller's own slices under the same numbers (no allocation per entry).
// A slot, once added, stays in the list: eviction reuses the least recent
// one (MoveToFront(Back())) for the entry that replaces it.
package slotlist

// List orders slots from the most recently used (front) to the least
// (back). Make one with New.
type List struct {
	prev, next []int32
	head, tail int32 // -1 when empty
}

// New returns an empty list.
func New() List { return List{head: -1, tail: -1} }

// Len is the number of slots added.
func (l *List) Len() int { return len(l.prev) }

// Back is the least recently used slot, -1 when the list is empty.
func (l *List) Back() int32 { return l.tail }

// Add adds the next slot number (Len before the call) at the front and
// returns it.
func (l *List) Add() int32 {
	s := int32(len(l.prev))
	l.prev, l.next = append(l.prev, -1), append(l.next, -1)
	l.pushFront(s)
	return s
}

// MoveToFront makes slot s the most recently used.
func (l *List) MoveToFront(s int32) {
	l.unlink(s)
	l.pushFront(s)
}

func (l *List) unlink(s int32) {
	p, n := l.prev[s], l.next[s]
	if p >= 0 {
		l.next[p] = n
	} else {
		l.head = n
	}
	if n >= 0 {
		l.prev[n] = p
	} else {
		l.tail = p
	}
}

func (l *List) pushFront(s int32) {
	l.prev[s], l.next[s] = -1, l.head
	if l.head >= 0 {
		l.prev[l.head] = s
	}
	l.head = s
	if l.tail < 0 {
		l.tail = s
	}
}
