package workload

import (
	"errors"
	"testing"
)

// TestReplicateTraceDisjointIDs: copies share no hash id when the ids are
// negative, and copies whose ids would overflow int64 are refused rather
// than wrapped onto one another.
func TestReplicateTraceDisjointIDs(t *testing.T) {
	recs := []TraceRecord{
		{Timestamp: 0, InputLength: 1024, HashIDs: []int64{-1, 4}},
		{Timestamp: 1000, InputLength: 1024, HashIDs: []int64{0, 4}},
	}
	out, err := ReplicateTrace(recs, 5)
	if err != nil {
		t.Fatal(err)
	}
	owner := map[int64]int64{} // id -> copy
	for _, r := range out {
		k := r.Timestamp % 1000 / 200 // copy k is shifted k/5 of the 1 s gap
		for _, h := range r.HashIDs {
			if c, ok := owner[h]; ok && c != k {
				t.Fatalf("hash id %d shared by copies %d and %d", h, c, k)
			}
			owner[h] = k
		}
	}
	if len(owner) != 5*3 {
		t.Fatalf("%d distinct ids over 5 copies, want 15", len(owner))
	}
	big := append(recs, TraceRecord{Timestamp: 2000, InputLength: 1536, HashIDs: []int64{0, 4, 1 << 62}})
	if _, err := ReplicateTrace(big, 5); !errors.Is(err, ErrInvalid) {
		t.Fatalf("ids up to 1<<62 in 5 copies: err %v, want refused (they overflow int64)", err)
	}
	if out, err := ReplicateTrace(big, 1); err != nil || len(out) != 3 {
		t.Fatalf("one copy: %d records, err %v", len(out), err)
	}
}
